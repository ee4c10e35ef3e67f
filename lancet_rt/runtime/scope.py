"""The step context: the state a step's layers read beside their arguments, in three objects.

- :data:`THREAD` (:class:`ThreadContext`, one per host thread): the chunked forward this thread runs
  (its :class:`ChunkScope`: the chunks' carried routing, their turns, the step's first counts
  exchange, the weights' compute-dtype copies, the early-backward record, the batch-sized buffers
  of the chunks' outputs: :func:`chunk_empty`) and the backward running
  beside this thread's forward (cross-microbatch overlap). Per thread because the chunks of one
  forward and the layers they run share one host thread (each chunk a greenlet on it).
- :data:`CHUNK` (:class:`ChunkContext`, one per execution context: each greenlet, so each chunk, has
  its own): the activation-checkpointing log being recorded or replayed (:mod:`lancet_rt.runtime.recompute`).
  Per chunk because a chunk may yield inside a checkpointed region, and its recording must not leak
  into the chunk that runs next on the same thread.
- :data:`PROCESS` (:class:`ProcessContext`, one per process): the deferred-dW queue in force, the
  backward beside the host's forward as the autograd engine's threads see it, and the dual all-to-all
  that a partial backward issues from the forward. Process-wide because backward runs on the
  engine's threads (a device thread per GPU), not on the host thread that set them.

A MoE layer asks :func:`current` for the chunk scope; with none active it runs as one chunk and
:func:`switch` is a no-op.

What stays outside: state that belongs to one autograd node and dies with it, which the step's
backward reaches through the graph after the forward's scope has ended: an all-to-all's
:class:`lancet_rt.comm.group.BackwardLink` (its dual issued early, and that dual's loss-gradient
factor), a checkpointed region's log (held by the region's recomputation context), the casts' copies.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections import deque
from typing import Callable, Optional

import torch


class ThreadContext(threading.local):
    """The step context of one host thread (:data:`THREAD`). Each field is set by the driver that owns
    it and put back when that driver's call ends:

    Attributes:
        chunks: the :class:`ChunkScope` of the chunked forward this thread runs, or None. Set by
            :meth:`lancet_rt.Overlapped.run_chunked` for one chunked forward (the outer value restored
            after it); None outside the chunks, where a layer runs as one chunk.
        beside: the backward (a :class:`lancet_rt.runtime.beside.BackwardBeside`) that
            :meth:`lancet_rt.Overlapped.accumulate` runs beside this thread's forward
            (:func:`set_beside`), or None. Set for one microbatch's forward.
    """

    chunks: Optional["ChunkScope"] = None
    beside: object = None


class ChunkContext:
    """The part of the step context that each execution context has its own of (:data:`CHUNK`): a
    greenlet (a chunk of :class:`lancet_rt.Overlapped`) or a thread. Its fields are context variables
    (``get()``; ``set()`` returns the token that ``reset()`` takes to put the outer value back).

    Attributes:
        recording: the snapshot log (a list of :class:`lancet_rt.runtime.recompute.Snapshot`) of the
            checkpointed region whose forward this context runs, or None. Set by the region's forward
            context (:func:`lancet_rt.runtime.recompute.checkpoint_context`) for that forward; each MoE
            call in it appends where its routing started.
        replaying: the snapshots still to replay (a deque, oldest first) in the recomputation this
            context runs, or None. Set by the region's recomputation context for one rerun, in backward;
            each recomputed MoE call takes the next one.
    """

    recording: "contextvars.ContextVar[Optional[list]]" = contextvars.ContextVar("lancet_recording", default=None)
    replaying: "contextvars.ContextVar[Optional[deque]]" = contextvars.ContextVar("lancet_replaying", default=None)


class ProcessContext:
    """The process-wide part of the step context (:data:`PROCESS`), read from any thread.

    Attributes:
        dw_queue: the :class:`lancet_rt.runtime.wgrad.WGradQueue` that autograd Functions created now
            defer dW into, or None (dW at once). Set by the driver for its forward and backward
            (:func:`lancet_rt.runtime.wgrad.set_current`), and by a recomputation for its rerun.
        beside: the backward beside the host's forward, as the engine's threads see it (its
            all-to-alls hand the host back through :func:`backward_wait`); set with ``THREAD.beside``.
        dual_from_forward: (link, scale) while a chunk's partial backward runs to issue that
            :class:`lancet_rt.comm.group.BackwardLink`'s dual from the forward, for a loss gradient of 1
            scaled later by ``scale`` (a :class:`lancet_rt.schedule.early_backward.GradScale`), or None.
            Set by :func:`lancet_rt.schedule.early_backward.issue_from_forward` for that one
            ``autograd.grad`` call; taken (set back to None) by the link's ``issue``, which keeps the
            scale on the link for the step's backward. One at a time: the early backward is off where a
            backward runs beside the forward.
    """

    def __init__(self):
        self.dw_queue = None
        self.beside = None
        self.dual_from_forward: Optional[tuple] = None


THREAD = ThreadContext()
CHUNK = ChunkContext()
PROCESS = ProcessContext()


class ChunkScope:
    """What a layer needs to know about the chunked forward it runs in (``THREAD.chunks``).

    Lifetime: one chunked forward. :class:`lancet_rt.Overlapped` makes it before the chunks' first
    forward and drops it after the last; what the chunks' autograd graph still needs from it (the
    compute-dtype copies in ``casts``, the links in ``last_combine``, the chunks' output pieces of
    :meth:`pieces`) lives on in the graph, as long as the backward needs it. A recomputation in
    backward runs outside any scope (and inside one, :func:`chunk_empty` gives it fresh memory).

    Args:
        rows: rows (along dim 0) of each chunk.
        switch: yields control to the scheduler; returns when this chunk is resumed.

    Attributes:
        layer_state: each MoE call's carried routing state (``call_key``: the n-th call of a layer),
            shared by the chunks, which pass the gating in order.
        waiting: for each chunk, (the order in which it yielded, whether its next step issues a
            transfer); the scheduler decides from these alone, so every rank runs the same schedule
            and issues its collectives in the same order.
        first_exchange: the step's first counts exchange per group (``id(group)``), which later
            chunks wait for before issuing theirs (:func:`lancet_rt.comm.faults.wait_first_exchange`).
        casts: the weights' compute-dtype copies shared by the chunks
            (:func:`lancet_rt.runtime.casts.compute_copy`).
        last_combine: per chunk, the (output, link) of the combine all-to-all of the last MoE layer
            it ran, or None where that layer's backward cannot be started from the forward
            (:mod:`lancet_rt.schedule.early_backward`).
        sites: the :class:`ChunkSite` of each (site, n-th call): what the chunks share there (the
            batch-sized buffers of :meth:`pieces`, among others).
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
        self.sites: dict = {}
        self._site_calls: dict = {}
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

    def site(self, site) -> "ChunkSite":
        """The :class:`ChunkSite` the chunks share at their n-th call of ``site`` (any hashable naming the
        call site; the n-th call of a site in a chunk is the n-th in every chunk), made by the first chunk
        to get there."""
        k = (self.chunk, site)
        n = self._site_calls.get(k, 0)
        self._site_calls[k] = n + 1
        key = (site, n)
        got = self.sites.get(key)
        if got is None:
            got = self.sites[key] = ChunkSite(self.rows)
        return got

    def pieces(self, site, count: int, shape: tuple, dtype: torch.dtype, device) -> Optional[tuple]:
        """This chunk's ``count`` pieces of the batch-sized buffer of the outputs made at ``site``
        (:meth:`ChunkSite.take`), or None where the caller allocates."""
        return self.site(site).take(self.chunk, count, shape, dtype, device)


class ChunkSite:
    """What the chunks' n-th calls of one site share (:meth:`ChunkScope.site`). Made in the forward by the
    first chunk to reach the site; a chunk's autograd node may hold it to share with the other chunks in
    backward too, after the forward's scope has ended (e.g. :meth:`take` for the gradients' pieces: its
    first caller allocates for all the chunks, whichever chunk's backward runs first; :meth:`lend` for
    a scratch buffer the chunks' backward use in turn).

    Attributes:
        rows: rows (along dim 0) of each chunk of the forward that made it.
    """

    def __init__(self, rows: list[int]):
        self.rows = rows
        self._split: Optional[list] = None
        self._sum_nodes: dict = {}  # chunk -> weakref of its autograd node (join_sum)
        self._sum: Optional[list] = None  # [graph task, chunks summed (None: each its own), the sums]
        self._lent: Optional[torch.Tensor] = None
        self._loans = 0
        self._lender: Optional[int] = None

    def take(self, chunk: int, count: int, shape: tuple, dtype: torch.dtype, device) -> Optional[tuple]:
        """Chunk ``chunk``'s ``count`` pieces (each contiguous, uninitialised, ``shape``) of one batch-sized
        buffer, or None where the chunks' sizes are unknown or the pieces were taken: the caller allocates.

        The first caller allocates one buffer for the ``count`` outputs of all the chunks, dim 0 sized by
        their rows (its own dim 0 per row of its own, times each chunk's rows), and splits it once: 2 host
        ops for the batch instead of ``count`` allocations per chunk. Each chunk's pieces are handed out
        once, to that chunk: a chunk whose shape, dtype or device differs from the buffer's gets None.
        The pieces are plain tensors (split below autograd's view tracking: each has its own version
        counter, and a custom Function may return it as a fresh output, modifiable in place), sharing
        the buffer's memory: the buffer lives until the last piece dies (e.g. the last chunk's piece
        saved for backward), not until the site does.
        """
        rows = self.rows
        N = len(rows)
        if N < 2:
            return None
        split = self._split
        if split is None:
            lead, r = shape[0], rows[chunk]
            if r == 0 or lead % r:
                return None
            sizes = [lead // r * q for q in rows] * count
            buf = torch.empty((sum(sizes), *shape[1:]), dtype=dtype, device=device)
            with torch._C._AutoDispatchBelowADInplaceOrView():
                split = self._split = list(buf.split(sizes))
        if len(split) != count * N:
            return None
        mine = split[chunk]
        if mine is None or mine.shape != tuple(shape) or mine.dtype != dtype or mine.device != torch.device(device):
            return None
        got = tuple(split[chunk + i * N] for i in range(count))
        for i in range(count):
            split[chunk + i * N] = None
        return got

    def lend(self, shape: tuple, dtype: torch.dtype, device) -> Optional[torch.Tensor]:
        """A scratch buffer (contiguous, uninitialised, ``shape``) that the chunks' calls here use one
        after the other, each reading what it wrote before it returns (e.g. a backward's partial sums):
        the first caller allocates it and each chunk's call gets that same memory, 1 allocation per
        batch instead of one per chunk. None where the caller allocates: with one chunk, for another
        shape, dtype or device than the buffer's, on a thread other than the first caller's (calls on
        one thread run one after the other, and their work in stream order), and past one call per
        chunk (a second backward), when the site has let the buffer go.
        """
        N = len(self.rows)
        if N < 2 or self._loans >= N:
            return None
        self._loans += 1
        buf, me = self._lent, threading.get_ident()
        if self._lender is None:
            self._lender = me
            buf = self._lent = torch.empty(shape, dtype=dtype, device=device)
        if self._loans == N:  # the last chunk's call: the buffer lives while the caller holds it
            self._lent = None
        if buf is None or me != self._lender:
            return None
        if buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != torch.device(device):
            return None
        return buf

    def holds(self) -> bool:
        """Whether pieces of a buffer are still to be handed out here (keeping the buffer alive)."""
        return self._split is not None and any(p is not None for p in self._split)

    def join_sum(self, chunk: int, node) -> None:
        """Enrol chunk ``chunk``'s autograd node (a custom Function's ``ctx``, from its forward) in the
        chunks' gradient sum here (:meth:`sum_gradients`). Held weakly: the site never keeps a graph alive."""
        self._sum_nodes[chunk] = weakref.ref(node)

    def sum_gradients(self, chunk: int, compute: Callable[[Optional[tuple]], tuple]) -> Optional[tuple]:
        """Chunk ``chunk``'s turn in the sum over the chunks of gradients of the same tensors, called from
        its node's backward, on whatever thread runs it.

        ``compute(into)`` gives this chunk's gradients (a tuple, None where one is not wanted): fresh
        tensors where ``into`` is None; else added into ``into`` (the running sums: what the previous
        turn's ``compute`` returned), the same tensors returned. The first chunk whose backward runs
        writes, the later ones add (in the order their backward runs, as the autograd engine would add
        the gradients the chunks returned), and the last gets the sums, to return for all the chunks;
        the others get None (nothing for the engine to add). The sums are dropped then, so a retained
        graph's next backward starts afresh.

        Where that cannot be done, each chunk gets ``compute(None)``, its own gradients: outside a
        backward, with fewer than 2 chunks, or where a chunk's node did not join (:meth:`join_sum`) or
        does not run in this backward (one that reaches some chunks only). Decided once per backward
        (graph task) at its first turn here, so a backward that raised leaves nothing behind for the next.
        """
        task = torch._C._current_graph_task_id()
        state = self._sum
        if state is None or state[0] != task:
            nodes = [ref() for ref in self._sum_nodes.values()]
            whole = (
                task != -1
                and len(self.rows) >= 2
                and len(nodes) == len(self.rows)
                and all(n is not None and torch._C._will_engine_execute_node(n) for n in nodes)
            )
            state = self._sum = [task, set() if whole else None, None]
        done = state[1]
        if done is None or chunk in done:
            return compute(None)
        sums = compute(state[2])
        done.add(chunk)
        if len(done) < len(self.rows):
            state[2] = sums
            return None
        self._sum = None
        return sums


def chunk_site(site) -> Optional[ChunkSite]:
    """The :class:`ChunkSite` this chunk shares with the others at ``site`` (:meth:`ChunkScope.site`), or
    None outside a chunked forward and in a recomputation (which runs one chunk's forward again alone)."""
    s = THREAD.chunks
    if s is None or CHUNK.replaying.get() is not None:
        return None
    return s.site(site)


def chunk_empty(site, shape: tuple, dtype: torch.dtype, device, count: int = 1):
    """An uninitialised ``shape`` tensor (``count`` > 1: a tuple of ``count``) for this chunk's output
    made at ``site``: its piece of one batch-sized buffer inside a chunked forward
    (:meth:`ChunkScope.pieces`), else ``torch.empty`` (outside a scope, in a recomputation, or where
    the chunks' sizes are unknown)."""
    s = THREAD.chunks
    got = None
    if s is not None and CHUNK.replaying.get() is None:
        got = s.pieces(site, count, shape, dtype, device)
    if got is None:
        got = tuple(torch.empty(shape, dtype=dtype, device=device) for _ in range(count))
    return got[0] if count == 1 else got


def current() -> Optional[ChunkScope]:
    """The chunk scope of the forward this thread runs (None: not chunked)."""
    return THREAD.chunks


def set_current(scope: Optional[ChunkScope]) -> None:
    THREAD.chunks = scope


def switch(issues_next: bool = False) -> None:
    """Give the other chunks a turn (after issuing a collective); no-op outside a chunk scope.

    ``issues_next``: this chunk's next step issues a transfer (its counts are on their way), so the
    scheduler resumes it as soon as another chunk has had a turn. Otherwise a backward running
    beside this forward (:func:`set_beside`) takes a turn first.
    """
    beside = THREAD.beside
    if beside is not None and not issues_next:
        beside.turn()
    s = current()
    if s is not None:
        s.switch(issues_next)


# Cross-microbatch overlap (lancet_rt.schedule.accumulate): the backward of one microbatch runs on a helper
# thread beside the forward of the next, and the two take turns. The forward gives the backward a
# turn each time it yields after issuing a transfer (``THREAD.beside``); the backward gives the host
# back each time one of its all-to-alls is about to wait (backward_wait, called by the autograd
# engine's thread, so it reads ``PROCESS.beside``).
def set_beside(backward) -> None:
    """Run ``backward`` beside the forward that this thread runs from now on (None: nothing).

    ``backward`` has ``turn()`` (run until its next all-to-all waits), ``yield_()`` (called there,
    on the engine's thread) and ``fill(work)`` (the host is about to wait for ``work``)."""
    THREAD.beside = backward
    PROCESS.beside = backward


def backward_wait() -> None:
    """A backward all-to-all is about to wait: a forward running beside this backward takes its turn."""
    b = PROCESS.beside
    if b is not None:
        b.yield_()


def beside_active() -> bool:
    """Whether a backward runs beside the forward of this thread (:func:`set_beside`)."""
    return THREAD.beside is not None


def host_wait(work) -> None:
    """The host is about to wait for ``work``: a backward beside this forward runs deferred dW meanwhile."""
    beside = THREAD.beside
    if beside is not None:
        beside.fill(work)
