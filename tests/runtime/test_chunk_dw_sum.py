"""The chunks' weight gradients summed where they are computed (ChunkSite.sum_gradients; the experts' dW
GEMMs with ``accumulate``, and the dW queue's running sums): one gradient per weight for the engine,
the same bits as the engine's sum of the chunks' gradients, in the order their backward ran; each
chunk its own gradient where a backward reaches some chunks only; a retained graph's second backward
summed afresh."""

import copy

import pytest
import torch

import lancet_rt
from lancet_rt import ops as _ops
from lancet_rt.moe import experts as _experts
from lancet_rt.runtime import scope, wgrad
from tests.schedule.test_overlap import make_model


@pytest.fixture(autouse=True)
def _no_scope_left():
    yield
    scope.set_current(None)


class _Scaled(torch.autograd.Function):
    """y = x * w; its gradient of w summed over the chunks through ``site`` (``into``: added in place)."""

    @staticmethod
    def forward(ctx, x, w, site, chunk, log):
        ctx.save_for_backward(x)
        ctx.site, ctx.chunk, ctx.log = site, chunk, log
        site.join_sum(chunk, ctx)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors

        def compute(into):
            ctx.log.append((ctx.chunk, into is not None))
            dw = (g * x).sum(0)
            return (dw,) if into is None else (into[0].add_(dw),)

        got = ctx.site.sum_gradients(ctx.chunk, compute)
        return None, None if got is None else got[0], None, None, None


def _chunks(n, log):
    site = scope.ChunkSite([2] * n)
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    xs = [torch.randn(2, 5) for _ in range(n)]
    return w, xs, [_Scaled.apply(x, w, site, c, log) for c, x in enumerate(xs)], site


def _engine_sum(xs, gs, order):
    """The chunks' gradients of w added in ``order``, as the engine adds what the chunks return."""
    parts = [(g * x).sum(0) for x, g in zip(xs, gs)]
    total = parts[order[0]].clone()
    for c in order[1:]:
        total = total + parts[c]
    return total


def test_the_first_chunk_writes_the_later_add_the_last_returns_the_sum():
    log = []
    w, xs, ys, site = _chunks(3, log)
    gs = [torch.randn(2, 5) for _ in ys]
    torch.autograd.backward(ys, gs)
    order = [c for c, _ in log]
    assert sorted(order) == [0, 1, 2] and [into for _, into in log] == [False, True, True]
    assert torch.equal(w.grad, _engine_sum(xs, gs, order))
    assert site._sum is None  # reset after the last chunk


def test_a_retained_graph_sums_afresh_in_its_second_backward():
    log = []
    w, xs, ys, _ = _chunks(2, log)
    gs = [torch.randn(2, 5) for _ in ys]
    torch.autograd.backward(ys, gs, retain_graph=True)
    first = w.grad.clone()
    torch.autograd.backward(ys, gs)
    assert [into for _, into in log] == [False, True, False, True]
    assert torch.equal(first, _engine_sum(xs, gs, [c for c, _ in log[:2]]))
    assert torch.equal(w.grad, first + _engine_sum(xs, gs, [c for c, _ in log[2:]]))


def test_a_backward_of_some_chunks_gives_each_its_own_gradient():
    log = []
    w, xs, ys, _ = _chunks(3, log)
    g = torch.randn(2, 5)
    ys[1].backward(g, retain_graph=True)  # chunk 1 only: no sum to wait for
    assert log == [(1, False)] and torch.equal(w.grad, (g * xs[1]).sum(0))
    w.grad = None
    torch.autograd.backward([ys[0], ys[2]], [g, g])  # two of three
    assert [into for _, into in log[1:]] == [False, False]
    assert torch.equal(w.grad, _engine_sum(xs, [g, g, g], [c for c, _ in log[1:]]))


def test_no_sum_outside_a_backward_with_one_chunk_or_a_chunk_that_did_not_join():
    calls = []

    def compute(into):
        calls.append(into)
        return (torch.ones(1),)

    assert scope.ChunkSite([2, 2]).sum_gradients(0, compute)[0].item() == 1.0  # not in a backward
    log = []
    w, xs, ys, site = _chunks(1, log)
    ys[0].sum().backward()
    assert log == [(0, False)] and torch.equal(w.grad, xs[0].sum(0))
    site = scope.ChunkSite([1, 1])
    x = torch.randn(3, 5)
    w = torch.randn(5, requires_grad=True)
    y = _Scaled.apply(x, w, site, 0, log)  # chunk 1 never joins
    y.sum().backward()
    assert log[-1] == (0, False) and torch.equal(w.grad, x.sum(0))


def _counting_dw(monkeypatch, pairs=None):
    """Record each experts' dW GEMM: whether it accumulated into a sum (a pair's two, in order); the
    pairs' launches counted in ``pairs`` too."""
    calls = []
    ns = _ops.get_ops(torch.device("cpu"), torch.float32)
    dw, pair = ns.grouped_mm_dw, ns.grouped_mm_dw_pair

    def counted(*args, **kwargs):
        calls.append(kwargs.get("accumulate", False))
        return dw(*args, **kwargs)

    def counted_pair(*args, **kwargs):
        calls.extend(kwargs.get("accumulate", (False, False)))
        if pairs is not None:
            pairs.append(1)
        return pair(*args, **kwargs)

    monkeypatch.setattr(ns, "grouped_mm_dw", counted)
    monkeypatch.setattr(ns, "grouped_mm_dw_pair", counted_pair)
    return calls


def _step(model, chunks, defer_wgrad, retain=False):
    torch.manual_seed(1)
    x, g = torch.randn(6, 3, 16), torch.randn(6, 3, 16)
    x.requires_grad_(True)
    y = lancet_rt.Overlapped(model, chunks=chunks, defer_wgrad=defer_wgrad)(x)
    if retain:
        y.backward(g, retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]
    y.backward(g)
    return [y.detach(), x.grad] + (first if retain else []) + [p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    "chunks,capacity_factor,defer_wgrad,retain",
    [(2, None, False, False), (3, 1.25, False, False), (3, None, True, False), (2, 1.25, False, True)],
)
def test_the_experts_sum_their_chunks_dw_in_the_gemms_with_the_same_bits(
    monkeypatch, chunks, capacity_factor, defer_wgrad, retain
):
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    model = make_model(capacity_factor)
    twin = copy.deepcopy(model)
    calls = _counting_dw(monkeypatch)
    # each chunk its own dW, summed by the engine (or the queue's add_): as before the sums
    monkeypatch.setattr(_experts, "dw_sum_site", lambda *args: None)
    unsummed = wgrad.WGradQueue.push

    def push(self, *args, sums=False, **kwargs):
        return unsummed(self, *args, **kwargs)

    monkeypatch.setattr(wgrad.WGradQueue, "push", push)
    ref = _step(model, chunks, defer_wgrad, retain)
    assert calls and not any(calls)
    calls.clear()
    monkeypatch.undo()
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    pairs = []
    calls = _counting_dw(monkeypatch, pairs)
    got = _step(twin, chunks, defer_wgrad, retain)
    # two dW GEMMs per layer and chunk, in one launch; all but the first chunk's add into the running sums
    layers = len(list(model.moe_layers()))
    backwards = 2 if retain else 1
    assert len(calls) == 2 * layers * chunks * backwards
    assert len(pairs) == layers * chunks * backwards
    assert sum(calls) == 2 * layers * (chunks - 1) * backwards
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert (a is None and b is None) or torch.equal(a, b)


def test_the_experts_return_their_dw_once_for_the_chunks(monkeypatch, execution):
    # the engine gets one gradient per weight: the last chunk's backward returns the sum, the others
    # None; with CUDA's semantics too (backward on the engine's device thread, not the forward's)
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    model = make_model(None)
    twin = copy.deepcopy(model)
    with monkeypatch.context() as m:
        m.setattr(_experts, "dw_sum_site", lambda *args: None)
        ref = _step(twin, 3, False)
    returned = []
    backward = _experts._ExpertsFn._backward

    def counted(ctx, dy):
        got = backward(ctx, dy)
        returned.append(tuple(g is not None for g in got[1:3]))
        return got

    monkeypatch.setattr(_experts._ExpertsFn, "_backward", staticmethod(counted))
    got = _step(model, 3, False)
    for a, b in zip(ref, got, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    layers = len(list(model.moe_layers()))
    assert len(returned) == 3 * layers
    assert returned.count((True, True)) == layers and returned.count((False, False)) == 2 * layers
