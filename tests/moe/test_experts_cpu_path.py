"""The experts' CPU path (kernels.cpu_backend) does no work it need not, on memory it can stream (found
comparing the float32 layer with torchtitan's): without an input gradient no dX GEMM and no dual
all-to-all; gate and up computed and kept as contiguous halves (kernels.cpu_backend.GateUp),
and without dX their gradient too, bit for bit the one [R, 2F] GEMM's results; one host read of
the counts per forward without a group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lancet_rt.kernels import cpu_backend as cb
from lancet_rt.kernels.cpu_backend import GateUp

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_halves_are_the_fused_gemm_bit_for_bit(dtype, bias):
    """F a multiple of the vector step: the halves' GEMMs, activation and its gradient give the one
    [R, 2F] GEMM's and its strided halves' bits (odd segment sizes, an empty one, R * F not a
    multiple of any vector width)."""
    g = torch.Generator().manual_seed(0)
    R, D, F, sizes = 73, 32, 64, [20, 0, 45, 8]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    x = torch.randn(R, D, generator=g).to(dtype)
    w = (torch.randn(len(sizes), 2 * F, D, generator=g) * 0.2).to(dtype)
    b = torch.randn(len(sizes), 2 * F, generator=g).to(dtype) if bias else None
    h, gu = cb.gate_up_swiglu(x, w, bounds, b)
    h2, halves = cb.gate_up_swiglu(x, w, bounds, b, halves=True)
    assert isinstance(halves, GateUp) and halves.shape == gu.shape
    assert all(t.is_contiguous() and t.shape == (R, F) for t in halves)
    assert torch.equal(h2, h)
    assert torch.equal(halves.gate, gu[:, :F]) and torch.equal(halves.up, gu[:, F:])
    dh = torch.randn(R, F, generator=g).to(dtype)
    want = cb.swiglu_bwd(gu, dh)
    assert torch.equal(cb.swiglu_bwd(halves, dh), want)
    out = torch.full((R, 2 * F), float("nan"), dtype=dtype)
    assert cb.swiglu_bwd(halves, dh, out=out) is out and torch.equal(out, want)
    oai = dict(activation="swiglu_oai", alpha=1.5, limit=0.5)
    assert torch.equal(cb.swiglu_fwd(halves, **oai), cb.swiglu_fwd(gu, **oai))
    assert torch.equal(cb.swiglu_bwd(halves, dh, **oai), cb.swiglu_bwd(gu, dh, **oai))
    # the gradient as halves too (the layer's backward without dX), and dW from them
    for act in ({}, oai):
        joined = cb.swiglu_bwd(halves, dh, **act)
        dgu = cb.swiglu_bwd(halves, dh, halves=True, **act)
        assert isinstance(dgu, GateUp) and all(t.is_contiguous() for t in dgu)
        assert torch.equal(dgu.gate, joined[:, :F]) and torch.equal(dgu.up, joined[:, F:])
        bufs = GateUp(*torch.full((2, R, F), float("nan"), dtype=dtype))
        assert cb.swiglu_bwd(halves, dh, halves=True, out=bufs, **act) is not None
        assert torch.equal(bufs.gate, dgu.gate) and torch.equal(bufs.up, dgu.up)
        assert torch.equal(cb.grouped_mm_dw(dgu, x, bounds), cb.grouped_mm_dw(joined, x, bounds))


def test_a_silu_tail_is_why_f_must_be_a_multiple_of_the_vector_step():
    """The reason for the condition: over a contiguous [R, F] with F = 40 the vectorized loop's scalar
    tail falls elsewhere than over the strided half, and silu's scalar and vector forms differ."""
    x = torch.randn(70, 80, generator=torch.Generator().manual_seed(0))
    strided = torch.nn.functional.silu(x[:, :40])
    assert not torch.equal(strided, torch.nn.functional.silu(x[:, :40].contiguous()))
    assert torch.equal(torch.nn.functional.silu(x[:, :64]), torch.nn.functional.silu(x[:, :64].contiguous()))


@pytest.mark.parametrize("case", ["F=40", "float64", "interleaved", "differentiated"])
def test_pre_activation_stays_one_tensor_where_halves_would_change_bits(case):
    """F off the vector step, float64 (MKL's dgemm rounds a [R, F] product otherwise than the [R, 2F]
    one), GPT-OSS's interleaved order, or differentiated directly (autograd would sum dX over two
    GEMMs): one [R, 2F] tensor, as without ``halves``."""
    F, dtype, interleaved = (
        (40, torch.float32, False)
        if case == "F=40"
        else (64, torch.float64, False)
        if case == "float64"
        else (64, torch.float32, case == "interleaved")
    )
    x, w = torch.randn(10, 8, dtype=dtype), torch.randn(2, 2 * F, 8, dtype=dtype)
    w.requires_grad_(case == "differentiated")
    h, gu = cb.gate_up_swiglu(x, w, [0, 4, 10], interleaved=interleaved, halves=True)
    assert isinstance(gu, torch.Tensor) and gu.shape == (10, 2 * F)
    assert torch.equal(h, cb.gate_up_swiglu(x, w, [0, 4, 10], interleaved=interleaved)[0])


def test_gate_up_halves_are_differentiable():
    """Differentiated directly (as the float64 checks do), the halves give the fused path's gradients."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 8, generator=g)
    w = torch.randn(3, 64, 8, generator=g)
    dh = torch.randn(30, 32, generator=g)
    grads = []
    for halves in (False, True):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        h, _ = cb.gate_up_swiglu(xi, wi, [0, 10, 10, 30], halves=halves)
        h.backward(dh)
        grads.append((xi.grad, wi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_cpu_layer_saves_contiguous_halves_not_the_strided_pre_activation():
    """What the layer's experts keep for backward on the CPU path: gate and up as two contiguous [R, F]
    tensors (the same bytes as one [R, 2F]); no [R, 2F] tensor is saved."""
    torch.manual_seed(0)
    D, F = 32, 64
    moe = lancet_rt.MoE(D, F, 4, 2)
    x = torch.randn(64, D, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        moe(x)
    R = 64 * 2
    shapes = [tuple(t.shape) for t in saved]
    assert (R, 2 * F) not in shapes
    halves = [t for t in saved if tuple(t.shape) == (R, F)]
    assert len(halves) == 3 and all(t.is_contiguous() for t in halves)  # gate, up and h


@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("chunks, defer", [(1, False), (3, True)])
def test_layer_with_halves_is_bitwise_the_layer_without(monkeypatch, chunks, defer, x_grad):
    """The whole layer, F = 64 (halves taken; without an input gradient dgu as halves too),
    expert-parallel on the emulated link (dY and dX permuted), chunked with deferred dW: output, input
    gradient and every parameter gradient the same bits with the CPU path's halves as with the one
    [R, 2F] pre-activation; and chunked, the output and the input gradient are unchunked's (the
    weight gradients sum per-chunk products)."""
    ns = ops_mod.get_ops(torch.device("cpu"), torch.float32)

    def run(halves, chunks, defer):
        monkeypatch.setattr(ns, "gate_up_halves", halves)
        torch.manual_seed(0)
        moe = lancet_rt.MoE(32, 64, 8, 2, ep_group=lancet_rt.EmulatedGroup(4, float("inf"), 0.0))
        x = torch.randn(240, 32, generator=torch.Generator().manual_seed(1), requires_grad=x_grad)
        runner = lancet_rt.Overlapped(moe, chunks=chunks, defer_wgrad=defer) if chunks > 1 else moe
        y = runner(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
        return [y.detach(), x.grad] + [p.grad for p in moe.parameters()]

    with_halves = run(True, chunks, defer)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(with_halves, run(False, chunks, defer)))
    if chunks > 1 and x_grad:
        assert all(torch.equal(a, b) for a, b in zip(with_halves[:2], run(True, 1, False)[:2]))


def test_one_process_reads_the_counts_once_per_forward():
    """Without a group the layer reads its kept rows per expert once (the rows to permute and the
    experts' segment bounds), not once more per grouped GEMM."""
    from bench.host import OpCounter

    torch.manual_seed(0)
    moe = lancet_rt.MoE(32, 64, 8, 2)
    x = torch.randn(100, 32, requires_grad=True)
    moe(x).sum().backward()  # warm
    with OpCounter() as counter:
        moe(x).sum().backward()
    assert counter.reads == 1, counter.ops
