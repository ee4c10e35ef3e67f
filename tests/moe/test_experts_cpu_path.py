"""The experts' CPU path (the references) does no work it need not (issue 38, the float32 layer
against torchtitan's): without an input gradient no dX GEMM and no dual all-to-all."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lancet_rt
from lancet_rt import ops as ops_mod


def _ep_moe(seed=0):
    torch.manual_seed(seed)
    return lancet_rt.MoE(32, 48, 8, 2, ep_group=lancet_rt.EmulatedGroup(4, float("inf"), 0.0))


def _step(moe, x_grad: bool, chunks: int = 1):
    x = torch.randn(90, 32, generator=torch.Generator().manual_seed(1)).requires_grad_(x_grad)
    moe.zero_grad(set_to_none=True)
    runner = lancet_rt.Overlapped(moe, chunks=chunks) if chunks > 1 else moe
    y = runner(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
    return y.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters()}


@pytest.mark.parametrize("chunks", [1, 3])
def test_no_input_gradient_no_dx_gemm_and_no_dual_all_to_all(monkeypatch, chunks):
    """Tokens that need no gradient (a first layer's input): the experts' backward runs one
    grouped_mm_dx (dH) per chunk, not two, and issues no dispatch dual; every parameter gradient
    is bitwise the one with an input gradient."""
    calls = []
    get_ops = ops_mod.get_ops

    def spied_get_ops(*args, **kwargs):
        ns = get_ops(*args, **kwargs)
        dx = ns.grouped_mm_dx
        return SimpleNamespace(**{**vars(ns), "grouped_mm_dx": lambda *a, **k: calls.append(1) or dx(*a, **k)})

    monkeypatch.setattr(ops_mod, "get_ops", spied_get_ops)
    duals = []
    issue = lancet_rt.comm.group.BackwardLink.issue
    monkeypatch.setattr(lancet_rt.comm.group.BackwardLink, "issue", lambda self, g: duals.append(1) or issue(self, g))

    with_grad = _step(_ep_moe(), True, chunks)
    n_dx, n_duals = len(calls), len(duals)
    calls.clear()
    duals.clear()
    without = _step(_ep_moe(), False, chunks)
    # with: dH and dX per chunk, and the dispatch's and the combine's duals per chunk
    assert (n_dx, n_duals) == (2 * chunks, 2 * chunks)
    assert (len(calls), len(duals)) == (chunks, chunks)  # dH only; the combine's dual only
    assert without[1] is None
    assert torch.equal(with_grad[0], without[0])
    for name, g in with_grad[2].items():
        assert torch.equal(g, without[2][name]), name
