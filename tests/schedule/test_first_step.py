"""The first expert-parallel step warms its kernels itself, before the layers' first collective.

Without it a rank compiles and autotunes (minutes on an H100) between two collectives and its peers
wait. Two gloo ranks on the Triton path (LANCET_KERNELS=triton, in the interpreter: the path that
tunes on CUDA; ``lancet_rt.ops.implementation`` is "triton" here as it is on a GPU). Every warm-up
step, every collective of the group and the layers' first collectives are recorded in order: the
warm-up must come after the schedule check (whose all-gather carries no kernel), before the layers'
first collective, issue no collective itself, run once per compute dtype (bf16 under the step's
autocast, then float32 without it), and run inside the autocast the step computes in. On CUDA the
same code path runs; what the interpreter cannot show is the compile time it takes off the step.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(600)


def _record(events: list):
    """Wrap the warm-up's step, the group's collectives and the layers' first collectives."""
    from lancet_rt.kernels import grouped_gemm

    from lancet_rt.comm import group
    from lancet_rt.moe.dispatch.alltoall import AllToAll
    from lancet_rt.moe.layer import MoE
    from lancet_rt.schedule import guard, warmup

    step = warmup._step
    warming = []

    def warm_step(run, *a, **k):
        dtype = str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None
        owner = getattr(run, "__self__", None)  # (a layer's warm-up runs its forward_eager; 0: the whole model)
        events.append(("warm", dtype, 0 if owner is None else id(owner)))
        warming.append(True)
        try:
            return step(run, *a, **k)
        finally:
            warming.pop()

    launch = grouped_gemm._launch_gemm

    def gemm(op, grid, args, device, **const):
        if warming:
            events.append(("warm gemm", str(args[0].dtype), None))
        return launch(op, grid, args, device, **const)

    warmup._step = warm_step
    grouped_gemm._launch_gemm = gemm
    for name in ("all_gather", "all_to_all", "exchange", "all_reduce", "broadcast"):
        method = getattr(group.TorchGroup, name)
        setattr(
            group.TorchGroup,
            name,
            lambda self, *a, _m=method, _n=name, **k: (events.append(("collective", _n, None)), _m(self, *a, **k))[1],
        )
    check_schedule = guard.check_schedule

    def schedule(ov, layers):
        check_schedule(ov, layers)
        events.append(("schedule checked", None, None))

    guard.check_schedule = schedule
    # (the layer's config check, its dispatcher's counts exchange; not the warm-up's own)
    for cls, name, layer_of in ((MoE, "_check_config", lambda s: s), (AllToAll, "exchange_counts", lambda s: s.moe)):
        method = getattr(cls, name)
        setattr(
            cls,
            name,
            lambda self, *a, _m=method, _n=name, _l=layer_of, **k: (
                warming or events.append(("layer", _n, id(_l(self)))),
                _m(self, *a, **k),
            )[1],
        )


def _steps(rank, world, overlapped: bool):
    os.environ["LANCET_KERNELS"] = "triton"
    import torch.distributed as dist

    import lancet_rt
    from lancet_rt import ops
    from lancet_rt.models.blocks import MoEBlocks

    ops._cache.clear()
    events: list = []
    _record(events)
    torch.manual_seed(0)
    model = MoEBlocks(2, 16, 2, dict(d_ffn=32, num_experts=4, top_k=2, capacity_factor=None, ep_group=dist.group.WORLD))
    runner = lancet_rt.Overlapped(model, chunks=2) if overlapped else model
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(rank))
    per_step = []
    for autocast in (True, True, False):
        events.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = runner(x)
        out.float().square().mean().backward()
        per_step.append(list(events))
    return per_step


def _check_first_step(events: list, dtype: str, warm_steps: int) -> None:
    """``warm_steps`` warm-ups under ``dtype``'s autocast, each before the first collective of the layers
    it warms (a layer's own, outside Overlapped; every layer's, in it), none issuing a collective."""
    warm = [i for i, (kind, _, _) in enumerate(events) if kind == "warm"]
    assert len(warm) == warm_steps, events
    assert all(events[i][1] == dtype for i in warm), f"warm-up outside the step's autocast ({dtype}): {events}"
    gemms = {v for kind, v, _ in events if kind == "warm gemm"}
    assert gemms == {dtype if dtype else "torch.float32"}, events
    for i in warm:
        owner = events[i][2]
        first = next(j for j, (kind, _, who) in enumerate(events) if kind == "layer" and owner in (who, 0))
        assert i < first, f"a layer collective before its warm-up: {events}"
        assert not [e for e in events[i:first] if e[0] == "collective"], f"the warm-up issued a collective: {events}"
    checked = [i for i, (kind, _, _) in enumerate(events) if kind == "schedule checked"]
    if checked:
        assert checked[0] < warm[0]  # (the schedule check's all-gather comes first; it compiles nothing)


@pytest.mark.parametrize("overlapped", [True, False], ids=["overlapped", "bare-layers"])
def test_first_step_warms_once_per_dtype_before_the_first_collective(overlapped):
    results = run_ranks(_steps, 2, overlapped, timeout=540)
    errors = {r: v for r, (status, v) in results.items() if status != "ok"}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    # Overlapped warms the whole model in one step; layers outside one warm each their own.
    per_first_step = 1 if overlapped else 2
    for r, (_, (first, second, third)) in sorted(results.items()):
        _check_first_step(first, "torch.bfloat16", per_first_step)
        assert not [e for e in second if e[0] == "warm"], f"rank {r} warmed bf16 twice: {second}"
        _check_first_step(third, None, per_first_step)  # float32: a new dtype, warmed again


def _explicit(rank, world):
    os.environ["LANCET_KERNELS"] = "triton"
    import torch.distributed as dist

    import lancet_rt
    from lancet_rt import ops
    from lancet_rt.models.blocks import MoEBlocks

    ops._cache.clear()
    events: list = []
    _record(events)
    model = MoEBlocks(1, 16, 2, dict(d_ffn=32, num_experts=4, top_k=2, capacity_factor=None, ep_group=dist.group.WORLD))
    runner = lancet_rt.Overlapped(model, chunks=2)
    x = torch.randn(2, 4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lancet_rt.warmup(runner, x)
        events.clear()
        runner(x).float().sum().backward()
    return [e for e in events if e[0] == "warm"]


def test_explicit_warmup_in_the_steps_autocast_leaves_nothing_to_warm():
    results = run_ranks(_explicit, 2, timeout=300)
    errors = {r: v for r, (status, v) in results.items() if status != "ok"}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    assert all(v == [] for _, v in results.values()), results


# ------------------------------------------------------------------ CUDA_DEVICE_MAX_CONNECTIONS
def test_one_connection_on_cuda_warns_naming_the_variable(monkeypatch):
    from lancet_rt.schedule.warmup import check_connections

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.warns(RuntimeWarning, match=r"CUDA_DEVICE_MAX_CONNECTIONS=1.*Unset CUDA_DEVICE_MAX_CONNECTIONS"):
        check_connections(torch.device("cuda", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_connections(torch.device("cpu"))  # nothing to check off CUDA
        for value in ("8", "32"):
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
            check_connections(torch.device("cuda", 0))
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
        check_connections(torch.device("cuda", 0))


@pytest.mark.parametrize("value", ["0", "eight", "-1", "2.5"])
def test_unreadable_connections_value_is_a_value_error(monkeypatch, value):
    from lancet_rt.schedule.warmup import check_connections

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    with pytest.raises(ValueError, match=f"CUDA_DEVICE_MAX_CONNECTIONS must be an integer >= 1.*{value!r}"):
        check_connections(torch.device("cuda", 0))
    check_connections(torch.device("cpu"))


def _connections_checked(rank, world):
    import torch.distributed as dist

    import lancet_rt
    from lancet_rt.models.blocks import MoEBlocks
    from lancet_rt.schedule import warmup

    events: list = []
    _record(events)
    checked = warmup.check_connections
    warmup.check_connections = lambda device: (events.append(("connections", str(device), None)), checked(device))[1]
    model = MoEBlocks(1, 16, 2, dict(d_ffn=32, num_experts=4, top_k=2, capacity_factor=None, ep_group=dist.group.WORLD))
    runner = lancet_rt.Overlapped(model, chunks=2)
    emulated = lancet_rt.Overlapped(
        MoEBlocks(1, 16, 2, dict(d_ffn=32, num_experts=4, top_k=2, ep_group=lancet_rt.EmulatedGroup(2))), chunks=2
    )
    x = torch.randn(2, 4, 16)
    for _ in range(2):
        runner(x).sum().backward()
    emulated(x).sum().backward()
    return events


def test_overlapped_with_a_process_group_checks_connections_before_its_layers_collectives():
    """Each step of an Overlapped with a real group checks the variable (on CUDA it reads it; here the
    device is the CPU, so the check itself returns: its CUDA branch is tested above with a CUDA device);
    a step on an emulated link has no peers and checks nothing."""
    results = run_ranks(_connections_checked, 2, timeout=300)
    errors = {r: v for r, (status, v) in results.items() if status != "ok"}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    for _, events in results.values():
        kinds = [k for k, _, _ in events]
        assert kinds.count("connections") == 2, events
        first_layer = kinds.index("layer")
        assert kinds.index("connections") < first_layer
        assert ("connections", "cpu", None) in events
