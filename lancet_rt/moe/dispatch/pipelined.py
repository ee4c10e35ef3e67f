"""The Tutel-style baseline (``MoE(..., pipeline_chunks=P)``, P > 1): every expert's rows cut into P
pieces, each piece dispatched, computed and combined in turn over the all-to-all dispatcher's
stages (:class:`Pipelined`, an :class:`~lancet_rt.moe.dispatch.alltoall.AllToAll` with its own
:meth:`~Pipelined.run`), so piece p's experts overlap piece p+1's transfer. The backward is pipelined the same way,
as Tutel's is: every piece's combine gradient leaves at once (:class:`_JoinPieces`), and each
piece's expert backward issues its dispatch gradient while the other pieces' transfers are in flight.
"""

from __future__ import annotations

import torch

from lancet_rt.moe.dispatch.alltoall import AllToAll
from lancet_rt.moe.dispatch.base import Chunk, Exchanged
from lancet_rt.moe.dispatch.common import to_device
from lancet_rt.runtime import scope as _scope


def _pieces(kept: list, P: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, kept_PE): the dispatch rows piece by piece, then expert by expert, and each piece's
    kept rows per expert (piece p takes rows [kept_e p / P, kept_e (p+1) / P) of expert e)."""
    E = len(kept)
    starts = [0]
    for k in kept[:-1]:
        starts.append(starts[-1] + k)
    bounds = [[starts[e] + kept[e] * p // P for e in range(E)] for p in range(P + 1)]
    kept_PE = torch.tensor([[bounds[p + 1][e] - bounds[p][e] for e in range(E)] for p in range(P)])
    order = to_device(
        torch.cat(
            [torch.arange(bounds[p][e], bounds[p + 1][e]) for p in range(P) for e in range(E)]
            + [torch.zeros(0, dtype=torch.long)]
        ),
        device,
    )
    return order, kept_PE


class Pipelined(AllToAll):
    """The Tutel-style baseline: the all-to-all dispatcher's stages, P pieces in turn (module docstring)."""

    name = "pipelined"

    def run(self, c: Chunk) -> Exchanged:
        """The baseline's permute, P dispatches, experts and combines; the shared experts run while the
        dispatches fly."""
        moe, x_TD, r, ops, chunk = self.moe, c.x_TD.to(c.dtype), c.route, c.ops, c.index
        P = moe.pipeline_chunks
        kept = r.kept_E.tolist()  # host sync: the pieces' bounds
        x_SD, src_S = self.permute(x_TD, r, sum(kept), ops, chunk)
        order, kept_PE = _pieces(kept, P, x_SD.device)
        pieces = x_SD.index_select(0, order).split(kept_PE.sum(1).tolist())
        kept_PE = to_device(kept_PE, x_SD.device)
        if moe.group is not None:
            exchange = self.exchange_counts(kept_PE, c.dtype)
            exchange.wait()
            counts, sent = exchange.host  # host ints, [P][W][E_local] each
        else:
            counts = sent = [None] * P
        ds = [self.dispatch(pieces[p], kept_PE[p], counts[p], sent[p]) for p in range(P)]
        shared = self.shared(c.x_TD)
        _scope.switch()
        combines = [self.combine(self.experts(d.pending.wait(), d, ops, d.pending.link), d) for d in ds]
        _scope.switch()
        y_pieces = [done.wait() for done in combines]
        return Exchanged(_JoinPieces.apply(order, [done.link for done in combines], *y_pieces), src_S, None, shared)


class _JoinPieces(torch.autograd.Function):
    """The pipelined baseline's combined pieces back in dispatch-row order (``y_SD[order] = cat(pieces)``).

    Backward issues every piece's combine all-to-all gradient at once, last piece first: the engine
    then runs the pieces' backward from the last to the first (latest-created node first), so each
    piece's transfer is the next to arrive when its expert backward needs it, and the expert
    backward of one piece overlaps the transfers of the others (Tutel pipelines its backward too).
    """

    @staticmethod
    def forward(ctx, order, links, *pieces):
        ctx.save_for_backward(order)
        ctx.links, ctx.sizes = links, [p.shape[0] for p in pieces]
        y_SD = torch.cat(pieces)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return y_SD.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad_y_SD):
        (order,) = ctx.saved_tensors
        grads = grad_y_SD.index_select(0, order).split(ctx.sizes)
        for link, g in reversed(list(zip(ctx.links, grads))):
            if link is not None:
                link.issue(g)
        return (None, None) + tuple(grads)
