"""Faults across expert-parallel ranks: agreement, bounded waits, and clean state after a failure.

Every rank of an expert-parallel group issues the same collectives in the same order (the schedule
is decided from its own state, never from timing). A fault breaks that in one of three ways, and
each ends fast, on every rank, with an error that names the rank at fault (README, "Reliability"):

- **Before the step's collectives** (bad input, mismatched configuration or schedule, an exception
  in the model before the step's first counts exchange): the failing rank still takes part in that
  exchange with a failure status (or in the configuration/schedule all-gather), every rank raises
  there, and the group stays usable. To make "before" well defined, a chunk does not issue its
  counts exchange until the step's first one has been waited (:func:`in_order`): no rank runs ahead
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

import functools
import weakref
from typing import Callable, Optional

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
def check_schedule(overlapped) -> None:
    """Compare ``chunks``, ``defer_wgrad`` and ``check`` across each expert-parallel group once.

    One all-gather per group with peers, on the first forward and again if the schedule changes
    (it must change on every rank). Ranks with different schedules would issue different
    collectives (hang, or mix up data), so every rank raises a ValueError naming the ranks and values.
    """
    chunks = overlapped.chunks
    mine = (chunks if isinstance(chunks, int) else 0, int(overlapped.defer_wgrad), int(overlapped.check))
    if getattr(overlapped, "_agreed_schedule", None) == mine:
        return
    for group in _groups(overlapped):
        if group.size == 1:
            continue
        rows = group.all_gather(torch.tensor(mine, dtype=torch.int64)).tolist()
        diff = []
        for j, name in enumerate(("chunks", "defer_wgrad", "check")):
            if len({row[j] for row in rows}) > 1:
                shown = [
                    ("'auto'" if v == 0 else str(v)) if name == "chunks" else str(bool(v))
                    for v in (row[j] for row in rows)
                ]
                who = getattr(getattr(group, "monitor", None), "name", lambda q: f"rank {q}")  # global ranks
                diff.append(f"{name}: " + ", ".join(f"{who(r)}={v}" for r, v in enumerate(shown)))
        if diff:
            raise ValueError(
                f"Overlapped schedule differs across expert-parallel ranks ({'; '.join(diff)}); every rank "
                f"must use the same chunks, defer_wgrad and check, or the ranks issue different collectives"
            )
    overlapped._agreed_schedule = mine


def agreed(error: BaseException) -> BaseException:
    """Mark ``error`` as raised on every rank at the same point (the group stays in step)."""
    error._lancet_agreed = True
    return error


def check_output_rows(outputs: list, rows: list) -> None:
    """Every output tensor of chunk c must have a fixed multiple of chunk c's rows along dim 0 (the
    rows themselves, or rows x seq for token-major outputs such as transformers' router logits
    [B * S, E]), else concatenating the chunks' outputs would silently give a different result from
    the unchunked model."""
    from torch.utils import _pytree as pytree

    per_chunk = [pytree.tree_leaves(out) for out in outputs]
    for j in range(len(per_chunk[0]) if per_chunk else 0):
        ratio = None
        for c, (leaves, n) in enumerate(zip(per_chunk, rows)):
            leaf = leaves[j] if j < len(leaves) else None
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                continue
            k = leaf.shape[0] / n if n else (0 if leaf.shape[0] == 0 else None)
            if n and ratio is None:
                ratio = k
            if k is None or (n and (k != ratio or k != int(k))):
                raise ValueError(
                    f"Overlapped: output {j} of chunk {c} has {leaf.shape[0]} rows along dim 0 for the chunk's "
                    f"{n} input rows{'' if ratio is None else f' (other chunks: {ratio:g} per row)'}; the model "
                    f"must keep dim 0 (row i of the output from row i of the inputs)"
                )


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


def in_order(group, issue: Callable[[], object]):
    """Issue a counts exchange, but first wait for the step's first one on ``group`` (real groups).

    A rank that fails before the step's collectives reports it on that first exchange; a peer that
    had already issued a second exchange would wait in it forever. Waiting the first exchange before
    issuing the second costs nothing in the steady state: it is waited right after anyway, and the
    other chunk's computation has been queued meanwhile.
    """
    s = _scope.current()
    if s is None or getattr(group, "monitor", None) is None or group.size == 1:
        return issue()
    first = s.first_exchange.get(id(group))
    if first is not None:
        first.wait()  # raises here if a rank reported a failure
        return issue()
    handle = issue()
    s.first_exchange[id(group)] = handle
    return handle


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


def _state(group) -> _State:
    st = _states.get(group)
    if st is None:
        st = _states[group] = _State()
    return st


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def note_link(group) -> None:
    """A forward all-to-all whose backward will issue a dual all-to-all."""
    _state(group).links += 1


def note_dual(group, early: bool = False) -> None:
    """A backward all-to-all is issued: the backward is open until the engine's final callback.
    ``early``: issued from the forward (:mod:`lancet_rt.schedule.early_backward`), inside a partial
    backward that ends before the step's own: counted, and the backward stays closed."""
    st = _state(group)
    st.duals += 1
    if not early and not st.backward_open and _in_backward():
        st.backward_open = True
        torch.autograd.Variable._execution_engine.queue_callback(st.close)


class StepGuard:
    """Around one step of :class:`lancet_rt.Overlapped`: find a backward that raised before this
    step, and make an exception in this step end cleanly on every rank (module docstring)."""

    def __init__(self, overlapped):
        self.overlapped = overlapped
        self.groups = _groups(overlapped)
        self.marks: dict = {}

    def __enter__(self):
        for g in self.groups:
            st = _state(g)
            if not st.backward_open or _in_backward():
                continue
            # The engine dropped the callback that ends the backward: the last backward raised.
            complete = st.duals >= st.links
            duals, links = st.duals, st.links
            st.close()
            _cancel_link(g)
            monitor = getattr(g, "monitor", None)
            if monitor is not None and g.size > 1 and not complete and monitor.broken is None:
                raise monitor.break_(
                    monitor.error(
                        GroupError,
                        f"expert-parallel {monitor.name(g.rank)}: the last backward raised after issuing "
                        f"{duals} of its "
                        f"{links} backward all-to-alls, so its peers are still waiting in the others. {ADVICE}",
                        [g.rank],
                    )
                )
        self.marks = {g: g.monitor.exchanges for g in self.groups if getattr(g, "monitor", None) is not None}
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            return False
        for g in self.groups:
            _cancel_link(g)
        if getattr(exc, "_lancet_agreed", False):
            return False  # every rank raised at the same collective: in step
        for g, mark in self.marks.items():
            monitor = g.monitor
            if g.size == 1 or monitor.broken is not None:
                continue
            if monitor.exchanges == mark:
                # No counts exchange of this step yet: the peers wait in the first one (or will).
                exc._lancet_status = 2
                layer = next(m for m in self.overlapped.moe_layers() if m.group is g)
                layer.fail_peers(exc)  # raises on every rank
            monitor.break_(
                monitor.error(
                    GroupError, f"expert-parallel {monitor.name(g.rank)} raised {type(exc).__name__}: {exc}", [g.rank]
                )
            )
            if hasattr(exc, "add_note"):
                exc.add_note(
                    f"lancet-rt: this happened after the step's collectives had started, so the peers were "
                    f"told and the expert-parallel group is unusable now. {ADVICE}."
                )
        return False


def guarded_step(forward):
    """Decorates :meth:`lancet_rt.Overlapped.forward`: :func:`check_schedule`, then the step under a
    :class:`StepGuard`."""

    @functools.wraps(forward)
    def step(overlapped, *args, **kwargs):
        check_schedule(overlapped)
        with StepGuard(overlapped):
            return forward(overlapped, *args, **kwargs)

    return step


def _groups(overlapped) -> list:
    seen = []
    for m in overlapped.moe_layers():
        if m.group is not None and all(m.group is not g for g in seen):
            seen.append(m.group)
    return seen


def _cancel_link(group) -> None:
    cancel = getattr(group, "cancel_pending", None)
    if cancel is not None:
        cancel()
