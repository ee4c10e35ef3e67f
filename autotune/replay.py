"""dPRO-style replay: predict a step at other chunk counts and link bandwidths from a recorded trace.

    python -m lancet_rt.autotune.replay trace.json --chunks 1,2,4,8 --bandwidth-gbps 0.05,0.1,0.2

dPRO (Hu et al., MLSys 2022) replays a profiled step's operators along their dependencies to predict
the step under other configurations. Here the trace is one training step of
:class:`lancet_rt.Overlapped` recorded with :func:`lancet_rt.tracing` (on the emulated link, whose
transfers the trace records), and the replay rebuilds the step at N chunks on a link of bandwidth B:

1. **Parse** (:func:`parse_trace`). The forward's host time is attributed, chunk segment by chunk
   segment (the ``chunk c`` spans), to each MoE layer's stages: ``pre`` (attention, norms: up to the
   router), ``route`` (router and gating), ``permute`` (counts exchange hand-off, permute), ``issue``
   (starting the dispatch), ``experts`` (experts and starting the combine), ``post`` (unpermute,
   residual) and the chunk's ``tail``; waits on the link are not work. The backward's host time is
   split into the traced ``unpermute bwd``, ``experts bwd`` and deferred dW (``dW``,
   ``dW flush``) and the untraced rest. The link's transfers give each layer's bytes per token and
   the link model (``latency + bytes / bandwidth``, least squares).
2. **Scale.** Each stage's time summed over the chunks is known at the traced chunk count(s); at
   others it is interpolated piecewise-linearly between traced counts (the nearest two's line
   beyond them), and with a single trace it stays the traced total (per-chunk overheads are not
   seen). A chunk gets the share of its tokens. Backward work is each stage's forward time times
   the ratio measured for its kind (experts, post, the rest), deferred dW likewise.
3. **Replay** (:func:`replay`). The forward runs Overlapped's own scheduling rule
   (:func:`lancet_rt.schedule.overlap._next_chunk`, imported, with the gating-in-order wait of
   :meth:`lancet_rt.MoE._routing_state`) over each chunk's stage program on two resources: the host
   (computation) and the link, a FIFO. The backward runs the forward's creation order in reverse
   (the autograd engine's order on one device): each backward all-to-all is issued by its gradient's
   producer (the unpermute's backward, the experts' after their dX) and waited by its own node, which
   drains deferred dW meanwhile by the queue's own rule (:func:`lancet_rt.schedule.wgrad.best_fit` over whole
   items, one per stage holding weights); what is left is flushed at the end.

What it cannot see: contention for the CPU and the GIL between the link's thread and the
computation (and other processes), the link thread's wake-up delay, the expert load of other ranks
(a real collective ends with its slowest peer), and on a GPU the host's launch overheads and
host-boundness (the host time of a CUDA trace is taken as the compute stream's time), kernels of two
streams sharing the SMs, and NCCL's deviations from a linear link model. Traces on a real group carry
no link transfers (no bytes), so only traces on the emulated link replay.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from .profiling import LinkModel

#: Forward stages of one MoE layer, in the order a chunk runs them.
STAGES = ("pre", "route", "permute", "issue", "experts", "post")
#: Share of the experts' backward that is dW (2 of its 4 grouped GEMMs), run after the dispatch's
#: backward all-to-all has been issued when dW is not deferred.
EXPERTS_DW_SHARE = 0.5
_CHUNK_SPAN = re.compile(r"chunk (\d+)$")
_FWD = ("route", "permute", "dispatch", "experts", "combine", "unpermute")


# ----------------------------------------------------------------------------------------- parse
@dataclass
class TracedStep:
    """What one traced step holds, in ms (see the module docstring).

    Attributes:
        chunks: N of the traced step.
        layers: the MoE layers' trace names, in forward order.
        tokens: tokens of each chunk (at the first MoE layer).
        forward: ``{(layer index, stage): [ms per chunk]}``; the tail is ``(-1, "tail")``.
        glue_ms: forward host time outside the chunk segments (the scheduler, cutting, concatenation).
        segments: chunk segments of the forward (greenlet resumptions).
        backward: host time of the backward by part: ``post`` (unpermute bwd), ``experts``
            (experts bwd), ``dw`` (deferred dW, drained and flushed), ``rest`` (untraced).
        bytes: ``{(layer index, "dispatch" | "combine"): [off-rank bytes per chunk]}``.
        link_samples: (bytes, ms) of every link transfer.
        step_ms, forward_ms: the traced step and its forward.
        forward_waits_ms, backward_waits_ms: host time spent waiting on the link.
        deferred: whether dW was deferred (dW spans present).
    """

    chunks: int
    layers: list
    tokens: list
    forward: dict
    glue_ms: float
    segments: int
    backward: dict
    bytes: dict
    link_samples: list
    step_ms: float
    forward_ms: float
    forward_waits_ms: float
    backward_waits_ms: float
    deferred: bool

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)


def load_events(source) -> list:
    """Trace events (Chrome JSON, times in us) from a path, a :class:`lancet_rt.Trace`, a dict or a list."""
    if hasattr(source, "events"):
        return source.events()
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        with open(source) as f:
            source = json.load(f)
    if isinstance(source, dict):
        source = source.get("traceEvents")
    if not isinstance(source, list):
        raise ValueError("trace must be a path, a lancet_rt.Trace, {'traceEvents': [...]} or a list of events")
    return source


def _ms(e) -> tuple:
    return e["ts"] * 1e-3, (e["ts"] + e["dur"]) * 1e-3


def _overlap(a: float, b: float, spans: Sequence[tuple]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


def parse_trace(source) -> TracedStep:
    """Parse one training step's trace (see the module docstring).

    Raises:
        ValueError: if the trace is not one step of Overlapped (or a plain model) with lancet MoE
            layers on the emulated link, naming what is missing.
    """
    events = [e for e in load_events(source) if e.get("ph", "X") == "X"]
    extent = [e for e in events if e.get("tid") == "tracing"]
    if len(extent) != 1:
        raise ValueError("trace must hold one 'tracing' extent (recorded by lancet_rt.tracing() of this version)")
    t_start, t_end = _ms(extent[0])
    host = [e for e in events if e.get("tid") == "compute"]
    waits = [_ms(e) for e in events if e.get("tid") == "wait"]
    chunk_spans = sorted((e for e in host if _CHUNK_SPAN.match(e["name"])), key=lambda e: e["ts"])
    fwd = [e for e in host if e["name"] in _FWD]
    routes = [e for e in fwd if e["name"] == "route"]
    if not routes:
        raise ValueError("trace holds no MoE 'route' span: record a step of a model with lancet_rt.MoE layers")
    layers: list = []
    for e in sorted(routes, key=lambda e: e["ts"]):
        if e["args"].get("layer") not in layers:
            layers.append(e["args"].get("layer"))
    chunked = bool(chunk_spans)
    n = 1 + max(e["args"].get("chunk") or 0 for e in routes) if chunked else 1
    seen = {(e["args"].get("layer"), e["args"].get("chunk") or 0) for e in routes}
    if len(routes) != len(layers) * n or len(seen) != len(routes):
        raise ValueError(f"trace must hold one step: {len(routes)} route spans for {len(layers)} layers x {n} chunks")
    tokens = [0] * n
    for e in routes:
        if e["args"].get("layer") == layers[0]:
            if "tokens" not in e["args"]:
                raise ValueError("route spans carry no 'tokens' (trace recorded by an older lancet_rt)")
            tokens[e["args"].get("chunk") or 0] = int(e["args"]["tokens"])
    L = len(layers)
    unpermutes = [e for e in fwd if e["name"] == "unpermute"]
    forward_end = max(_ms(e)[1] for e in (chunk_spans or unpermutes))
    segments = [(*_ms(e), e["args"]["chunk"]) for e in chunk_spans] or [(t_start, forward_end, 0)]

    # Forward: each chunk segment's host time to the stage its chunk is in.
    forward = {(l, s): [0.0] * n for l in range(L) for s in STAGES}
    forward[(-1, "tail")] = [0.0] * n
    state = {c: (0, "pre") for c in range(n)}
    fwd_sorted = sorted(fwd, key=lambda e: e["ts"])
    for a, b, c in segments:
        marks = []
        for e in fwd_sorted:
            x, y = _ms(e)
            if x < a - 1e-9 or x > b + 1e-9:
                continue
            l = layers.index(e["args"].get("layer"))
            if e["name"] == "route":
                marks += [(x, (l, "route")), (y, (l, "permute"))]
            elif e["name"] == "dispatch":
                marks += [(x, (l, "issue")), (y, (l, "experts"))]
            elif e["name"] == "combine":
                marks.append((y, (l, "post")))
            elif e["name"] == "unpermute":
                marks.append((y, (l + 1, "pre") if l + 1 < L else (-1, "tail")))
        t = a
        for when, new in sorted(marks, key=lambda m: m[0]):
            when = min(max(when, t), b)
            forward[state[c]][c] += (when - t) - _overlap(t, when, waits)
            state[c], t = new, when
        forward[state[c]][c] += (b - t) - _overlap(t, b, waits)
    fwd_host = sum(sum(v) for v in forward.values())
    forward_waits = _overlap(t_start, forward_end, waits)
    glue = max(0.0, (forward_end - t_start) - forward_waits - fwd_host)

    # Backward: traced parts and the untraced rest.
    bwd_events = [e for e in host if _ms(e)[0] >= forward_end - 1e-9]
    traced = {"post": "unpermute bwd", "experts": "experts bwd", "dw": "dW", "flush": "dW flush"}
    part = {k: sum(_ms(e)[1] - _ms(e)[0] for e in bwd_events if e["name"] == name) for k, name in traced.items()}
    backward_waits = _overlap(forward_end, t_end, waits)
    busy = (t_end - forward_end) - backward_waits
    backward = dict(post=part["post"], experts=part["experts"], dw=part["dw"] + part["flush"],
                    rest=max(0.0, busy - part["post"] - part["experts"] - part["dw"] - part["flush"]))
    deferred = any(e["name"] == "dW" for e in bwd_events) or part["flush"] > 0

    # The link: forward all-to-alls (the first ones on the FIFO) to the dispatch/combine spans.
    link = sorted((e for e in events if e.get("tid") == "link"), key=lambda e: e["ts"])
    a2a = [e for e in link if e["name"] == "all_to_all"]
    issues = sorted((e for e in fwd if e["name"] in ("dispatch", "combine")), key=lambda e: e["ts"])
    if not link:
        raise ValueError("trace holds no link transfers: record it on lancet_rt.EmulatedGroup")
    if len(a2a) < len(issues) or len(issues) != 2 * L * n:
        raise ValueError(f"trace must hold a dispatch and a combine per layer and chunk ({2 * L * n}), and their "
                         f"transfers; got {len(issues)} spans, {len(a2a)} transfers (MoE(pipeline_chunks > 1)?)")
    nbytes = {(l, k): [0] * n for l in range(L) for k in ("dispatch", "combine")}
    for e, tr in zip(issues, a2a):
        c = _chunk_at(segments, e["ts"] * 1e-3)
        nbytes[(layers.index(e["args"].get("layer")), e["name"])][c] += int(tr["args"].get("bytes", 0))
    samples = [(int(e["args"].get("bytes", 0)), _ms(e)[1] - _ms(e)[0]) for e in link]
    return TracedStep(chunks=n, layers=layers, tokens=tokens, forward=forward, glue_ms=glue,
                      segments=len(chunk_spans), backward=backward, bytes=nbytes, link_samples=samples,
                      step_ms=t_end - t_start, forward_ms=forward_end - t_start, forward_waits_ms=forward_waits,
                      backward_waits_ms=backward_waits, deferred=deferred)


def _chunk_at(segments, t: float) -> int:
    for a, b, c in segments:
        if a - 1e-9 <= t <= b + 1e-9:
            return c
    return segments[-1][2]


# ------------------------------------------------------------------------------------- profile
@dataclass
class ReplayProfile:
    """The replay's model of the step, from one or more traced steps of the same batch.

    Attributes:
        layers: MoE layer names.
        tokens: tokens of the batch.
        totals: ``{(layer, stage): {chunks: ms}}``: each forward stage's time summed over the chunks,
            at each traced chunk count.
        glue_per_segment_ms: forward host time outside chunk segments, per segment.
        ratios: ``{kind: {chunks: ratio}}``: backward ms per forward ms of ``experts``, ``post`` and
            ``rest`` (the other stages).
        dw_ratio: ``{chunks: ratio}``: deferred dW ms per forward ms of the stages holding weights
            (``pre``, ``experts``).
        bytes_per_token: ``{(layer, "dispatch" | "combine"): off-rank bytes per token}``.
        link: the link model fitted to the traced transfers.
        deferred: whether dW is deferred.
        traced: ``{chunks: traced step ms}``.
    """

    layers: list
    tokens: int
    totals: dict
    glue_per_segment_ms: float
    ratios: dict
    dw_ratio: dict
    bytes_per_token: dict
    link: LinkModel
    deferred: bool
    traced: dict = field(default_factory=dict)

    def stage_ms(self, key, chunks: int, tokens: float) -> float:
        """A stage's time for a chunk of ``tokens`` when the batch is cut into ``chunks``: its total at
        ``chunks`` (piecewise linear through the traced counts, the nearest segment's line beyond
        them, flat with one) shared in proportion to the tokens."""
        return max(_interp(self.totals[key], chunks, extend=True), 0.0) * tokens / self.tokens if self.tokens else 0.0

    def ratio(self, kind: str, chunks: int) -> float:
        return _interp(self.ratios[kind], chunks)

    def dw(self, chunks: int) -> float:
        return _interp(self.dw_ratio, chunks)


def _interp(points: dict, x: float, extend: bool = False) -> float:
    """Piecewise-linear through ``{x: y}``; beyond the ends the nearest segment's line (``extend``)
    or the nearest value."""
    xs = sorted(points)
    if len(xs) == 1 or (not extend and (x <= xs[0] or x >= xs[-1])):
        return points[min(xs, key=lambda v: abs(v - x))]
    i = max(1, min(len(xs) - 1, next((k for k, v in enumerate(xs) if v >= x), len(xs) - 1)))
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def build_profile(steps: Sequence[TracedStep]) -> ReplayProfile:
    """Fit the replay's model (module docstring, step 2) to traced steps of one model and batch.

    Args:
        steps: at least one :class:`TracedStep`; at two or more chunk counts the replay interpolates
            between them (and extrapolates the nearest two beyond), at one it scales by tokens alone.
            Of several steps at one chunk count the fastest is kept (:func:`_fastest`).
    """
    steps = list(steps)
    if not steps:
        raise ValueError("steps must hold at least one traced step")
    first = steps[0]
    for s in steps[1:]:
        if s.layers != first.layers or s.total_tokens != first.total_tokens or s.deferred != first.deferred:
            raise ValueError("the traces must be steps of one model, batch and dW setting (layers, tokens, "
                             "deferral differ)")
    T = first.total_tokens
    steps = [_fastest(group) for group in _by_chunks(steps)]
    totals = {key: {s.chunks: sum(s.forward[key]) for s in steps} for key in first.forward}
    kinds = dict(experts=["experts"], post=["post"], rest=["pre", "route", "permute", "issue", "tail"])
    ratios, dw_ratio = {k: {} for k in kinds}, {}
    for s in steps:
        f = {k: sum(sum(v) for (l, st), v in s.forward.items() if st in kinds[k]) for k in kinds}
        for k in kinds:
            ratios[k][s.chunks] = s.backward[k] / f[k] if f[k] > 0 else 0.0
        f_w = sum(sum(v) for (l, st), v in s.forward.items() if st in ("pre", "experts"))
        dw_ratio[s.chunks] = s.backward["dw"] / f_w if f_w > 0 else 0.0
    segs = sum(s.segments for s in steps)
    glue = sum(s.glue_ms for s in steps if s.segments) / segs if segs else 0.0
    bpt = {k: statistics.fmean(sum(s.bytes[k]) for s in steps) / T if T else 0.0 for k in first.bytes}
    link = LinkModel.fit([p for s in steps for p in s.link_samples])
    return ReplayProfile(layers=list(first.layers), tokens=T, totals=totals, glue_per_segment_ms=glue,
                         ratios=ratios, dw_ratio=dw_ratio, bytes_per_token=bpt, link=link, deferred=first.deferred,
                         traced={s.chunks: s.step_ms for s in steps})


def _by_chunks(steps) -> list:
    groups: dict = {}
    for s in steps:
        groups.setdefault(s.chunks, []).append(s)
    return [groups[n] for n in sorted(groups)]


def _fastest(steps: Sequence[TracedStep]) -> TracedStep:
    """The fastest of several traced steps at one chunk count: load from elsewhere only ever slows a
    step, so the fastest is the steadiest record (as the benchmarks take the fastest step). Whole
    steps, not the fastest record of each stage: those would add up to a step faster than any."""
    return min(steps, key=lambda s: s.step_ms)


# -------------------------------------------------------------------------------------- replay
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
        profile: from :func:`build_profile`.
        chunks: N >= 1; chunk c gets ``tensor_split`` shares of the batch's tokens.
        gbps: link bandwidth, GB/s for off-rank bytes (``math.inf``: free).
        latency_ms: per-collective latency (default: the traced link's fit).
        counts_channel: "shared": the counts exchanges queue in the link's FIFO; "own": a channel of
            their own, latency only (``TorchGroup(counts_group=)``, ``EmulatedGroup(counts_channel="own")``).
    """
    from lancet_rt.schedule.overlap import _next_chunk  # the scheduler's own rule
    from lancet_rt.schedule.wgrad import best_fit  # the dW queue's own rule

    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    if counts_channel not in ("shared", "own"):
        raise ValueError(f"counts_channel must be 'shared' or 'own', got {counts_channel!r}")
    gbps = profile.link.gbps if gbps is None else float(gbps)
    latency_ms = profile.link.latency_ms if latency_ms is None else float(latency_ms)
    if not gbps > 0 or not latency_ms >= 0:
        raise ValueError(f"gbps must be > 0 and latency_ms >= 0, got {gbps}, {latency_ms}")
    n, L, T = chunks, len(profile.layers), profile.tokens
    tokens = [T // n + (c < T % n) for c in range(n)]
    link = _Link(gbps, latency_ms)
    counts = link if counts_channel == "shared" else _Link(gbps, latency_ms)  # latency only: no bytes
    clock = dict(host=0.0, work=0.0)
    created: list = []  # the forward's autograd nodes, in creation order
    routed = [0] * L

    def compute(ms, entry=None):
        clock["host"] += ms
        clock["work"] += ms
        if entry is not None:
            created.append(entry)

    def transfer(l, c, which):
        """Issue layer l's forward ``which`` all-to-all of chunk c (its autograd node is created)."""
        nbytes = profile.bytes_per_token[(l, which)] * tokens[c]
        created.append(("a2a", (l, c, which), nbytes))
        return link.issue(clock["host"], nbytes)

    def program(c):
        t = tokens[c]
        for l in range(L):
            pre = profile.stage_ms((l, "pre"), n, t)
            compute(pre, ("op", "pre", pre))
            while routed[l] != c:  # chunks pass the gating in order
                yield False
            route = profile.stage_ms((l, "route"), n, t)
            compute(route, ("op", "route", route))
            routed[l] += 1
            exchange = counts.issue(clock["host"], 0)
            yield True
            clock["host"] = max(clock["host"], exchange)
            for stage in ("permute", "issue"):
                ms = profile.stage_ms((l, stage), n, t)
                compute(ms, ("op", stage, ms))
            dispatch = transfer(l, c, "dispatch")
            yield False
            clock["host"] = max(clock["host"], dispatch)
            ms = profile.stage_ms((l, "experts"), n, t)
            compute(ms, ("op", "experts", ms, (l, c)))
            combine = transfer(l, c, "combine")
            yield False
            clock["host"] = max(clock["host"], combine)
            ms = profile.stage_ms((l, "post"), n, t)
            compute(ms, ("op", "post", ms, (l, c)))
        ms = profile.stage_ms((-1, "tail"), n, t)
        compute(ms, ("op", "tail", ms))

    # Forward: Overlapped.run_chunked's loop (N = 1 is the plain model: no scheduler, no yields).
    gens = [program(c) for c in range(n)]
    segments = 0
    if n == 1:
        for _ in gens[0]:
            pass
    else:
        live, last, yields = list(range(n)), None, 0
        waiting = {c: (-n + c, False) for c in range(n)}
        while live:
            c = last = _next_chunk(live, waiting, last)
            segments += 1
            compute(profile.glue_per_segment_ms)
            try:
                urgent = next(gens[c])
                yields += 1
                waiting[c] = (yields, urgent)
            except StopIteration:
                live.remove(c)
    forward_ms = clock["host"]

    # Backward: reverse creation order; all-to-alls issued by their gradient's producer, waited by
    # their own node, which drains deferred dW by the runtime's own rule (best fit, whole items).
    r, queue, bwd = {k: profile.ratio(k, n) for k in profile.ratios}, [], {}
    for entry in reversed(created):
        if entry[0] == "a2a":
            end = bwd.get(entry[1])
            if end is None:
                continue
            ran = 0
            while (i := best_fit(queue, end - clock["host"], ran)) is not None:
                compute(queue.pop(i))
                ran += 1
            clock["host"] = max(clock["host"], end)
            continue
        kind, ms = entry[1], entry[2]
        back = ms * r["experts" if kind == "experts" else "post" if kind == "post" else "rest"]
        if kind == "experts":
            l, c = entry[3]
            dx = back if profile.deferred else back * (1 - EXPERTS_DW_SHARE)
            compute(dx)
            bwd[(l, c, "dispatch")] = link.issue(clock["host"], profile.bytes_per_token[(l, "dispatch")] * tokens[c])
            compute(back - dx)
        elif kind == "post":
            l, c = entry[3]
            compute(back)
            bwd[(l, c, "combine")] = link.issue(clock["host"], profile.bytes_per_token[(l, "combine")] * tokens[c])
        else:
            compute(back)
        if profile.deferred and kind in ("pre", "experts"):
            queue.append(ms * profile.dw(n))  # one dW item per stage holding weights
    compute(sum(queue))  # the final flush
    return ReplayPrediction(chunks=n, gbps=gbps, latency_ms=latency_ms, step_ms=clock["host"], forward_ms=forward_ms,
                            compute_ms=clock["work"], comm_ms=link.busy, segments=segments)


def replay_traces(traces: Iterable, chunks: Sequence[int], bandwidths: Sequence[Optional[float]] = (None,),
                  latency_ms: Optional[float] = None, counts_channel: str = "shared") -> list:
    """Parse ``traces`` (paths or Trace objects), fit the profile and replay every (chunks, bandwidth)."""
    profile = build_profile([parse_trace(t) for t in traces])
    return [replay(profile, n, b, latency_ms, counts_channel) for b in bandwidths for n in chunks]


# ---------------------------------------------------------------------------------------- command
def _ints(text: str) -> list:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return out


def _floats(text: str) -> list:
    try:
        out = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or any(not v > 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return out


def main(argv=None) -> list:
    p = argparse.ArgumentParser(prog="python -m lancet_rt.autotune.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="trace JSON of one step each (lancet_rt.tracing(); two or more chunk "
                                             "counts of the same batch also fit the per-chunk overhead)")
    p.add_argument("--chunks", type=_ints, default=[1, 2, 4], help="chunk counts to predict (default 1,2,4)")
    p.add_argument("--bandwidth-gbps", type=_floats, default=None,
                   help="link bandwidths to predict, GB/s (default: the traced link's)")
    p.add_argument("--latency-us", type=float, default=None, help="link latency (default: the traced link's)")
    p.add_argument("--counts-channel", choices=("shared", "own"), default="shared",
                   help="the counts exchanges in the link's FIFO (default) or on a channel of their own")
    p.add_argument("--json", default=None, help="write the predictions here (a JSON list)")
    args = p.parse_args(argv)
    try:
        profile = build_profile([parse_trace(t) for t in args.traces])
    except (OSError, ValueError) as exc:
        p.exit(2, f"replay: {exc}\n")
    if args.latency_us is not None and not args.latency_us >= 0:
        p.error(f"--latency-us must be >= 0, got {args.latency_us}")
    lat = None if args.latency_us is None else args.latency_us * 1e-3
    preds = [replay(profile, n, b, lat, args.counts_channel) for b in (args.bandwidth_gbps or [None]) for n in args.chunks]
    print(f"replay of {len(args.traces)} trace(s): {len(profile.layers)} MoE layers, {profile.tokens} tokens, traced "
          + ", ".join(f"{n} chunk(s) {ms:.2f} ms" for n, ms in sorted(profile.traced.items()))
          + f"; link {profile.link.latency_ms * 1e3:.0f} us + bytes / {profile.link.gbps:.3g} GB/s"
          + (", deferred dW" if profile.deferred else ""))
    print(f"{'chunks':>6} {'GB/s':>9} {'step ms':>9} {'forward':>9} {'compute':>9} {'comm':>9}")
    for q in preds:
        print(f"{q.chunks:>6} {q.gbps:>9.3g} {q.step_ms:>9.2f} {q.forward_ms:>9.2f} {q.compute_ms:>9.2f} {q.comm_ms:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([q.__dict__ for q in preds], f, indent=1)
    return preds


if __name__ == "__main__":
    main(sys.argv[1:])
