"""Lancet's cost model for chunk counts: profiled stage times (:mod:`lancet_rt.autotune.profiling`) plus a
two-stream simulation.

How a candidate N is predicted (:meth:`CostModel.predict`): computation at N chunks takes
``C(N) = C(1) + (N - 1) * o``, the per-chunk overhead ``o`` being the least-squares slope of the
compute-only profiles (never a measurement on the real link), spread over the stages in proportion
to their 1-chunk times and over the chunks in proportion to their rows. The forward is issued in the
order :class:`lancet_rt.Overlapped`'s round-robin scheduler issues it (per layer: every chunk's pre,
counts exchange and dispatch, then every chunk's experts and combine, then every chunk's post with
the next layer's pre, ...) and simulated on two streams, one compute and one communication (a FIFO
link), each op starting at ``max(end of its dependencies, end of the previous op on its stream)``;
the counts exchange blocks the host, and queues in the link's FIFO or, with ``counts_channel="own"``,
takes the latency on a channel of its own. The backward runs the forward's compute ops in reverse creation
order (the autograd engine's order), each taking ``(backward time at 1 chunk) / (forward time)`` of
its forward time; each backward all-to-all is issued by its gradient's producer (the unpermute's
backward, the experts' backward after its dX) and waited for by its own node, which drains deferred
dW meanwhile (``min(dW queued, time left)``); what is left is flushed at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .profiling import ComputeProfile, LinkModel


# ------------------------------------------------------------------------------------- simulation
@dataclass
class SimOp:
    """One op of the two-stream simulation.

    Attributes:
        name: for the record (``"L0 c1 experts"``).
        stream: ``"compute"``, ``"comm"`` (the link, a FIFO) or ``"counts"`` (the counts exchanges'
            own channel, with ``counts_channel="own"``).
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


_STREAMS = ("compute", "comm", "counts")


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


class _StepGraph:
    """The forward being built: its timeline, each op's kind and which all-to-all each op reads."""

    def __init__(self, comm: bool):
        self.tl = _Timeline()
        self.comm = comm
        self.kinds: list = []  # per forward op: its kind
        self.consumes: dict = {}  # forward compute op -> the forward all-to-all whose output it reads

    def add(self, kind: str, name: str, stream: str, ms: float, deps=(), reads=None) -> int:
        i = self.tl.add(name, stream, ms, deps)
        self.kinds.append(kind)
        if reads is not None and self.comm:
            self.consumes[i] = reads
        return i


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
        counts_channel: "shared": the counts exchanges queue in the link's FIFO (one communicator);
            "own": they take the latency on a channel of their own (``TorchGroup(counts_group=)``).
    """

    def __init__(
        self, profile: ComputeProfile, link: LinkModel, *, defer_wgrad: bool = False, counts_channel: str = "shared"
    ):
        if not isinstance(profile, ComputeProfile):
            raise TypeError(f"profile must be a ComputeProfile, got {type(profile).__name__}")
        if not isinstance(link, LinkModel):
            raise TypeError(f"link must be a LinkModel, got {type(link).__name__}")
        if counts_channel not in ("shared", "own"):
            raise ValueError(f"counts_channel must be 'shared' or 'own', got {counts_channel!r}")
        self.profile, self.link, self.defer_wgrad = profile, link, bool(defer_wgrad)
        self.counts_stream = "counts" if counts_channel == "own" else "comm"

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
        g = _StepGraph(comm=p.world_size > 1)
        self._forward(g, shares, scale)
        forward_end = g.tl.makespan
        self._backward(g, scale)
        tl = g.tl
        end = tl.makespan
        comm_ms = sum(o.ms for o in tl.ops if o.stream == "comm")
        return Prediction(
            chunks=n,
            step_ms=end,
            forward_ms=forward_end,
            backward_ms=end - forward_end,
            compute_ms=self.compute_ms(n),
            comm_ms=comm_ms,
            ops=tuple(tl.ops),
        )

    def _phase_a(self, g: "_StepGraph", layer: int, c: int, after, share: float, scale: float) -> int:
        """Chunk c's pre-MoE compute, the blocking counts exchange, and the dispatch it issues."""
        st = self.profile.layers[layer]
        pre = g.add("pre", f"L{layer} c{c} pre", "compute", st.pre * scale * share, (after,))
        if not g.comm:
            return g.add("issue", f"L{layer} c{c} issue", "compute", st.issue * scale * share)
        ex = g.add("exchange", f"L{layer} c{c} exchange", self.counts_stream, self.link.time_ms(0), (pre,))
        issue = g.add("issue", f"L{layer} c{c} issue", "compute", st.issue * scale * share, (ex,))
        return g.add(
            "dispatch", f"L{layer} c{c} dispatch", "comm", self.link.time_ms(st.dispatch_bytes * share), (issue,)
        )

    def _forward(self, g: "_StepGraph", shares: list, scale: float) -> None:
        """The forward, in the round-robin scheduler's issue order: per layer, every chunk's pre +
        dispatch, then every chunk's experts + combine, then every chunk's post with the next layer's pre."""
        p, n = self.profile, len(shares)
        L = len(p.layers)
        if L == 0:
            for c in range(n):
                g.add("pre", f"c{c} forward", "compute", p.forward_ms * scale * shares[c])
        dispatch = [self._phase_a(g, 0, c, None, shares[c], scale) if L else None for c in range(n)]
        combine = [None] * n
        for layer in range(L):
            st = p.layers[layer]
            for c in range(n):
                e = g.add(
                    "experts",
                    f"L{layer} c{c} experts",
                    "compute",
                    st.experts * scale * shares[c],
                    (dispatch[c],),
                    reads=dispatch[c],
                )
                combine[c] = (
                    g.add(
                        "combine",
                        f"L{layer} c{c} combine",
                        "comm",
                        self.link.time_ms(st.combine_bytes * shares[c]),
                        (e,),
                    )
                    if g.comm
                    else e
                )
            for c in range(n):
                post = g.add(
                    "post",
                    f"L{layer} c{c} post",
                    "compute",
                    st.post * scale * shares[c],
                    (combine[c],),
                    reads=combine[c],
                )
                if layer + 1 < L:
                    dispatch[c] = self._phase_a(g, layer + 1, c, post, shares[c], scale)
                else:
                    g.add("tail", f"c{c} tail", "compute", p.tail_ms * scale * shares[c])

    def _backward(self, g: "_StepGraph", scale: float) -> None:
        """The backward: the reverse of the forward's creation order, deferred dW drained while the
        backward all-to-alls fly and flushed at the end."""
        p, tl, kinds, consumes = self.profile, g.tl, g.kinds, g.consumes
        n_fwd = len(tl.ops)
        fwd = list(tl.ops)
        fwd_compute = sum(o.ms for o in fwd if o.stream == "compute")
        bwd_total = p.backward_ms * scale
        dw_total = p.dw_ms * scale if self.defer_wgrad else 0.0
        ratio = (bwd_total - dw_total) / fwd_compute if fwd_compute > 0 else 0.0
        dw_weight = sum(o.ms for o, k in zip(fwd, kinds) if k in ("pre", "experts"))
        pool = 0.0
        issued: dict = {}  # forward all-to-all -> its backward all-to-all
        waits: list = []  # backward all-to-alls the next compute op waits for
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
