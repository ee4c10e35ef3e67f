"""Traces of the schedule: every stage's stream, chunk, start and end, as Chrome/Perfetto JSON.

    with lancet_rt.tracing() as tr:
        loss = model(x).sum(); loss.backward()
    tr.save("trace.json")        # open in https://ui.perfetto.dev or chrome://tracing

On CPU spans use the wall clock; on CUDA they are pairs of events on the stream that runs them,
resolved when the trace is saved. When no trace is active every hook here is a cheap no-op.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Optional

import torch

_active: Optional["Trace"] = None


class _Span:
    __slots__ = ("name", "track", "args", "t0", "t1", "ev0", "ev1")

    def __init__(self, name, track, args):
        self.name, self.track, self.args = name, track, args
        self.t0 = self.t1 = None
        self.ev0 = self.ev1 = None

    def end(self) -> None:
        if self.ev1 is not None:
            self.ev1.record()
        else:
            self.t1 = time.perf_counter()


class Trace:
    """A recording of stage spans. Create it with :func:`tracing`."""

    def __init__(self):
        self.spans: list[_Span] = []
        self._links: list = []
        self.expert_loads: list = []  # (layer key, int64 [E] tensor) per batch (lancet_rt.routing.traces)
        self._lock = threading.Lock()
        self.origin = time.perf_counter()
        self._cuda_origin = None

    def begin(self, name: str, track: str, cuda: bool = False, **args) -> _Span:
        span = _Span(name, track, args)
        if cuda:
            if self._cuda_origin is None:
                self._cuda_origin = (torch.cuda.Event(enable_timing=True), time.perf_counter())
                self._cuda_origin[0].record()
            span.ev0 = torch.cuda.Event(enable_timing=True)
            span.ev1 = torch.cuda.Event(enable_timing=True)
            span.ev0.record()
        else:
            span.t0 = time.perf_counter()
        with self._lock:
            self.spans.append(span)
        return span

    def events(self) -> list[dict]:
        """The spans as Chrome trace events (microseconds since the trace began)."""
        if self._cuda_origin is not None:
            torch.cuda.synchronize()
        out = []
        for work, nbytes in self._links:
            name = getattr(work, "kind", None) or ("all_to_all" if nbytes else "exchange")
            issued = getattr(work, "issued", None)  # a real backend's collective (comm.channels.Transfer)
            if issued is not None and work.start is not None:
                out.append(self._event(name, "link issue", issued, work.start, {}))  # issued -> handed to the backend
            if work.start is not None and work.end is not None:
                out.append(self._event(name, "link", work.start, work.end, dict(bytes=nbytes or None)))
        for s in self.spans:
            if s.ev0 is not None:
                ref_ev, ref_t = self._cuda_origin
                t0 = ref_t + ref_ev.elapsed_time(s.ev0) * 1e-3
                t1 = ref_t + ref_ev.elapsed_time(s.ev1) * 1e-3
            elif s.t1 is not None:
                t0, t1 = s.t0, s.t1
            else:
                continue
            out.append(self._event(s.name, s.track, t0, t1, s.args))
        return sorted(out, key=lambda e: e["ts"])

    def _event(self, name, track, t0, t1, args):
        return dict(
            name=name,
            ph="X",
            pid=0,
            tid=track,
            ts=(t0 - self.origin) * 1e6,
            dur=max(t1 - t0, 0.0) * 1e6,
            args={k: v for k, v in args.items() if v is not None},
        )

    def save(self, path: str) -> None:
        """Write a Chrome/Perfetto trace JSON."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms"}, f)


@contextlib.contextmanager
def tracing(trace: Optional[Trace] = None):
    """Record every stage while the context is open; yields the :class:`Trace`.

    Args:
        trace: the recording to fill (a new :class:`Trace` by default). A subclass that overrides
            :meth:`Trace.begin` sees every stage's start (and, through the span it returns, its end)
            as it happens: how a profiler times the layer's stages without patching them.
    """
    global _active
    prev, _active = _active, Trace() if trace is None else trace
    # The context's own extent (track "tracing"): where a traced step ends, untraced work included
    # (a replay of the trace needs it); on CUDA it ends on the current stream.
    extent = _active.begin("tracing", "tracing", torch.cuda.is_available() and torch.cuda.is_initialized())
    try:
        yield _active
    finally:
        extent.end()
        _active = prev


def active() -> Optional[Trace]:
    return _active


def span(name: str, track: str = "compute", cuda: bool = False, **args):
    """A stage span on ``track`` (the compute stream unless said otherwise); no-op when not tracing
    (one shared null context: the layer opens several spans per chunk)."""
    t = _active
    return _NO_SPAN if t is None else _traced_span(t, name, track, cuda, args)


_NO_SPAN = contextlib.nullcontext()


@contextlib.contextmanager
def _traced_span(t, name: str, track: str, cuda: bool, args: dict):
    s = t.begin(name, track, cuda, **args)
    try:
        yield
    finally:
        s.end()


def record_link(work, nbytes: int) -> None:
    """Keep a CPU link transfer (an emulated one, or a real backend's collective with its issue time);
    its start and end are read when the trace is saved."""
    t = _active
    if t is not None:
        with t._lock:
            t._links.append((work, nbytes))


def record_expert_load(layer, load: torch.Tensor) -> None:
    """Keep a MoE layer's expert loads of one batch (read by ``RoutingTrace.from_trace``)."""
    t = _active
    if t is not None:
        with t._lock:
            t.expert_loads.append((id(layer), load))


def cuda_link_span(stream, nbytes: int) -> Optional[_Span]:
    """Begin a span on the current (communication) stream; the caller ends it."""
    t = _active
    if t is None:
        return None
    return t.begin("all_to_all" if nbytes else "exchange", "link", cuda=True, bytes=nbytes)
