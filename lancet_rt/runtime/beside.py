"""The backward beside the host's forward (cross-microbatch overlap): the baton the two pass.

Under :meth:`lancet_rt.Overlapped.accumulate` the backward of microbatch i runs on a helper thread
while the host runs the forward of microbatch i+1, and the two take turns, exactly one running at a
time (:mod:`lancet_rt.schedule.accumulate` says why and when). :class:`BackwardBeside` is that
backward as both sides see it: the host's driver gives it turns, finishes or unwinds it; the step
context hands over at the schedule's points (:mod:`lancet_rt.runtime.scope`: a forward's chunk
yields, a backward all-to-all is about to wait, the host is about to wait for a transfer); the
helper thread reports the start and the end of the backward it runs.

It sits below the driver, the layers and the links, so every one of those calls goes down to it and
none comes back up: the baton is data that both threads pass, not a callback into the driver.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from lancet_rt import trace as _trace


class Aborted(RuntimeError):
    """Raised inside a suspended backward when the forward beside it failed: it unwinds the engine."""


class BackwardBeside:
    """One microbatch's backward on a helper thread, taking turns with the host.

    ``turn()`` (host) lets it run until its next all-to-all waits, or to its end; ``yield_()``
    (called by :func:`lancet_rt.runtime.scope.backward_wait` on the engine's thread) gives the host back.
    Two semaphores form the baton: exactly one of the two threads runs.

    Args:
        index: the microbatch (for the trace's spans).
        queue: the :class:`lancet_rt.runtime.wgrad.WGradQueue` its deferred dW goes to (None: none),
            drained while the host waits (:meth:`fill`).
        cuda: whether the backward runs on CUDA (its spans are timed on the device).

    Attributes:
        turns: the turns the host gave it so far.
        done: its thread has ended the backward (or never ran it).
        error: what the backward raised, handed to the host.
    """

    def __init__(self, index: int, queue=None, cuda: bool = False):
        self.index = index
        self.queue = queue
        self.turns = 0
        self.done = False
        self.error: Optional[BaseException] = None
        self._abort = False
        self._task: Optional[int] = None  # the engine's id of this backward's graph task, once it runs
        self._host = threading.current_thread()
        self._cuda = cuda
        self._go = threading.Semaphore(0)  # the backward may run
        self._back = threading.Semaphore(0)  # the host may run

    # ---------------------------------------------------------------- the backward's thread
    def first_turn(self) -> bool:
        """Wait for the first turn; False: the forward beside failed first (run nothing)."""
        self._go.acquire()
        return not self._abort

    def note_task(self, grad_outputs) -> None:
        """A pre-hook of the loss's node, the backward's first: it names the graph task that may give
        the host its turns (on whichever thread the engine runs it; on CUDA its device thread)."""
        self._task = torch._C._current_graph_task_id()

    def ended(self, error: Optional[BaseException]) -> None:
        """The backward ended (``error``: what it raised, None if nothing); the host runs again."""
        self.error = error
        self.done = True
        self._back.release()

    # ---------------------------------------------------------------- the host
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

    def yield_(self) -> None:
        """Engine thread, at a backward all-to-all's wait: the host runs until it gives a turn back.

        Only inside this backward's own graph task, while it runs. Any other autograd call that
        reaches an all-to-all's backward (the host's own, or a user's gradient penalty, which on CUDA
        runs on the device thread too, after this backward ended) runs through: the host is waiting
        for that call, so giving it a turn would block both forever."""
        if self.done or self._task is None or torch._C._current_graph_task_id() != self._task:
            return
        if self._abort:
            raise Aborted("lancet_rt.schedule.accumulate: the forward beside this backward failed")
        self._back.release()
        self._go.acquire()
        if self._abort:
            raise Aborted("lancet_rt.schedule.accumulate: the forward beside this backward failed")

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

    def on_host(self) -> bool:
        """Whether the calling thread is the host this backward runs beside."""
        return threading.current_thread() is self._host


class _EventWork:
    """A CUDA event seen as a collective's work handle (``is_completed``), for the dW queue's drain."""

    def __init__(self, event):
        self.is_completed = event.query


def _as_work(work):
    """``work`` as the dW queue drains during it: an event (``query`` only) gets ``is_completed``."""
    if not hasattr(work, "is_completed") and hasattr(work, "query"):
        return _EventWork(work)
    return work
