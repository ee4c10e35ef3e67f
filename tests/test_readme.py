"""The README's Python examples run, in order, as a user would paste them."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_readme_lists_every_environment_variable():
    text = README.read_text()
    for var in ("LANCET_KERNELS", "TRITON_INTERPRET", "LANCET_AUTOTUNE_CACHE", "LANCET_GATING_FWD_CONFIG",
                "LANCET_GATING_BWD_CONFIG", "LANCET_PERMUTE_FWD_CONFIG", "LANCET_UNPERMUTE_FWD_CONFIG",
                "LANCET_UNPERMUTE_BWD_CONFIG", "LANCET_GEMM_CONFIG"):
        assert var in text, var
