"""Parse a recorded step for the replay: the host time of each MoE layer's stages, per chunk.

Step 1 of :mod:`lancet_rt.autotune.replay` (its module docstring describes what is attributed
where): :func:`parse_trace` reads one training step of :class:`lancet_rt.Overlapped` recorded with
:func:`lancet_rt.tracing` on the emulated link into a :class:`TracedStep`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Sequence

from lancet_rt.jsonfile import read_json

#: Forward stages of one MoE layer, in the order a chunk runs them.
STAGES = ("pre", "route", "permute", "issue", "experts", "post")
_CHUNK_SPAN = re.compile(r"chunk (\d+)$")
_FWD = ("route", "permute", "dispatch", "experts", "combine", "unpermute")


@dataclass
class TracedStep:
    """What one traced step holds, in ms (see :mod:`lancet_rt.autotune.replay`).

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


def _path_of(source):
    """``source`` as a path name when it is one (str, bytes, os.PathLike), else None."""
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        return os.fsdecode(source)
    return None


def load_events(source) -> list:
    """Trace events (Chrome JSON, times in us) from a path, a :class:`lancet_rt.Trace`, a dict or a list.

    Raises:
        ValueError: the file or object is not a trace (from a path: the message starts with the path,
            whatever is wrong, :func:`lancet_rt.jsonfile.read_json`).
    """
    if hasattr(source, "events"):
        return source.events()
    path = _path_of(source)
    if path is not None:
        source = read_json(source)
    if isinstance(source, dict):
        source = source.get("traceEvents")
    if not isinstance(source, list) or not all(isinstance(e, dict) for e in source):
        what = "a path, a lancet_rt.Trace, {'traceEvents': [...]} or a list of events (objects)"
        raise ValueError(
            f"{path}: not a trace: expected {{'traceEvents': [...]}} or a list of events (objects)"
            if path is not None
            else f"trace must be {what}"
        )
    return source


def _ms(e) -> tuple:
    return e["ts"] * 1e-3, (e["ts"] + e["dur"]) * 1e-3


def _overlap(a: float, b: float, spans: Sequence[tuple]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


def parse_trace(source) -> TracedStep:
    """Parse one training step's trace (see :mod:`lancet_rt.autotune.replay`).

    Args:
        source: a trace path, a :class:`lancet_rt.Trace`, ``{"traceEvents": [...]}`` or a list of events.

    Returns:
        The :class:`TracedStep`.

    Raises:
        ValueError: if the trace is not one step of Overlapped (or a plain model) with lancet MoE
            layers on the emulated link, naming what is missing (and the file, from a path).
    """
    path = _path_of(source)
    try:
        return _parse_events(load_events(source))
    except (
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
        ArithmeticError,
    ) as exc:  # an event without a field it needs
        where = f"{path}: " if path is not None else ""
        raise ValueError(
            f"{where}not a lancet_rt.tracing() trace of one step (an event lacks a field or has one "
            f"of the wrong type: {type(exc).__name__} {exc})"
        ) from None
    except ValueError as exc:
        if path is None or str(exc).startswith(path):
            raise
        raise ValueError(f"{path}: {exc}") from None


def _parse_events(events: list) -> TracedStep:
    """:func:`parse_trace` on the events (any error names what is wrong, not the file)."""
    events = [e for e in events if e.get("ph", "X") == "X"]
    extent = [e for e in events if e.get("tid") == "tracing"]
    if len(extent) != 1:
        raise ValueError("trace must hold one 'tracing' extent (recorded by lancet_rt.tracing() of this version)")
    t_start, t_end = _ms(extent[0])
    host = [e for e in events if e.get("tid") == "compute"]
    waits = [_ms(e) for e in events if e.get("tid") == "wait"]
    chunk_spans = sorted((e for e in host if _CHUNK_SPAN.match(e["name"])), key=lambda e: e["ts"])
    fwd = [e for e in host if e["name"] in _FWD]
    layers, n, tokens = _layers_and_chunks(fwd, chunked=bool(chunk_spans))
    unpermutes = [e for e in fwd if e["name"] == "unpermute"]
    forward_end = max(_ms(e)[1] for e in (chunk_spans or unpermutes))
    segments = [(*_ms(e), e["args"]["chunk"]) for e in chunk_spans] or [(t_start, forward_end, 0)]

    forward = _forward_stages(fwd, layers, n, segments, waits)
    fwd_host = sum(sum(v) for v in forward.values())
    forward_waits = _overlap(t_start, forward_end, waits)
    glue = max(0.0, (forward_end - t_start) - forward_waits - fwd_host)
    backward, backward_waits, deferred = _backward_parts(host, forward_end, t_end, waits)
    nbytes, samples = _link_bytes(events, fwd, layers, n, segments)
    return TracedStep(
        chunks=n,
        layers=layers,
        tokens=tokens,
        forward=forward,
        glue_ms=glue,
        segments=len(chunk_spans),
        backward=backward,
        bytes=nbytes,
        link_samples=samples,
        step_ms=t_end - t_start,
        forward_ms=forward_end - t_start,
        forward_waits_ms=forward_waits,
        backward_waits_ms=backward_waits,
        deferred=deferred,
    )


def _layers_and_chunks(fwd: list, chunked: bool) -> tuple:
    """The MoE layers (forward order), the chunk count and each chunk's tokens, from the route spans,
    checked to be one step."""
    routes = [e for e in fwd if e["name"] == "route"]
    if not routes:
        raise ValueError("trace holds no MoE 'route' span: record a step of a model with lancet_rt.MoE layers")
    layers: list = []
    for e in sorted(routes, key=lambda e: e["ts"]):
        if e["args"].get("layer") not in layers:
            layers.append(e["args"].get("layer"))
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
    return layers, n, tokens


def _forward_stages(fwd: list, layers: list, n: int, segments: list, waits: list) -> dict:
    """Each chunk segment's host time (less the link waits) to the stage its chunk is in."""
    L = len(layers)
    forward = {(l, s): [0.0] * n for l in range(L) for s in STAGES}
    forward[(-1, "tail")] = [0.0] * n
    state = {c: (0, "pre") for c in range(n)}
    fwd_sorted = sorted(fwd, key=lambda e: e["ts"])
    for a, b, c in segments:
        marks = _stage_marks(fwd_sorted, layers, a, b)
        t = a
        for when, new in sorted(marks, key=lambda m: m[0]):
            when = min(max(when, t), b)
            forward[state[c]][c] += (when - t) - _overlap(t, when, waits)
            state[c], t = new, when
        forward[state[c]][c] += (b - t) - _overlap(t, b, waits)
    return forward


def _stage_marks(fwd_sorted: list, layers: list, a: float, b: float) -> list:
    """(time, (layer, stage) entered) of the forward spans starting within the segment [a, b]."""
    L = len(layers)
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
    return marks


def _backward_parts(host: list, forward_end: float, t_end: float, waits: list) -> tuple:
    """The backward's traced parts and its untraced rest, its link waits and whether dW was deferred."""
    bwd_events = [e for e in host if _ms(e)[0] >= forward_end - 1e-9]
    traced = {"post": "unpermute bwd", "experts": "experts bwd", "dw": "dW", "flush": "dW flush"}
    part = {k: sum(_ms(e)[1] - _ms(e)[0] for e in bwd_events if e["name"] == name) for k, name in traced.items()}
    backward_waits = _overlap(forward_end, t_end, waits)
    busy = (t_end - forward_end) - backward_waits
    backward = dict(
        post=part["post"],
        experts=part["experts"],
        dw=part["dw"] + part["flush"],
        rest=max(0.0, busy - part["post"] - part["experts"] - part["dw"] - part["flush"]),
    )
    deferred = any(e["name"] == "dW" for e in bwd_events) or part["flush"] > 0
    return backward, backward_waits, deferred


def _link_bytes(events: list, fwd: list, layers: list, n: int, segments: list) -> tuple:
    """The forward all-to-alls (the first ones on the FIFO) matched to the dispatch/combine spans:
    off-rank bytes per layer, kind and chunk, and (bytes, ms) of every link transfer."""
    L = len(layers)
    link = sorted((e for e in events if e.get("tid") == "link"), key=lambda e: e["ts"])
    a2a = [e for e in link if e["name"] == "all_to_all"]
    issues = sorted((e for e in fwd if e["name"] in ("dispatch", "combine")), key=lambda e: e["ts"])
    if not link:
        raise ValueError("trace holds no link transfers: record it on lancet_rt.EmulatedGroup")
    if len(a2a) < len(issues) or len(issues) != 2 * L * n:
        raise ValueError(
            f"trace must hold a dispatch and a combine per layer and chunk ({2 * L * n}), and their "
            f"transfers; got {len(issues)} spans, {len(a2a)} transfers (MoE(pipeline_chunks > 1)?)"
        )
    nbytes = {(l, k): [0] * n for l in range(L) for k in ("dispatch", "combine")}
    for e, tr in zip(issues, a2a):
        c = _chunk_at(segments, e["ts"] * 1e-3)
        nbytes[(layers.index(e["args"].get("layer")), e["name"])][c] += int(tr["args"].get("bytes", 0))
    samples = [(int(e["args"].get("bytes", 0)), _ms(e)[1] - _ms(e)[0]) for e in link]
    return nbytes, samples


def _chunk_at(segments, t: float) -> int:
    for a, b, c in segments:
        if a - 1e-9 <= t <= b + 1e-9:
            return c
    return segments[-1][2]
