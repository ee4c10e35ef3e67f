"""bench.host's counts, which do not depend on the machine: issue 20's acceptance as a regression
test (host reads and saved bytes per extra chunk; ATen ops on the CPU path)."""
from __future__ import annotations

import pytest
import torch

from bench import host


@pytest.mark.parametrize("extra", [[], ["--capacity-factor", "1.25", "--autocast", "bf16", "--defer-wgrad"]])
def test_an_extra_chunk_reads_once_and_saves_nothing_more(extra):
    threads = torch.get_num_threads()
    try:
        rows = host.main(["--device", "cpu", "--chunks", "4", "--reps", "1", *extra])
    finally:
        torch.set_num_threads(threads)  # (bench.host sets its own)
    row = next(r for r in rows if r["chunks"] == 4)
    assert row["reads_per_chunk"] <= 1
    assert row["saved_x"] <= 1.10
    limit = 250 if not extra else 280  # (autocast: the fp32 accumulations' casts, ~20 more)
    assert row["ops_per_chunk"] <= limit, row["ops_per_chunk"]
    assert "plain_us_per_chunk" in row  # (a time: reported, not asserted)
