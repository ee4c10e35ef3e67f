"""The replay's simulation: one step at N chunks on a link of bandwidth B, from a fitted profile.

Step 3 of :mod:`lancet_rt.autotune.replay` (its module docstring describes the rules): the forward
runs Overlapped's own scheduling rule over each chunk's stage program on the host and a FIFO link,
the backward runs the forward's creation order in reverse and drains deferred dW by the queue's own rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

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
    """

    chunks: int
    gbps: float
    latency_ms: float
    step_ms: float
    forward_ms: float
    compute_ms: float
    comm_ms: float
    segments: int = 0


class _Link:
    def __init__(self, gbps: float, latency_ms: float):
        self.gbps, self.latency_ms, self.free, self.busy = gbps, latency_ms, 0.0, 0.0

    def issue(self, now: float, nbytes: float) -> float:
        """Start a transfer at ``now`` (behind the ones in flight); returns its end."""
        ms = self.latency_ms + (0.0 if math.isinf(self.gbps) else nbytes / (self.gbps * 1e9) * 1e3)
        start = max(now, self.free)
        self.free = start + ms
        self.busy += ms
        return self.free


def replay(profile: ReplayProfile, chunks: int, gbps: Optional[float] = None,
           latency_ms: Optional[float] = None, counts_channel: str = "shared") -> ReplayPrediction:
    """Replay one step at ``chunks`` on a link of ``gbps`` (default: the traced link's fit).

    Args:
        profile: from :func:`lancet_rt.autotune.replay_profile.build_profile`.
        chunks: N >= 1; chunk c gets ``tensor_split`` shares of the batch's tokens.
        gbps: link bandwidth, GB/s for off-rank bytes (``math.inf``: free).
        latency_ms: per-collective latency (default: the traced link's fit).
        counts_channel: "shared": the counts exchanges queue in the link's FIFO; "own": a channel of
            their own, latency only (``TorchGroup(counts_group=)``, ``EmulatedGroup(counts_channel="own")``).

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
    sim = _Simulation(profile, chunks, gbps, latency_ms, counts_channel)
    segments = sim.forward()
    forward_ms = sim.host
    sim.backward()
    return ReplayPrediction(chunks=chunks, gbps=gbps, latency_ms=latency_ms, step_ms=sim.host, forward_ms=forward_ms,
                            compute_ms=sim.work, comm_ms=sim.link.busy, segments=segments)


class _Simulation:
    """One replayed step's state: the host clock, the links and the forward's autograd nodes."""

    def __init__(self, profile: ReplayProfile, n: int, gbps: float, latency_ms: float, counts_channel: str):
        self.profile, self.n = profile, n
        T = profile.tokens
        self.tokens = [T // n + (c < T % n) for c in range(n)]
        self.link = _Link(gbps, latency_ms)
        self.counts = self.link if counts_channel == "shared" else _Link(gbps, latency_ms)  # latency only: no bytes
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

    def transfer(self, l: int, c: int, which: str) -> float:
        """Issue layer l's forward ``which`` all-to-all of chunk c (its autograd node is created)."""
        nbytes = self.profile.bytes_per_token[(l, which)] * self.tokens[c]
        self.created.append(("a2a", (l, c, which), nbytes))
        return self.link.issue(self.host, nbytes)

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
            yield True
            self.wait(exchange)
            self.stage(l, "permute", c)
            self.stage(l, "issue", c)
            dispatch = self.transfer(l, c, "dispatch")
            yield False
            self.wait(dispatch)
            self.stage(l, "experts", c, (l, c))
            combine = self.transfer(l, c, "combine")
            yield False
            self.wait(combine)
            self.stage(l, "post", c, (l, c))
        self.stage(-1, "tail", c)

    def forward(self) -> int:
        """Overlapped.run_chunked's loop (N = 1 is the plain model: no scheduler, no yields); returns
        the scheduler's segments."""
        from lancet_rt.schedule.overlap import _next_chunk  # the scheduler's own rule

        n = self.n
        gens = [self.program(c) for c in range(n)]
        segments = 0
        if n == 1:
            for _ in gens[0]:
                pass
            return segments
        live, last, yields = list(range(n)), None, 0
        waiting = {c: (-n + c, False) for c in range(n)}
        while live:
            c = last = _next_chunk(live, waiting, last)
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
        from lancet_rt.schedule.wgrad import best_fit  # the dW queue's own rule

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
                bwd[(l, c, "dispatch")] = self._issue_backward(l, c, "dispatch")
                self.compute(back - dx)
            elif kind == "post":
                l, c = entry[3]
                self.compute(back)
                bwd[(l, c, "combine")] = self._issue_backward(l, c, "combine")
            else:
                self.compute(back)
            if profile.deferred and kind in ("pre", "experts"):
                queue.append(ms * profile.dw(n))  # one dW item per stage holding weights
        self.compute(sum(queue))  # the final flush

    def _issue_backward(self, l: int, c: int, which: str) -> float:
        """Issue the backward all-to-all of layer l's forward ``which`` of chunk c; returns its end."""
        return self.link.issue(self.host, self.profile.bytes_per_token[(l, which)] * self.tokens[c])
