"""Faults across expert-parallel ranks: agreement, bounded waits, and clean state after a failure.

Every rank of an expert-parallel group issues the same collectives in the same order (the schedule
is decided from its own state, never from timing). A fault breaks that in one of three ways, and
each ends fast, on every rank, with an error that names the rank at fault (README, "Reliability"):

- **Before the step's collectives** (bad input, mismatched configuration or schedule, an exception
  in the model before the step's first counts exchange): the failing rank still takes part in that
  exchange with a failure status (or in the configuration/schedule all-gather), every rank raises
  there, and the group stays usable. To make "before" well defined, a chunk does not issue its
  counts exchange until the step's first one has been waited (:func:`wait_first_exchange`): no rank runs ahead
  into a second exchange that a failing rank would never match.
- **After they started** (an exception in chunk 2 of 4, in backward, a KeyboardInterrupt): the
  ranks are out of step for good. The failing rank writes a failure record to the process group's
  store and marks the group broken; a peer blocked in a collective reads the record within
  :data:`lancet_rt.comm.monitor.POLL_S` and raises :class:`PeerError` naming it. Any later
  collective on the group raises :class:`GroupError` at once.
- **A peer that stops answering** (killed, hung, partitioned): a rank waiting in a collective for
  longer than the group's timeout (``LANCET_TIMEOUT_S``, default 300 s, or
  :meth:`lancet_rt.TorchGroup.set_timeout`) raises :class:`PeerTimeout`; one whose collective
  fails (gloo notices a closed connection at once) raises :class:`PeerError`. Either names the
  ranks that did not reach the collective and says whether their process exited (same machine) or
  is alive.

- **Mismatched steps** (a rank skipped a backward, ran an extra forward or step): on gloo every
  collective is preceded by a header all-gather of (sequence number, kind, dtype, sizes), and every
  rank raises :class:`CollectiveMismatch` naming what each rank issued before the payload reaches
  gloo (which would abort the process on mismatched sizes). Cost: one all-gather of 9 + 2 W int64
  per rank and one host round trip per collective, so 5 per MoE layer per training step (counts
  exchange, dispatch and combine, two backward all-to-alls; with ``pipeline_chunks`` P, 1 + 4 P).
  On NCCL it is off (it would be a host sync per collective; ``GroupMonitor.check_headers``
  turns it on); there the counts exchange's tag (:mod:`lancet_rt.moe.dispatch.common`: which layer,
  chunk, direction and dtype each rank ran, compared by every rank on receipt) and the positions of
  ranks blocked in collectives of different kinds (:meth:`GroupMonitor.wait`) still raise it, else a
  mismatched step ends at the timeout. On a split gloo group
  (:meth:`lancet_rt.TorchGroup.split`) the header check runs on a thread of the group and its own
  control group, before the collective is handed to gloo, and the host does not wait for it: the
  mismatch is raised by the collective's ``wait()`` (or the next issue) on every rank, nothing sent.

How a wait is bounded on gloo and on NCCL: :mod:`lancet_rt.comm.monitor`. On NCCL no host sync and
no collective is added per chunk.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from lancet_rt.runtime import scope as _scope

ADVICE = (
    "This expert-parallel group is out of step and cannot be used again: end the process "
    "(torchrun restarts the job), or destroy the process group and build the model on a new one"
)


class GroupError(RuntimeError):
    """The expert-parallel group cannot go on (a rank failed in the middle of a step, stopped
    answering, or died). ``ranks``: the group ranks at fault; ``global_ranks``: the same ranks in the
    default group's numbering (the processes whose logs to read; the messages name these)."""

    def __init__(self, message: str, ranks=(), *, global_ranks=None):
        super().__init__(message)
        self.ranks = sorted(set(ranks))
        self.global_ranks = self.ranks if global_ranks is None else sorted(set(global_ranks))


class PeerError(GroupError):
    """A peer failed in the middle of a step, or was lost (its collective failed, its process exited)."""


class CollectiveMismatch(GroupError):
    """The ranks issued different collectives at the same point (sequence number, kind, dtype or sizes):
    raised on every rank before the mismatched collective reaches the backend; or their counts exchanges
    came from different MoE layers, chunks, directions or dtypes: raised on every rank before any token is sent."""


class PeerTimeout(PeerError, TimeoutError):
    """Peers did not reach a collective within the group's timeout."""


# ------------------------------------------------------------------------------ agreement
def agreed(error: BaseException) -> BaseException:
    """Mark ``error`` as raised on every rank at the same point (the group stays in step)."""
    error._lancet_agreed = True
    return error


def status_code(error: Optional[BaseException]) -> int:
    """The status a rank sends on the counts exchange: 0 ok, 1 input rejected, 2 failed otherwise."""
    if error is None:
        return 0
    return getattr(error, "_lancet_status", 1)


def raise_on_bad_status(status_W, local_error: Optional[BaseException], group=None) -> None:
    """Raise on every rank once any rank reported a failure on the counts exchange or the config
    all-gather (the ranks stay in step: the error is marked so the step guard leaves the group usable).
    ``status_W``: each rank's status code, host ints or a host tensor; ``group``: the group they came
    from (its monitor names the ranks by their global numbers)."""
    codes = status_W.tolist() if isinstance(status_W, torch.Tensor) else list(status_W)
    bad = [r for r, s in enumerate(codes) if s != 0]
    if not bad:
        return
    monitor = getattr(group, "monitor", None)
    who = monitor.names(bad) if monitor is not None else f"rank(s) {bad}"
    if local_error is not None:
        error = local_error
    elif all(codes[r] == 1 for r in bad):
        error = ValueError(
            f"MoE input rejected on expert-parallel {who} (see the error raised there); "
            f"every rank stops instead of waiting in the all-to-all"
        )
    else:
        error = PeerError(
            f"expert-parallel {who} failed in this step before its collectives started "
            f"(see the error raised there); every rank stops, and the group stays usable",
            bad,
            global_ranks=monitor.to_global(bad) if monitor is not None else None,
        )
    raise agreed(error)


def _step_orders(group):
    """The step's chunk scope where its counts exchanges on ``group`` are ordered (a real group of
    several ranks inside a chunked forward), else None."""
    s = _scope.current()
    if s is None or getattr(group, "monitor", None) is None or group.size == 1:
        return None
    return s


def wait_first_exchange(group) -> None:
    """Before issuing a counts exchange on ``group``: wait for the step's first one, if it was issued.

    A rank that fails before the step's collectives reports it on that first exchange; a peer that
    had already issued a second exchange would wait in it forever. Waiting the first exchange before
    issuing the second costs nothing in the steady state: it is waited right after anyway, and the
    other chunk's computation has been queued meanwhile. Raises there if a rank reported a failure.
    The caller then issues its exchange and hands it to :func:`note_exchange`: two plain calls in
    sequence, so this module never calls back into the dispatcher.
    """
    s = _step_orders(group)
    first = None if s is None else s.first_exchange.get(id(group))
    if first is not None:
        first.wait()


def note_exchange(group, handle) -> None:
    """After issuing a counts exchange on ``group``: keep it as the step's first if none was issued yet
    (:func:`wait_first_exchange` waits for it before the next one)."""
    s = _step_orders(group)
    if s is not None:
        s.first_exchange.setdefault(id(group), handle)


# ------------------------------------------------------------------------------ per-group state
class _State:
    """Backward bookkeeping of one group (any kind): did the last backward end, and how far it got."""

    def __init__(self):
        self.backward_open = False
        self.links = 0  # forward all-to-alls with grad since the last backward ended
        self.duals = 0  # backward all-to-alls issued since the backward opened

    def close(self):
        self.backward_open = False
        self.links = self.duals = 0


_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def backward_state(group) -> _State:
    """The backward bookkeeping of ``group`` (the step guard reads it to find a backward that raised)."""
    st = _states.get(group)
    if st is None:
        st = _states[group] = _State()
    return st


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def note_link(group) -> None:
    """A forward all-to-all whose backward will issue a dual all-to-all."""
    backward_state(group).links += 1


def note_dual(group, early: bool = False) -> None:
    """A backward all-to-all is issued: the backward is open until the engine's final callback.
    ``early``: issued from the forward (:mod:`lancet_rt.schedule.early_backward`), inside a partial
    backward that ends before the step's own: counted, and the backward stays closed."""
    st = backward_state(group)
    st.duals += 1
    if not early and not st.backward_open and in_backward():
        st.backward_open = True
        torch.autograd.Variable._execution_engine.queue_callback(st.close)
