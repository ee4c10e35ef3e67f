"""The counts exchange's tag (lancet_rt/moe/dispatch/common.py): ranks out of step end with
``CollectiveMismatch`` on every rank, with the per-collective header check off (``LANCET_CHECK_HEADERS=0``,
how NCCL runs) and on, instead of a silently wrong forward, a gloo abort or a hang.

Real gloo processes (2 ranks, and 4 for the naming of the odd rank out), each case on a process group
of its own (a mismatch leaves its group unusable), one spawn per header setting, under the hang guard
of ``run_ranks``. The groups' timeout is 60 s, so a ``CollectiveMismatch`` was found by the check, not
by a rank giving up on its peers. The same faults on process groups given to the layers as they are (the
default transport: the group split at its first collective, the counts on its control group), in both
execution modes (CUDA semantics: backward on a device thread, the header check off).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lancet_rt
from lancet_rt import env
from lancet_rt.models.blocks import Block
from tests import cuda_semantics  # noqa: F401 - the execution modes, in the ranks too
from tests.dist import assert_raised, outcome, run_ranks

D, F, E = 8, 6, 4
TIMEOUT_S = 60.0


class _TwoMoE(nn.Module):
    """Two blocks of attention and a MoE layer; the blocks listed in ``skip`` are not run."""

    def __init__(self, group, **moe):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(D, 2, lancet_rt.MoE(D, F, E, 2, ep_group=group, **moe)) for _ in range(2))
        self.skip = ()

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = block(x)
        return x


def _group(kind: str):
    """A new process group's TorchGroup: "plain", "split" (TorchGroup.split) or "own" (a counts group of its own)."""
    import torch.distributed as dist

    g = dist.new_group()
    if kind == "split":
        tg = lancet_rt.TorchGroup.split(g)
    elif kind == "own":
        tg = lancet_rt.TorchGroup(g, counts_group=dist.new_group())
    else:
        tg = lancet_rt.comm.group.as_group(g)
    tg.set_timeout(TIMEOUT_S)
    return tg


#: The other dispatchers that exchange counts (the same tag: lancet_rt.moe.dispatch.common.exchange_counts).
_DISPATCHERS = {
    "pipelined": dict(pipeline_chunks=2),
    "shadow": dict(shadow_experts=1),
    "allreduce": dict(dispatcher="allreduce"),
}


class _Untagged:
    """A TorchGroup seen without its monitor: the same collectives, the counts exchanged untagged."""

    def __init__(self, group):
        self._group = group

    def __getattr__(self, name):
        if name == "monitor":
            raise AttributeError(name)
        return getattr(self._group, name)


def _bitwise_as_untagged(rank, x, gy) -> bool:
    """A step on the tagged group equals one on the same group untagged, bit for bit (the tag is not a count)."""
    tg = _group("plain")
    out = []
    for group in (tg, _Untagged(tg)):
        m = _TwoMoE(group)
        y = m(x)
        y.backward(gy)
        out.append([y.detach()] + [p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*out)), "the tag changed a result"
    return len(out[0])


def _into(errors: list, y, gy) -> None:
    try:
        y.backward(gy)
    except BaseException as exc:  # reported to the forward's thread
        errors.append(f"{type(exc).__name__}: {exc}")


def _cases(rank, world, headers: str, kinds: tuple) -> dict:
    """Every case in sequence, each on a group of its own; {case: outcome on this rank}."""
    import os

    os.environ[env.CHECK_HEADERS] = headers  # (read when a group's monitor is made)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, gy = torch.randn(2, 3, D, generator=gen), torch.randn(2, 3, D, generator=gen)
    res = {}

    def in_step(kind):  # no false alarm: forward, backward, forward; a recomputation in backward, on another
        import threading  # thread than the forward's (as CUDA's autograd runs it)

        m = _TwoMoE(_group(kind))
        m(x).backward(gy)
        ckpt, errors = lancet_rt.checkpoint(m, x), []
        worker = threading.Thread(target=_into, args=(errors, ckpt, gy))
        worker.start()
        worker.join()
        assert not errors, errors
        return m(x).shape[0]

    res["in step"] = outcome(lambda: in_step("plain"))
    res["bitwise as untagged"] = outcome(lambda: _bitwise_as_untagged(rank, x, gy))

    def skip_layer(chunks=None, **moe):
        m = _TwoMoE(_group("plain"), **moe)
        m.skip = (0,) if rank == 1 else ()
        return list((m if chunks is None else lancet_rt.Overlapped(m, chunks=chunks))(x).shape)

    res["skip a layer"] = outcome(skip_layer)
    res["skip a layer, Overlapped(chunks=2)"] = outcome(lambda: skip_layer(chunks=2))
    for name, moe in _DISPATCHERS.items():
        res[f"skip a layer, {name}"] = outcome(lambda: skip_layer(**moe))

    def autocast_alone():
        m = _TwoMoE(_group("plain"))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0):
            return list(m(x).shape)

    res["autocast on rank 0 alone"] = outcome(autocast_alone)

    def skip_backward(kind):
        m = _TwoMoE(_group(kind))
        y = m(x)
        if rank == 0:
            y.backward(gy)
        return list(m(x).shape)

    for kind in kinds:
        res[f"skip a backward, {kind}"] = outcome(lambda: skip_backward(kind))
    return res


#: (a) rank 1 skips MoE layer 0: rank 0's layer 0 meets rank 1's layer 1 (same shapes; was: rank 1 went on with
#: layer 0's counts, then gloo aborted it with the header check off, or the next collective failed with it on).
#: (b) rank 0 runs a backward rank 1 skips: with the header check on, the headers say so on every group kind; off,
#: where the counts have a channel of their own (a split group, a counts group), each rank waits for a collective
#: the other never issues (was: until the timeout), and the blocked ranks' positions in the store say so. On a plain
#: gloo group with the check off gloo itself aborts on the sizes before anything of ours runs (docs/reliability.md).
_B_KINDS = {"0": ("split", "own"), "1": ("plain", "split")}


@pytest.fixture(scope="module", params=["0", "1"], ids=["headers-off", "headers-on"])
def cases(request):
    results = run_ranks(_cases, 2, request.param, _B_KINDS[request.param], timeout=300)
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
    return request.param, [results[r][1] for r in (0, 1)]


def test_ranks_in_step_raise_nothing(cases):
    for res in cases[1]:
        assert res["in step"] == ["ok", 2, None], res["in step"]
        assert res["bitwise as untagged"][0] == "ok" and res["bitwise as untagged"][1] > 10, res["bitwise as untagged"]


@pytest.mark.parametrize(
    "case", ["skip a layer", "skip a layer, Overlapped(chunks=2)"] + [f"skip a layer, {name}" for name in _DISPATCHERS]
)
def test_a_skipped_moe_layer_raises_collective_mismatch_on_every_rank(cases, case):
    headers, results = cases
    names = (" ('blocks.0.moe' here)", " ('blocks.1.moe' here)") if "Overlapped" in case else ("", "")
    for res in results:
        assert_raised(
            res[case],
            "CollectiveMismatch",
            "does not match across expert-parallel ranks",
            f"rank 0 ran MoE layer #0{names[0]}",
            f"rank 1 ran MoE layer #1{names[1]}",
            "no token was sent",
            ranks=[0, 1],
        )


def test_autocast_on_one_rank_raises_collective_mismatch_naming_both_dtypes(cases):
    for res in cases[1]:
        assert_raised(
            res["autocast on rank 0 alone"],
            "CollectiveMismatch",
            "torch.bfloat16",
            "torch.float32",
            "rank 0 ran MoE layer #0",
            "rank 1 ran MoE layer #0",
            ranks=[0, 1],
        )


def test_a_skipped_backward_raises_collective_mismatch_on_every_rank(cases):
    headers, results = cases
    for kind in _B_KINDS[headers]:
        for res in results:
            assert_raised(
                res[f"skip a backward, {kind}"],
                "CollectiveMismatch",
                "does not match across expert-parallel ranks",
                "counts exchange",
                "all-to-all",
                ranks=[0, 1],
            )
            if headers == "0":
                assert "header check off" in res[f"skip a backward, {kind}"][1]


def _odd_rank_out(rank, world) -> list:
    import os

    os.environ[env.CHECK_HEADERS] = "0"
    torch.set_num_threads(1)
    m = _TwoMoE(_group("plain"))
    m.skip = (0,) if rank == world - 1 else ()
    return outcome(lambda: list(m(torch.randn(2, 3, D, generator=torch.Generator().manual_seed(rank))).shape))


def test_four_ranks_name_the_rank_that_skipped_a_layer_on_every_rank():
    results = run_ranks(_odd_rank_out, 4, timeout=300)
    for r in range(4):
        assert results[r][0] == "ok", results[r][1]
        assert_raised(
            results[r][1], "CollectiveMismatch", "rank 3 ran MoE layer #1", "rank 0 ran MoE layer #0", ranks=[3]
        )


def test_the_odd_rank_out_is_named_alike_from_every_rank_s_view():
    from lancet_rt.comm.header import odd_ones

    assert odd_ones([(1, 2)] * 4) == []
    assert odd_ones([(1, 2), (1, 2), (1, 2), (1, 3)]) == [3]
    assert odd_ones([(1, 2), (1, 3)]) == [0, 1]  # no majority: every rank
    assert odd_ones([(1, 2), (1, 2), (1, 3), (1, 3)]) == [0, 1, 2, 3]


def test_positions_of_another_kind_at_the_same_number_are_a_mismatch():
    from lancet_rt.comm.header import blocked_apart

    at = ["9 9 all-to-all", "9 9 counts exchange", "8 9 counts exchange", None]
    problem, ranks = blocked_apart(0, 9, "all-to-all", at)
    assert ranks == [0, 1] and "rank 0 waits in #9 all-to-all; rank 1 in #9 counts exchange" == problem
    assert blocked_apart(1, 9, "counts exchange", at[:1] + [None, None, None])[1] == [0, 1]
    assert blocked_apart(0, 9, "all-to-all", ["9 9 all-to-all", "9 9 all-to-all", "9 9", None]) == ("", [])


def test_a_row_that_is_not_a_counts_exchange_s_is_named_as_such():
    from lancet_rt.moe.dispatch.common import TAG_WORDS, describe_tag

    assert "not a counts exchange's" in describe_tag(None, [7] * TAG_WORDS)
    assert "not a counts exchange's" in describe_tag(None, [])


def _as_given(rank, world) -> dict:
    """The ranks out of step on gloo ProcessGroups given as ``ep_group`` as they are (the default transport: split
    at the first collective), each case on a group of its own; {case: outcome on this rank}."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, gy = torch.randn(2, 3, D, generator=gen), torch.randn(2, 3, D, generator=gen)

    def model():
        g = dist.new_group()
        lancet_rt.comm.group.as_group(g).set_timeout(TIMEOUT_S)
        return _TwoMoE(g)

    def skip_layer():
        m = model()
        m.skip = (0,) if rank == 1 else ()
        return list(m(x).shape)

    def skip_backward():
        m = model()
        y = m(x)
        if rank == 0:
            y.backward(gy)
        return list(m(x).shape)

    def in_step():
        m = model()
        m(x).backward(gy)
        m(x).backward(gy)
        return m.blocks[0].moe.group.counts_channel

    return {"in step": outcome(in_step), "skip a layer": outcome(skip_layer), "skip a backward": outcome(skip_backward)}


def test_a_process_group_given_as_it_is_raises_collective_mismatch_on_every_rank(execution):
    """With the header check off (CUDA-semantics mode: backward on a device thread), a rank's skipped backward on a
    plain gloo group made gloo abort the other rank on the sizes; the default transport puts the counts on a group
    of their own, where the tag or the blocked ranks' positions find it."""
    results = run_ranks(_as_given, 2, timeout=300)
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
        res = results[r][1]
        assert res["in step"] == ["ok", "own", None], res["in step"]
        assert_raised(
            res["skip a layer"],
            "CollectiveMismatch",
            "rank 0 ran MoE layer #0",
            "rank 1 ran MoE layer #1",
            "no token was sent",
            ranks=[0, 1],
        )
        assert_raised(
            res["skip a backward"],
            "CollectiveMismatch",
            "does not match across expert-parallel ranks",
            "counts exchange",
            "all-to-all",
            ranks=[0, 1],
        )


def _finder_exits(rank, world) -> str:
    """Rank 0 finds a mismatch (its record written) and exits at once; rank 1 waits in a collective that the
    exit cuts short (gloo: connection closed) or that times out: it raises the same finding, not a PeerError."""
    import os

    from lancet_rt.comm.faults import CollectiveMismatch

    os.environ[env.CHECK_HEADERS] = "0"
    tg = _group("plain")
    tg.set_timeout(20.0)
    if rank == 0:
        monitor = tg.monitor
        monitor.break_(monitor.error(CollectiveMismatch, "collective #1 does not match (planted)", [0, 1]))
        os._exit(0)  # (no farewell: the peer's collective ends by a closed connection)
    return outcome(lambda: tg.all_gather(torch.zeros(2)))


def test_a_peers_mismatch_is_raised_as_a_mismatch_when_its_exit_cuts_the_collective_short():
    out = run_ranks(_finder_exits, 2, may_die=(0,))
    assert_raised(
        out[1][1], "CollectiveMismatch", "collective #1 does not match (planted)", "was waiting in collective"
    )
