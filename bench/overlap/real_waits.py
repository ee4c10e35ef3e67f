"""A step's time outside its waits on ``bench.overlap --link real``: the computation as the step ran it, on the
link or off it, with the CPU the bytes' transfer took from it included; and what the machine's cores did
meanwhile (:func:`cpu_shares`).

lancet's layers open a ``"wait"`` span around every wait for a collective (the counts, a dispatch or combine,
a backward dual); :class:`WaitClock` is a trace that keeps only those spans' intervals (every other span is a
no-op), and :func:`waited` is the time inside their union, so the step's time outside it is the time its
threads computed. ``accumulate``'s two threads take turns (one runs at a time, lancet_rt.runtime.beside), so a
wait of either is time neither computes. A peer's step opens no spans: all of it counts as computation."""

from __future__ import annotations

import time
from typing import Optional

from lancet_rt.trace import Trace


class _NoSpan:
    __slots__ = ()

    def end(self) -> None:
        pass


_NO_SPAN = _NoSpan()


class _Interval:
    __slots__ = ("clock", "t0", "counts")

    def __init__(self, clock: "WaitClock", counts: bool):
        self.clock, self.t0, self.counts = clock, time.perf_counter(), counts

    def end(self) -> None:
        # (an append is atomic: any thread may end one)
        self.clock.waits.append((self.t0, time.perf_counter(), self.counts))


class WaitClock(Trace):
    """A trace (``lancet_rt.tracing(WaitClock())``) that keeps each ``"wait"`` span's (start, end, whether it
    waited for the split sizes' counts exchange rather than rows), in ``time.perf_counter`` seconds, in
    :attr:`waits`."""

    def __init__(self):
        super().__init__()
        self.waits: list = []

    def begin(self, name: str, track: str, cuda: bool = False, **args):
        return _Interval(self, bool(args.get("counts"))) if name == "wait" else _NO_SPAN


def waited(waits: list, t0: float, t1: float, counts: Optional[bool] = None) -> float:
    """Seconds of [t0, t1] inside the union of the intervals ``waits`` (:attr:`WaitClock.waits`; ``counts``:
    only the counts' waits, or only the rows', where given)."""
    total, reach = 0.0, t0
    for a, b, c in sorted(waits):
        if counts is not None and c != counts:
            continue
        a, b = max(a, reach), min(b, t1)
        if b > a:
            total += b - a
            reach = b
    return total


def cpu_times() -> list:
    """The machine's CPU time so far, in ticks, per state (/proc/stat's ``cpu`` line: user, nice, system, idle,
    iowait, irq, softirq, steal, ...)."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:]]


def cpu_shares(before: list, after: list) -> dict:
    """The shares of the machine's cores between two :func:`cpu_times` (guest time is inside user time, so it is
    left out of the total): ``idle`` (idle and iowait), ``irq`` (hard and soft interrupts) and ``steal``."""
    d = [b - a for a, b in zip(before, after)][:8]
    total = sum(d)
    if total <= 0:
        return dict(idle=0.0, irq=0.0, steal=0.0)
    return dict(idle=(d[3] + d[4]) / total, irq=(d[5] + d[6]) / total, steal=d[7] / total)
