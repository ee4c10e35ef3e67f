"""One rank of ``bench.overlap --link real`` (bench.overlap.real): its view of the link and its timed step.

:class:`Rank` shapes its own port (bench.reallink), meets the other ranks at barriers of a group of its own, and
times one step of a schedule as :class:`Timing`: the slowest rank's wall time, its time outside its waits and
inside them (bench.overlap.real_waits), the machine's cores' shares, and with ``--loaded`` the bytes the traffic
beside sent (bench.reallink.traffic). :func:`timing_fields` names each figure in the row; :func:`step_bytes`
reads the busiest port's bytes of a sequential step and of its forward as the shaper counts them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist

from bench.common import wall_ms
from bench.overlap.real_runner import RealRunner
from bench.overlap.real_waits import WaitClock, cpu_shares, cpu_times, waited
from bench.reallink import link as reallink
from bench.reallink import traffic
from lancet_rt.trace import tracing


@dataclass
class Timing:
    """One timed step, each figure the slowest rank's, per microbatch except the forward's: its wall time; its
    time outside its waits (``computing_ms``, bench.overlap.real_waits) and inside the waits for the counts and
    for rows; the same until its forward ended (None for a schedule without one forward then one backward);
    the MB the traffic beside sent meanwhile (``--loaded``; None when it was off); and the machine's cores'
    shares over the step (every process's, :func:`bench.overlap.real_waits.cpu_shares`): idle, in interrupts and
    their soft handlers (the network stack's receive path runs there), and stolen by the hypervisor, the most any
    rank's window saw."""

    ms: float
    computing_ms: float
    counts_waits_ms: float
    rows_waits_ms: float
    forward_ms: Optional[float]
    forward_computing_ms: Optional[float]
    forward_counts_waits_ms: Optional[float]
    forward_rows_waits_ms: Optional[float]
    load_mb: Optional[float]
    cpu_idle: float
    cpu_irq: float
    cpu_steal: float


#: The :class:`Timing` figures given per microbatch (the others are the step's own).
PER_MICROBATCH = ("ms", "computing_ms", "counts_waits_ms", "rows_waits_ms", "load_mb")


class Rank:
    """A rank's view: its link (None on loopback), a group for the timing's own barriers, and with
    ``--loaded`` the traffic beside the steps (bench.reallink.traffic)."""

    def __init__(self, args):
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.link = reallink.rank_link()
        self.sync = dist.new_group(backend="gloo")
        self.rate: Optional[int] = None
        self.only_port: Optional[int] = None
        self.load = traffic.Load(self.rank, self.world) if args.loaded and self.link is not None else None

    def set_rate(self, rate_bps: Optional[int], loaded: bool = False) -> None:
        """Every rank shapes its port at ``rate_bps`` (None: unshaped), then they meet. ``loaded``: the rate
        binds only the traffic beside the steps, which then runs (the steps' own bytes pass unshaped)."""
        port = traffic.PORT if loaded else None
        if self.link is not None and (rate_bps, port) != (self.rate, self.only_port):
            if self.load is not None and self.only_port is not None:
                self.load.off()
            self.link.set_rate(rate_bps, only_port=port)
            if loaded:
                self.load.on()
        self.rate, self.only_port = rate_bps, port
        dist.barrier(self.sync)

    def slowest(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.sync)
        return float(t)

    def timed(self, runner: RealRunner, name: str) -> float:
        """One step of ``name`` from a barrier: the slowest rank's ms per microbatch (:meth:`step`)."""
        return self.step(runner, name).ms

    def step(self, runner: RealRunner, name: str) -> Timing:
        """One step of ``name`` from a barrier, every figure the slowest rank's (:class:`Timing`)."""
        loading = self.load is not None and self.only_port is not None
        clock = WaitClock()
        dist.barrier(self.sync)
        sent = self.load.sent() if loading else 0  # (after the barrier: its wait is no part of the step)
        t0, cpu0 = time.perf_counter(), cpu_times()
        with tracing(clock):
            ms = wall_ms(lambda: runner.step(name))
        cpu = cpu_shares(cpu0, cpu_times())
        t1, fwd_end, w = t0 + ms * 1e-3, runner.forward_end, clock.waits
        fig = dict(
            ms=ms,
            computing_ms=ms - waited(w, t0, t1) * 1e3,
            counts_waits_ms=waited(w, t0, t1, True) * 1e3,
            rows_waits_ms=waited(w, t0, t1, False) * 1e3,
            load_mb=(self.load.sent() - sent) / 1e6 if loading else None,
            cpu_idle=cpu["idle"],
            cpu_irq=cpu["irq"],
            cpu_steal=cpu["steal"],
        )
        if fwd_end is not None:  # (a schedule without one forward then one backward has none)
            fig["forward_ms"] = (fwd_end - t0) * 1e3
            fig["forward_computing_ms"] = fig["forward_ms"] - waited(w, t0, fwd_end) * 1e3
            fig["forward_counts_waits_ms"] = waited(w, t0, fwd_end, True) * 1e3
            fig["forward_rows_waits_ms"] = waited(w, t0, fwd_end, False) * 1e3
        fig = self._slowest_of({f.name: fig.get(f.name) for f in fields(Timing)})
        per = runner.per_step[name]
        return Timing(**{k: v / per if v is not None and k in PER_MICROBATCH else v for k, v in fig.items()})

    def _slowest_of(self, figures: dict) -> dict:
        """Each figure's largest value over the ranks (None, on every rank alike, stays None)."""
        t = torch.tensor([-1.0 if v is None else float(v) for v in figures.values()], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.sync)
        return {k: None if x < 0 else float(x) for k, x in zip(figures, t.tolist())}

    def tx_bytes(self) -> int:
        """Bytes this rank's interface has sent (its namespace's /proc/net/dev)."""
        dev = reallink.IFACE if self.link is not None else "lo"
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == dev:
                    return int(rest.split()[8])
        return 0


#: The row's name of each Timing figure per link: field -> (on the link, off it, with the traffic beside).
FIELDS = dict(
    ms=("{}_ms", "{}_compute_ms", "{}_loaded_ms"),
    forward_ms=("{}_forward_ms", "{}_forward_compute_ms", "{}_forward_loaded_ms"),
    computing_ms=("{}_computing_ms", "{}_computing_unshaped_ms", "{}_computing_loaded_ms"),
    forward_computing_ms=("{}_forward_computing_ms", "{}_forward_computing_unshaped_ms", None),
    counts_waits_ms=("{}_counts_waits_ms", None, None),
    rows_waits_ms=("{}_rows_waits_ms", None, None),
    forward_counts_waits_ms=("{}_forward_counts_waits_ms", None, None),
    forward_rows_waits_ms=("{}_forward_rows_waits_ms", None, None),
    load_mb=(None, None, "{}_load_mb"),
    cpu_idle=("{}_cpu_idle", "{}_cpu_idle_unshaped", "{}_cpu_idle_loaded"),
    cpu_irq=("{}_cpu_irq", "{}_cpu_irq_unshaped", "{}_cpu_irq_loaded"),
    cpu_steal=("{}_cpu_steal", None, None),
)


def timing_fields(n: str, runs: dict) -> dict:
    """Schedule ``n``'s row fields: the median over the rounds of each :class:`Timing` figure on each link
    (``runs``: link -> Timings), named as :data:`FIELDS` says (None where no step has it)."""
    out = {}
    for f in fields(Timing):
        for lk, name in zip(("shaped", "unshaped", "loaded"), FIELDS[f.name]):
            if name is None or lk not in runs:
                continue
            got = [getattr(t, f.name) for t in runs[lk] if getattr(t, f.name) is not None]
            out[name.format(n)] = statistics.median(got) if got else None
    return out


def step_bytes(runner: RealRunner, me: Rank) -> tuple[float, float]:
    """What the busiest port carries in one sequential step and in its forward (wire bytes as the shaper counts
    them, every segment's headers included: bench.reallink.link.RankLink.shaped_bytes; the busiest port of
    each), the forward's read once every rank's forward has ended (a barrier at its end: a send ends when the bytes
    are queued, so a rank ahead would miss some of its own). On the shaped link."""
    count = me.link.shaped_bytes
    at_forward_end: list = []

    def forward_end():  # once every rank's forward has ended, all of its bytes have passed the ports
        dist.barrier(me.sync)
        at_forward_end.append(count())

    runner.on_forward_end = forward_end
    before = count()
    try:
        me.timed(runner, "sequential")
    finally:
        runner.on_forward_end = None
    t = torch.tensor([count() - before, at_forward_end[0] - before], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=me.sync)
    return float(t[0]), float(t[1])
