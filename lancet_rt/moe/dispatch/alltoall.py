"""The default dispatcher: expert parallelism over all-to-alls (each rank its own tokens).

Counts first (:meth:`~lancet_rt.moe.dispatch.base.Dispatcher.exchange_counts`, the layer's one host
sync, issued early and waited late), then the rows to the experts' ranks, the experts, and the
outputs back; the shared experts run while the dispatch is in flight, and the layer yields to the
overlap scheduler while each exchange flies. :class:`AllToAll` adds the rows' exchanges (``dispatch``,
``combine``) to the base class's stages; the pipelined and shadowing dispatchers reuse them.
"""

from __future__ import annotations

from typing import Optional

import torch

from lancet_rt import trace as _trace
from lancet_rt.comm import group as comm
from lancet_rt.kernels.cpu_backend import HostBounds
from lancet_rt.moe.dispatch.base import Chunk, Dispatcher, Exchanged
from lancet_rt.moe.dispatch.common import (
    Counts,
    Dispatched,
    counts_turn,
    exchange_counts,
    host_bounds,
    offsets,
    regroup_permutations,
)
from lancet_rt.runtime import scope as _scope


class AllToAll(Dispatcher):
    """Expert parallelism over all-to-alls: counts, permute, rows out, experts, rows back (module docstring)."""

    name = "alltoall"

    @property
    def regroups_rows(self) -> bool:
        """Rows from several ranks for several local experts arrive rank-major (:meth:`dispatch`)."""
        moe = self.moe
        return moe.group is not None and moe.ep_size > 1 and moe.num_local_experts > 1

    def exchange_counts(self, kept_PE: torch.Tensor, dtype: torch.dtype, error: Optional[Exception] = None) -> Counts:
        """:meth:`~lancet_rt.moe.dispatch.base.Dispatcher.exchange_counts`: each rank gets the rows it will
        receive for each of its local experts; with ``shadow_experts`` every row also carries the sender's kept
        rows of all E experts (the global loads hot-expert shadowing chooses from)."""
        moe = self.moe
        L, W = moe.num_local_experts, moe.ep_size
        one = kept_PE.dim() == 1  # (a chunk's kept_E [E] as it is: one piece, no [1, E] view made for it)
        P = 1 if one else kept_PE.shape[0]
        # (in kept_PE's dtype: the row is made int64 where the status column joins it, common.exchange_counts)
        counts = kept_PE.view(W, L) if P == 1 else kept_PE.view(P, W, L).permute(1, 0, 2).reshape(W, P * L)
        loads = None
        if moe.shadow_experts:
            loads = (kept_PE.long() if one else kept_PE.sum(0).long()).view(1, -1).expand(W, -1)
        return exchange_counts(moe, kept_PE, counts, L, loads, error, dtype)

    def dispatch(
        self, x_SD: torch.Tensor, kept_E: torch.Tensor, counts_WL, sent_WL, ops=None, received=None
    ) -> Dispatched:
        """Send each kept row to its expert's rank (async).

        Args:
            x_SD: [S, D] rows grouped by expert (so by destination rank).
            kept_E: [E] kept rows per expert, on the device.
            counts_WL, sent_WL: [W, E_local] rows received / sent per (rank, local expert), as host
                ints (nested lists, from :attr:`~lancet_rt.moe.dispatch.common.Counts.host`: nothing is
                read here). Without a group: None, or W = 1 rows of the kept rows per expert (the
                experts' segment bounds, so that the references read nothing).
            ops, received: the kernel namespace and the received counts as they arrived (``Counts.arrived``,
                [W, E_local + ...] on the rows' device): on the kernels' path the row maps and the experts'
                bounds are then made there in one launch (``ops.regroup_rows``); else (None, or the
                references) from the host ints.

        Returns:
            The chunk's :class:`~lancet_rt.moe.dispatch.common.Dispatched` layout; its ``pending`` is
            the rows' exchange in flight.
        """
        moe = self.moe
        if moe.group is None:  # (counts_WL: [kept_E] as host ints where known, the experts' bounds)
            bounds_L1 = None if counts_WL is None else HostBounds(host_bounds(counts_WL[0]))
            return Dispatched(
                comm.Pending(x_SD, None), offsets(kept_E), bounds_L1, [x_SD.shape[0]], [x_SD.shape[0]], None, None
            )
        send_splits = [sum(row) for row in sent_WL]
        recv_splits = [sum(row) for row in counts_WL]
        off_rank = (sum(send_splits) - send_splits[moe.ep_rank]) * x_SD.element_size() * x_SD.shape[-1]
        with _trace.span(
            "dispatch", cuda=x_SD.is_cuda, layer=moe.trace_name, rows=x_SD.shape[0], off_rank_bytes=off_rank
        ):
            pending = comm.all_to_all(x_SD, moe.group, recv_splits, send_splits)
        bounds_L1 = HostBounds(host_bounds([sum(col) for col in zip(*counts_WL)]))
        L = len(counts_WL[0])
        if (
            received is not None
            and not getattr(ops, "host_offsets", True)
            and received.device == x_SD.device
            and len(counts_WL) > 1
            and L > 1
        ):
            to_expert, to_rank, offsets_L1 = ops.regroup_rows(received, sum(recv_splits), L)
            return Dispatched(pending, offsets_L1, bounds_L1, send_splits, recv_splits, to_expert, to_rank)
        to_expert, to_rank = regroup_permutations(counts_WL, x_SD.device)
        # (the device offsets are made where the kernels need them: the experts stage, Dispatcher.experts)
        return Dispatched(pending, None, bounds_L1, send_splits, recv_splits, to_expert, to_rank)

    def combine(self, y_recv: torch.Tensor, d: Dispatched) -> comm.Pending:
        """Send expert outputs back to the tokens' ranks (async).

        Args:
            y_recv: [R, D] the experts' outputs in received-row order.
            d: the chunk's layout from :meth:`dispatch`.

        Returns:
            The exchange in flight; ``wait()`` gives y_SD in dispatch-row order.
        """
        moe = self.moe
        if moe.group is None:
            return comm.Pending(y_recv, None)
        with _trace.span("combine", cuda=y_recv.is_cuda, layer=moe.trace_name, rows=y_recv.shape[0]):
            return comm.all_to_all(y_recv, moe.group, d.send_splits, d.recv_splits)

    def run(self, c: Chunk) -> Exchanged:
        """Permute, dispatch, experts, combine; the shared experts run while the dispatch is in flight."""
        moe, x_TD, r, ops, chunk = self.moe, c.x_TD.to(c.dtype), c.route, c.ops, c.index
        if moe.group is None:
            kept = r.kept_E.tolist()  # host sync: the rows, and the experts' bounds for the references, in one read
            x_SD, src_S = self.permute(x_TD, r, sum(kept), ops, chunk)
            d = self.dispatch(x_SD, r.kept_E, [kept], [kept])
        else:
            counts = self.exchange_counts(r.kept_E, c.dtype)
            counts.keep_arrived = not getattr(ops, "host_offsets", True)  # (the kernels make the row maps from them)
            counts_turn(moe, x_TD)  # other chunks run while the counts travel (where that pays)
            with _trace.span("wait", "wait", chunk=chunk, counts=True):
                counts.wait()
            recv, sent = counts.host[0][0], counts.host[1][0]
            x_SD, src_S = self.permute(x_TD, r, sum(map(sum, sent)), ops, chunk)
            received, counts.arrived = counts.arrived, None  # (held no longer than the dispatch needs it)
            d = self.dispatch(x_SD, r.kept_E, recv, sent, ops, received)
        shared = self.shared(c.x_TD)
        _scope.switch()
        y_recv = self.experts(d.pending.wait(), d, ops, d.pending.link)
        pending = self.combine(y_recv, d)
        _scope.switch()
        y_SD = pending.wait()
        s = _scope.current()
        if s is not None and pending.link is not None and y_SD.requires_grad:
            s.last_combine[chunk] = (y_SD, pending.link)  # (lancet_rt.schedule.early_backward)
        return Exchanged(y_SD, src_S, pending.link, shared)
