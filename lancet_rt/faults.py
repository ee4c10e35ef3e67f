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
  :data:`POLL_S` and raises :class:`PeerError` naming it. Any later collective on the group raises
  :class:`GroupError` at once.
- **A peer that stops answering** (killed, hung, partitioned): a rank waiting in a collective for
  longer than the group's timeout (``LANCET_TIMEOUT_S``, default 300 s, or
  :meth:`lancet_rt.TorchGroup.set_timeout`) raises :class:`PeerTimeout`; one whose collective
  fails (gloo notices a closed connection at once) raises :class:`PeerError`. Either names the
  ranks that did not reach the collective and says whether their process exited (same machine) or
  is alive.

How a wait is bounded depends on the backend. gloo: the waiting thread waits in slices of
:data:`POLL_S` and reads the store between them (one store operation per slice, only in a wait
that has already lasted a slice), and lancet's collectives are issued with gloo's own operation
timeout set to the group's timeout, so a pending receive ends by itself and the process can exit.
NCCL: the host does not wait for collectives (the streams do), so a watchdog thread follows the
collectives in flight and, on a failure record or after the timeout, logs the diagnosis and aborts
the communicator, which ends the stuck kernels and wakes a host blocked on the counts; the main
thread then raises. No host sync and no collective is added per chunk on either backend.
"""
from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import env, scope as _scope

log = logging.getLogger("lancet_rt")

#: A rank blocked in a collective looks for failure records this often (seconds).
POLL_S = 0.1
#: After a collective failed or timed out, how long peers get to report where they are (seconds).
ROLL_CALL_S = 2 * POLL_S

ADVICE = ("This expert-parallel group is out of step and cannot be used again: end the process "
          "(torchrun restarts the job), or destroy the process group and build the model on a new one")


class GroupError(RuntimeError):
    """The expert-parallel group cannot go on (a rank failed in the middle of a step, stopped
    answering, or died). ``ranks``: the group ranks at fault."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = sorted(set(ranks))


class PeerError(GroupError):
    """A peer failed in the middle of a step, or was lost (its collective failed, its process exited)."""


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
    mine = (0 if chunks == "auto" else int(chunks), int(overlapped.defer_wgrad), int(overlapped.check))
    if getattr(overlapped, "_agreed_schedule", None) == mine:
        return
    for group in _groups(overlapped):
        if group.size == 1:
            continue
        rows = group.all_gather(torch.tensor(mine, dtype=torch.int64)).tolist()
        diff = []
        for j, name in enumerate(("chunks", "defer_wgrad", "check")):
            if len({row[j] for row in rows}) > 1:
                shown = [("'auto'" if v == 0 else str(v)) if name == "chunks" else str(bool(v))
                         for v in (row[j] for row in rows)]
                diff.append(f"{name}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(shown)))
        if diff:
            raise ValueError(
                f"Overlapped schedule differs across expert-parallel ranks ({'; '.join(diff)}); every rank "
                f"must use the same chunks, defer_wgrad and check, or the ranks issue different collectives")
    overlapped._agreed_schedule = mine


def agreed(error: BaseException) -> BaseException:
    """Mark ``error`` as raised on every rank at the same point (the group stays in step)."""
    error._lancet_agreed = True
    return error


def check_output_rows(outputs: list, rows: list) -> None:
    """Every output tensor of chunk c must have chunk c's rows along dim 0, else concatenating the
    chunks' outputs would silently give a different result from the unchunked model."""
    from torch.utils import _pytree as pytree

    for c, (out, n) in enumerate(zip(outputs, rows)):
        for j, leaf in enumerate(pytree.tree_leaves(out)):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] != n:
                raise ValueError(
                    f"Overlapped: output {j} of chunk {c} has {leaf.shape[0]} rows along dim 0 but the chunk's "
                    f"inputs had {n}; the model must keep dim 0 (row i of the output from row i of the inputs)")


def status_code(error: Optional[BaseException]) -> int:
    """The status a rank sends on the counts exchange: 0 ok, 1 input rejected, 2 failed otherwise."""
    if error is None:
        return 0
    return getattr(error, "_lancet_status", 1)


def raise_on_bad_status(status_W: torch.Tensor, local_error: Optional[BaseException]) -> None:
    """Raise on every rank once any rank reported a failure on the counts exchange or the config
    all-gather (the ranks stay in step: the error is marked so the step guard leaves the group usable)."""
    codes = status_W.tolist()
    bad = [r for r, s in enumerate(codes) if s != 0]
    if not bad:
        return
    if local_error is not None:
        error = local_error
    elif all(codes[r] == 1 for r in bad):
        error = ValueError(f"MoE input rejected on expert-parallel rank(s) {bad} (see the error raised there); "
                           f"every rank stops instead of waiting in the all-to-all")
    else:
        error = PeerError(f"expert-parallel rank(s) {bad} failed in this step before its collectives started "
                          f"(see the error raised there); every rank stops, and the group stays usable", bad)
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
        self.links = 0   # forward all-to-alls with grad since the last backward ended
        self.duals = 0   # backward all-to-alls issued since the backward opened

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


def note_dual(group) -> None:
    """A backward all-to-all is issued: the backward is open until the engine's final callback."""
    st = _state(group)
    st.duals += 1
    if not st.backward_open and _in_backward():
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
                raise monitor.break_(GroupError(
                    f"expert-parallel rank {g.rank}: the last backward raised after issuing {duals} of its {links} "
                    f"backward all-to-alls, so its peers are still waiting in the others. {ADVICE}", [g.rank]))
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
            monitor.break_(GroupError(f"expert-parallel rank {g.rank} raised {type(exc).__name__}: {exc}",
                                      [g.rank]))
            if hasattr(exc, "add_note"):
                exc.add_note(f"lancet-rt: this happened after the step's collectives had started, so the peers were "
                             f"told and the expert-parallel group is unusable now. {ADVICE}.")
        return False


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


# ------------------------------------------------------------------------------ the monitor
class GroupMonitor:
    """Sequence numbers, bounded waits and failure records of one :class:`lancet_rt.TorchGroup`.

    Args:
        group: the process group.
        rank, size: this rank and the group size.
        backend: the group's backend name.
        timeout_s: how long a rank waits in one collective before it raises :class:`PeerTimeout`.
    """

    def __init__(self, group, rank: int, size: int, backend: str, timeout_s: float):
        self.group, self.rank, self.size = group, rank, size
        self.issued = 0       # collectives issued on this group, in order (the same on every rank)
        self.exchanges = 0    # of which counts exchanges
        self.broken: Optional[GroupError] = None
        self.set_timeout(timeout_s)
        self._store = _group_store(group)
        self._gloo = _gloo_backend(group) if "gloo" in backend else None
        self._watchdog = "nccl" in backend  # the host never waits for NCCL collectives: a thread does
        self._fatal: Optional[GroupError] = None
        self._inflight: "collections.deque" = collections.deque()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._events_seen = 0
        self._published_at = -1
        if size > 1:
            self._put(f"who/{rank}", _process_identity())

    def set_timeout(self, timeout_s: float) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._timeout_td = datetime.timedelta(seconds=self.timeout_s)
        self._slice_td = datetime.timedelta(seconds=min(POLL_S, self.timeout_s))

    # ---------------------------------------------------------------- issuing and waiting
    def issue(self, what: str, launch: Callable[[], object]) -> "Watched":
        """Issue a collective (``launch()`` returns its work) with this group's bounds."""
        if self.broken is not None:
            raise GroupError(f"expert-parallel group unusable since an earlier failure: {self.broken}",
                             self.broken.ranks)
        self.issued += 1
        seq = self.issued
        if what == "counts exchange":
            self.exchanges += 1
        try:
            if self._gloo is not None:  # gloo's own operation timeout ends a pending receive by itself
                prev = self._gloo.options._timeout
                self._gloo._set_default_timeout(self._timeout_td)
                try:
                    work = launch()
                finally:
                    self._gloo._set_default_timeout(prev)
            else:
                work = launch()
        except Exception as exc:  # gloo refuses new work on a closed connection
            raise self.break_(self._lost(seq, what, exc)) from exc
        if self._watchdog:
            with self._lock:
                while self._inflight and self._inflight[0][2].is_completed():
                    self._inflight.popleft()
                self._inflight.append((seq, what, work, time.monotonic()))
            self._start_watchdog()
        return Watched(work, self, seq, what)

    def wait(self, work, seq: int, what: str) -> None:
        """Wait for ``work``: in slices on gloo, reading failure records between them."""
        if self._watchdog:
            try:
                self.block(work.wait)
            except GroupError:
                raise
            except Exception as exc:
                raise self.break_(self._lost(seq, what, exc)) from exc
            return
        started = None
        while True:
            try:
                work.wait(timeout=self._slice_td)
                return
            except Exception as exc:
                if work.is_completed():  # finished after the slice ended, or failed
                    try:
                        work.wait()
                        return
                    except Exception as real:
                        raise self.break_(self._lost(seq, what, real)) from real
                now = time.monotonic()
                if started is None:
                    started = now - POLL_S
                    self._publish_at(seq)
                err = self._peer_failure(seq, what)
                if err is None and now - started >= self.timeout_s:
                    err = self._timed_out(seq, what, now - started)
                if err is not None:
                    raise self.break_(err) from exc

    def block(self, call: Callable[[], object]):
        """Run a host-blocking call (a CUDA event synchronisation) that the watchdog can end by
        aborting the communicator; raises the watchdog's error if it did."""
        try:
            out = call()
        except Exception as exc:
            if self._fatal is not None:
                raise self._fatal from exc
            raise
        if self._fatal is not None:
            raise self._fatal
        return out

    # ---------------------------------------------------------------- failure records
    def break_(self, error: GroupError) -> GroupError:
        """Mark the group unusable and tell the peers (a record in the store); returns ``error``."""
        if self.broken is None:
            self.broken = error
            self._put(f"fail/{self.rank}", json.dumps({"ranks": error.ranks, "msg": str(error)[:2000],
                                                       "kind": type(error).__name__}))
            self._add("events", 1)
        return error

    def _peer_failure(self, seq: int, what: str) -> Optional[GroupError]:
        """A failure record of a peer (one store operation when there is none)."""
        events = self._add("events", 0)
        if events is None or events == self._events_seen:
            return None
        self._events_seen = events
        self._publish_at(seq, force=True)  # someone may be asking where everyone is
        return self._from_records(seq, what)

    def _from_records(self, seq: int, what: str, cause: str = "") -> Optional[GroupError]:
        """The error the peers' failure records describe, if any rank wrote one."""
        records = self._records()
        if not records:
            return None
        at_fault = sorted({r for rec in records.values() for r in rec["ranks"]})
        origin = {q: rec for q, rec in records.items() if q in rec["ranks"]}  # not ranks that gave up on others
        told = "; ".join(f"rank {q}: {rec['msg'].splitlines()[0][:600]}" for q, rec in sorted((origin or records).items()))
        if at_fault == [self.rank]:
            return PeerError(f"expert-parallel rank {self.rank} was reported as not answering while it waited in "
                             f"collective #{seq} ({what}) (by {told}){cause}. {ADVICE}", at_fault)
        timeout = all(rec.get("kind") == "PeerTimeout" for rec in records.values())
        return (PeerTimeout if timeout else PeerError)(
            f"expert-parallel rank(s) {at_fault} failed or stopped answering in the middle of a step; rank "
            f"{self.rank} was waiting in collective #{seq} ({what}) ({told}){cause}. {ADVICE}", at_fault)

    def _records(self) -> dict:
        out = {}
        for q in range(self.size):
            text = self._get(f"fail/{q}") if q != self.rank else None
            if text:
                try:
                    out[q] = json.loads(text)
                except ValueError:
                    out[q] = {"ranks": [q], "msg": text}
        return out

    def _timed_out(self, seq: int, what: str, waited: float) -> GroupError:
        known = self._from_records(seq, what)
        if known is not None:
            return known
        ranks, notes = self._roll_call(seq)
        who = f"rank(s) {ranks} stopped answering ({'; '.join(notes)})" if ranks else _unnamed(notes)
        return PeerTimeout(f"expert-parallel rank {self.rank} waited {waited:.1f} s (timeout {self.timeout_s:g} s, "
                           f"{env.TIMEOUT}) in collective #{seq} ({what}): {who}. {ADVICE}", ranks)

    def _lost(self, seq: int, what: str, exc: BaseException) -> GroupError:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        known = self._from_records(seq, what, f"; backend error: {cause}")
        if known is not None:
            return known
        ranks, notes = self._roll_call(seq)
        who = f"rank(s) {ranks} stopped answering ({'; '.join(notes)})" if ranks else _unnamed(notes)
        if "timed out" in cause.lower():  # gloo's operation timeout, set to the group's
            return PeerTimeout(f"collective #{seq} ({what}) timed out on expert-parallel rank {self.rank} (timeout "
                               f"{self.timeout_s:g} s, {env.TIMEOUT}): {who}. Backend error: {cause}. {ADVICE}", ranks)
        return PeerError(f"collective #{seq} ({what}) failed on expert-parallel rank {self.rank}: {who}. "
                         f"Backend error: {cause}. {ADVICE}", ranks)

    def _roll_call(self, seq: int) -> tuple[list, list]:
        """Which peers have not reached collective ``seq``, and why (exited, alive, failed)."""
        self._publish_at(seq, force=True)
        if self._add("events", 1) is None:
            where = "none found" if self._store is None else "unreachable: its host, often rank 0, may have died"
            return [], [f"the process group's store is {where}"]
        time.sleep(ROLL_CALL_S)  # peers blocked in a collective report where they are
        records = self._records()
        ranks, notes = [], []
        for q in range(self.size):
            if q == self.rank:
                continue
            if q in records:
                if q in records[q]["ranks"]:  # it failed itself (not a rank that gave up on another)
                    ranks.append(q)
                    notes.append(f"rank {q} failed: {records[q]['msg'].splitlines()[0][:300]}")
                continue
            state = _process_state(self._get(f"who/{q}"))
            at = self._get(f"at/{q}")
            reached = at is not None and int(at.split()[1]) >= seq
            if state == "exited":
                ranks.append(q)
                notes.append(f"rank {q}: its process has exited")
            elif not reached:
                ranks.append(q)
                where = f"last seen waiting in #{at.split()[0]}" if at else "no report"
                alive = ", its process is alive" if state == "alive" else ""
                notes.append(f"rank {q} has not reached collective #{seq} ({where}{alive})")
        return ranks, notes

    def _publish_at(self, seq: int, force: bool = False) -> None:
        if force or self._published_at != seq:
            self._published_at = seq
            self._put(f"at/{self.rank}", f"{seq} {self.issued}")

    # ---------------------------------------------------------------- NCCL watchdog
    def _start_watchdog(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="lancet-rt-watchdog", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while self.broken is None:
            time.sleep(POLL_S)
            with self._lock:
                while self._inflight and self._inflight[0][2].is_completed():
                    self._inflight.popleft()
                front = self._inflight[0] if self._inflight else None
            if front is None:
                continue
            seq, what, _work, since = front
            age = time.monotonic() - since
            if age < POLL_S:
                continue
            self._publish_at(seq)
            err = self._peer_failure(seq, what)
            if err is None and age >= self.timeout_s:
                err = self._timed_out(seq, what, age)
            if err is not None:
                log.error("lancet-rt: %s", err)  # before the abort: NCCL's error handling may end the process
                self._fatal = self.break_(err)
                _abort(self.group)
                return

    # ---------------------------------------------------------------- store access (never blocks)
    def _put(self, key: str, value: str) -> None:
        if self._store is not None:
            try:
                self._store.set(f"lancet_rt/{key}", value)
            except Exception:  # noqa: BLE001 - the store's host may be the rank that died
                pass

    def _add(self, key: str, n: int) -> Optional[int]:
        if self._store is None:
            return None
        try:
            return self._store.add(f"lancet_rt/{key}", n)
        except Exception:  # noqa: BLE001
            return None

    def _get(self, key: str) -> Optional[str]:
        if self._store is None:
            return None
        try:
            if not self._store.check([f"lancet_rt/{key}"]):
                return None
            return self._store.get(f"lancet_rt/{key}").decode()
        except Exception:  # noqa: BLE001
            return None


class Watched:
    """A collective's work whose ``wait()`` is bounded by its group's :class:`GroupMonitor`."""

    __slots__ = ("work", "monitor", "seq", "what")

    def __init__(self, work, monitor: GroupMonitor, seq: int, what: str):
        self.work, self.monitor, self.seq, self.what = work, monitor, seq, what

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        self.monitor.wait(self.work, self.seq, self.what)
        return True


def _unnamed(notes: list) -> str:
    return "no peer could be named" + (f" ({'; '.join(notes)})" if notes else "")


def _group_store(group):
    try:
        return dist.distributed_c10d._get_process_group_store(group)
    except Exception:  # noqa: BLE001 - a private API: without it, failures are found by timeout only
        return None


def _gloo_backend(group):
    try:
        backend = group._get_backend(torch.device("cpu"))
        backend.options._timeout  # noqa: B018 - the API the operation timeout needs
        return backend
    except Exception:  # noqa: BLE001
        return None


def _abort(group) -> None:
    try:
        dist.distributed_c10d._abort_process_group(group)
    except Exception as exc:  # noqa: BLE001
        log.error("lancet-rt: could not abort the communicator (%s); the process waits for the process group's "
                  "own timeout", exc)


# ------------------------------------------------------------------------------ processes
def _machine() -> Optional[str]:
    """This machine and PID namespace (two ranks with the same value can see each other's PIDs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{socket.gethostname()}:{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _proc_stat(pid: int) -> Optional[tuple[str, str]]:
    """(state, start time) of a process from /proc, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def _process_identity() -> str:
    stat = _proc_stat(os.getpid())
    return json.dumps({"machine": _machine(), "pid": os.getpid(), "start": stat[1] if stat else None})


def _process_state(identity: Optional[str]) -> Optional[str]:
    """"exited" or "alive" for a process on this machine, None when that cannot be told."""
    if not identity:
        return None
    who = json.loads(identity)
    if who["machine"] is None or who["machine"] != _machine():
        return None
    stat = _proc_stat(who["pid"])
    if stat is None or stat[0] == "Z" or (who["start"] is not None and stat[1] != who["start"]):
        return "exited"
    return "alive"
