"""The replay's model of a step, fitted to traced steps: stage totals per chunk count, backward ratios, link.

Step 2 of :mod:`lancet_rt.autotune.replay`: :func:`build_profile` turns the
:class:`lancet_rt.autotune.replay_trace.TracedStep` of one or more traces into a :class:`ReplayProfile`,
which interpolates each stage's time between the traced chunk counts.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

from .profiling import LinkModel
from .replay_trace import TracedStep


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
    """Fit the replay's model (step 2 of :mod:`lancet_rt.autotune.replay`) to traced steps of one
    model and batch.

    Args:
        steps: at least one :class:`TracedStep`; at two or more chunk counts the replay interpolates
            between them (and extrapolates the nearest two beyond), at one it scales by tokens alone.
            Of several steps at one chunk count the fastest is kept (:func:`_fastest`).

    Returns:
        The :class:`ReplayProfile`.
    """
    steps = list(steps)
    if not steps:
        raise ValueError("steps must hold at least one traced step")
    first = steps[0]
    for s in steps[1:]:
        if s.layers != first.layers or s.total_tokens != first.total_tokens or s.deferred != first.deferred:
            raise ValueError(
                "the traces must be steps of one model, batch and dW setting (layers, tokens, deferral differ)"
            )
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
    return ReplayProfile(
        layers=list(first.layers),
        tokens=T,
        totals=totals,
        glue_per_segment_ms=glue,
        ratios=ratios,
        dw_ratio=dw_ratio,
        bytes_per_token=bpt,
        link=link,
        deferred=first.deferred,
        traced={s.chunks: s.step_ms for s in steps},
    )


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
