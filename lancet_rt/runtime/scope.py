"""The chunk scope of an overlapped forward, as seen from inside a MoE layer.

:class:`lancet_rt.Overlapped` runs the model once per chunk, each run a coroutine. A MoE layer asks
:func:`current` for the scope; with none active it runs as one chunk and :func:`switch` is a no-op.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

_local = threading.local()


class ChunkScope:
    """What a layer needs to know about the chunked forward it runs in.

    Args:
        rows: rows (along dim 0) of each chunk.
        switch: yields control to the scheduler; returns when this chunk is resumed.

    Attributes:
        waiting: for each chunk, (the order in which it yielded, whether its next step issues a
            transfer); the scheduler decides from these alone, so every rank runs the same schedule
            and issues its collectives in the same order.
        first_exchange: the step's first counts exchange per group (``id(group)``), which later
            chunks wait for before issuing theirs (:func:`lancet_rt.comm.faults.in_order`).
        casts: the weights' compute-dtype copies shared by the chunks
            (:func:`lancet_rt.runtime.casts.compute_copy`).
        last_combine: per chunk, the (output, link) of the combine all-to-all of the last MoE layer
            it ran, or None where that layer's backward cannot be started from the forward
            (:mod:`lancet_rt.schedule.early_backward`).
    """

    def __init__(self, rows: list[int], switch: Callable[[], None]):
        self.rows = rows
        self.total_rows = sum(rows)
        self.chunk = 0
        self._switch = switch
        self.layer_state: dict = {}
        self._calls: dict = {}
        self.waiting: dict = {}
        self.first_exchange: dict = {}
        self.casts: dict = {}
        self.last_combine: dict = {}
        self._yields = 0

    def switch(self, issues_next: bool = False) -> None:
        """Yield; ``issues_next``: this chunk's next step, once resumed, issues a transfer."""
        self._yields += 1
        self.waiting[self.chunk] = (self._yields, issues_next)
        self._switch()

    def call_key(self, layer) -> tuple:
        """A key for this call of ``layer`` that is equal across chunks (the n-th call is the n-th)."""
        k = (self.chunk, id(layer))
        n = self._calls.get(k, 0)
        self._calls[k] = n + 1
        return id(layer), n


def current() -> Optional[ChunkScope]:
    return getattr(_local, "scope", None)


def set_current(scope: Optional[ChunkScope]) -> None:
    _local.scope = scope


def switch(issues_next: bool = False) -> None:
    """Give the other chunks a turn (after issuing a collective); no-op outside a chunk scope.

    ``issues_next``: this chunk's next step issues a transfer (its counts are on their way), so the
    scheduler resumes it as soon as another chunk has had a turn. Otherwise a backward running
    beside this forward (:func:`set_beside`) takes a turn first.
    """
    beside = getattr(_local, "beside", None)
    if beside is not None and not issues_next:
        beside.turn()
    s = current()
    if s is not None:
        s.switch(issues_next)


# Cross-microbatch overlap (lancet_rt.schedule.accumulate): the backward of one microbatch runs on a helper
# thread beside the forward of the next, and the two take turns. The forward gives the backward a
# turn each time it yields after issuing a transfer (the host's thread-local ``beside``); the
# backward gives the host back each time one of its all-to-alls is about to wait (backward_wait,
# called by the autograd engine's thread, so the hook is process-wide).
_backward_beside = None


def set_beside(backward) -> None:
    """Run ``backward`` beside the forward that this thread runs from now on (None: nothing).

    ``backward`` has ``turn()`` (run until its next all-to-all waits), ``yield_()`` (called there,
    on the engine's thread) and ``fill(work)`` (the host is about to wait for ``work``)."""
    global _backward_beside
    _local.beside = backward
    _backward_beside = backward


def backward_wait() -> None:
    """A backward all-to-all is about to wait: a forward running beside this backward takes its turn."""
    b = _backward_beside
    if b is not None:
        b.yield_()


def beside_active() -> bool:
    """Whether a backward runs beside the forward of this thread (:func:`set_beside`)."""
    return getattr(_local, "beside", None) is not None


def host_wait(work) -> None:
    """The host is about to wait for ``work``: a backward beside this forward runs deferred dW meanwhile."""
    beside = getattr(_local, "beside", None)
    if beside is not None:
        beside.fill(work)
