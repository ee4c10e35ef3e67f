"""What the dispatchers and the layer share: one chunk's routing and communication layout, the
counts exchange, and the small index helpers (segment offsets, the rank-major/expert-major
permutations, host-to-device copies without a host sync)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lancet_rt.comm import faults
from lancet_rt.comm import group as comm
from lancet_rt.schedule import scope as _scope


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
    offsets_L1: Optional[torch.Tensor]  # [E_local + 1] segment bounds of x_RD, by local expert (None: not
                                        # made yet, bounds_L1 holds them: see segment_offsets)
    bounds_L1: Optional[tuple]          # the same bounds as host ints (None: not known on the host)
    send_splits: list
    recv_splits: list
    to_expert_major: Optional[torch.Tensor]  # rank-major -> expert-major row permutation
    to_rank_major: Optional[torch.Tensor]

    def segment_offsets(self, ops, device) -> Optional[torch.Tensor]:
        """The experts' segment bounds as a tensor on ``device``, made from the host bounds on first use;
        None where ``ops`` take host bounds (the references: no tensor made, no copy)."""
        if self.offsets_L1 is None and not getattr(ops, "host_offsets", False):
            self.offsets_L1 = to_device(torch.tensor(self.bounds_L1), device)
        return self.offsets_L1


class Counts:
    """A counts exchange in flight (see :func:`exchange_counts`).

    After :meth:`wait`, :attr:`host` holds the received and sent counts as Python ints, read from
    the exchange's host buffers in ONE read (``tolist``): the layer's one host read per chunk. The
    split sizes, the experts' segment bounds and the status all come from it, so no other value of
    a tensor is read on the host in the dispatch.
    """

    def __init__(self, exchange, P, W, L, error, group=None):
        self._exchange, self._shape, self._error, self._group = exchange, (P, W, L), error, group
        self.host: Optional[tuple[list, list]] = None  # (recv, sent), each [P][W][E_local] ints
        self.loads: Optional[list] = None  # [W][E] each rank's kept rows per expert (hot-expert shadowing)

    def wait(self) -> None:
        """Fills :attr:`host`; raises if any rank reported a rejected input."""
        P, W, L = self._shape
        recv = self._exchange.wait()
        if self.host is None:
            rows_recv, rows_sent = torch.stack((recv, self._exchange.sent)).tolist()  # the one read
            faults.raise_on_bad_status([row[P * L] for row in rows_recv], self._error, self._group)
            self.host = (_by_piece(rows_recv, P, L), _by_piece(rows_sent, P, L))
            if len(rows_recv[0]) > P * L + 1:  # the senders' whole kept_E rode along (shadowing)
                self.loads = [row[P * L + 1:] for row in rows_recv]

    def received(self) -> torch.Tensor:
        """recv [P, W, E_local] on the host, after :meth:`wait`."""
        P, W, L = self._shape
        return self._exchange.wait()[:, : P * L].view(W, P, L).permute(1, 0, 2)


def _by_piece(rows_W: list, P: int, L: int) -> list:
    """[W][P * L + 1] exchanged ints (status last) as [P][W][L]."""
    return [[row[p * L:(p + 1) * L] for row in rows_W] for p in range(P)]


def exchange_counts(moe, kept_PE: torch.Tensor, error: Optional[Exception] = None) -> Counts:
    """Start sending each rank the rows it will get for each of its local experts (counts first).

    Args:
        moe: the layer (its group, ``num_experts``, ``num_local_experts``, ``ep_size``, ``dispatcher``).
        kept_PE: [P, E] kept rows per expert of P pieces sent back to back.
        error: this rank's rejected-input error, sent as a status column so that every rank raises.

    Returns:
        A :class:`Counts` handle; with ``dispatcher="allreduce"`` every rank gets every rank's
        counts over all E experts (they must agree). With ``moe.shadow_experts > 0`` each row also
        carries the sender's kept rows of all E experts (``Counts.loads``: the same global loads on
        every rank, from which the shadowed experts are chosen; :mod:`~lancet_rt.moe.dispatch.shadow`).
    """
    L, W = moe.num_local_experts, moe.ep_size
    P = kept_PE.shape[0]
    if moe.dispatcher == "allreduce":
        L = moe.num_experts
        counts = kept_PE.reshape(1, P * L).expand(W, -1).long()
    else:
        counts = (kept_PE.view(W, L) if P == 1 else kept_PE.view(P, W, L).permute(1, 0, 2).reshape(W, P * L)).long()
    # The status column: one pad (constant_pad_nd), not a full and a cat, per chunk and layer.
    send = torch.nn.functional.pad(counts, (0, 1), value=faults.status_code(error))
    if getattr(moe, "shadow_experts", 0) and moe.dispatcher == "alltoall":
        send = torch.cat([send, kept_PE.sum(0).long().view(1, -1).expand(W, -1)], dim=1)
    group = moe.group
    return faults.in_order(group, lambda: Counts(group.exchange(send), P, W, L, error, group))


def counts_turn(moe, x: torch.Tensor) -> None:
    """Let the other chunks run while this chunk's counts travel, where that pays.

    On CUDA the host only enqueues work: another chunk's turn keeps the GPU queue fed while the
    counts reach the host, and costs this chunk nothing. On the CPU the host *is* the device: a
    turn is another chunk's whole computation up to its own MoE layer (its attention, say), and
    this chunk's dispatch would wait all of it with the link possibly idle, for counts that arrive
    after one link latency when they have a channel of their own. There the chunk waits for its
    counts instead. Counts that share the tokens' channel queue behind the transfers in flight, so
    the turn is still given. The choice depends on the device and the group's configuration only,
    so every rank makes the same one and issues its collectives in the same order; it assumes the
    latency is shorter than a turn (20 us on the benchmarks' emulated link, against a turn of
    milliseconds), and an emulated latency longer than a turn makes waiting the slower choice.
    """
    if gives_counts_turn(x.device.type, getattr(moe.group, "counts_channel", "shared")):
        _scope.switch(issues_next=True)


def gives_counts_turn(device_type: str, counts_channel: str) -> bool:
    """:func:`counts_turn`'s rule (the autotuner's replay follows it too): False on the CPU with
    the counts on a channel of their own."""
    return not (device_type == "cpu" and counts_channel == "own")


def host_bounds(counts_L: list) -> list:
    """Segment bounds [n + 1] of host ints ``counts_L`` [n]."""
    out = [0]
    for c in counts_L:
        out.append(out[-1] + c)
    return out


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """Segment bounds [n + 1] (int64) of ``counts`` [n]."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts.long(), 0, out=out[1:])
    return out


def regroup_permutations(counts_WL, device):
    """Row permutations between the received (rank-major) and the grouped (expert-major) order.

    Args:
        counts_WL: [W, L] rows received from rank w for local expert l, as host ints (nested lists,
            :attr:`Counts.host`: no read) or a host tensor (read once).
        device: where the permutations go.

    Row j of block (w, l) is received at ``start[w, l] + j`` and grouped at ``first[l, w] + j``;
    so ``to_expert[first[l, w] + j] = start[w, l] + j``: an arange shifted per block, one
    ``repeat_interleave`` of the W x L shifts (a per-block loop read two scalars per rank and local
    expert, 2 W L host reads per chunk and layer).
    """
    if isinstance(counts_WL, torch.Tensor):
        counts_WL = counts_WL.tolist()
    W, L = len(counts_WL), len(counts_WL[0]) if counts_WL else 0
    if L == 1 or W == 1:
        return None, None
    flat = [c for row in counts_WL for c in row]
    start = host_bounds(flat)                                  # received order: (w, l) blocks
    counts_B = [counts_WL[w][l] for l in range(L) for w in range(W)]
    first = host_bounds(counts_B)                              # grouped order: (l, w) blocks
    shift_B = [start[w * L + l] - first[l * W + w] for l in range(L) for w in range(W)]
    return _permutations(torch.tensor(shift_B), torch.tensor(counts_B), first[-1], device)


def _permutations(shift_B: torch.Tensor, counts_B: torch.Tensor, total: int, device):
    rows = torch.arange(total)
    to_expert = torch.repeat_interleave(shift_B, counts_B, output_size=total).add_(rows)
    to_rank = torch.empty_like(to_expert).index_put_((to_expert,), rows)
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
