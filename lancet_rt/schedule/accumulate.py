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
take turns with a baton (:class:`lancet_rt.runtime.beside.BackwardBeside`, below the driver and the
layers, which hand it over), exactly one of them running at a time:

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
from lancet_rt.runtime import beside as _beside
from lancet_rt.runtime import scope as _scope


def _start_backward(loss: torch.Tensor, index: int, dw_queue) -> _beside.BackwardBeside:
    """Start the backward of ``loss`` (microbatch ``index``, its deferred dW into ``dw_queue``) on the
    helper thread, beside the host: it waits for its first turn (the baton,
    :class:`lancet_rt.runtime.beside.BackwardBeside`)."""
    beside = _beside.BackwardBeside(index, dw_queue, loss.is_cuda)
    _worker().submit(lambda: _run_backward(beside, loss))
    return beside


def _run_backward(beside: _beside.BackwardBeside, loss: torch.Tensor) -> None:
    """The helper thread's job: ``loss.backward()`` from its first turn; its end (and what it raised)
    reported to the baton. Its turns are handed over below it, by the step context
    (:func:`lancet_rt.runtime.scope.backward_wait`), so this job only starts and ends the backward."""
    run = beside.first_turn()
    error = None
    try:
        if run:
            if loss.is_cuda:  # host-side work of this backward on the loss's device, as on the host
                torch.cuda.set_device(loss.device)
            # The loss's node runs first, on whichever thread the engine runs this backward (on
            # CUDA its device thread): it names the graph task that may give the host its turns.
            handle = loss.grad_fn.register_prehook(beside.note_task) if loss.grad_fn is not None else None
            try:
                loss.backward()
            finally:
                if handle is not None:
                    handle.remove()
    except BaseException as e:  # handed to the host, which raises it
        error = e
    finally:
        beside.ended(error)


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


class Microbatches:
    """The M microbatches of one :meth:`lancet_rt.Overlapped.accumulate` step, and what runs around
    their forwards: the backward of microbatch i - 1 beside the forward of microbatch i
    (:meth:`microbatch`), the last backward after the last forward (:meth:`end`).

    The driver, :meth:`lancet_rt.Overlapped.accumulate`, runs the step (the step guard, the chunk
    count, each microbatch's chunked forward) and calls this, below it, around each forward; what it
    needs from the driver comes as data (the model, its dW queue, each forward's output), so nothing
    here calls the driver back.

    Gradients equal those of ``for i, mb: loss_fn(overlapped(*mb), i).backward()`` (``interleave=False``
    runs exactly that); capacity and the aux/z losses are per microbatch.

    Requirements beyond :class:`lancet_rt.Overlapped`'s: the forward and ``loss_fn`` run no backward
    of their own, and they do not modify tensors the previous microbatch's backward still needs
    (optimizer steps belong between calls). DDP's reducer cannot wrap the model (a forward starts
    before the previous backward has ended); use ``grad_sync`` for data-parallel gradients.

    Args:
        model: the model the :class:`lancet_rt.Overlapped` runs (a wrapper that cannot run a forward
            beside a backward says so in ``lancet_interleave_refused``: :func:`lancet_rt.parallel.fully_shard`).
        microbatches: M >= 1 microbatches, each the model's arguments: a tensor, a tuple/list of
            positional arguments, or a dict of keyword arguments.
        loss_fn: ``loss_fn(output, i)`` -> the one-element loss of microbatch i, whose ``backward()``
            runs (scale it by 1/M for the mean over microbatches).
        interleave: False runs the microbatches one after another (the reference schedule).
        grad_sync: a :class:`lancet_rt.parallel.GradientSync` that all-reduces the gradients during
            the last microbatch's backward (None: no data-parallel reduction).
        dw_queue: the Overlapped's dW queue (None: dW at once), which a backward beside a forward
            drains while the host waits.
    """

    def __init__(
        self,
        model,
        microbatches: Iterable,
        loss_fn: Callable[[Any, int], torch.Tensor],
        *,
        interleave: bool = True,
        grad_sync=None,
        dw_queue=None,
    ):
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
            raise TypeError(
                f"grad_sync must be None or a lancet_rt.parallel.GradientSync, got {type(grad_sync).__name__}"
            )
        if interleave:  # a wrapper that cannot run a forward beside a backward says so (lancet_rt.parallel.fully_shard)
            for m in model.modules():
                why = getattr(m, "lancet_interleave_refused", None)
                if why:
                    raise ValueError(f"accumulate(interleave=True) on this model: {why}")
        self.calls: list[tuple[tuple, dict]] = calls  # each microbatch's (args, kwargs)
        self.loss_fn = loss_fn
        self.interleave = interleave
        self.grad_sync = grad_sync
        self.dw_queue = dw_queue
        self.losses: list[torch.Tensor] = []
        self.pending: Optional[torch.Tensor] = None  # the loss whose backward has not run yet
        self._one_core = _OneCore()

    @contextlib.contextmanager
    def running(self):
        """Around the microbatches (their forwards and backwards): host autograd calls finish a parked
        backward first (:func:`_autograd_from_the_host`), and the host's core is given back however
        the step ends."""
        with _autograd_from_the_host():
            try:
                yield self
            finally:
                self._one_core.release()

    @contextlib.contextmanager
    def microbatch(self, i: int):
        """Around the forward of microbatch i, with the backward of microbatch i - 1 beside it.

        The body runs the forward and sets the yielded :class:`Forward`'s ``output``; after it, still
        beside the backward, ``loss_fn`` gives the microbatch's loss. An exception unwinds the
        backward beside (its thread ends) and propagates."""
        args, kwargs = self.calls[i]
        pending, beside = self.pending, None
        if pending is not None:
            if self.interleave:
                if not pending.is_cuda:
                    self._one_core.pin()
                beside = _start_backward(pending, i - 1, self.dw_queue)
                _live.append(beside)
            else:
                _host_backward(pending, i - 1, None)
        forward = Forward()
        try:
            on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in (*args, *kwargs.values()))
            with _trace.span(f"forward {i}", "compute", on_cuda, microbatch=i):
                _scope.set_beside(beside)
                try:
                    if beside is not None:
                        beside.turn()  # the backward's first all-to-all leaves before the forward starts
                    yield forward
                finally:
                    _scope.set_beside(None)
                loss = _check_loss(self.loss_fn(forward.output, i), i)
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
        self.pending = loss
        self.losses.append(loss.detach().reshape(()))

    def end(self) -> torch.Tensor:
        """After the last forward: its backward, alone on the host (``grad_sync`` around it).

        Returns:
            [M] the losses, detached.
        """
        self._one_core.release()  # the last backward runs alone
        _host_backward(self.pending, len(self.calls) - 1, self.grad_sync)
        return torch.stack(self.losses)


class Forward:
    """One microbatch's forward as :meth:`Microbatches.microbatch` gets it from the driver: its ``output``."""

    output: Any = None


_live: list = []  # the backward beside the host's forward, while it is parked (at most one)


def _finishing_live_backward(fn):
    """``fn`` (torch.autograd.backward / grad), first running to its end a backward parked beside the
    calling host. The parked backward holds the autograd engine's device thread (on CUDA), so an
    autograd call from the forward or the loss (a gradient penalty, say) would wait for that thread
    forever; run at the same point of the step on every rank, finishing it first keeps the
    collectives in the same order everywhere."""

    def call(*args, **kwargs):
        for b in list(_live):
            if not b.done and b.on_host():
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


def _host_backward(loss: torch.Tensor, i: int, grad_sync) -> None:
    with _trace.span(f"backward {i}", "compute", loss.is_cuda, microbatch=i):
        if grad_sync is None:
            loss.backward()
        else:
            with grad_sync:
                loss.backward()
