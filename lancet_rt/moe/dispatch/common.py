"""What the dispatchers and the layer share: one chunk's routing and communication layout, the
counts exchange, and the small index helpers (segment offsets, the rank-major/expert-major
permutations, host-to-device copies without a host sync)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lancet_rt.comm import faults
from lancet_rt.comm import group as comm


@dataclass
class Route:
    """One chunk's routing: what the later stages of the same chunk need."""

    weight_TK: torch.Tensor
    row_TK: torch.Tensor
    kept_E: torch.Tensor


@dataclass
class Dispatched:
    """One chunk's communication layout, from dispatch to combine."""

    pending: comm.Pending
    offsets_L1: torch.Tensor            # [E_local + 1] segment bounds of x_RD, by local expert
    send_splits: list
    recv_splits: list
    to_expert_major: Optional[torch.Tensor]  # rank-major -> expert-major row permutation
    to_rank_major: Optional[torch.Tensor]


class Counts:
    """A counts exchange in flight (see :func:`exchange_counts`)."""

    def __init__(self, exchange, P, W, L, error):
        self._exchange, self._shape, self._error = exchange, (P, W, L), error

    def wait(self) -> torch.Tensor:
        """recv [P, W, E_local] on the host; raises if any rank reported a rejected input."""
        P, W, L = self._shape
        recv = self._exchange.wait()
        faults.raise_on_bad_status(recv[:, P * L], self._error)
        return recv[:, : P * L].view(W, P, L).permute(1, 0, 2)

    def sent(self) -> torch.Tensor:
        """This rank's own counts [P, W, E_local] on the host (after :meth:`wait`)."""
        P, W, L = self._shape
        return self._exchange.sent[:, : P * L].view(W, P, L).permute(1, 0, 2)


def exchange_counts(moe, kept_PE: torch.Tensor, error: Optional[Exception] = None) -> Counts:
    """Start sending each rank the rows it will get for each of its local experts (counts first).

    Args:
        moe: the layer (its group, ``num_experts``, ``num_local_experts``, ``ep_size``, ``dispatcher``).
        kept_PE: [P, E] kept rows per expert of P pieces sent back to back.
        error: this rank's rejected-input error, sent as a status column so that every rank raises.

    Returns:
        A :class:`Counts` handle; with ``dispatcher="allreduce"`` every rank gets every rank's
        counts over all E experts (they must agree).
    """
    L, W = moe.num_local_experts, moe.ep_size
    P = kept_PE.shape[0]
    if moe.dispatcher == "allreduce":
        L = moe.num_experts
        counts = kept_PE.reshape(1, P * L).expand(W, -1).long()
    else:
        counts = kept_PE.view(P, W, L).permute(1, 0, 2).reshape(W, P * L).long()
    status = torch.full((W, 1), faults.status_code(error), dtype=torch.long, device=counts.device)
    group = moe.group
    return faults.in_order(group, lambda: Counts(group.exchange(torch.cat([counts, status], dim=1)), P, W, L, error))


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """Segment bounds [n + 1] (int64) of ``counts`` [n]."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts.long(), 0, out=out[1:])
    return out


def regroup_permutations(counts_WL: torch.Tensor, device, total: Optional[int] = None):
    """Row permutations between the received (rank-major) and the grouped (expert-major) order.

    Vectorised over the W x L blocks (a per-block loop read two scalars per rank and local expert,
    2 W L host reads per chunk and layer). ``total``, the received row count when the caller knows
    it (the dispatch has its split sizes), saves the one host read left.
    """
    W, L = counts_WL.shape
    if L == 1 or W == 1:
        return None, None
    starts_WL = (torch.cumsum(counts_WL.reshape(-1), 0) - counts_WL.reshape(-1)).view(W, L)
    # Expert-major order: for each local expert l, the rows from rank 0, 1, ...
    counts_B = counts_WL.t().reshape(-1)
    starts_B = starts_WL.t().reshape(-1)
    total = int(counts_B.sum()) if total is None else total
    block_B = torch.repeat_interleave(torch.arange(counts_B.numel()), counts_B, output_size=total)
    first_B = torch.cumsum(counts_B, 0) - counts_B   # each block's first position in the grouped order
    to_expert = starts_B[block_B] + torch.arange(total) - first_B[block_B]
    to_rank = torch.empty_like(to_expert)
    to_rank[to_expert] = torch.arange(total)
    return to_device(to_expert, device), to_device(to_rank, device)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync.

    A plain ``t.to("cuda")`` from pageable memory is a synchronous copy: the host waits for every
    kernel already queued on the stream (``cudaStreamSynchronize``), which would stall the host once
    per chunk and layer and drain the compute queue. Staged through pinned memory the copy is
    stream-ordered and asynchronous; the caching host allocator keeps the pinned block alive until
    the copy has run.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or t.numel() == 0:
        return t.to(device)  # (an empty copy moves no bytes and does not sync)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
