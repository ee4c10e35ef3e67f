"""Pipeline MoE dispatch (PPMoE, Chen et al., arXiv 2304.11414): no all-to-all, one all-reduce.

``MoE(..., dispatcher="allreduce")``. Inside a tensor-parallel group every rank already holds the
same tokens (the layer before the MoE ends in an all-reduce), so nothing needs sending to the
experts: each rank holds **whole experts** (the same ``[E/W, ...]`` layout and expert-to-rank map as
expert parallelism: expert e on rank e // (E/W)), routes the whole batch (the router is replicated),
takes the rows routed to its own experts by index slicing, computes them, and sums its partial
outputs with the other ranks' in **one all-reduce**.

Per layer and chunk of T tokens (D wide, b bytes per element, W ranks, K experts per token):

- forward: an all-reduce of the partial outputs ``[T, D]`` (a ring moves ``2 (W-1)/W x T D b`` per
  rank) against the all-to-all path's dispatch and combine (``2 x (W-1)/W x T K D b``, less the
  dropped assignments); both exchange counts (latency only). Here they carry every rank's
  routing, which must agree, and are waited for only before the all-reduce (the experts need just
  the local counts), so a rank with other tokens, or a rejected input, raises on every rank
  instead of hanging;
- backward: the input's gradient through the experts is partial on each rank and is all-reduced
  (``[T, D]``); so are the routing weights' gradients (``[T, K]`` float32), which makes the router's
  backward, aux and z-loss included, the same full computation on every rank (Megatron's
  "copy to tensor-parallel region": identity forward, all-reduce backward);
- memory: parameters as expert parallelism (E/W experts per rank); activations: the routing of the
  whole batch (replicated), and the local experts' rows only.

Per rank the all-reduce path moves ``1/K`` of the all-to-all path's bytes for the same T, but the
group shares one batch: for the group to process as many tokens as W expert-parallel ranks do
(each rank computing as many expert rows), T is W times larger, and the all-reduce moves ``W/K``
times the all-to-all's bytes. On one link it wins when ``W < K``, when latency dominates (fewer,
larger collectives), or when its link is faster (a tensor-parallel group inside a node, NVLink,
against an expert-parallel all-to-all across nodes: it wins while ``W/K`` stays under the
bandwidth ratio). It also replicates the router, gating and permutation over the group's batch.

Exactness: the routing is the contract's over the whole (replicated) batch, so outputs, drops,
aux/z losses and every gradient equal the unsharded layer's on every rank (tests/test_seeds.py,
2 gloo ranks, dropless and with capacity, chunked or not).
"""

from __future__ import annotations

import itertools
from typing import Optional, Protocol, runtime_checkable

import torch

from lancet_rt import trace as _trace
from lancet_rt.comm import group as comm
from lancet_rt.moe.dispatch.base import Chunk, Dispatcher, Exchanged
from lancet_rt.moe.dispatch.common import Counts, counts_turn, exchange_counts, to_device
from lancet_rt.routing.functions import permute, unpermute
from lancet_rt.runtime import scope as _scope
from lancet_rt.runtime import wgrad


@runtime_checkable
class TensorParallelGroup(comm.ExpertParallelGroup, Protocol):
    """An expert-parallel group that can also all-reduce (what ``dispatcher="allreduce"`` needs).

    Implemented by :class:`lancet_rt.TorchGroup` and :class:`lancet_rt.EmulatedGroup`.
    """

    def all_reduce(self, tensor: torch.Tensor) -> comm.Work:
        """Start a sum all-reduce of ``tensor`` in place; ``tensor`` is valid after ``wait()``."""


class _InFlight:
    """An all-reduce in flight, as :class:`lancet_rt.comm.group.Pending` waits on it."""

    def __init__(self, chunk):
        self.work, self.chunk = None, chunk


def _ring_bytes(group, t: torch.Tensor) -> int:
    W = group.size
    return 2 * (W - 1) * t.numel() * t.element_size() // W


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group (async; the consumer waits). Backward: identity, since the output is the
    same on every rank and so is its gradient (Megatron's "reduce from tensor-parallel region")."""

    @staticmethod
    def forward(ctx, y_TD, group, flight):
        out = y_TD.contiguous().clone()
        flight.work = group.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GradLink:
    """A backward all-reduce's plan: issued by a hook on its consumer's backward node as soon as that
    node has produced the gradient, and waited for by its own node, created before the consumer (a
    tensor hook would only run when its own node does), so that the autograd engine runs other work
    (this chunk's gating and router, other chunks) while it flies."""

    def __init__(self, group, chunk):
        self.group, self.chunk, self.early = group, chunk, None

    def issue(self, grad: torch.Tensor) -> None:
        g = grad.contiguous().clone()
        self.early = (g, self.group.all_reduce(g))

    def issue_after(self, consumer_output: torch.Tensor, index: int) -> None:
        """Issue once the backward node of ``consumer_output`` has computed its input ``index``'s gradient."""
        node = consumer_output.grad_fn
        if node is not None:
            node.register_hook(
                lambda grad_inputs, _: (
                    self.issue(grad_inputs[index]) if grad_inputs[index] is not None and self.early is None else None
                )
            )


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; backward: the (partial) gradient summed over the group, the all-reduce in
    flight while deferred dW drains (Megatron's "copy to tensor-parallel region")."""

    @staticmethod
    def forward(ctx, x, link):
        ctx.link, ctx.wgrad = link, wgrad.current()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        link = ctx.link
        hold = getattr(link.group, "hold_ms", None)
        window = (lambda: hold(_ring_bytes(link.group, grad))) if hold is not None else (lambda: None)
        return comm.finish_backward(link, grad, ctx.wgrad, window), None


def _grad_all_reduce(x: torch.Tensor, group, chunk) -> tuple:
    """(``x`` as identity whose gradient is all-reduced in backward, its :class:`_GradLink`)."""
    link = _GradLink(group, chunk)
    return _GradAllReduce.apply(x, link), link


def check_group(group) -> None:
    """A TypeError unless ``group`` can all-reduce (``dispatcher="allreduce"``)."""
    if group is not None and not isinstance(group, TensorParallelGroup):
        raise TypeError(
            f"dispatcher='allreduce' needs a group with all_reduce(tensor) (a ProcessGroup, "
            f"lancet_rt.TorchGroup or lancet_rt.EmulatedGroup), got {type(group).__name__}"
        )


class AllReduce(Dispatcher):
    """PPMoE's dispatch (module docstring): the tokens are replicated, each rank computes its experts'
    rows and one all-reduce sums the outputs; the unpermute runs before the all-reduce, in :meth:`run`."""

    name = "allreduce"

    def before_route(self, c: Chunk) -> None:
        """The tokens as the experts' path sees them, and their gradient's link (before the routing, so
        that the all-reduce, issued when the permutation's backward has run, is waited for after the
        router's backward); under autocast the replicated tokens meet the experts in the autocast dtype."""
        c.early = _grad_all_reduce(c.x_TD.to(c.dtype), self.moe.group, c.index)

    def exchange_counts(self, kept_PE: torch.Tensor, dtype: torch.dtype, error: Optional[Exception] = None) -> Counts:
        """:meth:`~lancet_rt.moe.dispatch.base.Dispatcher.exchange_counts`: every rank gets every rank's counts
        over all E experts (they must agree)."""
        L, W = self.moe.num_experts, self.moe.ep_size
        P = 1 if kept_PE.dim() == 1 else kept_PE.shape[0]
        counts = kept_PE.reshape(1, P * L).expand(W, -1).long()
        return exchange_counts(self.moe, kept_PE, counts, L, None, error, dtype)

    def unpermute(self, c: Chunk, ex: Exchanged) -> torch.Tensor:
        """y_TD as :meth:`run` returned it (unpermuted before the all-reduce)."""
        return ex.y_SD

    def run(self, c: Chunk) -> Exchanged:
        """The layer's stages after routing, PPMoE style (module docstring): y_TD [T, D] in the input's
        dtype, and the shared experts' output, in :class:`~lancet_rt.moe.dispatch.base.Exchanged`.

        ``c.early``, from :meth:`before_route`: [T, D] this chunk's tokens, the same on every rank of the
        group, and their gradient's link; ``c.route``: the chunk's routing, the same on every rank.
        """
        moe, r, ops, chunk = self.moe, c.route, c.ops, c.index
        (x_TD, x_link), group, L = c.early, moe.group, moe.num_local_experts
        w_TK, w_link = _grad_all_reduce(r.weight_TK, group, chunk)  # waited for before the gating's backward
        # Every rank's kept rows per expert (+ status), checked before the all-reduce: waiting for them
        # now would hold this chunk's experts behind the transfers in flight (a FIFO link, one NCCL
        # communicator), so the local counts size the permutation.
        counts = self.exchange_counts(r.kept_E, c.dtype)
        kept = r.kept_E.tolist()  # host sync: the local experts' rows size the permutation
        # Other chunks run (and create their autograd nodes) between this chunk's routing and its experts:
        # in backward their work then fills the window of this chunk's gradient all-reduces.
        _scope.switch()
        lo = sum(kept[: moe.ep_rank * L])
        mine = kept[moe.ep_rank * L : (moe.ep_rank + 1) * L]
        rows = sum(mine)
        with _trace.span("permute", cuda=x_TD.is_cuda, layer=moe.trace_name, chunk=chunk):
            row_TK = r.row_TK
            local_TK = (row_TK >= lo) & (row_TK < lo + rows)
            row_TK = torch.where(local_TK, row_TK - lo, torch.full_like(row_TK, -1))
            x_SD, src_S = permute(x_TD, row_TK, rows, ops)
        x_link.issue_after(x_SD, 0)
        offsets = to_device(torch.tensor(list(itertools.accumulate(mine, initial=0)), dtype=torch.int64), x_TD.device)
        with _trace.span("experts", cuda=x_TD.is_cuda, layer=moe.trace_name, rows=rows):
            y_SD = self.routed_experts(x_SD, offsets, ops)
        with _trace.span("unpermute", cuda=x_TD.is_cuda, layer=moe.trace_name, chunk=chunk):
            y_TD = unpermute(y_SD, row_TK, w_TK, src_S, ops)
        w_link.issue_after(y_TD, 2)
        counts_turn(moe, y_TD)  # other chunks run while the counts arrive (where that pays); then the all-reduce
        with _trace.span("wait", "wait", chunk=chunk, counts=True):
            counts.wait()
            recv_WE = counts.received()[0]
        differ = [q for q in range(recv_WE.shape[0]) if not torch.equal(recv_WE[q], recv_WE[moe.ep_rank])]
        if differ:  # every rank holds the same matrix, so every rank raises (before the all-reduce)
            raise ValueError(
                f"x must be the same on every rank of the group with dispatcher='allreduce' (the tokens "
                f"are replicated); rank(s) {differ} route other tokens than rank {moe.ep_rank}"
            )
        flight = _InFlight(chunk)
        with _trace.span("all_reduce", cuda=x_TD.is_cuda, layer=moe.trace_name, rows=x_TD.shape[0]):
            pending = comm.Pending(_AllReduceSum.apply(y_TD, group, flight), flight)
        _scope.switch()
        y_TD = pending.wait().to(c.x_TD.dtype)
        return Exchanged(y_TD, None, None, self.shared(c.x_TD))


def modeled_bytes(
    tokens: int, d_model: int, top_k: int, world: int, element_size: int, kept_fraction: float = 1.0
) -> dict:
    """Off-rank bytes per rank of one MoE layer's forward + backward, by dispatcher (the link model).

    Args:
        tokens: T on this rank (replicated over the group for "allreduce").
        d_model, top_k, world, element_size: D, K, W, b.
        kept_fraction: kept assignments / (T K) (capacity drops shrink the all-to-alls).

    Returns:
        ``{"alltoall": 4 x (W-1)/W x T K D b x kept, "allreduce": 2 x 2 (W-1)/W x T D b + the
        routing weights' gradient 2 (W-1)/W x T K 4}``.
    """
    share = (world - 1) / world
    return dict(
        alltoall=4 * share * tokens * top_k * d_model * element_size * kept_fraction,
        allreduce=2 * 2 * share * tokens * d_model * element_size + 2 * share * tokens * top_k * 4,
    )
