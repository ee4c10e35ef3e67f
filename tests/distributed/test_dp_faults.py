"""Faults in the data-parallel gradient collectives (``lancet_rt.parallel``): on 2 and 4 real gloo
ranks under a hard timeout, every rank raises a named error instead of hanging or dying in the backend.

sync_gradients, GradientSync and replicate issue their all-reduces and broadcasts through the
process group's monitor (:func:`lancet_rt.parallel.mesh.monitor`): sizes that differ across ranks
are a CollectiveMismatch on every rank before gloo sees them (gloo would abort the process: "Received
data size doesn't match"), a peer that never joins is a PeerTimeout naming it after
``LANCET_TIMEOUT_S`` (3 s here), a killed peer a PeerError naming it, an exception inside the step a
PeerError on the peers within a poll. One 2-rank spawn runs those cases in sequence, each fault on a
process group of its own (rank 1 kills itself in the last one); one 4-rank spawn repeats the
mismatch and the kill.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from lancet_rt import env
from tests.dist import assert_raised, outcome, run_ranks

TIMEOUT_S = 3.0


def _until_given_up(group, ranks):
    """Stop answering until ``ranks`` wrote their failure records (bounded: 60 s)."""
    import time

    import torch.distributed as dist

    store = dist.distributed_c10d._get_process_group_store(group)
    deadline = time.monotonic() + 60
    while not store.check([f"lancet_rt/fail/{r}" for r in ranks]) and time.monotonic() < deadline:
        time.sleep(0.05)


def _model(width: int = 8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 4))


def _backward(model, rank: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()


def _healthy_gradient_sync(rank, world, group) -> dict:
    """2 buckets of 3 and 4 pieces: the mean gradient, 7 all-reduces, one header all-gather (the plan)."""
    import torch.distributed as dist

    from lancet_rt.parallel import GradientSync

    model = _model()
    sync = GradientSync(model, group, bucket_mb=0.00016, piece_mb=0.00005)
    gathers, all_gather = [], dist.all_gather

    def counting(*a, **kw):
        gathers.append(1)
        return all_gather(*a, **kw)

    dist.all_gather = counting
    try:
        with sync:
            _backward(model, rank)
    finally:
        dist.all_gather = all_gather
    refs = []
    for r in range(world):  # every rank's gradients, computed here: their mean is the expected result
        ref = _model()
        _backward(ref, r)
        refs.append([p.grad for p in ref.parameters()])
    exact = all(
        torch.allclose(p.grad, sum(g[i] for g in refs) / world, rtol=1e-6, atol=1e-7)
        for i, p in enumerate(model.parameters())
    )
    return {
        "buckets": len(sync._buckets),
        "all-reduces": sync.issued,
        "header all-gathers": len(gathers),
        "mean gradient": exact,
    }


def _mismatches(rank, new_group, res) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import GradientSync, replicate, sync_gradients

    def sync_sizes():
        model = _model(9 if rank == 1 else 8)
        _backward(model, rank)
        sync_gradients(model, new_group())

    res["sync_gradients, sizes differ"] = outcome(sync_sizes)

    def gradient_sync_extra():
        model = _model()
        if rank == 1:
            model.append(torch.nn.Linear(4, 4))
        sync = GradientSync(model, new_group(), piece_mb=0.0001)
        with sync:
            _backward(model, rank)

    res["GradientSync, a parameter more on one rank"] = outcome(gradient_sync_extra)

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "ep"))
    res["replicate, models differ"] = outcome(lambda: replicate(_model(9 if rank == 1 else 8), mesh) and None)


def _dp_cases(rank, world, out_dir):
    """The cases in sequence; returns {case: outcome on this rank}. Rank 1 dies in the last one."""
    import torch.distributed as dist

    from lancet_rt.parallel import GradientSync, sync_gradients

    os.environ[env.TIMEOUT] = str(TIMEOUT_S)  # read when a group's monitor is created (first use)
    torch.set_num_threads(1)
    res = {"healthy GradientSync": outcome(lambda: _healthy_gradient_sync(rank, world, dist.new_group()))}
    _mismatches(rank, dist.new_group, res)

    g = dist.new_group()
    model = _model()
    sync = GradientSync(model, g, piece_mb=0.0001)

    def step():
        with sync:  # the plan check passes on both ranks
            if rank == 1:  # alive, but its backward never reaches the gradient all-reduce until rank 0 gave up
                _until_given_up(g, [0])
            else:
                _backward(model, rank)

    res["a peer never joins GradientSync"] = outcome(step)

    g = dist.new_group()
    model = _model()
    sync = GradientSync(model, g)

    def raising_step():
        with sync:
            if rank == 1:
                raise RuntimeError("injected in backward")
            _backward(model, rank)

    def next_step():
        with sync:
            _backward(model, rank)

    res["a rank raises inside GradientSync"] = outcome(raising_step)
    res["the step after it"] = outcome(next_step)

    g = dist.new_group()
    model = _model()
    _backward(model, rank)
    sync_gradients(model, g)  # a first step: the monitors exist, each rank's process is known
    if rank == 1:
        with open(os.path.join(out_dir, "rank1.json"), "w") as f:
            json.dump(res, f)
        os.kill(os.getpid(), signal.SIGKILL)
    res["a peer killed before sync_gradients"] = outcome(lambda: sync_gradients(model, g))
    return res


@pytest.fixture(scope="module")
def dp_cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_faults")
    results = run_ranks(_dp_cases, 2, str(out), timeout=120, may_die=(1,))
    assert 1 not in results, "rank 1 killed itself"
    assert results[0][0] == "ok", results[0][1]
    return [results[0][1], json.loads((out / "rank1.json").read_text())]


def test_the_normal_path_checks_the_plan_once_a_step_and_stays_exact(dp_cases):
    for res in dp_cases:
        kind, got, _ = res["healthy GradientSync"]
        assert kind == "ok", got
        assert got == {"buckets": 2, "all-reduces": 7, "header all-gathers": 1, "mean gradient": True}, got


@pytest.mark.parametrize(
    "case, words",
    [
        ("sync_gradients, sizes differ", ["gradient all-reduce (dense)", "sends [76, 76] elements", "sends [85, 85]"]),
        (
            "GradientSync, a parameter more on one rank",
            ["gradient sync plan", "1 buckets", "data-parallel ranks", "sends [76, 76]", "sends [96, 96]"],
        ),
        ("replicate, models differ", ["replicate broadcast (dense)", "sends [32, 32]", "sends [36, 36]"]),
    ],
)
def test_sizes_that_differ_raise_collective_mismatch_on_every_rank(dp_cases, case, words):
    for res in dp_cases:  # (gloo would abort both processes)
        assert_raised(res[case], "CollectiveMismatch", "does not match across", "nothing was sent", *words)


def test_a_peer_that_never_joins_the_all_reduce_times_out_by_name(dp_cases):
    """Rank 0 waits for the first piece (#2: #1 was the plan check) until the timeout and names rank 1;
    rank 1, when it issues its pieces later, reads rank 0's record and raises at once."""
    assert_raised(
        dp_cases[0]["a peer never joins GradientSync"],
        "PeerTimeout",
        "collective #2 (gradient bucket 0",
        f"timeout {TIMEOUT_S:g} s",
        "rank 1 has not reached collective #2",
        "its process is alive",
        ranks=[1],
    )
    assert_raised(
        dp_cases[1]["a peer never joins GradientSync"], "PeerError", "rank 1 was reported as not answering", ranks=[1]
    )


def test_an_exception_inside_gradient_sync_reaches_the_peers_and_breaks_the_group(dp_cases):
    """PeerError from rank 1's failure record (not after the timeout), then GroupError on both ranks:
    rank 1's next step would otherwise pair its all-reduces with rank 0's of this one."""
    assert_raised(dp_cases[1]["a rank raises inside GradientSync"], "RuntimeError", "injected in backward")
    assert_raised(
        dp_cases[0]["a rank raises inside GradientSync"],
        "PeerError",
        "data-parallel rank(s) [1] failed",
        "gradient bucket 0",
        "RuntimeError: injected in backward",
        ranks=[1],
    )
    for res in dp_cases:
        assert_raised(res["the step after it"], "GroupError", "data-parallel group unusable since an earlier failure")


def test_a_killed_peer_is_named_by_the_survivor(dp_cases):
    kind, msg, ranks = dp_cases[0]["a peer killed before sync_gradients"]
    assert kind in ("PeerError", "PeerTimeout") and "gradient all-reduce (dense)" in msg, (kind, msg)
    assert "rank 1: its process has exited" in msg and ranks == [1], (ranks, msg)


def _four_ranks(rank, world):
    """4 ranks: sizes that differ on rank 2, then rank 3 killed before the all-reduce."""
    import torch.distributed as dist

    from lancet_rt.parallel import sync_gradients

    os.environ[env.TIMEOUT] = str(TIMEOUT_S)
    torch.set_num_threads(1)
    model = _model(9 if rank == 2 else 8)
    _backward(model, rank)
    res = {"sizes differ on rank 2": outcome(lambda: sync_gradients(model, dist.new_group()))}
    g = dist.new_group()
    model = _model()
    _backward(model, rank)
    sync_gradients(model, g)  # a first step
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    res["rank 3 killed"] = outcome(lambda: sync_gradients(model, g))
    return res


def test_four_ranks_mismatch_and_a_killed_rank():
    results = run_ranks(_four_ranks, 4, timeout=120, may_die=(3,))
    assert 3 not in results, "rank 3 killed itself"
    for r in (0, 1, 2):
        status, res = results[r]
        assert status == "ok", res
        assert_raised(
            res["sizes differ on rank 2"],
            "CollectiveMismatch",
            "rank 2 issued #1 gradient all-reduce (dense)",
            "sends [85, 85, 85, 85]",
            "rank 0 issued #1 gradient all-reduce (dense) (torch.float32, sends [76",
        )
        kind, msg, ranks = res["rank 3 killed"]
        # (3 among the ranks named: a loaded machine may leave a live peer out of the 0.2 s roll call)
        assert kind in ("PeerError", "PeerTimeout") and 3 in ranks, (kind, ranks, msg)
        assert "rank 3: its process has exited" in msg and "gradient all-reduce (dense)" in msg, msg
