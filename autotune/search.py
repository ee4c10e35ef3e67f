"""Search over chunk counts: prune the candidates, then measure each on the real ``Overlapped`` step.

Every candidate runs the same training step (forward + backward of the wrapped model at that
chunk count); chunking changes no number, so the candidates differ only in time. Candidates are
timed in interleaved rounds (1, 2, 3, ..., 1, 2, 3, ...) after a warm-up of each, so slow drift of
a shared machine hits all of them alike; each gets the median (or the minimum) of its rounds.
Measurement decides: the choice is the fastest.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

import lancet_rt

DEFAULT_CANDIDATES = (1, 2, 3, 4, 6, 8)
DEFAULT_MIN_TOKENS_PER_CHUNK = 128


def candidate_chunks(
    tokens: int,
    rows: int,
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
    min_tokens_per_chunk: int = DEFAULT_MIN_TOKENS_PER_CHUNK,
) -> tuple[list[int], dict[int, str]]:
    """The candidates worth measuring, and why the others are not.

    Args:
        tokens: tokens per step on this rank.
        rows: rows along dim 0 of the inputs (chunks are cut along it; more chunks than rows
            would give empty chunks).
        candidates: chunk counts to consider (ints >= 1).
        min_tokens_per_chunk: a chunk must get at least this many tokens (1 always stays).

    Returns:
        (kept candidates in increasing order, {pruned candidate: reason}).
    """
    for name, v in (("tokens", tokens), ("rows", rows), ("min_tokens_per_chunk", min_tokens_per_chunk)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < (1 if name != "min_tokens_per_chunk" else 0):
            raise ValueError(f"{name} must be >= {1 if name != 'min_tokens_per_chunk' else 0}, got {v}")
    cands = sorted(set(candidates))
    if not cands or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in cands):
        raise ValueError(f"candidates must be a non-empty sequence of ints >= 1, got {list(candidates)!r}")
    kept, pruned = [], {}
    for n in cands:
        if n == 1:
            kept.append(n)
        elif n > rows:
            pruned[n] = f"more chunks than rows ({rows})"
        elif tokens / n < min_tokens_per_chunk:
            pruned[n] = f"{tokens / n:.0f} tokens per chunk < {min_tokens_per_chunk}"
        else:
            kept.append(n)
    if 1 not in kept:
        kept.insert(0, 1)
    return kept, pruned


class StepRunner:
    """One training step of an :class:`lancet_rt.Overlapped` model at a chosen chunk count.

    Args:
        overlapped: the wrapped model (its ``chunks`` setting is overridden per call and restored).
        args: positional inputs of the model (tensors are cut along dim 0).
        kwargs: keyword inputs.
        grad_output: gradient of the first tensor output for backward; None backpropagates
            ``out.float().sum()``.

    Attributes:
        device: the first tensor input's device.
        rows: its size along dim 0.
    """

    def __init__(self, overlapped, args: tuple, kwargs: Optional[dict] = None, grad_output=None):

        if not isinstance(overlapped, lancet_rt.Overlapped):
            raise TypeError(f"overlapped must be a lancet_rt.Overlapped, got {type(overlapped).__name__}")
        if not isinstance(args, tuple):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        self.overlapped, self.args, self.kwargs = overlapped, args, dict(kwargs or {})
        self.grad_output = grad_output
        tensors = [v for v in pytree.tree_leaves((args, self.kwargs)) if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not tensors:
            raise ValueError("args must hold a tensor with at least one dimension")
        self.device = tensors[0].device
        self.rows = int(tensors[0].shape[0])
        self._inputs = [t for t in tensors if t.requires_grad]

    def forward(self, n: int):
        saved = self.overlapped.chunks
        self.overlapped.chunks = n
        try:
            return self.overlapped(*self.args, **self.kwargs)
        finally:
            self.overlapped.chunks = saved

    def backward(self, out) -> None:
        y = next(v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor))
        if self.grad_output is not None:
            y.backward(self.grad_output)
        else:
            y.float().sum().backward()

    def zero_grad(self) -> None:
        for p in self.overlapped.parameters():
            p.grad = None
        for t in self._inputs:
            t.grad = None

    def __call__(self, n: int) -> None:
        """Forward and backward at ``n`` chunks, then drop the gradients."""
        self.backward(self.forward(n))
        self.zero_grad()


@dataclass
class Measurement:
    """One candidate's row of the search table.

    Attributes:
        chunks: N.
        status: ``"ok"``, ``"oom"`` or ``"pruned: <reason>"``.
        ms: the search's statistic (median or min) of the timed steps (None unless ok);
            ``ms_q20``/``ms_q80``: their 20th and 80th percentiles.
        samples: every timed step, in ms.
        peak_mem_mb: peak allocated CUDA memory during its steps (None on CPU).
    """

    chunks: int
    status: str = "ok"
    ms: Optional[float] = None
    ms_q20: Optional[float] = None
    ms_q80: Optional[float] = None
    samples: list = field(default_factory=list)
    peak_mem_mb: Optional[float] = None

    def as_dict(self) -> dict:
        return dict(
            chunks=self.chunks,
            status=self.status,
            measured_ms=self.ms,
            measured_q20_ms=self.ms_q20,
            measured_q80_ms=self.ms_q80,
            peak_mem_mb=self.peak_mem_mb,
        )


@dataclass
class SearchResult:
    """Measured candidates and the choice.

    Attributes:
        table: one :class:`Measurement` per candidate considered (pruned ones included), by chunk count.
        choice: the chunk count with the fastest statistic.
        statistic: "median" or "min": how each candidate's timed steps were summarised (``ms``).
        probes: ``{name: [ms, ...]}`` timed samples of the extra probes.
    """

    table: list
    choice: int
    statistic: str = "median"
    probes: dict = field(default_factory=dict)

    @property
    def best_ms(self) -> float:
        return min(m.ms for m in self.table if m.status == "ok")

    def measured(self, n: int) -> Optional[Measurement]:
        return next((m for m in self.table if m.chunks == n), None)


def _oom_errors() -> tuple:
    errors = [getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)]
    return tuple(e for e in errors if e is not None) or (RuntimeError,)


_STATISTICS = {"median": statistics.median, "min": min}


def search(
    runner: StepRunner,
    *,
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
    tokens: Optional[int] = None,
    min_tokens_per_chunk: int = DEFAULT_MIN_TOKENS_PER_CHUNK,
    warmup: int = 2,
    reps: int = 5,
    statistic: str = "median",
    probes: Optional[dict] = None,
    progress: Optional[Callable[[int], None]] = None,
    agree: Optional[Callable[[list], list]] = None,
) -> SearchResult:
    """Measure every surviving candidate on ``runner``'s step and pick the fastest.

    Args:
        runner: the step to time.
        candidates: chunk counts to consider.
        tokens: tokens per step (for the tokens-per-chunk pruning); None counts ``runner.rows``.
        min_tokens_per_chunk: see :func:`candidate_chunks`.
        warmup: untimed rounds before timing.
        reps: timed rounds; every candidate (and probe) runs once per round.
        statistic: "median" (default) or "min" of each candidate's timed steps; "min" resists other
            processes on a shared CPU.
        probes: extra ``{name: callable}`` timed in the same rounds (e.g. the cost model's compute-only
            steps, :meth:`lancet_rt.autotune.profiling.Profiler.probes`), so load hits them and the candidates alike.
        progress: called with 1 after every step.
        agree: optional ``callable(list of times) -> list`` making the candidates' times identical on
            every rank of a real group (e.g. an all-reduce max), so every rank chooses the same count.

    Returns:
        A :class:`SearchResult`. On CUDA a candidate that runs out of memory is dropped (status
        ``"oom"``); with a real process group every rank must fail alike, else the others wait.
    """
    if warmup < 0 or reps < 1:
        raise ValueError(f"warmup must be >= 0 and reps >= 1, got warmup={warmup}, reps={reps}")
    if statistic not in _STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(_STATISTICS)}, got {statistic!r}")
    kept, pruned = candidate_chunks(
        tokens if tokens is not None else runner.rows, runner.rows, candidates, min_tokens_per_chunk
    )
    table = {n: Measurement(n) for n in kept}
    table.update({n: Measurement(n, status=f"pruned: {why}") for n, why in pruned.items()})
    rounds = _Rounds(runner, table, kept, probes or {}, progress or (lambda k: None))
    for r in range(warmup + reps):  # candidates first: the model's first forward runs on its real group
        timed = r >= warmup
        for n in list(rounds.live):
            rounds.run(n, timed)
        for name in rounds.probe_samples:
            rounds.run_probe(name, timed)
    ok = _summarise(table, kept, _STATISTICS[statistic], agree)
    choice = min(ok, key=lambda n: (table[n].ms, n))
    return SearchResult(
        table=[table[n] for n in sorted(table)], choice=choice, statistic=statistic, probes=rounds.probe_samples
    )


class _Rounds:
    """Times one candidate's step or one probe at a time, recording into the table (OOM drops a candidate)."""

    def __init__(self, runner: StepRunner, table: dict, kept: list, probes: dict, tick: Callable[[int], None]):
        self.runner, self.table, self.probes, self.tick = runner, table, probes, tick
        self.probe_samples = {name: [] for name in probes}
        self.cuda = runner.device.type == "cuda"
        self.live = list(kept)

    def clock(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.runner.device)
        return time.perf_counter()

    def run(self, n: int, timed: bool) -> None:
        """One step at ``n`` chunks; its time is a sample when ``timed``."""
        m, runner, cuda = self.table[n], self.runner, self.cuda
        try:
            if cuda:
                torch.cuda.synchronize(runner.device)
                torch.cuda.reset_peak_memory_stats(runner.device)
            t0 = self.clock()
            runner(n)
            t1 = self.clock()
            if cuda:
                m.peak_mem_mb = max(m.peak_mem_mb or 0.0, torch.cuda.max_memory_allocated(runner.device) / 2**20)
            if timed:
                m.samples.append((t1 - t0) * 1e3)
        except _oom_errors():
            if not cuda:
                raise
            runner.zero_grad()
            torch.cuda.empty_cache()
            m.status = "oom"
            self.live.remove(n)
        self.tick(1)

    def run_probe(self, name, timed: bool) -> None:
        """One call of probe ``name``; its time is a sample when ``timed``."""
        t0 = self.clock()
        self.probes[name]()
        t1 = self.clock()
        if timed:
            self.probe_samples[name].append((t1 - t0) * 1e3)
        self.tick(1)


def _summarise(table: dict, kept: list, stat: Callable, agree: Optional[Callable[[list], list]]) -> list:
    """Each surviving candidate's statistic and quantiles (agreed across ranks); returns the survivors."""
    ok = [n for n in kept if table[n].status == "ok"]
    if not ok:
        raise RuntimeError("every chunk-count candidate ran out of memory")
    for n in ok:
        m = table[n]
        m.ms = stat(m.samples)
        # inclusive: quantiles within the samples (the default, exclusive, extrapolates from a few steps)
        qs = statistics.quantiles(m.samples, n=5, method="inclusive") if len(m.samples) >= 2 else [m.samples[0]] * 4
        m.ms_q20, m.ms_q80 = qs[0], qs[3]
    if agree is not None:
        for n, ms in zip(ok, agree([table[n].ms for n in ok])):
            table[n].ms = ms
    return ok
