"""Bounded waits and failure records of one expert-parallel process group (:class:`GroupMonitor`).

Every collective of a :class:`lancet_rt.TorchGroup` is issued and waited through its monitor. It
numbers the collectives (the same sequence on every rank), bounds each wait by the group's timeout,
writes this rank's failure to the process group's store and reads the peers' there, and, when a
peer is lost, names the ranks that did not reach the collective and says whether their process
exited (same machine) or is alive. :mod:`lancet_rt.comm.faults` describes the guarantees; README,
"Reliability", lists them.

gloo: the waiting thread waits in slices of :data:`POLL_S` and reads the store between them (one
store operation per slice, only in a wait that already lasted a slice); lancet's collectives are
issued with gloo's operation timeout set to the group's timeout, so a pending receive ends by
itself and the process can exit. NCCL: the host does not wait for collectives (the streams do), so
a watchdog thread follows the collectives in flight and, on a failure record or after the timeout,
logs the diagnosis and aborts the communicator, which ends the stuck kernels and wakes a host
blocked on the counts; the main thread then raises.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lancet_rt import env
from lancet_rt.comm import processes as _processes
from lancet_rt.comm.backend import abort as _abort
from lancet_rt.comm.backend import global_ranks as _global_ranks
from lancet_rt.comm.backend import gloo_backend as _gloo_backend
from lancet_rt.comm.backend import group_store as _group_store
from lancet_rt.comm.channels import Issuer, traced_transfer
from lancet_rt.comm.faults import ADVICE, CollectiveMismatch, GroupError, PeerError, PeerTimeout
from lancet_rt.comm.header import blocked_apart, header_row, mismatch

log = logging.getLogger("lancet_rt")

#: A rank blocked in a collective looks for failure records this often (seconds).
POLL_S = 0.1
#: After a collective failed or timed out, how long peers get to report where they are (seconds).
ROLL_CALL_S = 2 * POLL_S
#: With the header check off, a rank blocked this long looks where its peers are blocked, and again
#: this often (seconds): a peer in the same collective number of another kind is a mismatch.
LOOK_S = 2 * POLL_S


class GroupMonitor:
    """Sequence numbers, bounded waits and failure records of one :class:`lancet_rt.TorchGroup`.

    Args:
        group: the process group.
        rank, size: this rank and the group size.
        backend: the group's backend name.
        timeout_s: how long a rank waits in one collective before it raises :class:`PeerTimeout`.
        counts_group: the process group of the counts exchanges (None: ``group``); its collectives
            are numbered, bounded and aborted with ``group``'s.
        check_headers: compare every collective's (sequence number, kind, dtype, sizes) across the
            ranks before it is issued (:meth:`issue`; None: on for gloo, off for NCCL).
        header_device: where the header all-gather's tensors live (CUDA for NCCL; default CPU).
        channels: a split group's process groups (:mod:`lancet_rt.comm.channels`): headers on its control
            group, each collective checked and launched in issue order by the group's thread (``Issuer``);
            a mismatch is raised by the collective's wait (or the next issue) on every rank, nothing sent.

    Attributes:
        label: how messages name the group's ranks ("expert-parallel"; "data-parallel" for a group
            that only :mod:`lancet_rt.parallel` uses, :func:`lancet_rt.parallel.mesh.monitor`).
    """

    def __init__(
        self,
        group,
        rank: int,
        size: int,
        backend: str,
        timeout_s: float,
        counts_group=None,
        check_headers: Optional[bool] = None,
        header_device=None,
        channels=None,
    ):
        self.group, self.rank, self.size = group, rank, size
        self.channels = channels
        self.global_ranks = _global_ranks(group, size)  # group rank -> global rank, for messages
        self.label = "expert-parallel"
        # gloo: the header's host round trip costs what the collective's own wait costs; NCCL: a host sync, so off
        self.check_headers = env.check_headers(backend) if check_headers is None else bool(check_headers)
        self.header_device = torch.device("cpu") if header_device is None else header_device
        self.counts_group = group if counts_group is None else counts_group
        self.header_group = group if channels is None else channels.control
        self.issued = 0  # collectives issued on this group, in order (the same on every rank)
        self.exchanges = 0  # of which counts exchanges
        self.broken: Optional[GroupError] = None
        self.set_timeout(timeout_s)
        self._store = _group_store(group)
        self._gloo = _gloo_backend(group) if "gloo" in backend else None
        self._counts_gloo = _gloo_backend(self.counts_group) if "gloo" in backend else None
        self._nccl = "nccl" in backend  # the host never waits for NCCL collectives: the streams do
        self._watchdog = self._nccl and size > 1  # so a thread watches them (nothing to watch alone)
        self._fatal: Optional[GroupError] = None
        self._inflight: "collections.deque" = collections.deque()
        self._lock = threading.Lock()
        self._break_lock = threading.Lock()
        self._issuer, self._told = None, False  # (_told: the host has raised a failure of this group)
        # Run before the next collective, once (TorchGroup.split_at_first_use: building the split lanes)
        self._before_next: Optional[Callable[[], None]] = None
        self._before_lock = threading.Lock()
        if channels is not None:
            self.use_channels(channels)
        self._thread: Optional[threading.Thread] = None
        self._events_seen = 0
        self._published_at, self._published_what = -1, ""
        if size > 1:
            self._store.put(f"who/{rank}", _processes.identity())

    def use_channels(self, channels) -> None:
        """Carry this group's checked collectives on ``channels`` (a split group's process groups) from now
        on: headers on the control group, each collective checked and launched by the group's thread."""
        self.channels = channels
        self.header_group = self.counts_group = channels.control
        # each channel's gloo backend keeps the group's timeout as its operation timeout (set_timeout)
        self._gloo = self._counts_gloo = None
        self._issuer = Issuer(
            self._check_header, lambda fn, seq, what: self._launch(None, fn, seq, what), lambda: self.broken
        )
        self.set_timeout(self.timeout_s)

    def before_next(self, fn: Optional[Callable[[], None]]) -> None:
        """Run ``fn()`` before this group's next collective (:meth:`prepare`), on the thread that issues it."""
        self._before_next = fn

    def prepare(self, what: str = "collective") -> None:
        """Run what :meth:`before_next` left, once, as part of the next collective (``what``): a
        :class:`GroupError` it raises breaks the group (the peers read it in the store). Every collective of
        the monitor calls it first."""
        if self._before_next is None:
            return
        with self._before_lock:
            fn, self._before_next = self._before_next, None
            if fn is None:
                return
            self._refuse_if_broken()
            self._arriving = (self.issued + 1, what)
            self._publish_at(self.issued + 1, what=what)
            try:
                fn()
            except GroupError as exc:
                raise self.break_(exc) from None

    def watch_arrival(self, missing: list, waited: float) -> Optional[GroupError]:
        """While :meth:`prepare`'s work waits ``waited`` seconds for ``missing`` peers (a split built at the
        first collective), the error :meth:`wait` would raise in that collective: a peer's failure record,
        a peer whose process has exited, or the timeout with the roll call's diagnosis; None otherwise."""
        seq, what = self._arriving
        err = self._peer_failure(seq, what)
        if err is None and waited >= POLL_S:
            gone = [q for q in missing if _processes.state(self._store.get(f"who/{q}")) == "exited"]
            if gone:
                err = self.error(
                    PeerError,
                    f"{self.label} {self.names(gone)} failed or stopped answering before collective #{seq} "
                    f"({what}); {self.name(self.rank)} was waiting for it there "
                    f"({'; '.join(f'{self.name(q)}: its process has exited' for q in gone)}). {self._advice()}",
                    gone,
                )
        if err is None and waited >= self.timeout_s:
            err = self._timed_out(seq, what, waited)
        return err

    def _advice(self) -> str:
        return ADVICE.replace("expert-parallel", self.label, 1)

    # ---------------------------------------------------------------- naming ranks
    def to_global(self, qs) -> list:
        return [self.global_ranks[q] if 0 <= q < len(self.global_ranks) else q for q in qs]

    def name(self, q: int) -> str:
        """Group rank ``q`` as messages name it: its global rank (the process whose log to read), the
        group rank beside it where the two differ (a subgroup of a mesh)."""
        g = self.to_global([q])[0]
        return f"rank {g}" if g == q else f"rank {g} (group rank {q})"

    def names(self, qs) -> str:
        qs = sorted(qs)
        gs = self.to_global(qs)
        return f"rank(s) {gs}" if gs == qs else f"rank(s) {gs} (group rank(s) {qs})"

    def error(self, kind: type, message: str, ranks) -> GroupError:
        """A ``kind`` error blaming group ``ranks`` (``.global_ranks`` filled in)."""
        return kind(message, ranks, global_ranks=self.to_global(ranks))

    def set_timeout(self, timeout_s: float) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._timeout_td = datetime.timedelta(seconds=self.timeout_s)
        self._slice_td = datetime.timedelta(seconds=min(POLL_S, self.timeout_s))
        for g in self.channels.groups() if getattr(self, "channels", None) is not None else ():
            backend = _gloo_backend(g)
            if backend is not None:
                backend._set_default_timeout(self._timeout_td)

    # ---------------------------------------------------------------- issuing and waiting
    def issue(self, what: str, launch: Callable[[], object], header=None) -> "Watched":
        """Issue a collective (``launch()`` returns its work) with this group's bounds.

        ``header``: (dtype, elements sent to each rank, elements expected from each rank). With
        ``check_headers`` on, the ranks first all-gather (sequence number, kind, dtype, sizes) in a
        small fixed-size collective and every rank raises :class:`CollectiveMismatch` if they
        disagree, so mismatched messages never reach the backend (gloo aborts the process on them).
        """
        self.prepare(what)
        self._refuse_if_broken()
        self.issued += 1
        seq = self.issued
        if what == "counts exchange":
            self.exchanges += 1
        transfer = traced_transfer(what)
        checked = self.check_headers and self.size > 1 and header is not None
        if self._issuer is not None:
            work = self._issuer.submit(seq, what, launch, header if checked else None, transfer)
            return Watched(work, self, seq, what)
        gloo = self._counts_gloo if what == "counts exchange" else self._gloo
        if checked:
            self._check_header(seq, what, header)
        work = self._launch(gloo, launch, seq, what)
        if transfer is not None:
            transfer.started(work)
        if self._watchdog:
            with self._lock:
                while self._inflight and self._inflight[0][2].is_completed():
                    self._inflight.popleft()
                self._inflight.append((seq, what, work, time.monotonic()))
            self._start_watchdog()
        return Watched(work, self, seq, what)

    def check(self, what: str, header) -> None:
        """The header check of :meth:`issue` alone, numbered as a collective (gloo; nothing with
        ``check_headers`` off): every rank raises :class:`CollectiveMismatch` if the ranks' (sequence
        number, kind, dtype, sizes) differ. For a plan checked once before collectives issued
        unchecked, where waiting for the peers before each one could deadlock (gradient buckets)."""
        self.prepare(what)
        self._refuse_if_broken()
        if self.check_headers and self.size > 1:
            self.issued += 1
            if self._issuer is not None:  # in order with the collectives queued before it
                self.wait(self._issuer.submit(self.issued, what, None, header), self.issued, what)
                return
            self._check_header(self.issued, what, header)

    def _refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise self._raised(self.broken)

    def flush(self) -> None:
        """Return once every collective issued so far is on the backend (split groups; at once otherwise)."""
        if self._issuer is not None:
            self._issuer.flush()

    def _launch(self, gloo, launch: Callable[[], object], seq: int, what: str):
        try:
            if gloo is None:
                return launch()
            prev = gloo.options._timeout  # gloo's own operation timeout ends a pending receive by itself
            gloo._set_default_timeout(self._timeout_td)
            try:
                return launch()
            finally:
                gloo._set_default_timeout(prev)
        except RuntimeError as exc:  # gloo refuses new work on a closed connection (DistError)
            raise self.break_(self._lost(seq, what, exc)) from exc

    def _check_header(self, seq: int, what: str, header) -> None:
        """All-gather this collective's (seq, kind, dtype, sizes); CollectiveMismatch on every rank if they differ."""
        dtype, send, recv = header
        mine = torch.tensor(header_row(seq, what, dtype, send, recv), dtype=torch.int64, device=self.header_device)
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        # always on ``group`` (a counts exchange's header too): ranks issuing different kinds must still meet
        work = self._launch(
            self._gloo, lambda: dist.all_gather(rows, mine, group=self.header_group, async_op=True), seq, what
        )
        self.wait(work, seq, what)  # (the header is part of the collective: same number, same name)
        problem, ranks = mismatch(torch.stack(rows).cpu().tolist(), self.size, self.name)
        if problem:
            raise self.break_(
                self.error(
                    CollectiveMismatch,
                    f"collective #{seq} does not match across {self.label} ranks (seen on {self.name(self.rank)}): "
                    f"{problem}. The ranks ran different steps (a skipped backward, an extra forward or step, other "
                    f"shapes); nothing was sent. {self._advice()}",
                    ranks,
                )
            )

    @contextlib.contextmanager
    def bounded(self, what: str):
        """Around collectives that other code issues on this group (DCP's): numbered as one, each
        bounded by gloo's operation timeout set to this group's, and a failed one raised as the
        :class:`PeerError`/:class:`PeerTimeout` naming the lost ranks (NCCL: the process group's own
        timeout applies)."""
        self.prepare(what)
        if self.broken is not None:
            raise self.error(
                GroupError, f"process group unusable since an earlier failure: {self.broken}", self.broken.ranks
            )
        self.flush()  # (the collectives queued before these are on the backend first, on every rank)
        self.issued += 1
        seq = self.issued
        gloo = self._gloo if self._gloo is not None else _gloo_backend(self.group)
        prev = None if gloo is None else gloo.options._timeout
        if gloo is not None:
            gloo._set_default_timeout(self._timeout_td)
        try:
            yield
        except GroupError:
            raise
        except RuntimeError as exc:  # a collective failed or timed out (DCP wraps its own errors otherwise)
            raise self.break_(self._lost(seq, what, exc)) from exc
        finally:
            if gloo is not None:
                gloo._set_default_timeout(prev)

    def wait(self, work, seq: int, what: str) -> None:
        """Wait for ``work``: in slices on gloo, reading failure records between them."""
        if self._nccl or self._watchdog:
            try:
                self.block(work.wait)
            except GroupError:
                raise
            except RuntimeError as exc:
                raise self.break_(self._lost(seq, what, exc)) from exc
            return
        started = look = None
        while True:
            try:
                work.wait(timeout=self._slice_td)
                return
            except GroupError as exc:  # a split group's header check or launch failed (already broken)
                raise self._raised(exc) from exc
            except RuntimeError as exc:
                if work.is_completed():  # finished after the slice ended, or failed
                    try:
                        work.wait()
                        return
                    except GroupError as failed:
                        raise self._raised(failed) from failed
                    except RuntimeError as real:
                        raise self.break_(self._lost(seq, what, real)) from real
                now = time.monotonic()
                if started is None:
                    started, look = now - POLL_S, now - POLL_S + LOOK_S
                    self._publish_at(seq, what=what)
                err = self._peer_failure(seq, what)
                if err is not None and self._mismatch_only():
                    # A faster peer compared this collective's headers already; ours arrive too (every rank
                    # sent its row), and the comparison then raises the same CollectiveMismatch here.
                    err, look = None, now
                if err is None and not self.check_headers and now >= look:
                    err, look = self._blocked_apart(seq, what), now + 5 * LOOK_S
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

    def _raised(self, error: GroupError) -> GroupError:
        """``error`` itself if the issuer thread found it and the host raised no failure yet, else "unusable"."""
        if getattr(error, "_lancet_found_here", False) and not self._told:
            self._told = True
            return error
        return self.error(GroupError, f"{self.label} group unusable since an earlier failure: {error}", error.ranks)

    # ---------------------------------------------------------------- failure records
    def break_(self, error: GroupError) -> GroupError:
        """Mark the group unusable and tell the peers (a record in the store); returns ``error``."""
        with self._break_lock:  # (the issuer thread and the host may both find a failure)
            first = self.broken is None
            if first:
                self.broken = error
            if self._issuer is None or not self._issuer.on_thread():
                self._told = True  # (the host raises it, or its own exception, now)
        if first:
            self._store.put(
                f"fail/{self.rank}",
                json.dumps({"ranks": error.ranks, "msg": str(error)[:2000], "kind": type(error).__name__}),
            )
            self._store.add("events", 1)
        return error

    def _peer_failure(self, seq: int, what: str) -> Optional[GroupError]:
        """A failure record of a peer (one store operation when there is none)."""
        events = self._store.add("events", 0)
        if events is None or events == self._events_seen:
            return None
        self._events_seen = events
        self._publish_at(seq, force=True, what=what)  # someone may be asking where everyone is
        return self._from_records(seq, what)

    def _from_records(self, seq: int, what: str, cause: str = "") -> Optional[GroupError]:
        """The error the peers' failure records describe, if any rank wrote one."""
        records = self._records()
        if not records:
            return None
        at_fault = sorted({r for rec in records.values() for r in rec["ranks"]})
        origin = {q: rec for q, rec in records.items() if q in rec["ranks"]}  # not ranks that gave up on others
        told = "; ".join(
            f"{self.name(q)}: {rec['msg'].splitlines()[0][:600]}" for q, rec in sorted((origin or records).items())
        )
        if at_fault == [self.rank]:
            return self.error(
                PeerError,
                f"{self.label} {self.name(self.rank)} was reported as not answering while "
                f"it waited in collective #{seq} ({what}) (by {told}){cause}. {self._advice()}",
                at_fault,
            )
        if all(rec.get("kind") == "CollectiveMismatch" for rec in records.values()):
            # (a group-wide finding: whichever rank saw it first, every rank raises it, also one whose
            # collective was cut short by the finder's exit before its own check ran)
            return self.error(
                CollectiveMismatch,
                f"{self.label} ranks out of step: {told}; {self.name(self.rank)} was waiting in collective "
                f"#{seq} ({what}){cause}. {self._advice()}",
                at_fault,
            )
        timeout = all(rec.get("kind") == "PeerTimeout" for rec in records.values())
        return self.error(
            PeerTimeout if timeout else PeerError,
            f"{self.label} {self.names(at_fault)} failed or stopped answering in the middle of a step; "
            f"{self.name(self.rank)} was waiting in collective #{seq} ({what}) ({told}){cause}. {self._advice()}",
            at_fault,
        )

    def _blocked_apart(self, seq: int, what: str) -> Optional[GroupError]:
        """Header check off: a :class:`CollectiveMismatch` if a peer is blocked in collective ``seq`` of another
        kind (their ``at`` records: W - 1 store reads, in a wait that lasted :data:`LOOK_S`)."""
        problem, ranks = blocked_apart(
            self.rank, seq, what, [self._store.get(f"at/{q}") for q in range(self.size)], self.name
        )
        return (
            None
            if not problem
            else self.error(
                CollectiveMismatch,
                f"collective #{seq} does not match across {self.label} ranks (seen on {self.name(self.rank)}, header "
                f"check off): {problem}. The ranks ran different steps (a skipped backward, an extra forward or step), "
                f"so each waits for a collective the other never issues. {self._advice()}",
                ranks,
            )
        )

    def _mismatch_only(self) -> bool:
        records = self._records()
        return bool(records) and all(rec.get("kind") == "CollectiveMismatch" for rec in records.values())

    def _records(self) -> dict:
        out = {}
        for q in range(self.size):
            text = self._store.get(f"fail/{q}") if q != self.rank else None
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
        who = f"{self.names(ranks)} stopped answering ({'; '.join(notes)})" if ranks else _unnamed(notes)
        return self.error(
            PeerTimeout,
            f"{self.label} {self.name(self.rank)} waited {waited:.1f} s (timeout "
            f"{self.timeout_s:g} s, {env.TIMEOUT}) in collective #{seq} ({what}): {who}. "
            f"{self._advice()}",
            ranks,
        )

    def _lost(self, seq: int, what: str, exc: BaseException) -> GroupError:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        known = self._from_records(seq, what, f"; backend error: {cause}")
        if known is not None:
            return known
        ranks, notes = self._roll_call(seq)
        who = f"{self.names(ranks)} stopped answering ({'; '.join(notes)})" if ranks else _unnamed(notes)
        if any(w in cause.lower() for w in ("timed out", "timeout")):  # gloo's operation timeout (set to the group's)
            return self.error(
                PeerTimeout,
                f"collective #{seq} ({what}) timed out on {self.label} "
                f"{self.name(self.rank)} (timeout {self.timeout_s:g} s, {env.TIMEOUT}): {who}. Backend "
                f"error: {cause}. {self._advice()}",
                ranks,
            )
        return self.error(
            PeerError,
            f"collective #{seq} ({what}) failed on {self.label} {self.name(self.rank)}: "
            f"{who}. Backend error: {cause}. {self._advice()}",
            ranks,
        )

    def _roll_call(self, seq: int) -> tuple[list, list]:
        """Which peers have not reached collective ``seq``, and why (exited, alive, failed)."""
        self._publish_at(seq, force=True)
        if self._store.add("events", 1) is None:
            where = "none found" if self._store.store is None else "unreachable: its host, often rank 0, may have died"
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
                    notes.append(f"{self.name(q)} failed: {records[q]['msg'].splitlines()[0][:300]}")
                continue
            state = _processes.state(self._store.get(f"who/{q}"))
            at = self._store.get(f"at/{q}")
            reached = at is not None and int(at.split()[1]) >= seq
            if state == "exited":
                ranks.append(q)
                notes.append(f"{self.name(q)}: its process has exited")
            elif not reached:
                ranks.append(q)
                where = f"last seen waiting in #{at.split()[0]}" if at else "no report"
                alive = ", its process is alive" if state == "alive" else ""
                notes.append(f"{self.name(q)} has not reached collective #{seq} ({where}{alive})")
        return ranks, notes

    def _publish_at(self, seq: int, force: bool = False, what: str = "") -> None:
        """Where this rank waits: "seq issued what" (the kind: :meth:`_blocked_apart`)."""
        what = what or (self._published_what if seq == self._published_at else "")
        if force or self._published_at != seq:
            self._published_at, self._published_what = seq, what
            self._store.put(f"at/{self.rank}", f"{seq} {self.issued} {what}".rstrip())

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
            self._publish_at(seq, what=what)
            err = self._peer_failure(seq, what)
            if (
                err is None
                and not self.check_headers
                and age >= LOOK_S
                and (age < LOOK_S + POLL_S or int(age) > int(age - POLL_S))
            ):
                err = self._blocked_apart(seq, what)  # (after LOOK_S, then about once a second: W - 1 reads)
            if err is None and age >= self.timeout_s:
                err = self._timed_out(seq, what, age)
            if err is not None:
                log.error("lancet-rt: %s", err)  # before the abort: NCCL's error handling may end the process
                self._fatal = self.break_(err)
                _abort(self.group)
                if self.counts_group is not self.group:
                    _abort(self.counts_group)
                return


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
