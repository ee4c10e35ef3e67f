"""The default dispatcher: expert parallelism over all-to-alls (each rank its own tokens).

Counts first (:func:`~lancet_rt.moe.dispatch.common.exchange_counts`, the layer's one host sync,
issued early and waited late), then the rows to the experts' ranks, the experts, and the outputs
back; the shared experts run while the dispatch is in flight, and the layer yields to the overlap
scheduler while each exchange flies.
"""

from __future__ import annotations

import torch

from lancet_rt import trace as _trace
from lancet_rt.comm import group as comm
from lancet_rt.kernels.reference_experts import HostBounds
from lancet_rt.moe.dispatch.base import Exchanged
from lancet_rt.moe.dispatch.common import Dispatched, counts_turn, host_bounds, offsets, regroup_permutations
from lancet_rt.schedule import scope as _scope


def dispatch(moe, x_SD: torch.Tensor, kept_E: torch.Tensor, counts_WL, sent_WL, ops=None, received=None) -> Dispatched:
    """Send each kept row to its expert's rank (async).

    Args:
        moe: the layer (its group and trace name).
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
    if moe.group is None:  # (counts_WL: [kept_E] as host ints where known, the experts' bounds)
        bounds_L1 = None if counts_WL is None else HostBounds(host_bounds(counts_WL[0]))
        return Dispatched(
            comm.Pending(x_SD, None), offsets(kept_E), bounds_L1, [x_SD.shape[0]], [x_SD.shape[0]], None, None
        )
    send_splits = [sum(row) for row in sent_WL]
    recv_splits = [sum(row) for row in counts_WL]
    with _trace.span("dispatch", cuda=x_SD.is_cuda, layer=moe.trace_name, rows=x_SD.shape[0]):
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
    # (the device offsets are made where the kernels need them: MoE.compute_experts)
    return Dispatched(pending, None, bounds_L1, send_splits, recv_splits, to_expert, to_rank)


def combine(moe, y_recv: torch.Tensor, d: Dispatched) -> comm.Pending:
    """Send expert outputs back to the tokens' ranks (async).

    Args:
        moe: the layer (its group and trace name).
        y_recv: [R, D] the experts' outputs in received-row order.
        d: the chunk's layout from :func:`dispatch`.

    Returns:
        The exchange in flight; ``wait()`` gives y_SD in dispatch-row order.
    """
    if moe.group is None:
        return comm.Pending(y_recv, None)
    with _trace.span("combine", cuda=y_recv.is_cuda, layer=moe.trace_name, rows=y_recv.shape[0]):
        return comm.all_to_all(y_recv, moe.group, d.send_splits, d.recv_splits)


def exchange_and_compute(moe, x_TD: torch.Tensor, r, ops, chunk, x_in: torch.Tensor) -> Exchanged:
    """Permute, dispatch, experts, combine (a :class:`~lancet_rt.moe.dispatch.base.Dispatcher`); the
    shared experts (on ``x_in``, the layer's input) run while the dispatch is in flight."""
    if moe.group is None:
        kept = r.kept_E.tolist()  # host sync: the rows, and the experts' bounds for the references, in one read
        x_SD, src_S = moe.permute_rows(x_TD, r, sum(kept), ops, chunk)
        d = moe.dispatch(x_SD, r.kept_E, [kept], [kept])
    else:
        counts = moe.exchange_counts(r.kept_E.view(1, -1))
        counts.keep_arrived = not getattr(ops, "host_offsets", True)  # (the kernels make the row maps from them)
        counts_turn(moe, x_TD)  # other chunks run while the counts travel (where that pays)
        with _trace.span("wait", "wait", chunk=chunk, counts=True):
            counts.wait()
        recv, sent = counts.host[0][0], counts.host[1][0]
        x_SD, src_S = moe.permute_rows(x_TD, r, sum(map(sum, sent)), ops, chunk)
        received, counts.arrived = counts.arrived, None  # (held no longer than the dispatch needs it)
        d = moe.dispatch(x_SD, r.kept_E, recv, sent, ops, received)
    shared = moe.shared_output(x_in)
    _scope.switch()
    y_recv = moe.compute_experts(d.pending.wait(), d, ops, d.pending.link)
    pending = moe.combine(y_recv, d)
    _scope.switch()
    return Exchanged(pending.wait(), src_S, pending.link, shared)
