"""``TorchGroup.split`` called on one rank only: that rank raises a ``PeerTimeout`` naming the ranks that
did not join and saying what to do, within ``LANCET_TIMEOUT_S``, instead of the gloo constructor's bare
"Wait timeout"; both ranks then split a new group together, which works (2 real gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.dist import assert_raised, outcome, run_ranks


def _lone_split(rank, world, lone):
    import torch.distributed as dist

    import lancet_rt
    from lancet_rt.comm.group import as_group

    g = dist.new_group()
    res = outcome(lambda: lancet_rt.TorchGroup.split(g)) if rank == lone else ["absent", None, None]
    dist.barrier()  # the peer waits here while the lone rank is in split
    healthy = dist.new_group()
    lancet_rt.TorchGroup.split(healthy)
    rows = as_group(healthy).all_gather(torch.tensor([rank + 10]))
    return res, rows.flatten().tolist()


@pytest.mark.parametrize("lone", [0, 1])
def test_split_on_one_rank_names_the_peers_that_did_not_join(lone, monkeypatch):
    monkeypatch.setenv("LANCET_TIMEOUT_S", "3")
    monkeypatch.setenv("LANCET_CHECK_HEADERS", "1")
    results = run_ranks(_lone_split, 2, lone, timeout=180)
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
    res, rows = results[lone][1]
    other = 1 - lone
    assert_raised(
        res,
        "PeerTimeout",
        f"rank(s) [{other}]",
        "did not join within 3 s",
        "LANCET_TIMEOUT_S",
        "call it on every rank of the group",
        ranks=[other],
    )
    assert results[other][1][0] == ["absent", None, None]
    for r in (0, 1):  # the group split afterwards by both ranks works
        assert results[r][1][1] == [10, 11]
