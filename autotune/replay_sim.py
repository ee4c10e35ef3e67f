"""The replay's simulation: one step at N chunks on a link of bandwidth B, from a fitted profile.

Step 3 of :mod:`lancet_rt.autotune.replay` (its module docstring describes the rules): the forward
runs Overlapped's own scheduling rule over each chunk's stage program on the host and a FIFO link,
the backward runs the forward's creation order in reverse and drains deferred dW by the queue's own rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from lancet_rt.moe.dispatch.common import gives_counts_turn  # the layer's own rule
from lancet_rt.runtime.wgrad import best_fit  # the dW queue's own rule
from lancet_rt.schedule.overlap import next_chunk, not_started  # the scheduler's own rules

from .replay_profile import ReplayProfile

#: Share of the experts' backward that is dW (2 of its 4 grouped GEMMs), run after the dispatch's
#: backward all-to-all has been issued when dW is not deferred.
EXPERTS_DW_SHARE = 0.5


@dataclass(frozen=True)
class ReplayPrediction:
    """A replayed step.

    Attributes:
        chunks, gbps, latency_ms: the configuration.
        step_ms, forward_ms: predicted.
        compute_ms: the host's work (no waits).
        comm_ms: the link's busy time.
        segments: chunk resumptions of the forward's scheduler (0 at one chunk: no scheduler).
        straggler_ms: time returning all-to-alls waited for the hot rank's experts (0 without skew).
    """

    chunks: int
    gbps: float
    latency_ms: float
    step_ms: float
    forward_ms: float
    compute_ms: float
    comm_ms: float
    segments: int = 0
    straggler_ms: float = 0.0


@dataclass(frozen=True)
class Skew:
    """Skewed routing in the replay, as :class:`lancet_rt.comm.emulated_skew.SkewedGroup` models it.

    Attributes:
        port: the busiest port's bytes over rank 0's off-rank bytes (1: balanced); every all-to-all
            holds the link that much longer (less its latency).
        hot: the hottest rank's expert rows over rank 0's (1: balanced); a returning all-to-all (the
            combine, the dispatch's gradient) starts no earlier than its outbound transfer's end plus
            ``hot`` x this rank's experts stage (forward, or the backward's dX) for it; the hot rank is
            one device, running the chunks' work one after another from its outbound transfer's end.
    """

    port: float = 1.0
    hot: float = 1.0


class _Link:
    def __init__(self, gbps: float, latency_ms: float):
        self.gbps, self.latency_ms, self.free, self.busy = gbps, latency_ms, 0.0, 0.0
        self.held = 0.0  # time returning transfers waited for the hot rank (Skew)

    def issue(self, now: float, nbytes: float, not_before: float = 0.0) -> float:
        """Start a transfer at ``now`` (behind the ones in flight, not before ``not_before``); returns its end."""
        ms = self.latency_ms + (0.0 if math.isinf(self.gbps) else nbytes / (self.gbps * 1e9) * 1e3)
        start = max(now, self.free, not_before)
        self.held += start - max(now, self.free)
        self.free = start + ms
        self.busy += ms
        return self.free


def replay(
    profile: ReplayProfile,
    chunks: int,
    gbps: Optional[float] = None,
    latency_ms: Optional[float] = None,
    counts_channel: str = "shared",
    skew: Optional[Skew] = None,
) -> ReplayPrediction:
    """Replay one step at ``chunks`` on a link of ``gbps`` (default: the traced link's fit).

    Args:
        profile: from :func:`lancet_rt.autotune.replay_profile.build_profile`.
        chunks: N >= 1; chunk c gets ``tensor_split`` shares of the batch's tokens.
        gbps: link bandwidth, GB/s for off-rank bytes (``math.inf``: free).
        latency_ms: per-collective latency (default: the traced link's fit).
        counts_channel: "shared": the counts exchanges queue in the link's FIFO; "own": a channel of
            their own, latency only (``TorchGroup(counts_group=)``, ``EmulatedGroup(counts_channel="own")``).
        skew: skewed routing (:class:`Skew`); None: balanced, the replay as traced.

    Returns:
        The :class:`ReplayPrediction`.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    if counts_channel not in ("shared", "own"):
        raise ValueError(f"counts_channel must be 'shared' or 'own', got {counts_channel!r}")
    gbps = profile.link.gbps if gbps is None else float(gbps)
    latency_ms = profile.link.latency_ms if latency_ms is None else float(latency_ms)
    if not gbps > 0 or not latency_ms >= 0:
        raise ValueError(f"gbps must be > 0 and latency_ms >= 0, got {gbps}, {latency_ms}")
    sim = _Simulation(profile, chunks, gbps, latency_ms, counts_channel, skew or Skew())
    segments = sim.forward()
    forward_ms = sim.host
    sim.backward()
    return ReplayPrediction(
        chunks=chunks,
        gbps=gbps,
        latency_ms=latency_ms,
        step_ms=sim.host,
        forward_ms=forward_ms,
        compute_ms=sim.work,
        comm_ms=sim.link.busy,
        segments=segments,
        straggler_ms=sim.link.held,
    )


class _Simulation:
    """One replayed step's state: the host clock, the links and the forward's autograd nodes."""

    def __init__(
        self, profile: ReplayProfile, n: int, gbps: float, latency_ms: float, counts_channel: str, skew: Skew = Skew()
    ):
        self.profile, self.n, self.skew = profile, n, skew
        self.out_end: dict = {}  # (l, c) -> end of the backward's outbound transfer a returning one answers
        self.hot_free = 0.0  # when the hot rank's expert work queued so far is done
        T = profile.tokens
        self.tokens = [T // n + (c < T % n) for c in range(n)]
        self.link = _Link(gbps, latency_ms)
        self.counts = self.link if counts_channel == "shared" else _Link(gbps, latency_ms)  # latency only: no bytes

        # The host is the device here (the CPU's rule): with counts of their own it waits for them.
        self.counts_turn = gives_counts_turn("cpu", counts_channel)
        self.host = 0.0
        self.work = 0.0
        self.created: list = []  # the forward's autograd nodes, in creation order
        self.routed = [0] * len(profile.layers)

    def compute(self, ms: float, entry=None) -> None:
        """Run ``ms`` of host work, creating the autograd node ``entry`` if given."""
        self.host += ms
        self.work += ms
        if entry is not None:
            self.created.append(entry)

    def stage(self, l: int, stage: str, c: int, *extra) -> None:
        """Run chunk c's forward ``stage`` of layer l (its autograd node is created)."""
        ms = self.profile.stage_ms((l, stage), self.n, self.tokens[c])
        self.compute(ms, ("op", stage, ms, *extra))

    def transfer(self, l: int, c: int, which: str, not_before: float = 0.0) -> float:
        """Issue layer l's forward ``which`` all-to-all of chunk c (its autograd node is created)."""
        nbytes = self.profile.bytes_per_token[(l, which)] * self.tokens[c] * self.skew.port
        self.created.append(("a2a", (l, c, which), nbytes))
        return self.link.issue(self.host, nbytes, not_before)

    def hot_done(self, end: float, experts_ms: float) -> float:
        """When the hot rank's experts are done: from the outbound transfer's ``end`` (and its earlier work)."""
        if self.skew.hot == 1.0 and self.skew.port == 1.0:
            return 0.0
        self.hot_free = max(end, self.hot_free) + self.skew.hot * experts_ms
        return self.hot_free

    def wait(self, end: float) -> None:
        self.host = max(self.host, end)

    def program(self, c: int):
        """Chunk c's forward as a generator: yields (``urgent``) where Overlapped's chunk yields."""
        for l in range(len(self.profile.layers)):
            self.stage(l, "pre", c)
            while self.routed[l] != c:  # chunks pass the gating in order
                yield False
            self.stage(l, "route", c)
            self.routed[l] += 1
            exchange = self.counts.issue(self.host, 0)
            if self.counts_turn:
                yield True
            self.wait(exchange)
            self.stage(l, "permute", c)
            self.stage(l, "issue", c)
            dispatch = self.transfer(l, c, "dispatch")
            yield False
            self.wait(dispatch)
            self.stage(l, "experts", c, (l, c))
            experts_ms = self.created[-1][2]
            combine = self.transfer(l, c, "combine", self.hot_done(dispatch, experts_ms))
            yield False
            self.wait(combine)
            self.stage(l, "post", c, (l, c))
        self.stage(-1, "tail", c)

    def forward(self) -> int:
        """Overlapped.run_chunked's loop (N = 1 is the plain model: no scheduler, no yields); returns
        the scheduler's segments."""

        n = self.n
        gens = [self.program(c) for c in range(n)]
        segments = 0
        if n == 1:
            for _ in gens[0]:
                pass
            return segments
        live, last, yields = list(range(n)), None, 0
        waiting = not_started(n)
        while live:
            c = last = next_chunk(live, waiting, last)
            segments += 1
            self.compute(self.profile.glue_per_segment_ms)
            try:
                urgent = next(gens[c])
                yields += 1
                waiting[c] = (yields, urgent)
            except StopIteration:
                live.remove(c)
        return segments

    def backward(self) -> None:
        """Reverse creation order; all-to-alls issued by their gradient's producer, waited by their
        own node, which drains deferred dW by the runtime's own rule (best fit, whole items)."""

        profile, n = self.profile, self.n
        r, queue, bwd = {k: profile.ratio(k, n) for k in profile.ratios}, [], {}
        for entry in reversed(self.created):
            if entry[0] == "a2a":
                end = bwd.get(entry[1])
                if end is None:
                    continue
                ran = 0
                while (i := best_fit(queue, end - self.host, ran)) is not None:
                    self.compute(queue.pop(i))
                    ran += 1
                self.wait(end)
                continue
            kind, ms = entry[1], entry[2]
            back = ms * r["experts" if kind == "experts" else "post" if kind == "post" else "rest"]
            if kind == "experts":
                l, c = entry[3]
                dx = back if profile.deferred else back * (1 - EXPERTS_DW_SHARE)
                self.compute(dx)
                bwd[(l, c, "dispatch")] = self._issue_backward(
                    l, c, "dispatch", self.hot_done(self.out_end.get((l, c), 0.0), dx)
                )
                self.compute(back - dx)
            elif kind == "post":
                l, c = entry[3]
                self.compute(back)
                bwd[(l, c, "combine")] = self.out_end[(l, c)] = self._issue_backward(l, c, "combine")
            else:
                self.compute(back)
            if profile.deferred and kind in ("pre", "experts"):
                queue.append(ms * profile.dw(n))  # one dW item per stage holding weights
        self.compute(sum(queue))  # the final flush

    def _issue_backward(self, l: int, c: int, which: str, not_before: float = 0.0) -> float:
        """Issue the backward all-to-all of layer l's forward ``which`` of chunk c; returns its end."""
        nbytes = self.profile.bytes_per_token[(l, which)] * self.tokens[c] * self.skew.port
        return self.link.issue(self.host, nbytes, not_before)
