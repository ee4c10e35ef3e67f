"""Split channels of a gloo expert-parallel group (:meth:`lancet_rt.TorchGroup.split`), and the
thread that issues its checked collectives off the host's path.

What a real link showed (bench.overlap --link real; docs): on one gloo process group,

- a send waits for the peer's ready-to-receive notice, and that notice travels on the same TCP stream
  as the peer's own data to us: the two directions of an all-to-all take turns (one all-to-all of
  8 MiB per peer reached about half the port's rate with both directions busy, plain sockets nearly
  all of it; bench/results/HISTORY.md);
- the header check before every collective (:meth:`GroupMonitor.issue`) and the counts exchanges
  queued behind the tokens in flight, and the header's all-gather blocked the host until every
  peer had reached the same collective, once per collective.

So a split group has four process groups of the same ranks: ``control`` (headers, counts exchanges,
small all-gathers), ``up`` and ``down`` (the tokens: on ``up`` only rows from a lower rank to a higher
one travel, on ``down`` only the reverse; each direction's ready notices ride the other's idle
stream), and ``bulk`` (lancet's all-reduces, broadcasts and reduces). An all-to-all is two gloo
collectives, one per lane (:func:`lane_all_to_all`). And one thread per group (:class:`Issuer`) runs
each checked collective's header all-gather and then launches it, in issue order: the host queues a
collective and goes on; a mismatch is still found before any payload reaches gloo, and is raised by
the collective's ``wait()`` (or the next issue) on every rank.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lancet_rt import env
from lancet_rt import trace as _trace
from lancet_rt.comm.backend import group_store
from lancet_rt.comm.faults import CollectiveMismatch, PeerTimeout


@dataclass
class Channels:
    """The process groups of a split expert-parallel group (module docstring)."""

    control: dist.ProcessGroup
    up: dist.ProcessGroup
    down: dist.ProcessGroup
    bulk: dist.ProcessGroup

    def groups(self) -> list:
        return [self.control, self.up, self.down, self.bulk]


def make_channels(group: dist.ProcessGroup, timeout_s: float, watch: Optional[Callable] = None) -> Channels:
    """Four gloo groups of ``group``'s ranks (a collective call: every rank of ``group``, same order).

    Every rank first checks in on ``group``'s store (:func:`_all_arrive`), so a rank that calls it alone
    gets a :class:`lancet_rt.comm.faults.PeerTimeout` naming the ranks that did not, after
    ``timeout_s``, instead of the gloo constructor's bare "Wait timeout".

    ``watch``: None for :meth:`lancet_rt.TorchGroup.split` (the user's call); for a group split at its first
    collective (:meth:`lancet_rt.TorchGroup.split_at_first_use`), ``watch(missing, waited_s)`` is asked while
    the peers are awaited and returns the error to raise (a peer's failure record, a peer whose process
    exited, the group's timeout) or None: a peer lost before the first collective is named as in any other."""
    import datetime

    ranks = dist.get_process_group_ranks(group)
    n = _all_arrive(group, ranks, timeout_s, watch)
    td = datetime.timedelta(seconds=timeout_s)
    try:
        made = [_new_group(ranks, td, f"lancet_rt_lanes_{getattr(group, 'group_name', '')}_{n}_{i}") for i in range(4)]
    except RuntimeError as exc:  # a peer that checked in and then stopped (died, or left the call)
        me = dist.get_rank(group)
        raise _split_timeout(
            me,
            ranks,
            [q for q in range(len(ranks)) if q != me],
            timeout_s,
            f"; backend error: {str(exc).strip()[:200]}",
            watch is not None,
        ) from None
    return Channels(*made)


def _new_group(ranks: list, timeout, name: str) -> dist.ProcessGroup:
    """A gloo group of ``ranks`` made by them alone (local synchronization), named ``name`` (the same on every
    rank: the split's parent group and attempt). torch.distributed would name it after the ranks and the count
    of groups the process holds, which differs between ranks that made other groups on subsets of them (a
    model on a subgroup of some ranks only), and then the group's rendezvous never meets; its private naming
    function is replaced for the call (where it is missing, torch's name: ``_all_arrive`` compares the counts)."""
    c10d = dist.distributed_c10d
    original = getattr(c10d, "_process_group_name", None)
    if original is None:
        return dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
    with _NAMING:
        c10d._process_group_name = lambda *args, **kwargs: name
        try:
            return dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
        finally:
            c10d._process_group_name = original


_NAMING = threading.Lock()

#: Seconds between two looks at the store while waiting for the peers of a split.
_ARRIVE_POLL_S = 0.05


def _all_arrive(group: dist.ProcessGroup, ranks: list, timeout_s: float, watch: Optional[Callable] = None) -> int:
    """Wait until every rank of ``group`` has entered its n-th split (n: this rank's count of splits
    entered, so a retry after a failed split does not meet the earlier attempt's marks), at most
    ``timeout_s``; a :class:`PeerTimeout` naming the ranks that did not otherwise (or ``watch``'s error).
    Returns n (0 without a store or alone)."""

    store = group_store(group)
    if store is None or len(ranks) == 1:
        return 0
    me = dist.get_rank(group)
    # without torch's naming function to replace (_new_group), a group is named after the count of groups its
    # process holds: the ranks must agree on it, or the groups' rendezvous never meet (a "Wait timeout")
    named = getattr(dist.distributed_c10d, "_process_group_name", None) is not None
    have = "any" if named else len(dist.distributed_c10d._world.pg_names)
    entered = store.add(f"lancet_rt/split/{me}", 0)
    if entered is None:  # (the store is unreachable: the groups' construction times out by itself)
        return 0
    n = entered + 1
    store.put(f"lancet_rt/split/{me}/{n}/groups", str(have))
    store.add(f"lancet_rt/split/{me}", 1)
    start = time.monotonic()
    while True:
        missing = [q for q in range(len(ranks)) if q != me and store.add(f"lancet_rt/split/{q}", 0) < n]
        waited = time.monotonic() - start
        if not missing:
            _same_group_counts(store, me, ranks, n, have)  # (first: every rank finds the same)
            # a peer that entered this split and gave up on it before we came wrote its failure record:
            # raise it here rather than wait for that peer in the groups' construction
            error = None if watch is None else watch([], waited)
            if error is not None:
                raise error
            return n
        if watch is not None:
            error = watch(missing, waited)
            if error is not None:
                raise error
        elif waited >= timeout_s:
            raise _split_timeout(me, ranks, missing, timeout_s, "")
        time.sleep(_ARRIVE_POLL_S)


def _same_group_counts(store, me: int, ranks: list, n: int, have: int) -> None:
    """A :class:`lancet_rt.comm.faults.CollectiveMismatch` on every rank if the ranks hold different numbers of
    process groups at their ``n``-th split (module note in :func:`_all_arrive`)."""
    counts = [have if q == me else store.get(f"lancet_rt/split/{q}/{n}/groups") for q in range(len(ranks))]
    if len({str(c) for c in counts}) == 1:
        return
    raise CollectiveMismatch(
        f"splitting the process group of ranks {ranks} (seen on rank {ranks[me]}): the ranks hold different numbers "
        f"of torch.distributed process groups ({', '.join(f'rank {r}: {c}' for r, c in zip(ranks, counts))}), so "
        f"the split's groups, named after that number, cannot meet. Create (and destroy) the same process groups "
        f"on every rank of the group before its first collective",
        list(range(len(ranks))),
        global_ranks=list(ranks),
    )


def _split_timeout(me: int, ranks: list, missing: list, timeout_s: float, cause: str, first_use: bool = False):
    names = [ranks[q] for q in missing]
    if first_use:
        text = (
            f"expert-parallel rank {ranks[me]}: rank(s) {names} of the group (ranks {ranks}) did not reach its first "
            f"collective within {timeout_s:g} s (timeout {timeout_s:g} s, {env.TIMEOUT}){cause}, where every rank "
            f"builds the group's split lanes ({env.EP_TRANSPORT}; 'plain' keeps the group as it is). The ranks ran "
            f"different steps (a rank that stopped or skipped its first step)"
        )
    else:
        text = (
            f"TorchGroup.split on rank {ranks[me]}: rank(s) {names} of the group (ranks {ranks}) did not join "
            f"within {timeout_s:g} s (timeout_s, or {env.TIMEOUT}){cause}. TorchGroup.split is a collective "
            f"call: call it on every rank of the group, in the same order"
        )
    return PeerTimeout(text, missing, global_ranks=names)


class Both:
    """Two collectives' works as one (the two lanes of an all-to-all)."""

    __slots__ = ("works",)

    def __init__(self, *works):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout=timeout)
        return True

    def get_future(self):
        return torch.futures.collect_all([w.get_future() for w in self.works])


def lane_all_to_all(
    ch: Channels,
    rank: int,
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
) -> Both:
    """All-to-all of rows as two gloo all-to-alls: rows to higher ranks (and our own) on ``ch.up``,
    rows to lower ranks on ``ch.down``. The rows from ranks <= ``rank`` are a prefix of ``output``
    and those to ranks >= ``rank`` a suffix of ``input``, so each lane moves contiguous views."""
    W = len(input_splits)
    below_in = sum(input_splits[:rank])  # rows to lower ranks
    upto_out = sum(output_splits[: rank + 1])  # rows from ranks <= rank
    zeros_lo, zeros_hi = [0] * rank, [0] * (W - rank - 1)
    up = dist.all_to_all_single(
        output[:upto_out],
        input[below_in:],
        list(output_splits[: rank + 1]) + zeros_hi,
        zeros_lo + list(input_splits[rank:]),
        group=ch.up,
        async_op=True,
    )
    down = dist.all_to_all_single(
        output[upto_out:],
        input[:below_in],
        zeros_lo + [0] + list(output_splits[rank + 1 :]),
        list(input_splits[:rank]) + [0] + zeros_hi,
        group=ch.down,
        async_op=True,
    )
    return Both(up, down)


class Transfer:
    """A collective as a trace shows it (:mod:`lancet_rt.trace`): issued by the host, started (handed to
    the backend, after its header check), ended (the backend reported it done); perf_counter() times."""

    __slots__ = ("kind", "issued", "start", "end")

    def __init__(self, kind: str):
        self.kind, self.issued, self.start, self.end = kind, time.perf_counter(), None, None

    def started(self, work) -> None:
        self.start = time.perf_counter()
        try:
            work.get_future().then(self._ended)
        except (RuntimeError, AttributeError):  # a work without a future: its end stays unknown
            pass

    def _ended(self, fut) -> None:
        self.end = time.perf_counter()


def traced_transfer(what: str) -> Optional[Transfer]:
    """A :class:`Transfer` recorded in the active trace (None when not tracing)."""

    if _trace.active() is None:
        return None
    transfer = Transfer(what)
    _trace.record_link(transfer, 0)
    return transfer


class Deferred:
    """A collective queued on an :class:`Issuer`: a work whose ``wait(timeout)`` first waits for the
    launch (a timeout raises RuntimeError, as gloo's does), then for the collective; a failed header
    check or launch raises its error (a :class:`lancet_rt.comm.faults.GroupError`)."""

    __slots__ = ("launched", "work", "error", "transfer")

    def __init__(self, transfer: Optional[Transfer] = None):
        self.launched = threading.Event()
        self.work = None
        self.error: Optional[BaseException] = None
        self.transfer = transfer

    def is_completed(self) -> bool:
        return self.launched.is_set() and (self.error is not None or self.work is None or self.work.is_completed())

    def wait(self, timeout=None) -> bool:
        t0 = time.monotonic()
        if not self.launched.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("timed out waiting for the collective's header check and launch")
        if self.error is not None:
            raise self.error
        if self.work is None:  # a header check alone
            return True
        if timeout is None:
            return self.work.wait()
        left = max(timeout.total_seconds() - (time.monotonic() - t0), 0.0)
        return self.work.wait(timeout=type(timeout)(seconds=left))


class Issuer:
    """One thread issuing a group's checked collectives in issue order: the header check (a blocking
    all-gather on the control group, bounded and watched by the monitor), then the launch.

    Args:
        check: ``check(seq, what, header)`` raises on a mismatch (every rank raises for the same one).
        launch: ``launch(fn, seq, what)`` hands a collective to the backend and returns its work.
        broken: returns the group's failure, if any (queued collectives then fail with it).
    """

    def __init__(self, check: Callable, launch: Callable, broken: Callable):
        self._check, self._launch, self._broken = check, launch, broken
        self._queue: "collections.deque" = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._thread: Optional[threading.Thread] = None

    def submit(
        self, seq: int, what: str, fn: Optional[Callable], header, transfer: Optional[Transfer] = None
    ) -> Deferred:
        """Queue collective ``seq`` (``fn()`` launches it; None: a header check alone)."""
        d = Deferred(transfer)
        with self._cv:
            self._queue.append((d, seq, what, fn, header))
            self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lancet-rt-issuer", daemon=True)
                self._thread.start()
        return d

    def on_thread(self) -> bool:
        """Whether the caller is this issuer's thread."""
        return threading.current_thread() is self._thread

    def flush(self) -> None:
        """Return once every queued collective has been launched (or failed)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._queue and not self._busy)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue)
                d, seq, what, fn, header = self._queue.popleft()
                self._busy = True
            try:
                broken = self._broken()
                if broken is not None:  # (a known failure: this collective is never launched)
                    d.error = broken
                    continue
                if header is not None:
                    self._check(seq, what, header)
                if fn is not None:
                    d.work = self._launch(fn, seq, what)
                    if d.transfer is not None:
                        d.transfer.started(d.work)
            except BaseException as exc:  # handed to the waiting thread
                exc._lancet_found_here = True  # the host has not seen it yet (GroupMonitor raises it once)
                d.error = exc
            finally:
                d.launched.set()
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
