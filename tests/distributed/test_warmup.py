"""``lancet_rt.warmup``: after it, no kernel shape a step meets is new on any rank, so no rank
compiles or tunes between two collectives while its peer waits.

Two gloo ranks on the Triton path (the interpreter). Every launch is recorded with the key Triton
would compile and tune it under: the autotune key (the grouped GEMMs' bucket of mean rows per expert,
the sizes, the dtypes) and the constexprs. Warm-up runs first; then three training steps, the last
with the router turned so that every token of both ranks goes to rank 0's experts: rank 0 alone
crosses into a row bucket the balanced steps never reach (the case where one rank re-tuned alone).
Every key the steps launch must have been launched by warm-up, on each rank; and warm-up must leave
no trace (gradients, the configuration check, the RNG).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(400)


def _keys(monkeypatch_target, record):
    """Wrap the launch points of every Triton kernel family; record (kernel, key) per launch."""
    from lancet_rt.kernels import _common, grouped_gemm

    launch_gemm, run_autotuned = grouped_gemm._launch_gemm, _common.run_autotuned

    # each grouped GEMM's autotune key by its arguments' names: the row bucket, then (N, K, E) or (F, D, E)
    # (the dW pair: (N, K, N_B, K_B, E))
    kernels = {
        "fwd": grouped_gemm._FWD,
        "dx": grouped_gemm._FWD,
        "dw": grouped_gemm._DW,
        "dw_pair": grouped_gemm._DW_PAIR,
        "gate_up": grouped_gemm._GATE_UP,
    }
    pair_sizes = ("N", "K", "N_B", "K_B", "E")

    def gemm(op, grid, args, device, **const):
        jit = kernels[op]
        while not hasattr(jit, "arg_names"):  # (under the heuristics wrapper)
            jit = jit.fn
        named = dict(zip(jit.arg_names, args))
        sizes = {"gate_up": ("F", "D", "E"), "dw_pair": pair_sizes}.get(op, ("N", "K", "E"))
        key = (named["M_BUCKET"], *(named[s] for s in sizes))
        record(("gemm", op, *key, str(args[0].dtype), tuple(sorted(const.items()))))
        return launch_gemm(op, grid, args, device, **const)

    def tuned(tuner, grid, args, meta, env_var):
        named = {**dict(zip(tuner.arg_names, args)), **meta}
        key = tuple(named[k] for k in tuner.keys)
        dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
        record((tuner.fn.__name__, key, dtypes, tuple(sorted(meta.items()))))
        return run_autotuned(tuner, grid, args, meta, env_var)

    grouped_gemm._launch_gemm = gemm
    for mod in monkeypatch_target:
        mod.run_autotuned = tuned


def _rank(rank, world):
    os.environ["LANCET_KERNELS"] = "triton"
    import torch.distributed as dist
    from lancet_rt.kernels import gating, permute

    import lancet_rt
    from lancet_rt import ops
    from lancet_rt.models.blocks import MoEBlocks

    ops._cache.clear()
    seen: set = set()
    _keys((gating, permute), seen.add)
    torch.manual_seed(0)
    model = MoEBlocks(1, 16, 2, dict(d_ffn=32, num_experts=4, top_k=2, capacity_factor=None, ep_group=dist.group.WORLD))
    runner = lancet_rt.Overlapped(model, chunks=2)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(rank))
    rng = torch.get_rng_state()
    report = lancet_rt.warmup(runner, x)
    warm = set(seen)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert not model.moe_layers()[0]._config_checked  # the real step still checks the configuration
    seen.clear()
    for step in range(3):
        if step == 2:  # every token of both ranks to experts 0 and 1: rank 0's
            with torch.no_grad():
                router = model.moe_layers()[0].router.weight
                router.zero_()
                router[:, 0] = torch.tensor([10.0, 9.0, -10.0, -10.0])  # by feature 0 alone
                x = x.clone()
                x[..., 0] = 10.0  # (so feature 0 leads every token's normalised row)
        model.zero_grad(set_to_none=True)
        runner(x).square().mean().backward()
        if step == 1:
            balanced = set(seen)
    new = seen - warm
    buckets = {k[2] for k in seen if k[0] == "gemm"} - {k[2] for k in balanced if k[0] == "gemm"}
    return dict(
        new=sorted(map(str, new)),
        crossed=sorted(buckets),
        report_buckets=report["buckets"],
        all=sorted({k[2] for k in seen if k[0] == "gemm"}),
        bal=sorted({k[2] for k in balanced if k[0] == "gemm"}),
    )


def test_warmup_leaves_no_new_kernel_key_for_the_steps():
    results = run_ranks(_rank, 2, timeout=360)
    errors = {r: v for r, (status, v) in results.items() if status != "ok"}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    out = {r: v for r, (_, v) in results.items()}
    assert out[0]["crossed"], str(out) + "the skewed step must reach a bucket the balanced steps did not (rank 0)"
    assert out[0]["report_buckets"] == out[1]["report_buckets"]  # the same keys warmed on every rank
    for r in (0, 1):
        assert out[r]["new"] == [], f"rank {r} launched keys warm-up never did: {out[r]['new']}"


def _state_rank(rank, world):
    import torch.distributed as dist

    from tests.schedule.test_warmup_state import GRAD_STATES, warmup_case

    return {grads: warmup_case(grads, dist.group.WORLD, rank) for grads in GRAD_STATES}


def test_warmup_leaves_state_and_the_next_step_unchanged_on_two_ranks():
    """The state checks of tests/schedule/test_warmup_state.py with a 2-rank expert-parallel group:
    ``.grad`` None, zeros and a partial microbatch sum, bitwise, and the next step's gradients."""
    results = run_ranks(_state_rank, 2, timeout=300)
    errors = {r: v for r, (status, v) in results.items() if status != "ok"}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    found = [f"rank {r}, .grad {g}: {d}" for r, (_, v) in sorted(results.items()) for g, ds in v.items() for d in ds]
    assert not found, "\n".join(found)
