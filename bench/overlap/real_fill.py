"""What a pass must spend with the link idle or the computation idle on ``bench.overlap --link real``: its fill, its
drain, and its first transfer.

The pass bound (bench.overlap.real_bounds) lets a pass's link and its computation each run from the pass's first
moment to its last. No schedule does:

- a pass's first collective needs some chunk's computation before it (the forward: the first layer's attention
  and gating of a chunk; the backward: the loss's and the last layer's gradients of a chunk up to its first
  all-to-all), the *fill*; and after the pass's last collective ends its chunk still computes what follows it
  (the forward: the last layer's unpermute and residual; the backward: the first layer's gradients below its
  dispatch), the *drain*. The link is idle meanwhile;
- the computation that needs no transfer of the pass is every chunk's fill; everything else waits for a chunk's
  first collective, which ends at the earliest one fill and one *first transfer* after the pass began. If that
  transfer outlasts the other chunks' fills, the computation is idle meanwhile (the backward of a model whose
  last layer is a MoE: almost nothing precedes the first all-to-all).

Chunking shrinks these to one chunk's, never to zero. :func:`fill_and_drain` measures them on the unchunked model
given one chunk's rows (the same operations a chunk runs, with no other chunk to overlap), each step traced: off
the link, the time from the pass's start to its first collective's issue (fill) and from its last collective's
end to the pass's end (drain); on the link, its first collective's time on the backend. Per pass, the median over
the steps and the least any rank took. So a pass of any schedule at ``n`` equal chunks takes at least fill + its
bytes at the rate + drain, and at least its computation + max(0, first transfer - (n - 1) fills)
(:func:`bench.overlap.real_bounds.pass_bound`'s ``fill``)."""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from bench.overlap.real_bounds import FILL as FIGURES  # (each pass's fill, drain and first collective, in ms)
from lancet_rt.trace import Trace, tracing

#: The figures read on the link (the others off it).
FIRST = ("forward_first_ms", "backward_first_ms")


def link_times(trace: Trace) -> tuple[list, list]:
    """A traced step's collectives: when each was issued, and each one's (start, end) on the backend, in
    ``time.perf_counter`` seconds (one whose start or end is unknown is left out)."""
    issued, spans = [], []
    for e in trace.events():
        t = trace.origin + e["ts"] * 1e-6
        if e["tid"] == "link issue":
            issued.append(t)
        elif e["tid"] == "link":
            spans.append((t, t + e["dur"] * 1e-6))
    return issued, spans


def step_fill(issued: list, spans: list, t0: float, forward_end: float, t1: float) -> Optional[dict]:
    """One step's figures (:data:`FIGURES`) from its collectives (:func:`link_times`) and its start, forward end
    and end (``time.perf_counter`` seconds): a collective issued before the forward's end is the forward's. None
    if a pass ran none."""
    fwd_i, bwd_i = [t for t in issued if t < forward_end], [t for t in issued if t >= forward_end]
    fwd_s, bwd_s = sorted(s for s in spans if s[0] < forward_end), sorted(s for s in spans if s[0] >= forward_end)
    if not (fwd_i and bwd_i and fwd_s and bwd_s):
        return None
    return dict(
        forward_fill_ms=(min(fwd_i) - t0) * 1e3,
        forward_drain_ms=max(forward_end - max(e for _, e in fwd_s), 0.0) * 1e3,
        backward_fill_ms=(min(bwd_i) - forward_end) * 1e3,
        backward_drain_ms=max(t1 - max(e for _, e in bwd_s), 0.0) * 1e3,
        forward_first_ms=(fwd_s[0][1] - fwd_s[0][0]) * 1e3,
        backward_first_ms=(bwd_s[0][1] - bwd_s[0][0]) * 1e3,
    )


def fill_and_drain(runner, me, rate: int, steps: int = 5) -> dict:
    """:data:`FIGURES` of ``runner``'s sequential step (a :class:`bench.overlap.real_runner.RealRunner` built on
    one chunk's rows): the fills and drains off the link, each pass's first collective at ``rate``; each the
    median over ``steps`` traced steps after one untimed, then the least any rank (``me``: a
    :class:`bench.overlap.real_rank.Rank`) took. Every figure None where a step had none."""
    got = {}
    for link in (None, rate):
        me.set_rate(link)
        runner.step("sequential")
        for _ in range(steps):
            dist.barrier(me.sync)
            trace = Trace()
            with tracing(trace):
                t0 = time.perf_counter()
                runner.step("sequential")
                t1 = time.perf_counter()
            fill = step_fill(*link_times(trace), t0, runner.forward_end, t1)
            for k, v in (fill or {}).items():
                if (k in FIRST) == (link is not None):
                    got.setdefault(k, []).append(v)
    mine = [statistics.median(got[k]) if k in got else -1.0 for k in FIGURES]
    t = torch.tensor(mine, dtype=torch.float64)
    none = torch.tensor([1.0 if v < 0 else 0.0 for v in mine], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=me.sync)
    dist.all_reduce(none, op=dist.ReduceOp.MAX, group=me.sync)
    return {k: None if n > 0 else float(v) for k, v, n in zip(FIGURES, t.tolist(), none.tolist())}
