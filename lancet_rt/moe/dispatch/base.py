"""The dispatcher base class: one chunk's stages between the routing and the unpermute.

A dispatcher moves a chunk's permuted rows to their experts' ranks, runs the experts and brings the
outputs back. Its exchanges are issued asynchronously and waited for later
(:class:`lancet_rt.comm.group.Pending`), so that the overlap scheduler
(:mod:`lancet_rt.runtime.scope`) can run other chunks while they fly; :meth:`Dispatcher.run` calls
the stages in order and yields with :func:`lancet_rt.runtime.scope.switch` between them. Each stage
opens a :mod:`lancet_rt.trace` span, which is how profilers see the stages (no method is patched).

The stages (this class holds the ones every dispatcher shares; a subclass adds or overrides what
differs, and calls only down: a stage here never calls back into a subclass or the layer):

- :meth:`~Dispatcher.before_route`: work issued before the routing (nothing here);
- ``exchange_counts``: the counts first, the layer's one host synchronisation (its row's layout is each
  exchanging dispatcher's own: :class:`~lancet_rt.moe.dispatch.alltoall.AllToAll`,
  :class:`~lancet_rt.moe.dispatch.allreduce.AllReduce`);
- :meth:`~Dispatcher.permute`: the chunk's kept rows grouped by expert;
- ``dispatch`` / ``combine``: the rows' exchanges (:class:`~lancet_rt.moe.dispatch.alltoall.AllToAll`);
- :meth:`~Dispatcher.experts`: the grouped SwiGLU experts over the received rows;
- :meth:`~Dispatcher.shared`: the shared experts, run while the dispatch is in flight;
- :meth:`~Dispatcher.unpermute`: the outputs back in token order, weighted over K.

The implementations (:mod:`lancet_rt.moe.dispatch.registry` picks one per forward):

- :class:`~lancet_rt.moe.dispatch.alltoall.AllToAll`: the default expert-parallel all-to-all;
- :class:`~lancet_rt.moe.dispatch.pipelined.Pipelined`: the Tutel-style baseline (``pipeline_chunks > 1``);
- :class:`~lancet_rt.moe.dispatch.shadow.Shadow`: hot-expert shadowing (``shadow_experts > 0``);
- :class:`~lancet_rt.moe.dispatch.allreduce.AllReduce`: Pipeline MoE (``dispatcher="allreduce"``), which
  sends no rows and sums the partial outputs instead.

A dispatcher is made for one forward of one layer (:attr:`lancet_rt.MoE.dispatcher`) over the modules
the layer hands it, and reads the layer's options (:class:`Layer`); it never imports the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol

import torch

from lancet_rt import trace as _trace
from lancet_rt.comm import group as comm
from lancet_rt.moe.dispatch.common import Counts, Dispatched, Route
from lancet_rt.routing.functions import permute, unpermute

#: The values of ``MoE(dispatcher=...)``.
DISPATCHERS = ("alltoall", "allreduce")


class Exchanged(NamedTuple):
    """A row exchange's result on the tokens' rank."""

    y_SD: torch.Tensor  # expert outputs in dispatch-row order
    src_S: Optional[torch.Tensor]  # each row's source assignment (from the permutation)
    link: Optional[object]  # the combine's backward link for unpermute, or None
    shared: Optional[torch.Tensor]  # the shared experts' output [T, D], or None


@dataclass
class Chunk:
    """One chunk of one layer's forward, as the dispatcher's stages read it.

    Attributes:
        x_TD: [T, D] the layer's tokens, in the input's dtype (the shared experts' input).
        dtype: the compute dtype (tokens, all-to-alls, expert GEMMs).
        ops: the kernel namespace (:func:`lancet_rt.ops.get_ops`).
        index: the chunk's index in the overlap scope, or None outside one.
        route: the chunk's routing (set by the layer after :meth:`Dispatcher.before_route`).
        early: what :meth:`Dispatcher.before_route` issued for this chunk, or None.
    """

    x_TD: torch.Tensor
    dtype: torch.dtype
    ops: object
    index: Optional[int]
    route: Optional[Route] = None
    early: Optional[object] = None


class Layer(Protocol):
    """What the dispatchers read of the layer (:class:`lancet_rt.MoE` implements it); its modules are handed
    to the dispatcher by the layer (:class:`Dispatcher`'s Args)."""

    group: Optional[comm.ExpertParallelGroup]
    num_experts: int
    num_local_experts: int
    capacity_factor: Optional[float]
    ep_size: int
    ep_rank: int
    pipeline_chunks: int
    shadow_experts: int
    trace_name: str
    layer_number: int


class Dispatcher:
    """One forward's dispatch of one layer: the stages every dispatcher shares, and :meth:`run`.

    Args:
        moe: the layer (its group and options: :class:`Layer`).
        experts: its routed experts (:class:`lancet_rt.Experts`).
        shared_experts, shared_expert_gate: its shared experts and their gate, or None.
    """

    #: The registry's key (:mod:`lancet_rt.moe.dispatch.registry`).
    name = ""

    def __init__(self, moe: Layer, experts, shared_experts=None, shared_expert_gate=None):
        self.moe = moe
        self.routed_experts, self.shared_experts, self.shared_expert_gate = experts, shared_experts, shared_expert_gate

    @property
    def regroups_rows(self) -> bool:
        """Whether the experts get the rows in received order with a permutation to expert order
        (``Dispatched.to_expert_major``: the kernels then read and write through it as a row map)."""
        return False

    # ---------------------------------------------------------------- stages
    def before_route(self, c: Chunk) -> None:
        """Work issued before the chunk's routing (sets ``c.early``); none by default."""

    def exchange_counts(self, kept_PE: torch.Tensor, dtype: torch.dtype, error: Optional[Exception] = None) -> Counts:
        """Counts first: start sending each rank the rows it will get for each of its local experts.

        ``kept_PE`` holds the kept rows per expert of P pieces sent back to back ([P, E]; a chunk's
        ``kept_E`` [E] as it is for one piece: every exchanging dispatcher takes both); ``dtype`` is the compute
        dtype (the exchange's tag names it). Returns a handle whose ``wait()`` gives recv [P, W, E_local] on
        the host: this is the layer's one host synchronisation point (split sizes must be on the host to
        size the row all-to-all), issued early and waited on late. The exchange carries a status column: a
        rank whose input was rejected (``error``) still takes part, and every rank raises instead of waiting
        in the row all-to-all (:func:`lancet_rt.moe.dispatch.common.exchange_counts`). The row's layout is
        the dispatcher's own: every exchanging dispatcher implements it.
        """
        raise NotImplementedError(f"{type(self).__name__} exchanges no counts")

    def permute(self, x_TD: torch.Tensor, r: Route, num_rows: int, ops, chunk) -> tuple:
        """(x_SD, src_S): the chunk's kept rows grouped by expert (``num_rows`` of them)."""
        with _trace.span("permute", cuda=x_TD.is_cuda, layer=self.moe.trace_name, chunk=chunk):
            return permute(x_TD, r.row_TK, num_rows, ops)

    def experts(self, x_recv: torch.Tensor, d: Dispatched, ops, link=None) -> torch.Tensor:
        """Grouped SwiGLU experts over the received rows (rank-major in, rank-major out)."""
        with _trace.span("experts", cuda=x_recv.is_cuda, layer=self.moe.trace_name, rows=x_recv.shape[0]):
            return self.routed_experts(
                x_recv,
                d.segment_offsets(ops, x_recv.device),
                ops,
                to_expert=d.to_expert_major,
                to_rank=d.to_rank_major,
                link=link,
                bounds=d.bounds_L1,
            )

    def shared(self, x_TD: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared experts' output (gated by sigmoid(shared_expert_gate(x)) if there is a gate)."""
        if self.shared_experts is None:
            return None
        with _trace.span("shared experts", cuda=x_TD.is_cuda, layer=self.moe.trace_name):
            y_TD = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                y_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * y_TD
        return y_TD

    def unpermute(self, c: Chunk, ex: Exchanged) -> torch.Tensor:
        """y_TD [T, D] in the compute dtype: the rows back in token order, weighted over K."""
        r = c.route
        with _trace.span("unpermute", cuda=c.x_TD.is_cuda, layer=self.moe.trace_name, chunk=c.index):
            dropless = self.moe.capacity_factor is None
            return unpermute(ex.y_SD, r.row_TK, r.weight_TK, ex.src_S, c.ops, ex.link, dropless)

    # ---------------------------------------------------------------- orchestration
    def run(self, c: Chunk) -> Exchanged:
        """The chunk's stages from the routing to the rows back on the tokens' rank."""
        raise NotImplementedError
