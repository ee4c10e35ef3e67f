"""The experts' weight (and bias) gradients are deferred under ``Overlapped(defer_wgrad=True)``.

tests/schedule/test_overlap.py checks that deferral gives the right gradients, but the DeferredLinear items
alone satisfy its checks: an experts layer that computed dW inline in its backward would pass them.
Here every ``grouped_mm_dw`` (or ``grouped_mm_dw_pair``) and ``segment_sum`` (bias gradient) call the
MoE layer makes is recorded with the Python stack it ran on: under deferral each must come from the
weight-gradient queue (a backward all-to-all's drain window or the final flush), never from inside the
experts' autograd backward; and the gradients must equal, bit for bit in float32, those of the same chunked run without
deferral. Both layouts: the default experts, and GPT-OSS's (biases deferred with their weights).
"""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import lancet_rt
from lancet_rt import ops as ops_mod
from lancet_rt.models.blocks import MoEBlocks
from lancet_rt.moe import experts as experts_mod
from lancet_rt.runtime import wgrad as wgrad_mod

D, CHUNKS, LAYERS = 16, 2, 1
_EXPERTS_FILE = os.path.normcase(os.path.abspath(experts_mod.__file__))
_QUEUE_CODES = {wgrad_mod.WGradQueue.drain_during.__code__: "drain", wgrad_mod.WGradQueue.flush.__code__: "flush"}


def _caller():
    """Where the current grouped_mm_dw call runs: "drain" or "flush" (the queue, innermost first)
    or "inline" (inside the experts' autograd backward), else "other"."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code in _QUEUE_CODES:
            return _QUEUE_CODES[code]
        if code.co_name in ("backward", "_backward") and os.path.normcase(code.co_filename) == _EXPERTS_FILE:
            return "inline"
        f = f.f_back
    return "other"


_SPIED = ("grouped_mm_dw", "grouped_mm_dw_pair", "segment_sum")


@pytest.fixture
def dw_calls(monkeypatch):
    """Record (caller, implementing module, op) of every ``grouped_mm_dw`` and ``segment_sum`` call
    through the op namespaces the MoE layer gets."""
    calls: list[tuple[str, str, str]] = []
    get_ops = ops_mod.get_ops

    def spy(name, fn):
        def spied(*a, **k):
            calls.append((_caller(), fn.__module__, name))
            return fn(*a, **k)

        return spied

    def spied_get_ops(*args, **kwargs):
        ns = get_ops(*args, **kwargs)
        return SimpleNamespace(**{**vars(ns), **{n: spy(n, getattr(ns, n)) for n in _SPIED}})

    monkeypatch.setattr(ops_mod, "get_ops", spied_get_ops)
    return calls


def _run(model, runner, x, g):
    """Output, input gradient and every parameter gradient of one forward + backward."""
    x = x.clone().requires_grad_(True)
    y = runner(x)
    y.backward(g)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _gpt_oss_experts(model):
    """Give every MoE layer GPT-OSS's experts (same sizes), with random biases."""
    for m in model.moe_layers():
        e = m.experts
        m.experts = experts_mod.Experts(e.num_local_experts, e.d_model, e.d_ffn, layout="gpt_oss")
        with torch.no_grad():
            for b in (m.experts.gate_up_proj_bias, m.experts.down_proj_bias):
                b.normal_(std=0.1)


@pytest.mark.parametrize("layout", ["lancet", "gpt_oss"])
@pytest.mark.parametrize("kernels", ["default", "triton"])
def test_experts_dw_is_deferred_and_exact(kernels, layout, monkeypatch, dw_calls):
    if kernels == "triton":
        monkeypatch.setenv("LANCET_KERNELS", "triton")  # the interpreter on CPU (tests/conftest.py)
    else:
        monkeypatch.delenv("LANCET_KERNELS", raising=False)
    torch.manual_seed(0)
    # The link holds each transfer 20 ms, so the backward all-to-alls have windows to drain into.
    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=1.0, latency_us=20_000)
    model = MoEBlocks(LAYERS, D, 2, dict(d_ffn=12, num_experts=4, top_k=2, ep_group=link))
    if layout == "gpt_oss":
        _gpt_oss_experts(model)
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(5, 3, D, generator=gen), torch.randn(5, 3, D, generator=gen)

    # On the Triton GEMMs both dW GEMMs are one launch (grouped_mm_dw_pair), on the CPU backend two.
    dw_op = "grouped_mm_dw_pair" if kernels == "triton" else "grouped_mm_dw"
    impl = {dw_op: "lancet_rt.kernels.grouped_gemm", "segment_sum": "lancet_rt.kernels.segment_sum"}
    if kernels != "triton":
        impl = {dw_op: "lancet_rt.kernels.cpu_backend", "segment_sum": "lancet_rt.kernels.reference_experts"}
    ref = _run(model, lancet_rt.Overlapped(model, chunks=CHUNKS, defer_wgrad=False), x, g)
    ops = {dw_op, "segment_sum"} if layout == "gpt_oss" else {dw_op}
    assert dw_calls and set(dw_calls) == {("inline", impl[op], op) for op in ops}, (
        f"without deferral dW runs in the backward: {dw_calls}"
    )
    dw_calls.clear()
    experts_fwd = []
    for m in twin.moe_layers():
        m.experts.register_forward_hook(lambda *_: experts_fwd.append(1))
    ov = lancet_rt.Overlapped(twin, chunks=CHUNKS, defer_wgrad=True)
    got = _run(twin, ov, x, g)

    # Two dW GEMMs (gate_up, down) per experts call (one pair call on the Triton GEMMs), and with
    # biases two segment sums, every one run by the queue, none inline.
    assert len(experts_fwd) == LAYERS * CHUNKS
    per_call = {"grouped_mm_dw": 2, "grouped_mm_dw_pair": 1, "segment_sum": 2}
    assert len(dw_calls) == sum(per_call[op] for op in ops) * len(experts_fwd), dw_calls
    assert {(c[1], c[2]) for c in dw_calls} == {(impl[op], op) for op in ops}
    assert {c[0] for c in dw_calls} <= {"drain", "flush"}, f"experts dW not deferred: {dw_calls}"
    assert not ov.wgrad_queue.items
    # Exactly the non-deferred gradients: the same per-chunk dW, summed over 2 chunks (commutative).
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[2].keys() == ref[2].keys()
    params = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if layout == "gpt_oss" else ())
    assert {n for n in ref[2] if "experts" in n} == {
        f"blocks.{i}.moe.experts.{p}" for i in range(LAYERS) for p in params
    }
    for n in ref[2]:
        assert got[2][n].dtype == torch.float32
        assert torch.equal(got[2][n], ref[2][n]), f"grad {n}: max diff {(got[2][n] - ref[2][n]).abs().max()}"
