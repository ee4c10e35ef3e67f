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


def _first_use(rank, world, case):
    """A gloo ProcessGroup given as ``ep_group`` is split at its first collective: the peers' faults there."""
    import os
    import time

    import torch.distributed as dist

    from lancet_rt.comm.group import as_group

    g = dist.new_group()
    tg = as_group(g, expert_parallel=True)  # (as a MoE layer given ``g`` makes it)
    if case == "lone":  # only rank 0 reaches the group's first collective
        res = outcome(lambda: tg.all_gather(torch.tensor([rank]))) if rank == 0 else ["absent", None, None]
        dist.barrier()
    elif case == "groups differ":  # rank 0 holds one process group more than rank 1
        if rank == 0:
            dist.new_group([0], use_local_synchronization=True)
        res = outcome(lambda: tg.all_gather(torch.tensor([rank])).flatten().tolist())
    else:  # rank 1 exits before the group's first collective
        if rank == 1:
            os._exit(0)
        t0 = time.monotonic()
        res = outcome(lambda: tg.all_gather(torch.tensor([rank])))
        res.append(time.monotonic() - t0)
        return res
    healthy = as_group(dist.new_group(), expert_parallel=True)
    return res, healthy.all_gather(torch.tensor([rank + 10])).flatten().tolist(), healthy.channels is not None


def test_a_rank_alone_at_the_first_collective_of_a_group_split_there_names_the_peer(monkeypatch):
    monkeypatch.setenv("LANCET_TIMEOUT_S", "3")
    results = run_ranks(_first_use, 2, "lone", timeout=180)
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
        assert list(results[r][1][1:]) == [[10, 11], True]  # a group split afterwards by both ranks works
    assert_raised(
        results[0][1][0],
        "PeerTimeout",
        "rank(s) [1] stopped answering",
        "collective #1 (all-gather)",
        "rank 1 has not reached collective #1",
        "timeout 3 s, LANCET_TIMEOUT_S",
        ranks=[1],
    )


def test_ranks_holding_different_numbers_of_groups_split_alike(monkeypatch):
    """torch.distributed names a group made by its ranks alone after the count of groups its process holds;
    the split's groups are named after their parent group instead (a model on a subgroup of some ranks made
    groups the others do not hold)."""
    monkeypatch.setenv("LANCET_TIMEOUT_S", "30")
    results = run_ranks(_first_use, 2, "groups differ", timeout=180)
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
        assert list(results[r][1]) == [["ok", [0, 1], None], [10, 11], True], results[r][1]


def test_a_rank_that_exits_before_the_first_collective_is_named_before_the_timeout(monkeypatch):
    monkeypatch.setenv("LANCET_TIMEOUT_S", "60")
    results = run_ranks(_first_use, 2, "dead", timeout=180, may_die=(1,))
    kind, msg, ranks, waited = results[0][1]
    assert_raised([kind, msg, ranks], "PeerError", "rank(s) [1] failed", "its process has exited", ranks=[1])
    assert waited < 20, waited
