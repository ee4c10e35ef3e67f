"""The experts' backward on the CPU path allocates its outputs and nothing per step beyond them:
its temporaries live in scratch memory reused from step to step. Counted, not timed: the
bytes of every new storage an ATen op creates inside the backward."""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import cpu_backend as cb
from lancet_rt.kernels.reference_experts import grouped_mm_dx_ref
from torch.utils._python_dispatch import TorchDispatchMode

import lancet_rt
from lancet_rt.moe import experts as experts_mod


class _NewStorages(TorchDispatchMode):
    """Bytes of the storages ops return that none of their arguments holds (out=, in-place and
    views add nothing)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        held = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                held.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
                self.count += 1
        return out


def _backward_new_bytes(experts, x, offsets, bounds, dy) -> int:
    ops = lancet_rt.ops.get_ops(x.device, x.dtype)
    experts.zero_grad(set_to_none=True)
    y = experts(x, offsets, ops, bounds=bounds)
    counter = _NewStorages()
    original = experts_mod._ExpertsFn._backward

    def counted(ctx, grad):
        with counter:
            return original(ctx, grad)

    experts_mod._ExpertsFn._backward = staticmethod(counted)
    try:
        y.backward(dy)
    finally:
        experts_mod._ExpertsFn._backward = staticmethod(original)
    return counter.bytes


def test_experts_backward_allocates_only_its_gradients():
    torch.manual_seed(0)
    E, D, F = 4, 64, 96
    experts = lancet_rt.Experts(E, D, F)
    for R in (2048, 1400, 2048):  # a smaller chunk reuses the scratch; the same size again too
        bounds = cb.HostBounds([0, R // 5, R // 2, R // 2, R])  # (an empty expert)
        x = torch.randn(R, D, requires_grad=True)
        dy = torch.randn(R, D)
        _backward_new_bytes(experts, x, None, bounds, dy)  # warm: the scratch grows to this size
        new = _backward_new_bytes(experts, x, None, bounds, dy)
        # The three gradients returned, dX [R, D], dW_gate_up [E, 2F, D], dW_down [E, D, F], and
        # small host-bounds tensors (torch._grouped_mm's offsets: under 1 KiB). Before the scratch memory the
        # backward also made its [R, F] product, silu(g), dh * u, dg, du and a [R, 2F] concatenation:
        # 7 R F floats more.
        grads = 4 * (R * D + E * 2 * F * D + E * D * F)
        assert grads <= new <= grads + 1024, (R, new, grads)
        assert x.grad is not None and experts.gate_up_proj.grad is not None


def test_scratch_grows_once_and_is_per_thread():
    s = cb.Scratch()
    like = torch.empty(0)
    a = s.take("dh", (8, 4), like)
    b = s.take("dh", (4, 4), like)
    assert a.data_ptr() == b.data_ptr()  # reused
    c = s.take("dh", (16, 4), like)
    assert c.shape == (16, 4) and s.take("dh", (8, 4), like).data_ptr() == c.data_ptr()  # grown once
    assert s.take("dgu", (8, 4), like).data_ptr() != c.data_ptr()  # one buffer per role
    import threading

    seen = []
    t = threading.Thread(target=lambda: seen.append(s.take("dh", (8, 4), like).data_ptr()))
    t.start()
    t.join()
    assert seen and seen[0] != c.data_ptr()  # another thread, other memory


def test_half_precision_dx_with_contiguous_weights_is_no_worse():
    """On CPU the 16-bit dX GEMMs take a copy of the weights contiguous along the reduction (8x
    faster where the CPU has no native 16-bit GEMM): its error against float64 is the strided
    layout's (the bits may differ in the last place)."""
    torch.manual_seed(0)
    R, N, K, E = 256, 192, 64, 3
    bounds = [0, 100, 100, R]
    for dtype in (torch.bfloat16, torch.float16):
        dy = torch.randn(R, N, dtype=dtype)
        w = torch.randn(E, N, K, dtype=dtype) * 0.1
        ref = grouped_mm_dx_ref(dy.double(), w.double(), bounds)
        strided = torch.cat([dy[a:b] @ w[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        for got in (
            cb.grouped_mm_dx(dy, w, bounds),
            cb.grouped_mm_dx(dy, w, bounds, out=torch.empty(R, K, dtype=dtype)),
        ):
            err = ((got.double() - ref).norm() / ref.norm()).item()
            base = ((strided.double() - ref).norm() / ref.norm()).item()
            assert err <= 1.05 * base, (dtype, err, base)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["dx", "no-dx"])
@pytest.mark.parametrize("chunks, defer", [(1, False), (3, True)])
def test_scratch_is_bitwise_the_fresh_path(monkeypatch, chunks, defer, x_grad, autocast):
    """Scratch on for every size against scratch off, with expert parallelism (dY and dX permuted
    on the emulated link), chunked with deferred dW (dgu held by the queue), with and without an input
    gradient (without: dgu as contiguous halves), in float32 and under bf16 autocast (the float32 copy
    of gu in scratch too): the same bits."""

    def run(min_bytes):
        monkeypatch.setattr(cb.Workspace, "MIN_BYTES", min_bytes)
        torch.manual_seed(0)
        moe = lancet_rt.MoE(32, 64, 8, 2, ep_group=lancet_rt.EmulatedGroup(4, float("inf"), 0.0))
        x = torch.randn(90, 32, generator=torch.Generator().manual_seed(1), requires_grad=x_grad)
        runner = lancet_rt.Overlapped(moe, chunks=chunks, defer_wgrad=defer) if chunks > 1 else moe
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = runner(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype))
        return [y.detach()] + ([x.grad] if x_grad else []) + [p.grad for p in moe.parameters()]

    fresh, scratch = run(1 << 62), run(0)
    assert len(fresh) == len(scratch) and all(torch.equal(a, b) for a, b in zip(fresh, scratch))
