"""PPMoE's all-reduce dispatch (lancet_rt.moe.dispatch.allreduce) against the contract, on 2 gloo ranks and the
emulated link."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from tests.contract_ref import moe_contract_ref
from tests.dist import assert_all_ok, run_ranks
from tests.helpers import assert_close, assert_same_run, run_and_grad

D = 16


def _allreduce_matches(rank, world):
    """dispatcher="allreduce" on 2 gloo ranks with the same tokens: every output, loss and gradient
    equals the unsharded layer's (and the contract's); chunked under Overlapped too; other tokens on
    one rank raise on both."""
    import torch.distributed as dist

    out = []
    for K, cf, score_fn, aux in [(2, None, "softmax", 0.0), (2, 0.75, "sigmoid", 0.01)]:
        kw = dict(capacity_factor=cf, score_fn=score_fn, aux_loss_coef=aux, z_loss_coef=aux / 10)
        torch.manual_seed(0)
        full = lancet_rt.MoE(D, 6, 4, K, **kw)
        ar = lancet_rt.MoE(D, 6, 4, K, ep_group=dist.group.WORLD, dispatcher="allreduce", **kw)
        L = 4 // world
        sl = slice(rank * L, (rank + 1) * L)
        with torch.no_grad():
            ar.router.weight.copy_(full.router.weight)
            ar.experts.gate_up_proj.copy_(full.experts.gate_up_proj[sl])
            ar.experts.down_proj.copy_(full.experts.down_proj[sl])
        gen = torch.Generator().manual_seed(7)  # the same tokens on every rank
        x, g = torch.randn(23, D, generator=gen), torch.randn(23, D, generator=gen)
        ref = _run_moe(full, x, g)
        got = _run_moe(ar, x, g)
        for name, a, b in zip(("y", "grad x", "grad router"), got[:3], ref[:3]):
            assert_close(name, a, b)
        assert_close("grad gate_up", got[3], ref[3][sl])
        assert_close("grad down", got[4], ref[4][sl])
        assert_close("aux", ar.aux_loss.reshape(1), full.aux_loss.reshape(1))
        assert_close("z", ar.z_loss.reshape(1), full.z_loss.reshape(1))
        assert ar.dropped == full.dropped and torch.equal(ar.tokens_per_expert, full.tokens_per_expert)
        xd = x.double().requires_grad_(True)
        y_c, aux_c, z_c, _, dropped_c = moe_contract_ref(
            xd,
            full.router.weight.double(),
            full.experts.gate_up_proj.double(),
            full.experts.down_proj.double(),
            top_k=K,
            capacity_factor=cf,
            score_fn=score_fn,
        )
        assert_close("y vs contract", got[0], y_c.float())
        assert dropped_c == ar.dropped and math.isclose(ar.aux_loss.item(), aux_c.item(), rel_tol=1e-5)
        out.append(ar.dropped)

    # Chunked: Overlapped around attention + MoE blocks with the all-reduce dispatcher.
    torch.manual_seed(1)
    model = MoEBlocks(
        2,
        D,
        2,
        dict(
            d_ffn=12,
            num_experts=4,
            top_k=2,
            capacity_factor=0.75,
            aux_loss_coef=0.01,
            z_loss_coef=0.001,
            ep_group=dist.group.WORLD,
            dispatcher="allreduce",
        ),
    )
    torch.manual_seed(10 + rank)  # each rank its own experts
    for m in model.moe_layers():
        m.experts.reset_parameters()
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(5, 4, D, generator=gen), torch.randn(5, 4, D, generator=gen)
    assert_same_run(
        run_and_grad(model, model, (x,), {}, g),
        run_and_grad(twin, lancet_rt.Overlapped(twin, chunks=3, defer_wgrad=True), (x,), {}, g),
        "overlapped ",
    )
    out.append(sum(m.dropped for m in twin.moe_layers()))

    # Other tokens on one rank: every rank raises instead of hanging in the all-reduce.
    try:
        full_ar = lancet_rt.MoE(D, 6, 4, 2, ep_group=dist.group.WORLD, dispatcher="allreduce")
        full_ar(torch.randn(9, D, generator=torch.Generator().manual_seed(rank)))
        out.append("no error")
    except ValueError as exc:
        out.append(str(exc))
    # A rejected input on one rank (the wrong width): the other raises too.
    try:
        full_ar(torch.randn(9, D + 1 if rank else D))
        out.append("no error")
    except ValueError as exc:
        out.append(str(exc))
    return out


def _run_moe(moe, x, g):
    x = x.clone().requires_grad_(True)
    y = moe(x)
    y.backward(g)
    return y.detach(), x.grad, moe.router.weight.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad


def test_allreduce_dispatch_equals_contract_on_two_ranks():
    results = assert_all_ok(run_ranks(_allreduce_matches, 2, timeout=120))
    for r in results:
        assert r[1] > 0 and r[2] > 0, "the capacity cases must drop"
        assert "same on every rank" in r[3], r[3]
    assert "d_model=16" in results[1][4] and "rejected on expert-parallel rank(s) [1]" in results[0][4], results


def test_allreduce_dispatch_on_the_emulated_link():
    """One process as rank 0 of W: it computes only its experts' rows, and the link carries a ring
    all-reduce of the output [T, D] per layer and chunk (2 (W-1)/W x bytes) and the two backward
    all-reduces (x's and the routing weights' gradients), plus the counts exchanges."""
    W, T = 4, 24
    link = lancet_rt.EmulatedGroup(W, bandwidth_gbps=math.inf)
    moe = lancet_rt.MoE(D, 8, 8, 2, ep_group=link, dispatcher="allreduce")
    x = torch.randn(T, D, requires_grad=True)
    y = moe(x)
    assert link.transfers == 2 and link.off_rank_bytes == 2 * (W - 1) * T * D * 4 // W
    y.backward(torch.randn_like(y))
    assert link.transfers == 4
    assert link.off_rank_bytes == 2 * (W - 1) * T * D * 4 // W * 2 + 2 * (W - 1) * T * 2 * 4 // W
    with pytest.raises(ValueError, match="dispatcher"):
        lancet_rt.MoE(D, 8, 8, 2, dispatcher="ring")
    with pytest.raises(ValueError, match="pipeline_chunks"):
        lancet_rt.MoE(D, 8, 8, 2, ep_group=link, dispatcher="allreduce", pipeline_chunks=2)
