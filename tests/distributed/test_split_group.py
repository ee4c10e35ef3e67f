"""TorchGroup.split (2 and 4 gloo ranks): every collective equals the plain group's bitwise (ragged
all-to-alls with empty shares, the counts exchange, all-reduce, broadcast, reduce, object
all-gather, an Overlapped training step with deferred dW), the header check leaves the host free
(a rank's issue returns before its peer has issued), and bad arguments are refused. Its fault
detection is the plain group's: tests/distributed/test_faults_distributed.py and
tests/reliability/test_adversarial_a.py run their cases on both.
"""

from __future__ import annotations

import pytest
import torch

import lancet_rt
from tests.comm.test_faults import make_model, train_step
from tests.dist import assert_all_ok, run_ranks

D = 16


def _collectives(tg, rank: int, world: int) -> list:
    """The results of one of each collective on ``tg`` (same inputs on every group)."""
    gen = torch.Generator().manual_seed(rank)
    ins = [(rank * 3 + q) % 4 for q in range(world)]  # rows to each rank (some 0)
    outs = [(q * 3 + rank) % 4 for q in range(world)]
    x = torch.randn(sum(ins), D, generator=gen)
    y = torch.full((sum(outs), D), float("nan"))
    tg.all_to_all(y, x, outs, ins).wait()
    counts = tg.exchange(torch.arange(world * 3).view(world, 3) + 100 * rank).wait().clone()
    t = torch.randn(5, generator=gen)
    tg.all_reduce(t).wait()
    b = torch.full((3,), float(rank))
    tg.broadcast(b, src=world - 1).wait()
    r = torch.full((4,), float(rank + 1))
    tg.reduce(r, dst=0).wait()
    objs = tg.all_gather_object({"rank": rank, "ins": ins})
    return [y, counts, t, b, r if rank == 0 else None, objs]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _cases(rank, world):
    import torch.distributed as dist

    torch.set_num_threads(1)
    plain = lancet_rt.TorchGroup(dist.new_group())
    split = lancet_rt.TorchGroup.split(dist.new_group())
    out = {"collectives": _equal(_collectives(plain, rank, world), _collectives(split, rank, world))}

    gen = torch.Generator().manual_seed(10 + rank)
    x, g = torch.randn(4, 3, D, generator=gen), torch.randn(4, 3, D, generator=gen)
    steps = []
    for tg in (plain, split):
        model = make_model(tg, E=2 * world, capacity_factor=None)
        steps.append(train_step(lancet_rt.Overlapped(model, chunks=3, defer_wgrad=True), model, x, g))
        steps.append(train_step(model, model, x, g))  # unchunked
    out["overlapped step"] = _equal(steps[0], steps[2]) and _equal(steps[1], steps[3])

    # The header check runs on the group's thread: rank 0's issue returns before rank 1 has issued.
    store = dist.distributed_c10d._get_default_store()
    v = torch.ones(8)
    if rank == 0:
        work = split.all_reduce(v)
        out["issued before the peer"] = not store.check(["split_test/issued"])
        store.set("split_test/go", "1")
        work.wait()
    else:
        out["issued before the peer"] = None  # (rank 0's to tell)
        store.wait(["split_test/go"])
        work = split.all_reduce(v)
        store.set("split_test/issued", "1")
        work.wait()
    out["reduced"] = torch.equal(v, torch.full((8,), float(world)))

    # A failure the group's thread found is raised once, by the host's next wait or issue, as itself;
    # after that, or once the host has raised a failure of its own, the group is "unusable".
    from lancet_rt.comm.faults import GroupError, PeerError

    raised = []
    for host_first in (False, True):
        mon = lancet_rt.TorchGroup.split(dist.new_group()).monitor
        found = GroupError("found on the group's thread", [1])
        found._lancet_found_here = True
        mon.broken = found  # (as the issuer thread's break_ leaves it)
        if host_first:
            mon.break_(PeerError("raised by the host", [1]))  # a wait of the host raised its own error
        for _ in range(2):
            try:
                mon.issue("all-reduce", lambda: None, None)
            except GroupError as exc:
                raised.append(str(exc).split(":")[0])
    out["raised once"] = raised
    errors = []
    for call in (
        lambda: lancet_rt.TorchGroup.split(dist.new_group(), counts_group=dist.new_group()),
        lambda: lancet_rt.TorchGroup.split(split.group),
    ):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc).split(":")[0])
    out["refused"] = errors
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_split_group_equals_the_plain_group_and_issues_off_the_host(world):
    for rank, res in enumerate(assert_all_ok(run_ranks(_cases, world, timeout=240))):
        assert res == {
            "collectives": True,
            "overlapped step": True,
            "issued before the peer": True if rank == 0 else None,
            "reduced": True,
            "refused": ["counts_group", "group already has a TorchGroup (as_group made one)"],
            "raised once": ["found on the group's thread"]
            + ["expert-parallel group unusable since an earlier failure"] * 3,
        }, res


def _default_cases(rank, world):
    """A gloo ProcessGroup given as ``ep_group`` as it is: split at its first collective, once for every layer
    on it, the step bitwise the plain group's; ``LANCET_EP_TRANSPORT=plain`` or a TorchGroup of it keeps it
    plain."""
    import os

    import torch.distributed as dist

    from lancet_rt import env
    from lancet_rt.comm.group import as_group

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(10 + rank)
    x, g = torch.randn(4, 3, D, generator=gen), torch.randn(4, 3, D, generator=gen)
    out, steps = {}, []
    pg = dist.new_group()
    model = make_model(pg, E=2 * world, capacity_factor=None)  # two MoE layers on one group
    tg = as_group(pg)
    store = tg.monitor._store  # (splits entered by each rank: lancet_rt.comm.channels._all_arrive)
    out["built lazily"] = (tg.channels is None, store.add(f"lancet_rt/split/{rank}", 0))
    steps.append(train_step(lancet_rt.Overlapped(model, chunks=3, defer_wgrad=True), model, x, g))
    steps.append(train_step(model, model, x, g))
    out["split once for both layers"] = (
        tg.channels is not None,
        tg.counts_channel,
        store.add(f"lancet_rt/split/{rank}", 0),
        all(m.group is tg for m in model.moe_layers()),
    )
    kept = lancet_rt.TorchGroup(dist.new_group())  # a TorchGroup given as ep_group: as it is
    os.environ[env.EP_TRANSPORT] = "plain"
    plain_pg = dist.new_group()
    for group in (kept, plain_pg):
        m = make_model(group, E=2 * world, capacity_factor=None)
        steps.append(train_step(lancet_rt.Overlapped(m, chunks=3, defer_wgrad=True), m, x, g))
        steps.append(train_step(m, m, x, g))
    out["plain kept plain"] = (kept.channels, as_group(plain_pg).channels, as_group(plain_pg).counts_channel)
    out["bitwise as plain"] = all(_equal(steps[i], steps[i + 2]) and _equal(steps[i], steps[i + 4]) for i in (0, 1))
    os.environ[env.EP_TRANSPORT] = "lanes"
    try:
        make_model(dist.new_group(), E=2 * world)
        out["bad value"] = None
    except ValueError as exc:
        out["bad value"] = str(exc)
    return out


def test_a_gloo_process_group_given_as_ep_group_is_split_at_its_first_collective():
    for res in assert_all_ok(run_ranks(_default_cases, 2, timeout=240)):
        assert res == {
            "built lazily": (True, 0),
            "split once for both layers": (True, "own", 1, True),
            "plain kept plain": (None, None, "shared"),
            "bitwise as plain": True,
            "bad value": "LANCET_EP_TRANSPORT must be 'split', 'plain' or unset, got 'lanes'",
        }, res


def test_an_nccl_group_given_as_ep_group_is_not_split():
    """NCCL keeps its default (the counts on the tokens' communicator): nothing is left for its first collective."""

    class _Monitor:
        def before_next(self, fn):
            raise AssertionError("an NCCL group was marked for a split")

    tg = lancet_rt.TorchGroup.__new__(lancet_rt.TorchGroup)  # (no NCCL here: the fields split_at_first_use reads)
    tg.channels, tg._size, tg.backend, tg.monitor = None, 2, "nccl", _Monitor()
    tg.group = tg.counts_group = object()
    tg.split_at_first_use()
    assert tg.channels is None and tg.counts_channel == "shared"
