"""What the cost model (:mod:`lancet_rt.autotune.cost_model`) is fed: profiled computation and the link.

What is profiled (:class:`Profiler`, :meth:`LinkModel.measure`):

- **Computation**, on a zero-cost link (every MoE layer's group swapped for an
  ``EmulatedGroup(W, inf, 0)`` of the same world size, so the same rows reach the same local
  experts): the step time (forward + backward) at 1, 2 and 4 chunks, ``C(N)``, and one traced step at
  1 chunk that cuts the forward into stages per MoE layer (``pre``: from the previous layer's output
  to the dispatch, i.e. attention, norms, router, gating, permute and the counts exchange's hand-off;
  ``issue``: starting the dispatch; ``experts``: until the combine is started; ``post``: unpermute and
  the residual) and gives each layer's off-rank bytes per all-to-all. With deferred weight
  gradients, the deferred dW work (the queue's final flush on the zero-cost link) is timed too. The
  ``lancet-autotune`` command times these probes in the same interleaved rounds as the candidates,
  so load from other processes hits profile and measurement alike.
- **The link**: all-to-alls of a few sizes timed on the real group, fitted as
  ``latency + bytes / bandwidth`` (least squares), as Lancet interpolates its a2a profile.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

import lancet_rt
from lancet_rt import trace as _trace


# ---------------------------------------------------------------------------------------- the link
@dataclass(frozen=True)
class LinkModel:
    """Time of one all-to-all as ``latency_ms + off-rank bytes / bandwidth``.

    Attributes:
        latency_ms: the fixed cost of one collective (including the host hand-off).
        gbps: bandwidth in GB/s (1e9 bytes/s) for off-rank bytes; ``math.inf`` for a free link.
        samples: the (bytes, ms) points it was fitted to, for the record.
    """

    latency_ms: float
    gbps: float
    samples: tuple = ()

    def time_ms(self, nbytes: float) -> float:
        """Modeled time of one all-to-all moving ``nbytes`` off rank."""
        if math.isinf(self.gbps):
            return self.latency_ms
        return self.latency_ms + nbytes / (self.gbps * 1e9) * 1e3

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> "LinkModel":
        """Least-squares fit of ``ms = a + b * bytes`` to (bytes, ms) points.

        Args:
            samples: at least one point; with a single byte size only the latency is fitted.

        Returns:
            A :class:`LinkModel` with ``latency_ms = max(a, 0)`` and ``gbps = 1e-6 / b`` (inf if b <= 0).
        """
        pts = [(float(b), float(ms)) for b, ms in samples]
        if not pts:
            raise ValueError("samples must hold at least one (bytes, ms) point")
        xs = [b for b, _ in pts]
        mx = statistics.fmean(xs)
        my = statistics.fmean(ms for _, ms in pts)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in pts) / var if var > 0 else 0.0
        latency = my - slope * mx
        return cls(latency_ms=max(latency, 0.0), gbps=1e-6 / slope if slope > 0 else math.inf, samples=tuple(pts))

    @classmethod
    def measure(
        cls,
        group,
        *,
        device,
        dtype=torch.float32,
        row_elems: int = 1024,
        nbytes: Sequence[int] = (0, 1 << 20, 4 << 20),
        warmup: int = 1,
        reps: int = 5,
        agree=None,
    ) -> "LinkModel":
        """Time all-to-alls of a few sizes on ``group`` and fit the model.

        Every rank of a real group must call this at the same time with the same arguments (it runs
        collectives). The all-to-all sends the same number of rows to every rank; ``nbytes`` counts
        the off-rank bytes, as the emulated link and the MoE layer's traces do.

        Args:
            group: an :class:`lancet_rt.ExpertParallelGroup` (``moe.group``).
            device: where the buffers live (CUDA for NCCL).
            dtype: the rows' dtype.
            row_elems: elements per row.
            nbytes: target off-rank bytes per sample (rounded to whole rows per rank).
            warmup: untimed transfers per size before the timed ones.
            reps: timed repetitions per size, after the warm-up; the fastest counts (load from
                elsewhere only ever slows a transfer, so the minimum is the steadiest estimate, and
                the measured bandwidth, part of the cache key, stays put from run to run).
            agree: optional ``callable(list[float]) -> list[float]`` that makes the timings identical on
                every rank (for example an all-reduce max), so every rank fits the same model.

        Returns:
            The fitted :class:`LinkModel`.
        """
        if reps < 1:
            raise ValueError(f"reps must be >= 1, got {reps}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        W = group.size
        device = torch.device(device)
        row_bytes = torch.empty((), dtype=dtype).element_size() * row_elems
        points = []
        for target in nbytes:
            per_rank = max(1, round(target / (row_bytes * max(W - 1, 1))))
            splits = [per_rank] * W
            x = torch.randn(per_rank * W, row_elems, device=device).to(dtype)
            out = torch.empty_like(x)
            times = []
            for i in range(warmup + reps):
                _sync(device)
                t0 = time.perf_counter()
                group.all_to_all(out, x, splits, splits).wait()
                _sync(device)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            points.append(((W - 1) * per_rank * row_bytes, min(times)))
        if agree is not None:
            agreed = agree([ms for _, ms in points])
            points = [(b, ms) for (b, _), ms in zip(points, agreed)]
        return cls.fit(points)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def zero_cost_link(layers: Sequence[lancet_rt.MoE]):
    """Swap every MoE layer's group for a free emulated link of the same world size, then restore.

    The emulated world is symmetric, so each local expert gets the same rows as on the real group;
    what remains is computation (plus the link's host hand-off). Layers without a group are left alone.
    """
    saved = []
    free: dict = {}
    try:
        for m in layers:
            if m.group is not None and m.ep_size > 1:
                dev = m.router.weight.device
                key = (m.ep_size, str(dev))
                if key not in free:
                    free[key] = lancet_rt.EmulatedGroup(m.ep_size, math.inf, 0.0, device=dev)
                saved.append((m, m.group))
                m.group = free[key]
        yield
    finally:
        for m, g in saved:
            m.group = g


# ---------------------------------------------------------------------------------------- profile
@dataclass(frozen=True)
class LayerStages:
    """One MoE layer's forward at 1 chunk, in ms on a zero-cost link (see the module docstring).

    Attributes:
        pre, issue, experts, post: stage times.
        dispatch_bytes, combine_bytes: off-rank bytes of its two all-to-alls at 1 chunk.
    """

    pre: float
    issue: float
    experts: float
    post: float
    dispatch_bytes: int
    combine_bytes: int


@dataclass(frozen=True)
class ComputeProfile:
    """What the cost model knows about the computation.

    Attributes:
        step1_ms: C(1), the step (forward + backward) at 1 chunk on a zero-cost link.
        overhead_per_chunk_ms: o, the least-squares slope of C(N) over the profiled chunk counts
            (clamped at 0).
        points: {N: C(N)} of the compute-only profiles it was fitted to.
        forward_ms: the traced step's forward, rescaled so forward + backward = ``step1_ms``.
        layers: per MoE layer call, in forward order.
        tail_ms: forward after the last MoE layer.
        dw_ms: deferred dW work of one step at 1 chunk (0 without deferral).
        world_size: W of the MoE layers' groups (1: no communication).
        statistic: how repeated steps were summarised ("median" or "min").
    """

    step1_ms: float
    overhead_per_chunk_ms: float
    points: dict
    forward_ms: float
    layers: tuple
    tail_ms: float
    dw_ms: float
    world_size: int
    statistic: str = "median"
    raw: dict = field(default_factory=dict, compare=False)

    @property
    def backward_ms(self) -> float:
        return self.step1_ms - self.forward_ms

    @property
    def max_bytes(self) -> int:
        return max([max(s.dispatch_bytes, s.combine_bytes) for s in self.layers] or [0])


STATISTICS = {"median": statistics.median, "min": min}


class Profiler:
    """Compute-only probes of a step (every MoE group swapped for a zero-cost link) for the cost model.

    The probes are plain callables, so they can be timed in the same interleaved rounds as the
    candidates themselves (:func:`lancet_rt.autotune.search.search` ``probes=``): load from other processes
    then hits the profile and the measurement alike. :meth:`build` turns their times into a
    :class:`ComputeProfile`; :func:`profile_compute` does it all on its own.

    Args:
        runner: an :class:`lancet_rt.autotune.search.StepRunner`.
        layers: the model's MoE layers.
        wgrad_queue: the Overlapped model's deferred-dW queue, if ``defer_wgrad``: its final flush is
            timed at 1 chunk (on a free link every deferred dW runs there).
    """

    def __init__(self, runner, layers: Sequence[lancet_rt.MoE], *, wgrad_queue=None):
        self.runner, self.layers, self.wgrad_queue = runner, list(layers), wgrad_queue
        self.dw_samples: list[float] = []
        self._trace = None

    def step(self, n: int) -> None:
        """One compute-only step (forward + backward) at ``n`` chunks."""
        out = self.dw_samples if n == 1 else []
        with zero_cost_link(self.layers), _timing_flush(self.wgrad_queue, self.runner.device, out):
            self.runner(n)

    def probes(self, chunk_counts: Sequence[int]) -> dict:
        """``{("compute", n): callable}`` for :func:`lancet_rt.autotune.search.search`'s ``probes``."""
        return {("compute", n): (lambda n=n: self.step(n)) for n in chunk_counts}

    def trace(self) -> None:
        """Time the stages of one compute-only step at 1 chunk (after warm-up) to cut the forward."""
        device = self.runner.device
        with zero_cost_link(self.layers), _StageClock(self.layers, device) as clock:
            _sync(device)
            t0 = time.perf_counter()
            out = self.runner.forward(1)
            _sync(device)
            t1 = time.perf_counter()
            self.runner.backward(out)
            _sync(device)
            t2 = time.perf_counter()
            self.runner.zero_grad()
        stages, boundary = [], t0
        for c in clock.complete_calls:  # in forward order
            st = LayerStages(
                pre=(c["dispatch0"] - boundary) * 1e3,
                issue=(c["dispatch1"] - c["dispatch0"]) * 1e3,
                experts=(c["combine1"] - c["dispatch1"]) * 1e3,
                post=(c["end"] - c["combine1"]) * 1e3,
                dispatch_bytes=c["bytes"],
                combine_bytes=c["bytes"],
            )
            stages.append(st)
            boundary = c["end"]
        self._trace = dict(stages=stages, tail=(t1 - boundary) * 1e3, forward=(t1 - t0) * 1e3, step=(t2 - t0) * 1e3)

    def build(self, samples: dict, *, statistic: str = "median", dw_warmup: int = 0) -> ComputeProfile:
        """The profile from the probes' times.

        Args:
            samples: ``{n: [ms, ...]}`` timed compute-only steps per chunk count; must hold 1 and one more.
            statistic: "median" or "min" of each count's samples ("min" resists other processes on a
                shared CPU).
            dw_warmup: leading dW flush samples to drop (the warm-up steps at 1 chunk).

        Returns:
            A :class:`ComputeProfile` (traces one step first if :meth:`trace` was not called).
        """
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")
        counts = sorted(samples)
        if 1 not in counts or not all(samples[n] for n in counts):
            raise ValueError(
                f"samples must hold timings at 1 chunk (and, to fit the per-chunk overhead, at "
                f"more counts), got {counts}"
            )
        if self._trace is None:
            self.trace()
        stat = STATISTICS[statistic]
        points = {n: stat(samples[n]) for n in counts}
        c1 = points[1]
        xs = [n - 1 for n in counts]
        sxx = sum(x * x for x in xs)
        overhead = max(0.0, sum(x * (points[n] - c1) for x, n in zip(xs, counts)) / sxx) if sxx else 0.0
        dw = self.dw_samples[dw_warmup:] or self.dw_samples
        dw_ms = stat(dw) if dw else 0.0
        t = self._trace
        scale = c1 / max(t["step"], 1e-9)  # the traced step's shape, the probes' size
        stages = tuple(
            LayerStages(
                s.pre * scale, s.issue * scale, s.experts * scale, s.post * scale, s.dispatch_bytes, s.combine_bytes
            )
            for s in t["stages"]
        )
        world = max([m.ep_size for m in self.layers] or [1])
        return ComputeProfile(
            step1_ms=c1,
            overhead_per_chunk_ms=overhead,
            points=points,
            forward_ms=t["forward"] * scale,
            layers=stages,
            tail_ms=t["tail"] * scale,
            dw_ms=min(dw_ms, c1),
            world_size=world,
            statistic=statistic,
            raw=dict(traced_step_ms=t["step"], traced_forward_ms=t["forward"]),
        )


def profile_compute(
    runner,
    layers: Sequence[lancet_rt.MoE],
    *,
    chunk_counts: Sequence[int] = (1, 2, 4),
    warmup: int = 2,
    reps: int = 5,
    statistic: str = "median",
    wgrad_queue=None,
    progress: Optional[Callable[[int], None]] = None,
) -> ComputeProfile:
    """Profile the computation of ``runner``'s step on a zero-cost link, on its own.

    Args:
        runner: an :class:`lancet_rt.autotune.search.StepRunner`.
        layers: the model's MoE layers (their groups are swapped for a free link meanwhile).
        chunk_counts: the chunk counts whose compute-only step times fit the per-chunk overhead;
            must include 1 and one more.
        warmup: untimed rounds before timing.
        reps: timed rounds (each count once per round).
        statistic: "median" or "min" of the timed steps.
        wgrad_queue: the deferred-dW queue, if ``defer_wgrad``.
        progress: called with 1 after every step (a progress bar's ``update``).

    Returns:
        A :class:`ComputeProfile`.
    """
    if warmup < 0 or reps < 1:
        raise ValueError(f"warmup must be >= 0 and reps >= 1, got warmup={warmup}, reps={reps}")
    counts = sorted(set(chunk_counts))
    if (
        1 not in counts
        or len(counts) < 2
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts)
    ):
        raise ValueError(f"chunk_counts must hold 1 and at least one more int >= 1, got {list(chunk_counts)!r}")
    tick = progress or (lambda k: None)
    prof = Profiler(runner, layers, wgrad_queue=wgrad_queue)
    samples: dict = {n: [] for n in counts}
    for r in range(warmup + reps):
        for n in counts:
            _sync(runner.device)
            t0 = time.perf_counter()
            prof.step(n)
            _sync(runner.device)
            if r >= warmup:
                samples[n].append((time.perf_counter() - t0) * 1e3)
            tick(1)
    prof.trace()
    tick(1)
    return prof.build(samples, statistic=statistic, dw_warmup=warmup)


@contextlib.contextmanager
def _timing_flush(queue, device, out: list):
    """Time the deferred-dW queue's final flush (on a free link all deferred dW runs there)."""
    if queue is None:
        yield
        return
    original = queue.flush

    def flush():
        _sync(device)
        t0 = time.perf_counter()
        original()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)

    queue.flush = flush  # the queue registers ``self.flush`` with the autograd engine at its first push
    try:
        yield
    finally:
        del queue.flush


class _Boundary:
    """A traced stage's span whose end also runs ``on_end`` (:class:`_StageClock`)."""

    __slots__ = ("span", "on_end")

    def __init__(self, span, on_end):
        self.span, self.on_end = span, on_end

    def end(self) -> None:
        self.span.end()
        self.on_end()


class _StageClock(_trace.Trace):
    """Stage boundaries of each MoE layer call, on the host clock after a device synchronize.

    For the one profiling step this recording is the active trace (:func:`lancet_rt.trace.tracing`): the
    dispatchers' stage spans (``dispatch``, ``experts``, ``combine``) mark the boundaries as they begin
    and end, and a forward hook marks the layer's end; the device is synchronized at each boundary, so
    asynchronous CUDA work is charged to the stage that launched it. Off-rank bytes per all-to-all come
    from the dispatch span (rows not addressed to this rank), as the emulated link counts them.
    """

    def __init__(self, layers, device):
        super().__init__()
        self.layers, self.device = list(layers), device
        self.calls: list[dict] = []
        self._undo: list = []
        self._tracing = None

    def _now(self) -> float:
        _sync(self.device)
        return time.perf_counter()

    def __enter__(self) -> "_StageClock":
        for m in self.layers:
            self._undo.append(m.register_forward_hook(self._layer_end).remove)
        self._tracing = _trace.tracing(self)
        self._tracing.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracing.__exit__(*exc)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def begin(self, name: str, track: str, cuda: bool = False, **args):
        if name == "dispatch":
            self.calls.append({"dispatch0": self._now(), "bytes": int(args.get("off_rank_bytes", 0))})
        span = super().begin(name, track, cuda, **args)
        on_end = {"dispatch": self._dispatched, "experts": self._experts_done, "combine": self._combined}.get(name)
        return span if on_end is None else _Boundary(span, on_end)

    def _dispatched(self) -> None:
        if self.calls:
            self.calls[-1]["dispatch1"] = time.perf_counter()

    def _experts_done(self) -> None:
        _sync(self.device)

    def _combined(self) -> None:
        if self.calls:
            self.calls[-1]["combine1"] = time.perf_counter()

    def _layer_end(self, module, inputs, output) -> None:
        if self.calls and "end" not in self.calls[-1]:
            self.calls[-1]["end"] = self._now()

    @property
    def complete_calls(self) -> list:
        return [c for c in self.calls if {"dispatch0", "dispatch1", "combine1", "end"} <= c.keys()]
