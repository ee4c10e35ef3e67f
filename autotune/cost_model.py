"""Lancet's cost model for chunk counts: profiled stage times plus a two-stream simulation.

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

How a candidate N is predicted (:meth:`CostModel.predict`): computation at N chunks takes
``C(N) = C(1) + (N - 1) * o``, the per-chunk overhead ``o`` being the least-squares slope of the
compute-only profiles (never a measurement on the real link), spread over the stages in proportion
to their 1-chunk times and over the chunks in proportion to their rows. The forward is issued in the
order :class:`lancet_rt.Overlapped`'s round-robin scheduler issues it (per layer: every chunk's pre,
counts exchange and dispatch, then every chunk's experts and combine, then every chunk's post with
the next layer's pre, ...) and simulated on two streams, one compute and one communication (a FIFO
link), each op starting at ``max(end of its dependencies, end of the previous op on its stream)``;
the counts exchange blocks the host. The backward runs the forward's compute ops in reverse creation
order (the autograd engine's order), each taking ``(backward time at 1 chunk) / (forward time)`` of
its forward time; each backward all-to-all is issued by its gradient's producer (the unpermute's
backward, the experts' backward after its dX) and waited for by its own node, which drains deferred
dW meanwhile (``min(dW queued, time left)``); what is left is flushed at the end.
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
    def measure(cls, group, *, device, dtype=torch.float32, row_elems: int = 1024,
                nbytes: Sequence[int] = (0, 1 << 20, 4 << 20), reps: int = 5, agree=None) -> "LinkModel":
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
            reps: timed repetitions per size, after one warm-up transfer; the fastest counts (load from
                elsewhere only ever slows a transfer, so the minimum is the steadiest estimate, and
                the measured bandwidth, part of the cache key, stays put from run to run).
            agree: optional ``callable(list[float]) -> list[float]`` that makes the timings identical on
                every rank (for example an all-reduce max), so every rank fits the same model.

        Returns:
            The fitted :class:`LinkModel`.
        """
        if reps < 1:
            raise ValueError(f"reps must be >= 1, got {reps}")
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
            for i in range(reps + 1):
                _sync(device)
                t0 = time.perf_counter()
                group.all_to_all(out, x, splits, splits).wait()
                _sync(device)
                if i:
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
    candidates themselves (:func:`autotune.search.search` ``probes=``): load from other processes
    then hits the profile and the measurement alike. :meth:`build` turns their times into a
    :class:`ComputeProfile`; :func:`profile_compute` does it all on its own.

    Args:
        runner: an :class:`autotune.search.StepRunner`.
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
        """``{("compute", n): callable}`` for :func:`autotune.search.search`'s ``probes``."""
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
            st = LayerStages(pre=(c["dispatch0"] - boundary) * 1e3, issue=(c["dispatch1"] - c["dispatch0"]) * 1e3,
                             experts=(c["combine1"] - c["dispatch1"]) * 1e3, post=(c["end"] - c["combine1"]) * 1e3,
                             dispatch_bytes=c["bytes"], combine_bytes=c["bytes"])
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
            raise ValueError(f"samples must hold timings at 1 chunk (and, to fit the per-chunk overhead, at "
                             f"more counts), got {counts}")
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
        stages = tuple(LayerStages(s.pre * scale, s.issue * scale, s.experts * scale, s.post * scale,
                                   s.dispatch_bytes, s.combine_bytes) for s in t["stages"])
        world = max([m.ep_size for m in self.layers] or [1])
        return ComputeProfile(step1_ms=c1, overhead_per_chunk_ms=overhead, points=points,
                              forward_ms=t["forward"] * scale, layers=stages, tail_ms=t["tail"] * scale,
                              dw_ms=min(dw_ms, c1), world_size=world, statistic=statistic,
                              raw=dict(traced_step_ms=t["step"], traced_forward_ms=t["forward"]))


def profile_compute(runner, layers: Sequence[lancet_rt.MoE], *, chunk_counts: Sequence[int] = (1, 2, 4),
                    warmup: int = 2, reps: int = 5, statistic: str = "median", wgrad_queue=None,
                    progress: Optional[Callable[[int], None]] = None) -> ComputeProfile:
    """Profile the computation of ``runner``'s step on a zero-cost link, on its own.

    Args:
        runner: an :class:`autotune.search.StepRunner`.
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
    if 1 not in counts or len(counts) < 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                 for n in counts):
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


class _StageClock:
    """Stage boundaries of each MoE layer call, on the host clock after a device synchronize.

    For the one profiling step, every layer's stage methods (``dispatch``, ``compute_experts``,
    ``combine``) are wrapped on the instance and a forward hook marks the layer's end; the device is
    synchronized at each boundary, so asynchronous CUDA work is charged to the stage that launched it.
    Off-rank bytes per all-to-all come from the dispatch's split sizes (rows not addressed to this
    rank), as the emulated link counts them.
    """

    def __init__(self, layers, device):
        self.layers, self.device = list(layers), device
        self.calls: list[dict] = []
        self._undo: list = []

    def _now(self) -> float:
        _sync(self.device)
        return time.perf_counter()

    def __enter__(self) -> "_StageClock":
        for m in self.layers:
            self._wrap(m)
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _wrap(self, m) -> None:
        dispatch, experts, combine = m.dispatch, m.compute_experts, m.combine

        def timed_dispatch(x_SD, kept_E, *a, **kw):
            call = {"dispatch0": self._now()}
            self.calls.append(call)
            splits = kept_E.view(m.ep_size, -1).sum(1).tolist()
            row_bytes = x_SD.element_size() * (x_SD[0].numel() if x_SD.dim() > 1 else 1)
            call["bytes"] = int((sum(splits) - splits[m.ep_rank]) * row_bytes)
            d = dispatch(x_SD, kept_E, *a, **kw)
            call["dispatch1"] = time.perf_counter()
            return d

        def timed_experts(*a, **kw):
            y = experts(*a, **kw)
            _sync(self.device)
            return y

        def timed_combine(*a, **kw):
            pending = combine(*a, **kw)
            if self.calls:
                self.calls[-1]["combine1"] = time.perf_counter()
            return pending

        def hook(module, inputs, output):
            if self.calls and "end" not in self.calls[-1]:
                self.calls[-1]["end"] = self._now()

        m.dispatch, m.compute_experts, m.combine = timed_dispatch, timed_experts, timed_combine
        handle = m.register_forward_hook(hook)

        def undo():
            handle.remove()
            for name in ("dispatch", "compute_experts", "combine"):
                m.__dict__.pop(name, None)

        self._undo.append(undo)

    @property
    def complete_calls(self) -> list:
        return [c for c in self.calls if {"dispatch0", "dispatch1", "combine1", "end"} <= c.keys()]


# ------------------------------------------------------------------------------------- simulation
@dataclass
class SimOp:
    """One op of the two-stream simulation.

    Attributes:
        name: for the record (``"L0 c1 experts"``).
        stream: ``"compute"`` or ``"comm"``.
        ms: duration.
        deps: indices of earlier ops it waits for (its stream's previous op is implied).
        start, end: filled in by the simulation.
    """

    name: str
    stream: str
    ms: float
    deps: tuple = ()
    start: float = 0.0
    end: float = 0.0


_STREAMS = ("compute", "comm")


def simulate(ops: list[SimOp]) -> float:
    """Lancet's two-stream simulation: start = max(deps' end, previous op on the same stream's end).

    Args:
        ops: in issue order; ``start``/``end`` are filled in.

    Returns:
        The makespan (end of the last op), in ms.
    """
    free = dict.fromkeys(_STREAMS, 0.0)
    for i, op in enumerate(ops):
        if op.stream not in free:
            raise ValueError(f"ops[{i}].stream must be 'compute' or 'comm', got {op.stream!r}")
        if any(not 0 <= d < i for d in op.deps):
            raise ValueError(f"ops[{i}].deps must index earlier ops, got {op.deps}")
        op.start = max([free[op.stream]] + [ops[d].end for d in op.deps])
        op.end = op.start + op.ms
        free[op.stream] = op.end
    return max(free.values())


class _Timeline:
    """:func:`simulate`, one op at a time, so a schedule can look at the clock while it is built."""

    def __init__(self):
        self.ops: list[SimOp] = []
        self.free = dict.fromkeys(_STREAMS, 0.0)

    def add(self, name: str, stream: str, ms: float, deps=()) -> int:
        deps = tuple(d for d in deps if d is not None)
        op = SimOp(name, stream, max(ms, 0.0), deps)
        op.start = max([self.free[stream]] + [self.ops[d].end for d in deps])
        op.end = op.start + op.ms
        self.free[stream] = op.end
        self.ops.append(op)
        return len(self.ops) - 1

    @property
    def makespan(self) -> float:
        return max(self.free.values())


@dataclass(frozen=True)
class Prediction:
    """A predicted step at N chunks.

    Attributes:
        chunks: N.
        step_ms: predicted forward + backward.
        forward_ms, backward_ms: the two passes.
        compute_ms: C(N), computation alone.
        comm_ms: total link time of the step (exposed or hidden).
        ops: the simulated ops (for timelines).
    """

    chunks: int
    step_ms: float
    forward_ms: float
    backward_ms: float
    compute_ms: float
    comm_ms: float
    ops: tuple = field(default=(), compare=False, repr=False)


#: Share of the experts' backward that is dW (2 of its 4 grouped GEMMs); without deferral it runs
#: after the dispatch's backward all-to-all has been issued, so it overlaps it.
EXPERTS_DW_SHARE = 0.5


class CostModel:
    """Predict step times for chunk counts from a :class:`ComputeProfile` and a :class:`LinkModel`.

    The forward follows :class:`lancet_rt.Overlapped`'s round-robin issue order. The backward is the
    autograd engine's order: the reverse of the forward's creation order (its ready queue runs the
    latest-created node first). Each backward all-to-all is issued by its gradient's producer (the
    unpermute's backward for the combine, the experts' backward, after their dX, for the dispatch) and
    waited for by its own node, which drains deferred dW meanwhile.

    Args:
        profile: the compute profile.
        link: the link model (ignored when the profile's world size is 1: no communication).
        defer_wgrad: whether dW is deferred into the backward all-to-all windows.
    """

    def __init__(self, profile: ComputeProfile, link: LinkModel, *, defer_wgrad: bool = False):
        if not isinstance(profile, ComputeProfile):
            raise TypeError(f"profile must be a ComputeProfile, got {type(profile).__name__}")
        if not isinstance(link, LinkModel):
            raise TypeError(f"link must be a LinkModel, got {type(link).__name__}")
        self.profile, self.link, self.defer_wgrad = profile, link, bool(defer_wgrad)

    def compute_ms(self, n: int) -> float:
        """C(N) = C(1) + (N - 1) * o."""
        return self.profile.step1_ms + (n - 1) * self.profile.overhead_per_chunk_ms

    def predict(self, n: int, rows: Optional[int] = None) -> Prediction:
        """Simulate one step at ``n`` chunks.

        Args:
            n: chunk count >= 1.
            rows: rows along dim 0 (chunks get ``tensor_split`` shares of them); None for equal shares.

        Returns:
            A :class:`Prediction`.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        p = self.profile
        if rows is not None and rows >= 1:
            shares = [len(r) / rows for r in torch.arange(rows).tensor_split(n)]
        else:
            shares = [1.0 / n] * n
        scale = self.compute_ms(n) / p.step1_ms if p.step1_ms > 0 else 1.0
        comm = p.world_size > 1
        tl = _Timeline()
        kinds: list = []      # per forward op: its kind
        consumes: dict = {}   # forward compute op -> the forward all-to-all whose output it reads

        def add(kind, name, stream, ms, deps=(), reads=None):
            i = tl.add(name, stream, ms, deps)
            kinds.append(kind)
            if reads is not None and comm:
                consumes[i] = reads
            return i

        def phase_a(layer, c, after):
            """Chunk c's pre-MoE compute, the blocking counts exchange, and the dispatch it issues."""
            st = p.layers[layer]
            pre = add("pre", f"L{layer} c{c} pre", "compute", st.pre * scale * shares[c], (after,))
            if not comm:
                return add("issue", f"L{layer} c{c} issue", "compute", st.issue * scale * shares[c])
            ex = add("exchange", f"L{layer} c{c} exchange", "comm", self.link.time_ms(0), (pre,))
            issue = add("issue", f"L{layer} c{c} issue", "compute", st.issue * scale * shares[c], (ex,))
            return add("dispatch", f"L{layer} c{c} dispatch", "comm",
                       self.link.time_ms(st.dispatch_bytes * shares[c]), (issue,))

        # Forward, in the round-robin scheduler's issue order: per layer, every chunk's pre + dispatch,
        # then every chunk's experts + combine, then every chunk's post with the next layer's pre.
        L = len(p.layers)
        if L == 0:
            for c in range(n):
                add("pre", f"c{c} forward", "compute", p.forward_ms * scale * shares[c])
        dispatch = [phase_a(0, c, None) if L else None for c in range(n)]
        combine = [None] * n
        for layer in range(L):
            st = p.layers[layer]
            for c in range(n):
                e = add("experts", f"L{layer} c{c} experts", "compute", st.experts * scale * shares[c],
                        (dispatch[c],), reads=dispatch[c])
                combine[c] = (add("combine", f"L{layer} c{c} combine", "comm",
                                  self.link.time_ms(st.combine_bytes * shares[c]), (e,)) if comm else e)
            for c in range(n):
                post = add("post", f"L{layer} c{c} post", "compute", st.post * scale * shares[c],
                           (combine[c],), reads=combine[c])
                if layer + 1 < L:
                    dispatch[c] = phase_a(layer + 1, c, post)
                else:
                    add("tail", f"c{c} tail", "compute", p.tail_ms * scale * shares[c])
        forward_end = tl.makespan
        n_fwd = len(tl.ops)
        fwd = list(tl.ops)

        # Backward: the reverse of the forward's creation order.
        fwd_compute = sum(o.ms for o in fwd if o.stream == "compute")
        bwd_total = p.backward_ms * scale
        dw_total = p.dw_ms * scale if self.defer_wgrad else 0.0
        ratio = (bwd_total - dw_total) / fwd_compute if fwd_compute > 0 else 0.0
        dw_weight = sum(o.ms for o, k in zip(fwd, kinds) if k in ("pre", "experts"))
        pool = 0.0
        issued: dict = {}   # forward all-to-all -> its backward all-to-all
        waits: list = []    # backward all-to-alls the next compute op waits for
        for i in reversed(range(n_fwd)):
            o, kind = fwd[i], kinds[i]
            if kind in ("dispatch", "combine"):
                j = issued.get(i)
                if j is None:
                    continue
                left = tl.ops[j].end - tl.free["compute"]
                if pool > 0 and left > 0:  # the waiting node drains deferred dW while the a2a flies
                    drained = min(pool, left)
                    tl.add(f"{o.name} bwd dW", "compute", drained)
                    pool -= drained
                waits.append(j)
                continue
            if kind == "exchange":
                continue
            ms = o.ms * ratio
            inline_dw = ms * EXPERTS_DW_SHARE if kind == "experts" and not self.defer_wgrad else 0.0
            k = tl.add(f"{o.name} bwd", "compute", ms - inline_dw, waits)
            waits = []
            if i in consumes:
                a2a = consumes[i]
                issued[a2a] = tl.add(f"{fwd[a2a].name} bwd", "comm", fwd[a2a].ms, (k,))
            if inline_dw:
                tl.add(f"{o.name} bwd dW", "compute", inline_dw)
            if dw_total and kind in ("pre", "experts") and dw_weight > 0:
                pool += dw_total * o.ms / dw_weight
        if pool > 0 or waits:
            tl.add("dW flush", "compute", pool, waits)
        end = tl.makespan
        comm_ms = sum(o.ms for o in tl.ops if o.stream == "comm")
        return Prediction(chunks=n, step_ms=end, forward_ms=forward_end, backward_ms=end - forward_end,
                          compute_ms=self.compute_ms(n), comm_ms=comm_ms, ops=tuple(tl.ops))
