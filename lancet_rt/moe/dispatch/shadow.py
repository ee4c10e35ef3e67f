"""Hot-expert shadowing: the all-to-all dispatch with the hottest experts computed where their tokens are.

Under skewed routing the rank holding a hot expert receives several times the mean rows: its port
holds every all-to-all and its expert work holds every return (the straggler;
:class:`lancet_rt.comm.emulated_skew.SkewedGroup` models it). FasterMoE (Jiaao He et al., PPoPP'22,
"shadowing") moves the weights instead of the tokens: a hot expert's parameters are broadcast to
every rank, each rank computes its own tokens' rows of it, and the weight gradients are reduced back
to the owner; it pays when the expert's tokens outweigh its parameters (their abstract credits
shadowing, a fine-grained schedule and a congestion-avoiding gate together; docs/design.md quotes
it). This module is our own implementation of the idea for lancet's layer:

1. **Which experts, agreed.** With ``MoE(shadow_experts=N)`` the counts exchange carries each rank's
   kept rows of all E experts (:meth:`~lancet_rt.moe.dispatch.alltoall.AllToAll.loads`), so every rank
   holds the same global loads after it and takes the same decision (:func:`hot_experts`): at most N
   experts per step: those fetched by an earlier chunk of the step (free now), then the first k of
   the experts above :data:`HOT_LOAD` x the mean load, most loaded first (ties to the lower index),
   k chosen to maximise the bytes saved on the busiest port (max over ranks of rows sent or received
   off rank, once their rows stay home; dispatch and combine, ``chunks`` chunks at this chunk's
   counts) minus what fetching the k experts moves through a port (k = 0 when nothing pays).
2. **Fetch once per step.** A shadowed expert's weights (and biases) are fetched by one broadcast
   from the owner (groups without ``broadcast``/``reduce``: an all-reduce in which the owner gives
   them and every other rank zeros, exact as x + 0 = x); its backward reduces the weight gradients
   into the owner's parameters. Under :class:`lancet_rt.Overlapped` the fetched copy is kept in the step's
   chunk scope, so the other
   chunks use it without a collective and the gradient is reduced once, after every chunk's backward.
   On an :class:`~lancet_rt.comm.emulated.EmulatedGroup` (one process is every rank) the reduce is
   ``"avg"``: the link is held for both, the data stays (every emulated rank is rank 0).
3. **Dispatch the rest.** The chunk's ``row_TK`` is remapped so that the permute writes the shadowed
   experts' rows last (no row is copied); their counts are zeroed on both sides (every rank knows
   them) and the other rows go through the ordinary dispatch, experts and combine, while this rank's
   rows of the shadowed experts run through the same expert kernels
   (:class:`lancet_rt.moe.experts._ExpertsFn`) with the fetched weights; the unpermute reads the
   combine's rows followed by those.

Exactness: every row meets the same weights and the same kernels as without shadowing, so outputs,
the input's and the router's gradients are unchanged up to what the grouped GEMM's row count may
change (as chunking, which moves segment sizes too). The shadowed experts' weight gradients are the
one reassociated sum: each rank's partial dW (over its rows), then the reduce's sum, instead of
one GEMM over all ranks' rows in rank order (float32: rel RMS error ~1e-7, held to 1e-6 in
tests/distributed/test_shadow.py). Routing, drops and losses are untouched.

The fetch is issued before the chunk's dispatch and waited after the chunk's switch (other chunks run
meanwhile); the gradients' reduce is issued by the fetch's backward and waited by the node before it
(:class:`_AwaitGrad`), which the autograd engine runs after the other ready work. Not done, and refused
on every rank before any collective (:func:`unsupported`, ``MoEConfig``, ``lancet_rt.parallel``):
shadowing with ``pipeline_chunks > 1`` (the Tutel-style baseline dispatches without it), with FSDP2
(``fully_shard``), and with activation checkpointing under an Overlapped of several chunks.
"""

from __future__ import annotations

from typing import Optional

import torch

from lancet_rt import trace as _trace
from lancet_rt.comm.emulated import EmulatedGroup
from lancet_rt.kernels.cpu_backend import HostBounds
from lancet_rt.moe.dispatch.alltoall import AllToAll
from lancet_rt.moe.dispatch.base import Chunk, Exchanged
from lancet_rt.moe.dispatch.common import counts_turn, host_bounds, to_device
from lancet_rt.moe.experts import _ExpertsFn
from lancet_rt.runtime import casts
from lancet_rt.runtime import recompute as _recompute
from lancet_rt.runtime import scope as _scope

#: An expert is hot when its load exceeds this many times the mean expert load.
HOT_LOAD = 1.25


def check_group(shadow_experts: int, group) -> None:
    """A ValueError unless ``group`` can fetch weights (it has ``all_reduce``) when shadowing is on."""
    if shadow_experts and group is not None and not callable(getattr(group, "all_reduce", None)):
        raise ValueError(
            f"shadow_experts needs an ep_group with all_reduce (TorchGroup, EmulatedGroup), got {type(group).__name__}"
        )


def unsupported(moe, experts) -> Optional[ValueError]:
    """Why ``moe`` (shadowing, with a group) cannot run this forward, or None: checked at each forward
    before the layer's first collective, and raised on every rank through the layer's status exchange.

    Not supported: ``pipeline_chunks > 1`` (the Tutel-style baseline dispatches without shadowing; also
    refused by :class:`~lancet_rt.moe.config.MoEConfig`, this catches a later change of the attribute);
    experts sharded by FSDP2 (a fetch broadcasts the owner's whole weights, FSDP2 holds a dp shard of
    them as a DTensor); activation checkpointing (:func:`lancet_rt.checkpoint`) under an Overlapped
    with several chunks (the chunks after the first reuse the step's fetched copy, which the
    recomputation in backward cannot replay: torch's checkpoint then finds other saved tensors).
    """
    n = moe.shadow_experts
    if moe.pipeline_chunks > 1:
        return ValueError(
            f"shadow_experts={n} cannot be combined with pipeline_chunks={moe.pipeline_chunks} (the "
            f"Tutel-style pipelined dispatch does not shadow experts); set one of them to its default"
        )
    if _sharded(experts):
        return ValueError(
            f"shadow_experts={n} cannot be combined with FSDP2 (fully_shard) on the experts: shadowing "
            f"broadcasts an expert's whole weights from its owner and FSDP2 holds a shard of them; use "
            f"shadow_experts=0, or lancet_rt.parallel.replicate / GradientSync"
        )
    if _recompute.recording() and _scope.current() is not None:
        return ValueError(
            f"shadow_experts={n} cannot be combined with activation checkpointing (lancet_rt.checkpoint) "
            f"under Overlapped with more than one chunk: the chunks share one fetched copy of the hot "
            f"experts, which the recomputation cannot replay; use shadow_experts=0, chunks=1, or "
            f"checkpoint outside the MoE layers"
        )
    return None


def _sharded(experts) -> bool:
    """Whether FSDP2 manages ``experts`` as a unit of its own (its parameters are DTensors outside its forward)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in experts.parameters())


def hot_experts(
    loads_WE: list, limit: int, L: int, row_bytes: int, fetch_bytes: float, chunks: int, fetched=()
) -> list:
    """The experts to shadow (sorted), from every rank's kept rows per expert (module docstring, 1).

    Args:
        loads_WE: [W][E] rows each rank keeps per expert in this chunk (host ints, the same on every rank).
        limit: at most this many experts (fetched ones included).
        L: experts per rank (expert e lives on rank e // L).
        row_bytes: one row's bytes.
        fetch_bytes: what fetching one expert moves through the busiest port (and its gradient back).
        chunks: chunks in this step (the rows of the step estimated as this chunk's times ``chunks``).
        fetched: experts already fetched in this step (shadowed whatever their load).
    """
    W, E = len(loads_WE), len(loads_WE[0]) if loads_WE else 0
    load = [sum(row[e] for row in loads_WE) for e in range(E)]
    total = sum(load)
    # Each rank's port (rows it sends off rank, rows it receives off rank), as the dispatch would load it.
    sent = [sum(row) - sum(row[w * L : (w + 1) * L]) for w, row in enumerate(loads_WE)]
    recv = [sum(load[r * L : (r + 1) * L]) - sum(loads_WE[r][r * L : (r + 1) * L]) for r in range(W)]

    def without(e, sent, recv):  # the ports once expert e's rows stay home
        o = e // L
        s2 = [s - (loads_WE[w][e] if w != o else 0) for w, s in enumerate(sent)]
        r2 = list(recv)
        r2[o] -= load[e] - loads_WE[o][e]
        return s2, r2

    fetched = list(fetched)[:limit]
    for e in fetched:  # shadowed anyway (free now): the base to improve on
        sent, recv = without(e, sent, recv)
    new = [
        e
        for e in sorted(range(E), key=lambda e: (-load[e], e))
        if e not in fetched and total and load[e] * E > HOT_LOAD * total
    ][: max(limit - len(fetched), 0)]
    base = max(sent + recv, default=0)
    k_best, net_best = 0, 0.0
    for k, e in enumerate(new, 1):  # the net saving of also shadowing the first k new ones
        sent, recv = without(e, sent, recv)
        net = 2 * chunks * (base - max(sent + recv)) * row_bytes - k * fetch_bytes
        if net >= net_best:
            k_best, net_best = k, net
    out = fetched + new[:k_best]
    return sorted(out)


def _rooted(group) -> bool:
    """Whether ``group`` has rooted collectives (broadcast, reduce); else the fetch is an all-reduce."""
    return callable(getattr(group, "broadcast", None)) and callable(getattr(group, "reduce", None))


def fetch_bytes(group, weight_bytes: int) -> float:
    """What fetching an expert's ``weight_bytes`` moves through the busiest port: once with a broadcast
    (pipelined), ``2 (W - 1) / W`` times with the all-reduce fallback."""
    W = group.size
    return float(weight_bytes) if _rooted(group) else 2 * (W - 1) / W * weight_bytes


class _Box:
    """A collective's handle, from the node that issues it to the one that waits for it."""

    work = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class _Fetch(torch.autograd.Function):
    """One expert's parameters from its owner to every rank (a broadcast, or an all-reduce of the owner's
    values and the others' zeros), issued here and waited by the first user (``fwd``); backward issues
    the gradients' sum into the owner (a reduce, or an all-reduce) and :class:`_AwaitGrad` waits for it."""

    @staticmethod
    def forward(ctx, group, owner: int, op: str, fwd: _Box, bwd: _Box, *ws):
        flat = torch.cat([w.detach().reshape(-1) for w in ws])
        rooted = _rooted(group)
        if rooted:
            fwd.work = group.broadcast(flat, owner)
        else:
            if owner != group.rank:
                flat.zero_()
            fwd.work = group.all_reduce(flat, op)
        ctx.group, ctx.owner, ctx.op, ctx.rooted, ctx.bwd = group, owner, op, rooted, bwd
        ctx.shapes = [w.shape for w in ws]
        return tuple(t.view(s) for t, s in zip(flat.split([w.numel() for w in ws]), ctx.shapes))

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])  # a new buffer: reduced in place
        with _trace.span("shadow grad reduce"):
            if ctx.rooted:
                ctx.bwd.work = ctx.group.reduce(flat, ctx.owner, ctx.op)
            else:
                ctx.bwd.work = ctx.group.all_reduce(flat, ctx.op)
        if ctx.owner != ctx.group.rank:
            flat = torch.zeros_like(flat)  # (zeros, not None: every rank's _AwaitGrad runs and waits)
        return (None,) * 5 + tuple(t.view(s) for t, s in zip(flat.split([g.numel() for g in grads]), ctx.shapes))


class _AwaitGrad(torch.autograd.Function):
    """Identity on the parameters going into :class:`_Fetch`; its backward waits for the gradients'
    reduce, so that the autograd engine runs other ready work (later nodes first) while it flies."""

    @staticmethod
    def forward(ctx, box: _Box, *ws):
        ctx.box = box
        return tuple(w.view_as(w) for w in ws)

    @staticmethod
    def backward(ctx, *grads):
        ctx.box.wait()
        return (None,) + grads


def _fetched(moe, experts, e: int, cache: dict) -> tuple:
    """Expert ``e``'s parameters on this rank, [1, ...] each, fetched once per step (``cache``: expert ->
    (parameters, the fetch's box, whose ``wait()`` the first user calls))."""
    if e not in cache:
        L, group = moe.num_local_experts, moe.group
        emulated = isinstance(group, EmulatedGroup)  # every emulated rank is rank 0, the owner of its aliases
        # Every rank passes a slice of its own parameters (the owner: expert e's), so that every rank's
        # graph holds the fetch and every rank reaches its backward collective.
        fwd, bwd = _Box(), _Box()
        ws = _AwaitGrad.apply(bwd, *(p[e % L : e % L + 1] for p in experts._params()))
        with _trace.span("shadow fetch", layer=moe.trace_name, expert=e):
            cache[e] = (
                _Fetch.apply(group, group.rank if emulated else e // L, "avg" if emulated else "sum", fwd, bwd, *ws),
                fwd,
            )
    return cache[e]


def _step_cache(moe) -> dict:
    """The experts fetched in this step: kept in the chunk scope (one per step), or fresh per call."""
    s = _scope.current()
    fresh = dict(fetched={}, stacked={})  # expert -> (parameters, box); tuple of experts -> stacked parameters
    return fresh if s is None else s.layer_state.setdefault(("shadow", id(moe)), fresh)


def _remap_rows(row_TK: torch.Tensor, sent_E: list, hot: list) -> tuple:
    """(row_TK', n_keep): each assignment's dispatch row once the kept experts' rows come first and the
    shadowed experts' last (each group by expert, ``sent_E`` rows each; -1 stays -1); ``n_keep`` rows
    are dispatched. The permute then writes, and the unpermute reads, that order: no row is copied."""
    bounds = host_bounds(sent_E)
    hot_set = set(hot)
    experts = [e for e in range(len(sent_E)) if e not in hot_set] + list(hot)
    counts = [sent_E[e] for e in experts]
    first = host_bounds(counts)
    new_first = dict(zip(experts, first))
    shift_E = torch.tensor([new_first[e] - bounds[e] for e in range(len(sent_E))])  # new row - old row
    move = torch.repeat_interleave(shift_E, torch.tensor(sent_E), output_size=bounds[-1])
    move = to_device(move.to(row_TK.dtype), row_TK.device)
    kept = row_TK >= 0
    new = torch.where(
        kept, row_TK + move.index_select(0, row_TK.clamp(min=0).reshape(-1).long()).view_as(row_TK), row_TK
    )
    return new, first[-1] - sum(sent_E[e] for e in hot)


def _stacked(cache: dict, hot: list, fetches: list) -> list:
    """The shadowed experts' parameters stacked [H, ...] (once per step and set: ``cache``)."""
    key, stacked = tuple(hot), cache["stacked"]
    if key not in stacked:
        params = [f for f, _ in fetches]
        stacked[key] = [per_expert[0] if len(per_expert) == 1 else torch.cat(per_expert) for per_expert in zip(*params)]
    return stacked[key]


def _shadow_compute(moe, experts, x_HD: torch.Tensor, counts_H: list, stacked: list, ops) -> torch.Tensor:
    """The shadowed experts over this rank's rows of them (grouped by expert, ``counts_H`` each)."""
    present = (True, True) + tuple(b is not None for b in (experts.gate_up_proj_bias, experts.down_proj_bias))
    it = iter(stacked)
    tensors = tuple(next(it) if has else None for has in present)
    # (one compute-dtype copy per chunked forward, as the experts' own weights: lancet_rt.runtime.casts)
    weights = tuple(None if t is None else casts.compute_copy(t, x_HD.dtype) for t in tensors)
    bounds = HostBounds(host_bounds(counts_H))
    offsets = to_device(torch.tensor(bounds), x_HD.device)
    with _trace.span("shadow experts", cuda=x_HD.is_cuda, layer=moe.trace_name, rows=x_HD.shape[0]):
        return _ExpertsFn.apply(
            x_HD, *tensors, weights, offsets, bounds, ops, experts._spec, None, None, None, None, None
        )


def _zeroed(counts_WL: list, hot: list, L: int, rank: Optional[int] = None) -> list:
    """Counts [W][L] without the shadowed experts' rows: (w, l) is expert ``w * L + l`` (sent counts, and
    received ones on the emulated link, where rank w's copy receives for it), or ``rank * L + l``
    (received counts: every sender's rows for this rank's expert l)."""
    hot_set = set(hot)
    return [
        [0 if (w if rank is None else rank) * L + l in hot_set else c for l, c in enumerate(row)]
        for w, row in enumerate(counts_WL)
    ]


class Shadow(AllToAll):
    """The all-to-all dispatcher with hot-expert shadowing: its own :meth:`run` (module docstring)."""

    name = "shadow"

    def run(self, c: Chunk) -> Exchanged:
        """:meth:`lancet_rt.moe.dispatch.alltoall.AllToAll.run` with hot-expert shadowing (module docstring);
        the same chunk on every rank issues the same collectives. With experts shadowed, the chunk's
        ``r.row_TK`` is replaced by the order that puts their rows last (:func:`_remap_rows`), which the
        unpermute then reads."""
        moe, x_TD, r, ops, chunk = self.moe, c.x_TD.to(c.dtype), c.route, c.ops, c.index
        counts = self.exchange_counts(r.kept_E, c.dtype)
        counts_turn(moe, x_TD)  # other chunks run while the counts travel (where that pays)
        with _trace.span("wait", "wait", chunk=chunk, counts=True):
            counts.wait()
        recv, sent = counts.host[0][0], counts.host[1][0]
        L = moe.num_local_experts
        sent_E = [n for row in sent for n in row]
        cache = _step_cache(moe)
        s = _scope.current()
        experts = self.routed_experts
        cost = fetch_bytes(moe.group, sum(p[0].numel() * p.element_size() for p in experts._params()))
        hot = hot_experts(
            counts.loads,
            moe.shadow_experts,
            L,
            x_TD.element_size() * x_TD.shape[1],
            cost,
            1 if s is None else len(s.rows),
            cache["fetched"],
        )
        moe.shadowed = hot
        if not hot:
            x_SD, src_S = self.permute(x_TD, r, sum(sent_E), ops, chunk)
            d = self.dispatch(x_SD, r.kept_E, recv, sent)
        else:
            # (issued now, waited before the shadowed experts)
            fetches = [_fetched(moe, experts, e, cache["fetched"]) for e in hot]
            r.row_TK, n_keep = _remap_rows(r.row_TK, sent_E, hot)
            x_SD, src_S = self.permute(x_TD, r, sum(sent_E), ops, chunk)
            mine = None if isinstance(moe.group, EmulatedGroup) else moe.ep_rank
            d = self.dispatch(x_SD[:n_keep], r.kept_E, _zeroed(recv, hot, L, mine), _zeroed(sent, hot, L))
        shared = self.shared(c.x_TD)
        _scope.switch()
        if hot:  # this rank's rows of the shadowed experts, while the dispatch flies
            for _, box in fetches:
                box.wait()
            y_hot = _shadow_compute(
                moe, experts, x_SD[n_keep:], [sent_E[e] for e in hot], _stacked(cache, hot, fetches), ops
            )
        y_recv = self.experts(d.pending.wait(), d, ops, d.pending.link)
        pending = self.combine(y_recv, d)
        _scope.switch()
        if not hot:
            return Exchanged(pending.wait(), src_S, pending.link, shared)
        # (no early backward link: the combine's rows are only the first n_keep of the unpermute's)
        return Exchanged(torch.cat([pending.wait(), y_hot]), src_S, None, shared)
