"""Deferred weight gradients: dX at once, dW later, inside the backward all-to-alls' windows.

dW of a layer never feeds the backward all-to-alls of earlier layers, so it can wait (Lancet,
MLSys'24, section 4). Functions that support deferral capture the active :class:`WGradQueue` in
forward; in backward they return dX and push a closure computing dW. Every backward all-to-all,
while in flight, gives the queue its window: items are picked greedily by best fit (the item whose
estimated time is closest to the time left, stopping when the best is over twice what is left and
one already ran), as Lancet assigns dW to all-to-alls. The queue is flushed by an autograd-engine
callback before ``backward()`` returns, so optimizers see complete gradients.

Deferred weights are not in the autograd graph (a deferring Function takes them detached), so the
engine never runs their gradient accumulators during backward. Each dW is summed per parameter over
the chunks, and the flush hands the sums to the engine (a nested backward into each parameter's
AccumulateGrad): the parameters' hooks run once per backward with the whole gradient, as without
deferral. Whether the running backward accumulates at all is read from a probe leaf that every
deferring Function takes: under ``torch.autograd.grad``, or ``backward(inputs=...)`` naming other
tensors, dW is skipped (take weight gradients with ``backward()`` when deferring).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lancet_rt import trace as _trace
from lancet_rt.runtime import casts
from lancet_rt.runtime import scope as _scope


def current() -> Optional["WGradQueue"]:
    """The queue that Functions created now should defer into (None: compute dW at once):
    ``PROCESS.dw_queue`` of the step context (:mod:`lancet_rt.runtime.scope`)."""
    return _scope.PROCESS.dw_queue


def set_current(q: Optional["WGradQueue"]) -> Optional["WGradQueue"]:
    """Make ``q`` the queue in force; returns the one it replaces (to put back)."""
    prev, _scope.PROCESS.dw_queue = _scope.PROCESS.dw_queue, q
    return prev


@dataclass
class _Item:
    params: Sequence[torch.Tensor]
    needs: Sequence[bool]
    compute: Callable[[], Sequence[torch.Tensor]]
    flops: int
    nbytes: int = 0  # what the closure holds (its GEMMs' operands) until it runs
    dtype: Optional[torch.dtype] = None  # the dtype its GEMMs run in (priced at that rate)
    sums: bool = False  # compute takes the params' running sums (WGradQueue.push)


def held_bytes(*tensors) -> int:
    """Bytes of the distinct storages among ``tensors`` (None skipped): what a deferred item holds."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def best_fit(estimates_ms: Sequence[float], left_ms: float, ran: int) -> Optional[int]:
    """Lancet's greedy choice of the next dW for an all-to-all window (MLSys'24, section 4.2).

    The item whose estimated time is closest to the time left; none when nothing is left, or when
    the best is over twice the time left and an item already ran in this window.

    Args:
        estimates_ms: estimated time of each queued item.
        left_ms: time left in the window.
        ran: items already run in this window.

    Returns:
        The index to run next, or None to stop.
    """
    if left_ms <= 0 or not estimates_ms:
        return None
    best = min(range(len(estimates_ms)), key=lambda i: abs(left_ms - estimates_ms[i]))
    if ran and estimates_ms[best] > 2 * left_ms:
        return None
    return best


_device_rates: dict = {}


def _device_flops_per_ms(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float:
    """A dense matmul rate of ``device`` in ``dtype`` (FLOP per ms), timed once with CUDA events.

    Timed in the dtype of the dW items it prices: an fp32 model's GEMMs run at a fraction of the
    bf16 tensor-core rate (an order of magnitude below on an H100 without TF32), so a bf16 rate would let
    fp32 items overrun every window. Random operands come from a private generator so that
    calibrating in the middle of a backward never shifts the global CUDA RNG (dropout masks).
    """
    key = (device, dtype)
    if key not in _device_rates:
        n, reps = 2048, 10
        gen = torch.Generator(device=device)
        gen.manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        a @ b  # warm-up (cuBLAS handle and workspace)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        end.synchronize()
        _device_rates[key] = reps * 2 * n**3 / start.elapsed_time(end)
    return _device_rates[key]


#: ``torch.autograd.backward`` as torch defines it, which the flush delivers the dW sums with. That
#: nested backward finishes the engine's own accumulation, inside the backward being flushed; it is no
#: autograd call of the host's, so a driver's wrapper of the host's calls does not apply to it
#: (``Overlapped.accumulate`` wraps them while its step runs, to finish a backward parked beside the
#: host first: :mod:`lancet_rt.schedule.accumulate`), and the flush calls nothing above this module.
_engine_backward = torch.autograd.backward

#: With ``max_deferred_bytes=None``: the held inputs are capped at this many times the largest item
#: of the running backward (the items of about one layer's chunks wait for the next windows).
AUTO_CAP_ITEMS = 4


class WGradQueue:
    """Deferred dW work of one model, drained during backward all-to-alls.

    Args:
        max_deferred_bytes: a bound on the bytes the queued items hold (their GEMMs' operands: the
            layer inputs and output gradients a dW needs). Pushing past it runs the oldest items at
            once, so the held bytes never exceed it (an item larger than the bound alone runs at
            once). None: :data:`AUTO_CAP_ITEMS` times the largest item of the running backward; an
            item waits for the windows of the next layer or two, not for the final flush.
            ``math.inf``: no bound.

    Attributes:
        flops_per_ms: measured rate of dW work (EMA), used to estimate item times.
        ran_in_windows, flushed, forced: items run inside all-to-all windows / at the final flush /
            early to keep the bound, last backward.
        held_bytes, peak_held_bytes: bytes held by the queued items now / at most, last backward.
    """

    def __init__(self, max_deferred_bytes: Optional[float] = None):
        if max_deferred_bytes is not None and (
            isinstance(max_deferred_bytes, bool)
            or not isinstance(max_deferred_bytes, (int, float))
            or not max_deferred_bytes >= 0
        ):
            raise ValueError(
                f"max_deferred_bytes must be None or a number of bytes >= 0 (math.inf: no bound), "
                f"got {max_deferred_bytes!r}"
            )
        self.max_deferred_bytes = max_deferred_bytes
        self.held_bytes = self.peak_held_bytes = 0
        self.forced = 0
        self._largest = 0
        self.items: list[_Item] = []
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (param, dW so far)
        # A leaf every deferring Function takes: is its accumulator in the running backward?
        self.probe = torch.zeros((), requires_grad=True)
        self.flops_per_ms: Optional[float] = None
        self.ran_in_windows = 0
        self.flushed = 0
        self._callback_queued = False

    def push(
        self,
        params,
        needs,
        compute,
        flops: int,
        nbytes: int = 0,
        dtype: Optional[torch.dtype] = None,
        sums: bool = False,
    ) -> None:
        """Queue a dW closure; ``nbytes``: what it holds until it runs, ``dtype``: its GEMMs' dtype.

        ``sums``: ``compute`` takes the running sums of ``params``' gradients (a tuple, None for a
        parameter with none yet) and may add its gradient into a sum itself, returning that very
        tensor (then not added again), as the experts' dW GEMMs do: no gradient buffer and no add
        per item for the chunks after the first."""
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self._callback_queued = True
            self.ran_in_windows = self.flushed = self.forced = 0
            self.peak_held_bytes = self.held_bytes
            self._largest = 0
        item = _Item(tuple(params), tuple(needs), compute, int(flops), int(nbytes), dtype, sums)
        self._largest = max(self._largest, item.nbytes)
        cap = self.cap()
        while self.items and self.held_bytes + item.nbytes > cap:
            self._run(self._pop(0))  # the oldest first: it has waited longest
            self.forced += 1
        if item.nbytes > cap:
            self._run(item)
            self.forced += 1
            return
        self.items.append(item)
        self.held_bytes += item.nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def cap(self) -> float:
        """The bound on the held bytes now (``max_deferred_bytes``, or the automatic one)."""
        if self.max_deferred_bytes is not None:
            return self.max_deferred_bytes
        return AUTO_CAP_ITEMS * self._largest

    def discard_orphans(self) -> None:
        """Drop work left by a backward that raised (out of memory, say; the autotuner's search
        catches that and goes on). The engine dropped the final callback that would have flushed it,
        and with ``_callback_queued`` still set no later backward would queue its own: the stale
        closures (holding activations) would pile up and later backwards would lose their flush.
        :class:`lancet_rt.Overlapped` calls this before each forward; it does nothing inside a
        backward (a forward recomputed there, by activation checkpointing, must not drop its work).
        """
        task_id = getattr(torch._C, "_current_graph_task_id", None)
        if task_id is not None and task_id() != -1:
            return
        self.items.clear()
        self._sums.clear()
        self.held_bytes = 0
        self._callback_queued = False

    def _pop(self, i: int) -> _Item:
        item = self.items.pop(i)
        self.held_bytes -= item.nbytes
        return item

    def _estimate_ms(self, item: _Item, cuda: bool) -> float:
        if cuda:  # device time: the item's FLOPs at the calibrated rate of its device and the dtype it runs in
            p = item.params[0]
            rate = _device_flops_per_ms(p.device, item.dtype or p.dtype)
        else:
            rate = self.flops_per_ms
        return item.flops / rate if rate else 0.0

    def _run(self, item: _Item) -> float:
        t0 = time.perf_counter()
        if item.sums:
            grads = item.compute(tuple(self._sums.get(id(p), (None, None))[1] for p in item.params))
        else:
            grads = item.compute()
        item.compute = None  # the closure's operands go now
        for p, g, need in zip(item.params, grads, item.needs):
            if need and g is not None:
                held = self._sums.get(id(p))
                if held is not None and g is held[1]:
                    continue  # (added into the sum by compute)
                self._sums[id(p)] = (p, g.to(p.dtype) if held is None else held[1].add_(g))
        ms = (time.perf_counter() - t0) * 1e3
        on_cuda = any(p.is_cuda for p in item.params)
        if item.flops and ms > 0 and not on_cuda:  # host time is device time only on CPU
            rate = item.flops / ms
            self.flops_per_ms = rate if self.flops_per_ms is None else 0.7 * self.flops_per_ms + 0.3 * rate
        return ms

    def drain_during(self, work, window_ms: Optional[float] = None) -> None:
        """Run queued dW while ``work`` is in flight, picking items by best fit (:func:`best_fit`).

        On CPU the window is measured on the host clock: until ``work.expected_end`` (the emulated
        link's deadline), else ``window_ms`` from now, else while ``work.is_completed()`` is False.
        On CUDA the host runs ahead of the device, so the window is a device-time budget
        (``window_ms``) spent by the items' estimated device times (FLOPs over a matmul rate
        calibrated once with CUDA events); without an estimate the items run in order while
        ``work.is_completed()`` is False.
        """
        if not self.items:
            return
        cuda = any(p.is_cuda for p in self.items[0].params)
        deadline = None if cuda else getattr(work, "expected_end", None)
        if deadline is None and window_ms is not None and not cuda:
            deadline = time.perf_counter() + window_ms * 1e-3
        budget = window_ms if cuda else None
        ran = 0
        while self.items:
            if deadline is None and budget is None:
                done = getattr(work, "is_completed", None)
                if done is None or done():
                    break
                i = 0
            else:
                left = budget if budget is not None else (deadline - time.perf_counter()) * 1e3
                est = [self._estimate_ms(it, cuda) for it in self.items]
                i = best_fit(est, left, ran)
                if i is None:
                    break
                if budget is not None:
                    budget -= est[i]
            self._run(self._pop(i))
            ran += 1
        self.ran_in_windows += ran

    def flush(self) -> None:
        """Run everything still queued and deliver the sums (the engine calls this before backward returns)."""
        self._callback_queued = False
        with _trace.span("dW flush"):
            while self.items:
                self._run(self._pop(0))
                self.flushed += 1
        if self._sums:
            params, grads = zip(*self._sums.values())
            self._sums.clear()
            # Into each parameter's AccumulateGrad, once, as the engine would have done: its hooks run.
            _engine_backward(list(params), list(grads))


def accumulating(probe: torch.Tensor) -> bool:
    """Whether the backward running now accumulates into leaves' ``.grad`` (call it in backward).

    ``autograd.grad`` and ``backward(inputs=...)`` naming other tensors do not. The answer holds for
    the whole backward (graph task), so it is asked of the engine once per backward and probe, not
    once per deferred item.
    """
    task = torch._C._current_graph_task_id()
    key = (task, id(probe))
    if _accumulating_cache[0] == key and task != -1:
        return _accumulating_cache[1]
    try:
        answer = torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(probe).node)
    except RuntimeError:  # autograd.grad asked for the probe itself: nothing accumulates
        answer = False
    _accumulating_cache[:] = [key, answer]
    return answer


_accumulating_cache: list = [None, False]  # [(graph task id, id(probe)), answer] of the last question


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, probe, params, queue):
        # weight and bias come detached: dW reaches ``params`` (the Parameters) through the queue.
        ctx.save_for_backward(x, weight)
        ctx.probe, ctx.params, ctx.queue = probe, params, queue
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        needs = tuple(p.requires_grad for p in ctx.params)
        if any(needs) and accumulating(ctx.probe):
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])

            def weight_grads():
                return (dy2.t() @ x2 if needs[0] else None, dy2.sum(0) if len(needs) > 1 and needs[1] else None)

            ctx.queue.push(
                ctx.params,
                needs,
                weight_grads,
                2 * x2.shape[0] * x2.shape[1] * dy2.shape[1],
                held_bytes(x2, dy2),
                x2.dtype,
            )
        return dx, None, None, None, None, None


class DeferredLinear(nn.Linear):
    """An ``nn.Linear`` whose dW joins the active :class:`WGradQueue` (if any) instead of running now.

    :class:`lancet_rt.Overlapped` with ``defer_wgrad=True`` gives the model's ``nn.Linear`` modules
    this class; with no queue active it is an ``nn.Linear``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = _scope.PROCESS.dw_queue
        if q is None or not torch.is_grad_enabled():
            return super().forward(x)
        params = (self.weight,) if self.bias is None else (self.weight, self.bias)
        weight = self.weight.detach()
        bias = None if self.bias is None else self.bias.detach()
        if torch.is_autocast_enabled(x.device.type):
            # As nn.Linear under autocast: input and weights in the autocast dtype (dW is summed in
            # the parameter's dtype by the queue); the weights' copies made once per chunked forward.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), casts.compute_copy(self.weight, dtype)
            bias = None if bias is None else casts.compute_copy(self.bias, dtype)
        return _LinearFn.apply(x, weight, bias, q.probe, params, q)
