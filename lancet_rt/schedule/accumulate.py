"""Cross-microbatch overlap: a training step of M microbatches whose passes hide each other's
all-to-alls (``Overlapped.accumulate``).

Inside one forward + backward, the forward's all-to-alls can hide only behind forward computation:
the backward starts when the loss has every chunk's output. Gradient accumulation lifts that limit.
The backward of microbatch i and the forward of microbatch i+1 are independent, so they run
interleaved: while one pass's tokens travel, the other computes (the schedule of Megatron-Core's
``--overlap-moe-expert-parallel-comm`` and of DeepSeek's DualPipe, here on an unmodified eager model).

How. The autograd engine cannot be suspended mid-backward from Python (on CUDA its device threads
run the nodes, and greenlets are per thread), but a node can block. So the backward of microbatch i
runs as one ``loss.backward()`` on a helper thread, and it and the host's forward of microbatch i+1
take turns with a baton, exactly one of them running at a time:

- the forward hands the baton to the backward each time one of its chunks yields after issuing a
  dispatch or a combine (:func:`lancet_rt.runtime.scope.switch`), and once before it starts;
- the backward hands it back each time one of its all-to-alls is about to wait
  (:func:`lancet_rt.runtime.scope.backward_wait`, in the all-to-all's backward node): its transfer is in
  flight, and the forward computes meanwhile.

The turns are decided from the schedule alone, never from completion timing, so every rank issues
its collectives in the same order. The forward keeps its own chunk schedule (``Overlapped``), the
backward the engine's order. Deferred dW (``defer_wgrad=True``) fills what is left of each backward
all-to-all's window when the backward resumes, and the forward's waits too: when the host is about
to wait for a forward transfer (:func:`lancet_rt.runtime.scope.host_wait`), the backward's queued dW runs
meanwhile (on CPU, where the host's wait is the device's). Each backward flushes its queue before it
ends, as a single-step backward does.

On CPU, where the host thread is the device, the two threads are pinned to the core the host is on
for the interleaved part of the step (:class:`_OneCore`) and given back their affinity after it. The
passes take turns, so they lose no parallelism, and each hand-off otherwise wakes the other thread
on the other, idle core, whose caches hold none of the step's data (pinned, the interleaved passes'
computation came closer to that of the same work in sequence on a 2-core VM;
bench/results/HISTORY.md). On CUDA nothing is pinned: the host only queues kernels.

Exactness: each microbatch's forward is an ordinary ``Overlapped`` forward (its own capacity, aux
and z losses: those of the microbatch, as in M sequential steps), and its backward is one
``backward()`` of its loss that accumulates into ``.grad``. Backward i ends before backward i+1
starts, so gradients accumulate in the order of the M sequential steps.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from typing import Any, Callable, Iterable, Optional

import torch

from lancet_rt import trace as _trace
from lancet_rt.runtime import scope as _scope
from lancet_rt.schedule import guard as _guard


class _Aborted(RuntimeError):
    """Raised inside a suspended backward when the forward beside it failed: it unwinds the engine."""


class _Backward:
    """One microbatch's backward on a helper thread, taking turns with the host.

    ``turn()`` (host) lets it run until its next all-to-all waits, or to its end; ``yield_()``
    (called by :func:`lancet_rt.runtime.scope.backward_wait` on the engine's thread) gives the host back.
    Two semaphores form the baton: exactly one of the two threads runs.
    """

    def __init__(self, loss: torch.Tensor, index: int, queue=None):
        self.index = index
        self.queue = queue
        self.turns = 0
        self.done = False
        self.error: Optional[BaseException] = None
        self._abort = False
        self._task: Optional[int] = None  # the engine's id of this backward's graph task, once it runs
        self._host = threading.current_thread()
        self._cuda = loss.is_cuda
        self._go = threading.Semaphore(0)  # the backward may run
        self._back = threading.Semaphore(0)  # the host may run
        _worker().submit(lambda: self._main(loss))

    def _main(self, loss: torch.Tensor) -> None:
        self._go.acquire()
        try:
            if not self._abort:
                if loss.is_cuda:  # host-side work of this backward on the loss's device, as on the host
                    torch.cuda.set_device(loss.device)
                # The loss's node runs first, on whichever thread the engine runs this backward (on
                # CUDA its device thread): it names the graph task that may give the host its turns.
                handle = loss.grad_fn.register_prehook(self._note_task) if loss.grad_fn is not None else None
                try:
                    loss.backward()
                finally:
                    if handle is not None:
                        handle.remove()
        except BaseException as e:  # handed to the host, which raises it
            self.error = e
        finally:
            self.done = True
            self._back.release()

    def turn(self) -> None:
        """Run the backward until its next all-to-all waits (or it ends); raise what it raised."""
        if self.done:
            return
        self.turns += 1
        with _trace.span(f"backward {self.index}", "compute", self._cuda, microbatch=self.index):
            self._go.release()
            self._back.acquire()
        if self.error is not None and not self._abort:
            raise self.error

    def _note_task(self, grad_outputs):
        self._task = torch._C._current_graph_task_id()

    def yield_(self) -> None:
        """Engine thread, at a backward all-to-all's wait: the host runs until it gives a turn back.

        Only inside this backward's own graph task, while it runs. Any other autograd call that
        reaches an all-to-all's backward (the host's own, or a user's gradient penalty, which on CUDA
        runs on the device thread too, after this backward ended) runs through: the host is waiting
        for that call, so giving it a turn would block both forever."""
        if self.done or self._task is None or torch._C._current_graph_task_id() != self._task:
            return
        if self._abort:
            raise _Aborted("lancet_rt.schedule.accumulate: the forward beside this backward failed")
        self._back.release()
        self._go.acquire()
        if self._abort:
            raise _Aborted("lancet_rt.schedule.accumulate: the forward beside this backward failed")

    def fill(self, work) -> None:
        """Host, about to wait for ``work``: run the backward's deferred dW until it arrives.

        dW is compute only, so how many items run may depend on timing without changing the order
        of any collective. On CUDA ``work`` is the counts copy's event: the items run while it has not
        completed (their kernels queue behind the forward's, which the host would otherwise idle on).
        """
        if self.queue is not None and self.queue.items and not self.done:
            with torch.no_grad(), _trace.span("dW", "compute", microbatch=self.index):
                self.queue.drain_during(_as_work(work))  # (as the engine would: the forward runs with grad on)

    def finish(self) -> None:
        """Run the rest of the backward alone (nothing beside it yields to)."""
        while not self.done:
            self.turn()

    def abort(self) -> None:
        """Unwind the backward (its next all-to-all wait raises) and wait for its thread."""
        self._abort = True
        while not self.done:
            self._go.release()
            self._back.acquire()


class _EventWork:
    """A CUDA event seen as a collective's work handle (``is_completed``), for the dW queue's drain."""

    def __init__(self, event):
        self.is_completed = event.query


def _as_work(work):
    """``work`` as the dW queue drains during it: an event (``query`` only) gets ``is_completed``."""
    if not hasattr(work, "is_completed") and hasattr(work, "query"):
        return _EventWork(work)
    return work


class _Worker:
    """The helper thread that runs the backwards, one at a time, kept for the life of the process
    (a thread per microbatch would start cold: its own allocator arena, its own caches)."""

    def __init__(self):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="lancet-backward", daemon=True)
        self.thread.start()
        self.native_id: int = self.thread.native_id  # set by start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            self._jobs.get()()


_workers: dict = {}


def _worker() -> _Worker:
    pid = os.getpid()  # a forked child gets a worker of its own
    if pid not in _workers:
        _workers[pid] = _Worker()
    return _workers[pid]


@functools.lru_cache(maxsize=None)
def _sched_getcpu() -> Optional[Callable[[], int]]:
    """libc's ``sched_getcpu`` (glibc, musl), None where there is none."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None


def _current_cpu() -> Optional[int]:
    """The CPU the calling thread runs on, None where unknown."""
    getcpu = _sched_getcpu()
    cpu = getcpu() if getcpu is not None else -1
    return cpu if cpu >= 0 else None


class _OneCore:
    """The host thread and the backward's helper thread on one core, the host's, while a step's
    passes take turns on CPU (module docstring); :meth:`release` restores both threads' affinity.

    A no-op where affinity cannot be set (not Linux, ``sched_getcpu`` unknown) or the host may run
    on one CPU only."""

    def __init__(self):
        self.saved: Optional[tuple] = None  # (helper's native id, host's mask, helper's mask)

    def pin(self) -> None:
        if self.saved is not None or not hasattr(os, "sched_setaffinity"):
            return
        cpu, tid = _current_cpu(), _worker().native_id
        try:
            host, helper = os.sched_getaffinity(0), os.sched_getaffinity(tid)
        except OSError:
            return
        if cpu is None or len(host) < 2 or cpu not in host or cpu not in helper:
            return
        self.saved = (tid, host, helper)
        try:
            os.sched_setaffinity(0, {cpu})  # pid 0: the calling thread
            os.sched_setaffinity(tid, {cpu})
        except OSError:
            self.release()

    def release(self) -> None:
        if self.saved is None:
            return
        tid, host, helper = self.saved
        self.saved = None
        for thread, mask in ((0, host), (tid, helper)):
            try:
                os.sched_setaffinity(thread, mask)
            except OSError:  # the helper is gone (interpreter exit), or the cpuset shrank meanwhile
                pass


def _as_call(microbatch, i: int) -> tuple[tuple, dict]:
    if isinstance(microbatch, torch.Tensor):
        return (microbatch,), {}
    if isinstance(microbatch, (tuple, list)):
        return tuple(microbatch), {}
    if isinstance(microbatch, dict):
        return (), dict(microbatch)
    raise TypeError(
        f"microbatches[{i}] must be a tensor, a tuple/list of positional arguments or a dict of "
        f"keyword arguments, got {type(microbatch).__name__}"
    )


def _check_loss(loss, i: int) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__} for microbatch {i}")
    if loss.numel() != 1 or not loss.dtype.is_floating_point or not loss.requires_grad:
        raise ValueError(
            f"loss_fn must return a one-element floating-point tensor that requires grad, got "
            f"shape {tuple(loss.shape)} dtype {loss.dtype} requires_grad={loss.requires_grad} "
            f"for microbatch {i}"
        )
    return loss


class BackwardSync:
    """What ``grad_sync`` must be: a context manager around the last microbatch's backward that
    reduces its gradients (:class:`lancet_rt.parallel.GradientSync` is the one). Declared here so
    the driver checks the argument without importing the data-parallel engines, which sit above it."""


def accumulate(
    overlapped,
    microbatches: Iterable,
    loss_fn: Callable[[Any, int], torch.Tensor],
    *,
    interleave: bool = True,
    grad_sync=None,
) -> torch.Tensor:
    """Forward and backward of M microbatches, gradients accumulated into ``.grad``: one training step.

    With ``interleave=True`` the backward of microbatch i runs interleaved with the forward of
    microbatch i+1 (see the module docstring), so each pass's all-to-alls hide behind the other
    pass's computation. Gradients equal those of ``for i, mb: loss_fn(overlapped(*mb), i).backward()``
    (``interleave=False`` runs exactly that); capacity and the aux/z losses are per microbatch.

    Requirements beyond :class:`lancet_rt.Overlapped`'s: the forward and ``loss_fn`` run no backward
    of their own, and they do not modify tensors the previous microbatch's backward still needs
    (optimizer steps belong between calls). DDP's reducer cannot wrap the model (a forward starts
    before the previous backward has ended); use ``grad_sync`` for data-parallel gradients.

    Args:
        overlapped: the :class:`lancet_rt.Overlapped` model; its ``chunks`` and ``defer_wgrad`` hold
            for every microbatch (a chunk policy such as ``"auto"`` is asked once per call, on the first one).
        microbatches: M >= 1 microbatches, each the model's arguments: a tensor, a tuple/list of
            positional arguments, or a dict of keyword arguments.
        loss_fn: ``loss_fn(output, i)`` -> the one-element loss of microbatch i, whose ``backward()``
            runs (scale it by 1/M for the mean over microbatches).
        interleave: False runs the microbatches one after another (the reference schedule).
        grad_sync: a :class:`lancet_rt.parallel.GradientSync` that all-reduces the gradients during
            the last microbatch's backward (None: no data-parallel reduction).

    Returns:
        [M] the losses, detached.
    """
    if not _is_overlapped(overlapped):
        raise TypeError(f"overlapped must be a lancet_rt.Overlapped, got {type(overlapped).__name__}")
    if isinstance(microbatches, (torch.Tensor, dict)) or not isinstance(microbatches, Iterable):
        raise TypeError(f"microbatches must be a sequence of microbatches, got {type(microbatches).__name__}")
    calls = [_as_call(mb, i) for i, mb in enumerate(microbatches)]
    if not calls:
        raise ValueError("microbatches must hold at least one microbatch, got none")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(interleave, bool):
        raise TypeError(f"interleave must be a bool, got {type(interleave).__name__}")
    if grad_sync is not None and not isinstance(grad_sync, BackwardSync):
        raise TypeError(f"grad_sync must be None or a lancet_rt.parallel.GradientSync, got {type(grad_sync).__name__}")
    if interleave:  # a wrapper that cannot run a forward beside a backward says so (lancet_rt.parallel.fully_shard)
        for m in overlapped.model.modules():
            why = getattr(m, "lancet_interleave_refused", None)
            if why:
                raise ValueError(f"accumulate(interleave=True) on this model: {why}")

    # As Overlapped.forward: the schedule agreed across ranks once; an exception ends on every rank
    # and leaves no state behind (lancet_rt.schedule.guard).
    layers = overlapped.moe_layers()
    _guard.check_schedule(overlapped, layers)
    with _guard.StepGuard(layers):
        return _step(overlapped, calls, loss_fn, interleave, grad_sync)


def _is_overlapped(obj) -> bool:
    # Overlapped is checked by its interface: schedule.overlap imports this module, not the other way.
    return all(callable(getattr(obj, name, None)) for name in ("forward_chunked", "_resolve_chunks", "moe_layers"))


_live: list = []  # the backward beside the host's forward, while it is parked (at most one)


def _finishing_live_backward(fn):
    """``fn`` (torch.autograd.backward / grad), first running to its end a backward parked beside the
    calling host. The parked backward holds the autograd engine's device thread (on CUDA), so an
    autograd call from the forward or the loss (a gradient penalty, say) would wait for that thread
    forever; run at the same point of the step on every rank, finishing it first keeps the
    collectives in the same order everywhere."""

    def call(*args, **kwargs):
        for b in list(_live):
            if not b.done and threading.current_thread() is b._host:
                b.finish()
        return fn(*args, **kwargs)

    return functools.update_wrapper(call, fn)


@contextlib.contextmanager
def _autograd_from_the_host():
    """While a step runs, host autograd calls finish the parked backward first (:func:`_finishing_live_backward`)."""
    backward, grad = torch.autograd.backward, torch.autograd.grad
    torch.autograd.backward, torch.autograd.grad = _finishing_live_backward(backward), _finishing_live_backward(grad)
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = backward, grad


def _step(overlapped, calls: list, loss_fn, interleave: bool, grad_sync) -> torch.Tensor:
    with _autograd_from_the_host():
        return _steps(overlapped, calls, loss_fn, interleave, grad_sync)


def _steps(overlapped, calls: list, loss_fn, interleave: bool, grad_sync) -> torch.Tensor:
    if overlapped.wgrad_queue is not None:
        overlapped.wgrad_queue.discard_orphans()  # left by a backward that raised
    n = overlapped._resolve_chunks(*calls[0])
    losses = []
    pending: Optional[torch.Tensor] = None  # the loss whose backward has not run yet
    one_core = _OneCore()
    try:
        for i, (args, kwargs) in enumerate(calls):
            pending = _microbatch(overlapped, n, i, args, kwargs, loss_fn, pending, interleave, one_core)
            losses.append(pending.detach().reshape(()))
    finally:
        one_core.release()  # the last backward runs alone
    _host_backward(pending, len(calls) - 1, grad_sync)
    return torch.stack(losses)


def _microbatch(
    overlapped,
    n: int,
    i: int,
    args: tuple,
    kwargs: dict,
    loss_fn,
    pending: Optional[torch.Tensor],
    interleave: bool,
    one_core: _OneCore,
) -> torch.Tensor:
    """Forward of microbatch i (and its loss), with the backward of ``pending`` (i - 1) beside it."""
    beside = None
    if pending is not None:
        if interleave:
            if not pending.is_cuda:
                one_core.pin()
            beside = _Backward(pending, i - 1, overlapped.wgrad_queue)
            _live.append(beside)
        else:
            _host_backward(pending, i - 1, None)
    try:
        on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in (*args, *kwargs.values()))
        with _trace.span(f"forward {i}", "compute", on_cuda, microbatch=i):
            _scope.set_beside(beside)
            try:
                if beside is not None:
                    beside.turn()  # the backward's first all-to-all leaves before the forward starts
                out = overlapped.forward_chunked(n, args, kwargs)
            finally:
                _scope.set_beside(None)
            loss = _check_loss(loss_fn(out, i), i)
    except BaseException:
        if beside is not None:
            beside.abort()
            _live.remove(beside)
        raise
    if beside is not None:
        beside.finish()
        _live.remove(beside)
        if beside.error is not None:
            raise beside.error
    return loss


def _host_backward(loss: torch.Tensor, i: int, grad_sync) -> None:
    with _trace.span(f"backward {i}", "compute", loss.is_cuda, microbatch=i):
        if grad_sync is None:
            loss.backward()
        else:
            with grad_sync:
                loss.backward()
