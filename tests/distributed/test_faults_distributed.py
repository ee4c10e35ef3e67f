"""Faults across real processes (2 and 3 gloo ranks): mismatched schedules and configurations,
failures before and after the step's collectives started, in forward and backward, a rank that
stops answering, a rank that is killed, and the CUDA path's watchdog run on gloo.

Each case asserts the exception type and that the message names the rank (README, "Reliability").
Two spawns go through their faults in sequence, each fault on its own process group where the
group breaks, so one spawn checks many faults; the rank that dies is the last fault of its spawn.
Every spawn has a hard timeout (a hang fails, never waits). The 3-rank faults run twice: on plain
gloo groups (``LANCET_EP_TRANSPORT=plain``) and on split ones (``TorchGroup.split``: header checks and
launches on a thread of the group, the tokens on a lane per direction), which must detect and name the
same faults; the 2-rank faults run on process groups given as they are (the default: split at their
first collective).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time

import lancet_rt.autotune  # registers chunks="auto"
import pytest
import torch

import lancet_rt
from lancet_rt import env
from tests.comm.test_faults import assert_same_step, in_chunk, make_model, raise_, train_step
from tests.dist import assert_raised, outcome, run_ranks

D = 16


def _step(ov, x, g=None):
    y = ov(x)
    if g is not None:
        y.backward(g)
    return True


def _until_given_up(group, ranks):
    """Stop answering (block this rank) until ``ranks`` have written their failure records."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_process_group_store(group)
    deadline = time.monotonic() + 300  # (a hang guard)
    while not store.check([f"lancet_rt/fail/{r}" for r in ranks]) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group(timeout_s=None, split=False):
    """A new process group (``split``: a split TorchGroup on one)."""
    import torch.distributed as dist

    g = dist.new_group()
    if split:
        return lancet_rt.TorchGroup.split(g, **({} if timeout_s is None else dict(timeout_s=timeout_s)))
    if timeout_s is not None:
        lancet_rt.comm.group.as_group(g).set_timeout(timeout_s)
    return g


def _three_ranks(rank, world, out_dir, split=False):
    """The 3-rank faults in sequence; returns {case: outcome on this rank}. Rank 2 is the rank at
    fault in every case that breaks a group, and dies in the last one. ``split``: every group a split
    TorchGroup; else every group as it is (``LANCET_EP_TRANSPORT=plain``: not the default split)."""
    if not split:
        os.environ[env.EP_TRANSPORT] = "plain"
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, g = torch.randn(4, 3, D, generator=gen), torch.randn(4, 3, D, generator=gen)
    res = {}
    healthy = _group(split=split)

    def overlapped(**kw):
        moe = {k: kw.pop(k) for k in list(kw) if k in ("capacity_factor",)}
        return lancet_rt.Overlapped(make_model(healthy, E=6, **moe), **kw)

    # Agreement: every rank raises before any collective of the step; the group stays usable.
    res["chunks differ"] = outcome(lambda: _step(overlapped(chunks=3 if rank == 2 else 2), x))
    res["defer_wgrad differs"] = outcome(lambda: _step(overlapped(chunks=2, defer_wgrad=rank == 1), x))
    res["auto on one rank"] = outcome(lambda: _step(overlapped(chunks="auto" if rank == 0 else 2), x))
    res["check differs"] = outcome(lambda: _step(overlapped(chunks=2, check=rank == 1), x))
    res["MoE config differs"] = outcome(
        lambda: _step(overlapped(chunks=2, capacity_factor=1.0 if rank == 2 else 0.75), x)
    )
    # Failures before the step's collectives: status on the first exchange (or the config check).
    ov = overlapped(chunks=3)
    fresh = copy.deepcopy(ov.model)
    res["no tensor on one rank, first step"] = outcome(lambda: _step(ov, 1.0 if rank == 1 else x))
    h = (
        in_chunk(ov.model.blocks[0].attn, 0, lambda: raise_(RuntimeError("injected before the collectives")))
        if rank == 2
        else None
    )
    res["model error before the collectives"] = outcome(lambda: _step(ov, x, g))
    h = h.remove() if h else None
    h = in_chunk(ov.model.blocks[0].attn, 0, lambda: raise_(KeyboardInterrupt())) if rank == 0 else None
    res["KeyboardInterrupt before the collectives"] = outcome(lambda: _step(ov, x, g))
    h = h.remove() if h else None

    def same_as_fresh():
        got = train_step(ov, ov.model, x, g)
        ref = train_step(lancet_rt.Overlapped(fresh, chunks=3), fresh, x, g)
        assert_same_step(ref, got)
        return True

    res["next step after them equals a fresh model"] = outcome(same_as_fresh)

    # After the collectives started: the group breaks, the peers are told within a poll.
    broken = lancet_rt.Overlapped(make_model(_group(split=split), E=6), chunks=4)
    h = (
        in_chunk(broken.model.blocks[1], 2, lambda: raise_(RuntimeError("injected in chunk 2 of 4")))
        if rank == 2
        else None
    )
    res["error in chunk 2 of 4"] = outcome(lambda: _step(broken, x))
    res["next step on the broken group"] = outcome(lambda: _step(broken, x))

    bwd = lancet_rt.Overlapped(make_model(_group(split=split), E=6), chunks=2)
    if rank == 2:
        bwd.model.blocks[0].register_forward_hook(
            lambda m, a, y: [y.register_hook(lambda grad: raise_(RuntimeError("injected in backward")))] and None
        )
    res["error in backward"] = outcome(lambda: _step(bwd, x, g))
    res["step after the failed backward"] = outcome(lambda: _step(bwd, x, g))

    # Here the counts have a group of their own: its waits are bounded and read the records too.
    import torch.distributed as dist

    hung_group = _group()
    if split:
        hung_ep = lancet_rt.TorchGroup.split(hung_group, timeout_s=2.0)
    else:
        hung_ep = lancet_rt.TorchGroup(hung_group, timeout_s=2.0, counts_group=dist.new_group())
    hung = lancet_rt.Overlapped(make_model(hung_ep, E=6), chunks=2)
    if rank == 2:
        in_chunk(hung.model.blocks[1], 1, lambda: _until_given_up(hung_group, [0, 1]))
    res["a rank stops answering"] = outcome(lambda: _step(hung, x))

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dead = lancet_rt.Overlapped(make_model(_group(split=split), E=6), chunks=2)
    if rank == 2:
        in_chunk(dead.model.blocks[1], 1, lambda: os.kill(os.getpid(), signal.SIGKILL))
    return outcome(lambda: _step(dead, x))


@pytest.fixture(scope="module", params=["plain", "split"])
def three_ranks(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("three_ranks")
    results = run_ranks(_three_ranks, 3, str(out), request.param == "split", timeout=90, may_die=(2,))
    assert 2 not in results, "rank 2 killed itself"
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
        per_rank[r]["a rank is killed"] = results[r][1]
    return per_rank


@pytest.mark.parametrize(
    "case, words",
    [
        ("chunks differ", "chunks: rank 0=2, rank 1=2, rank 2=3"),
        ("defer_wgrad differs", "defer_wgrad: rank 0=False, rank 1=True, rank 2=False"),
        ("auto on one rank", "chunks: rank 0='auto', rank 1=2, rank 2=2"),
        ("check differs", "check: rank 0=False, rank 1=True, rank 2=False"),
    ],
)
def test_schedule_must_agree_across_ranks(three_ranks, case, words):
    for res in three_ranks:
        assert_raised(res[case], "ValueError", words)


def test_moe_config_must_agree_across_ranks(three_ranks):
    for r, res in enumerate(three_ranks):
        assert_raised(res["MoE config differs"], "ValueError", "differ in capacity_factor", f"rank {r}")


def test_bad_input_before_the_config_check_raises_everywhere(three_ranks):
    assert_raised(three_ranks[1]["no tensor on one rank, first step"], "ValueError", "no tensor argument")
    for r in (0, 2):
        assert_raised(three_ranks[r]["no tensor on one rank, first step"], "ValueError", "rank(s) [1]")


def test_model_error_before_the_collectives_raises_everywhere(three_ranks):
    assert_raised(three_ranks[2]["model error before the collectives"], "RuntimeError", "injected before")
    for r in (0, 1):
        assert_raised(
            three_ranks[r]["model error before the collectives"], "PeerError", "rank(s) [2]", "stays usable", ranks=[2]
        )


def test_keyboard_interrupt_before_the_collectives_raises_everywhere(three_ranks):
    assert_raised(three_ranks[0]["KeyboardInterrupt before the collectives"], "KeyboardInterrupt")
    for r in (1, 2):
        assert_raised(three_ranks[r]["KeyboardInterrupt before the collectives"], "PeerError", "rank(s) [0]", ranks=[0])


def test_next_step_after_early_failures_equals_a_fresh_model(three_ranks):
    for res in three_ranks:
        result = res["next step after them equals a fresh model"]
        assert result[0] == "ok", result


def test_error_in_chunk_two_of_four_reaches_every_rank(three_ranks):
    """PeerError, not PeerTimeout: the peers learnt it from rank 2's failure record, not by waiting."""
    assert_raised(three_ranks[2]["error in chunk 2 of 4"], "RuntimeError", "injected in chunk 2 of 4")
    for r in (0, 1):
        assert_raised(
            three_ranks[r]["error in chunk 2 of 4"],
            "PeerError",
            "rank(s) [2] failed or stopped answering",
            "RuntimeError: injected in chunk 2 of 4",
            ranks=[2],
        )


def test_broken_group_refuses_the_next_step(three_ranks):
    for res in three_ranks:
        assert_raised(res["next step on the broken group"], "GroupError", "unusable since", ranks=[2])


def test_error_in_backward_reaches_every_rank(three_ranks):
    assert_raised(three_ranks[2]["error in backward"], "RuntimeError", "injected in backward")
    assert_raised(
        three_ranks[2]["step after the failed backward"], "GroupError", "rank 2: the last backward raised", ranks=[2]
    )
    for r in (0, 1):
        assert_raised(
            three_ranks[r]["error in backward"], "PeerError", "rank(s) [2]", "last backward raised", ranks=[2]
        )
        assert_raised(three_ranks[r]["step after the failed backward"], "GroupError", "unusable since")


def test_a_rank_that_stops_answering_times_out_by_name(three_ranks):
    for r in (0, 1):
        assert_raised(
            three_ranks[r]["a rank stops answering"],
            "PeerTimeout",
            "rank(s) [2] stopped answering",
            "its process is alive",
            "LANCET_TIMEOUT_S",
            ranks=[2],
        )
    assert_raised(
        three_ranks[2]["a rank stops answering"], "PeerError", "rank 2 was reported as not answering", ranks=[2]
    )


def test_a_killed_rank_is_named_by_the_survivors(three_ranks):
    for r in (0, 1):
        assert_raised(
            three_ranks[r]["a rank is killed"],
            "PeerError",
            "rank(s) [2] stopped answering",
            "rank 2: its process has exited",
            ranks=[2],
        )


def _two_ranks(rank, world, out_dir):
    """The 2-rank faults in sequence (LANCET_TIMEOUT_S=2 set by the test); rank 1 dies in the last."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, g = torch.randn(4, 3, D, generator=gen), torch.randn(4, 3, D, generator=gen)
    res = {}
    healthy = _group()
    res["timeout from LANCET_TIMEOUT_S"] = ["ok", lancet_rt.comm.group.as_group(healthy).timeout_s, None]
    res["chunks 2 and 4"] = outcome(lambda: _step(lancet_rt.Overlapped(make_model(healthy), chunks=2 + 2 * rank), x))
    res["set_timeout(0)"] = outcome(lambda: lancet_rt.comm.group.as_group(healthy).set_timeout(0))
    dead = lancet_rt.Overlapped(make_model(_group()), chunks=2)  # (split by its first step, before the watchdog
    _step(dead, x, g)  # below aborts a group on rank 0 only: the ranks then hold different numbers of groups)

    late = _group()
    if rank == 1:  # never starts the step until rank 0 has given up on it
        _until_given_up(late, [0])
    res["a rank never starts the step"] = outcome(lambda: _step(lancet_rt.Overlapped(make_model(late), chunks=2), x))

    # The CUDA path's watchdog (a thread follows the collectives in flight; the host wait is plain),
    # run on gloo: it finds rank 1's failure record and aborts; gloo's operation timeout ends the wait.
    watched = _group(timeout_s=1.0)
    monitor = lancet_rt.comm.group.as_group(watched).monitor
    monitor._watchdog = True
    monitor.check_headers = False  # as on NCCL, where the header check is off (it would be a host sync)
    os.environ[env.EP_TRANSPORT] = "plain"  # (as on NCCL, whose groups are never split)
    wd = lancet_rt.Overlapped(make_model(watched), chunks=3)
    del os.environ[env.EP_TRANSPORT]
    if rank == 1:
        in_chunk(wd.model.blocks[1], 2, lambda: raise_(RuntimeError("injected under the watchdog")))
    res["watchdog finds a failure"] = outcome(lambda: _step(wd, x))
    res["watchdog raised it"] = ["ok", monitor._fatal is not None, None]

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if rank == 1:
        dead.model.blocks[0].register_forward_hook(
            lambda m, a, y: [y.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))] and None
        )
    return outcome(lambda: _step(dead, x, g))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(env.TIMEOUT, "2")
        results = run_ranks(_two_ranks, 2, str(out), timeout=90, may_die=(1,))
    assert 1 not in results and results[0][0] == "ok", results
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    per_rank[0]["a rank is killed in backward"] = results[0][1]
    return per_rank


def test_two_ranks_read_their_timeout_from_the_environment(two_ranks):
    assert [res["timeout from LANCET_TIMEOUT_S"][1] for res in two_ranks] == [2.0, 2.0]


def test_chunks_must_agree_on_two_ranks(two_ranks):
    for res in two_ranks:
        assert_raised(res["chunks 2 and 4"], "ValueError", "chunks: rank 0=2, rank 1=4")


def test_bad_group_timeout(two_ranks):
    for res in two_ranks:
        assert_raised(res["set_timeout(0)"], "ValueError", "timeout_s", "0")


def test_a_rank_that_never_starts_the_step_times_out_by_name(two_ranks):
    assert_raised(
        two_ranks[0]["a rank never starts the step"],
        "PeerTimeout",
        "rank(s) [1] stopped answering",
        "timeout 2 s, LANCET_TIMEOUT_S",
        "collective #1 (all-gather)",
        ranks=[1],
    )
    assert_raised(
        two_ranks[1]["a rank never starts the step"], "PeerError", "rank 1 was reported as not answering", ranks=[1]
    )


def test_the_watchdog_path_names_the_failed_rank(two_ranks):
    """The CUDA path (a watchdog thread, the host waiting plainly), exercised on gloo."""
    assert_raised(two_ranks[1]["watchdog finds a failure"], "RuntimeError", "injected under the watchdog")
    assert_raised(
        two_ranks[0]["watchdog finds a failure"],
        "PeerError",
        "rank(s) [1] failed or stopped answering",
        "RuntimeError: injected under the watchdog",
        ranks=[1],
    )
    assert two_ranks[0]["watchdog raised it"][1] is True


def test_a_rank_killed_in_backward_is_named(two_ranks):
    assert_raised(
        two_ranks[0]["a rank is killed in backward"],
        "PeerError",
        "rank(s) [1] stopped answering",
        "rank 1: its process has exited",
        ranks=[1],
    )
