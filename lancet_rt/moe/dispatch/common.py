"""What the dispatchers and the layer share: one chunk's routing and communication layout, the
counts exchange, and the small index helpers (segment offsets, the rank-major/expert-major
permutations, host-to-device copies without a host sync).

The counts exchange is tagged. Every MoE layer of one shape exchanges a ``[W, P L + 1]`` int64 row
(the counts, then the status), so a rank that skipped a MoE layer, a backward or a microbatch would
pair its exchange with another layer's and size its token all-to-all from it: silent on NCCL (no
header check there), and on gloo too where the headers match. The row therefore carries
:data:`TAG_WORDS` more columns, the same in every row a rank sends: a magic word, the monitor's
sequence number of the exchange, the layer's number on its group (:func:`number_layer`, the order
the layers were built in: the same model on every rank), the chunk, the direction (forward, or a
recomputation in backward) and the compute dtype. Every rank receives every rank's row, so every
rank compares them all and raises the same :class:`~lancet_rt.comm.faults.CollectiveMismatch`
(naming each rank's call) before any token is sent, at no extra collective and no extra host read:
the row is read on the host anyway. Groups without a monitor (:class:`lancet_rt.EmulatedGroup`,
one process) send no tag.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from lancet_rt.comm import faults
from lancet_rt.comm import group as comm
from lancet_rt.comm import header as _header
from lancet_rt.runtime import scope as _scope

#: Tag columns after the status: magic, sequence number, layer, chunk, direction, dtype.
TAG_WORDS = 6
_layers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its layers' weakrefs, in build order
for _dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    _header.code(str(_dtype))  # (so that a peer's compute dtype is named, not only this rank's)


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
    bounds_L1: Optional[tuple]  # the same bounds as host ints (None: not known on the host)
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

    def __init__(self, exchange, P, W, L, error, group=None, tagged: bool = False):
        self._exchange, self._shape, self._error, self._group = exchange, (P, W, L), error, group
        self._tag = TAG_WORDS if tagged else 0
        self._mismatch: Optional[Exception] = None
        self.host: Optional[tuple[list, list]] = None  # (recv, sent), each [P][W][E_local] ints
        # keep_arrived: keep the received counts [W, P * E_local + ...] where they arrived (``arrived``)
        # for row maps made there (the kernels' path; the references' path keeps nothing)
        self.keep_arrived, self.arrived = False, None
        self.loads: Optional[list] = None  # [W][E] each rank's kept rows per expert (hot-expert shadowing)

    def wait(self) -> None:
        """Fills :attr:`host`; raises if any rank reported a rejected input, and
        :class:`~lancet_rt.comm.faults.CollectiveMismatch` if the ranks' tags differ (every rank)."""
        P, W, L = self._shape
        recv = self._exchange.wait()
        if self._mismatch is not None:
            raise self._mismatch
        if self.host is None:
            sent = self._exchange.sent
            if sent is recv:  # (an emulated group: every rank receives what it sends)
                rows_recv = rows_sent = recv.tolist()  # the one read
            else:
                rows_recv, rows_sent = torch.stack((recv, sent)).tolist()  # the one read
            if self._tag:  # (another collective's data in a row: its status word is garbage too)
                tags = [row[P * L + 1 : P * L + 1 + self._tag] for row in rows_recv]
                if all(t[0] == _header.COUNTS_MAGIC for t in tags):
                    faults.raise_on_bad_status([row[P * L] for row in rows_recv], self._error, self._group)
                self._check(tags, rows_sent[0][P * L + 1 : P * L + 1 + self._tag])
            else:
                faults.raise_on_bad_status([row[P * L] for row in rows_recv], self._error, self._group)
            self.host = (_by_piece(rows_recv, P, L), _by_piece(rows_sent, P, L))
            if self.keep_arrived:
                self.arrived = recv
            if len(rows_recv[0]) > P * L + 1 + self._tag:  # the senders' whole kept_E rode along (shadowing)
                self.loads = [row[P * L + 1 + self._tag :] for row in rows_recv]

    def _check(self, tags_W: list, mine: list) -> None:
        """Raise :class:`~lancet_rt.comm.faults.CollectiveMismatch` (and break the group) unless every
        rank sent the tag this rank sent; ``tags_W``: each rank's, the same list on every rank."""
        monitor = self._group.monitor
        ranks = _header.odd_ones([tuple(t) for t in tags_W])
        if not ranks:
            return
        calls = "; ".join(f"{monitor.name(q)} {describe_tag(self._group, t)}" for q, t in enumerate(tags_W))
        self._mismatch = monitor.break_(
            monitor.error(
                faults.CollectiveMismatch,
                f"counts exchange #{mine[1]} does not match across {monitor.label} ranks (seen on "
                f"{monitor.name(monitor.rank)}): {calls}. The ranks ran different MoE layers, chunks, directions or "
                f"dtypes (a rank skipped a MoE layer, a backward or a microbatch, or ran under autocast alone); "
                f"no token was sent. {faults.ADVICE}",
                ranks,
            )
        )
        raise self._mismatch

    def received(self) -> torch.Tensor:
        """recv [P, W, E_local] on the host, after :meth:`wait`."""
        P, W, L = self._shape
        return self._exchange.wait()[:, : P * L].view(W, P, L).permute(1, 0, 2)


def _by_piece(rows_W: list, P: int, L: int) -> list:
    """[W][P * L + 1 + ...] exchanged ints (the counts first) as [P][W][L]."""
    return [[row[p * L : (p + 1) * L] for row in rows_W] for p in range(P)]


def number_layer(moe) -> int:
    """The layer's number on its group: how many MoE layers were built on that group before it. The
    same model built the same way on every rank numbers its layers alike, whichever layers a rank
    runs; a copy keeps its original's number. Called once, by the layer's constructor.

    Args:
        moe: the layer being built (its ``group`` set).

    Returns:
        The number the counts exchange's tag carries for this layer (-1 on a group without a monitor,
        which sends no tag).
    """
    if getattr(moe.group, "monitor", None) is None:
        return -1
    built = _layers.setdefault(moe.group, [])
    built.append(weakref.ref(moe))
    return len(built) - 1


def _tag(moe, seq: int, dtype: torch.dtype) -> list:
    """This exchange's tag words (module docstring); ``dtype``: the compute dtype."""
    s = _scope.current()
    backward = torch._C._current_graph_task_id() != -1  # a recomputation inside backward
    return [
        _header.COUNTS_MAGIC,
        seq,
        getattr(moe, "layer_number", -1),
        -1 if s is None else s.chunk,
        int(backward),
        _header.code(str(dtype)),
    ]


def describe_tag(group, tag: list) -> str:
    """A tag as the call that sent it: layer (by this rank's name for that number), chunk, direction, dtype."""
    if len(tag) != TAG_WORDS or tag[0] != _header.COUNTS_MAGIC:
        return "sent a row that is not a counts exchange's (another collective's data)"
    _, seq, number, chunk, backward, dtype = tag
    refs = _layers.get(group, [])
    layer = refs[number]() if 0 <= number < len(refs) else None
    name = f"MoE layer #{number}" + (f" ({layer.trace_name!r} here)" if layer is not None else "")
    where = "no chunk" if chunk < 0 else f"chunk {chunk}"
    return (
        f"ran {name}, {where}, {'recomputed in backward' if backward else 'forward'}, "
        f"{_header.known(dtype)} (its collective #{seq})"
    )


def exchange_counts(
    moe,
    kept_PE: torch.Tensor,
    counts: torch.Tensor,
    L: int,
    loads: Optional[torch.Tensor],
    error: Optional[Exception],
    dtype: torch.dtype,
) -> Counts:
    """Start sending each rank its counts row (counts first; the dispatcher lays the row out).

    Args:
        moe: the layer (its group, ``ep_size``; its number for the tag).
        kept_PE: [P, E] kept rows per expert of P pieces sent back to back ([E]: one piece).
        counts: [W, P * L] int32 or int64, the counts each rank receives (the dispatcher's
            ``exchange_counts``: each rank's rows of its local experts; with ``dispatcher="allreduce"`` every
            rank's counts over all E experts, which must agree).
        L: counts per piece in a row.
        loads: None, or [W, E] this rank's kept rows of every expert, carried after the counts
            (``Counts.loads``: the same global loads on every rank, from which the shadowed experts are
            chosen; :mod:`~lancet_rt.moe.dispatch.shadow`).
        error: this rank's rejected-input error, sent as a status column so that every rank raises.
        dtype: the compute dtype (the tokens': autocast's, else the experts'), for the tag.

    Returns:
        A :class:`Counts` handle. On a group with a monitor each row carries this call's tag, checked by
        ``Counts.wait`` (module docstring).
    """
    W = moe.ep_size
    P = 1 if kept_PE.dim() == 1 else kept_PE.shape[0]
    group = moe.group
    monitor = getattr(group, "monitor", None)
    tagged = monitor is not None and group.size > 1

    faults.wait_first_exchange(group)  # the step's first exchange first (faults: no rank runs ahead)
    status = faults.status_code(error)
    # The int64 row is made by the one cat that appends the status (int32 counts promote)
    if tagged:  # status and tag: one host row, one copy (pinned, no sync), one cat
        extra = to_device(torch.tensor([status] + _tag(moe, monitor.issued + 1, dtype)), counts.device)
        send = torch.cat([counts, extra.view(1, -1).expand(W, -1)] + ([] if loads is None else [loads]), dim=1)
    else:  # the status column: the group's, made once (one cat per chunk and layer, no pad and cast)
        send = torch.cat([counts, _status_column(W, status, counts.device)] + ([] if loads is None else [loads]), dim=1)
    handle = Counts(group.exchange(send), P, W, L, error, group, tagged)
    faults.note_exchange(group, handle)
    return handle


@functools.lru_cache(maxsize=64)
def _status_column(W: int, code: int, device: torch.device) -> torch.Tensor:
    """The int64 [W, 1] status column of an untagged counts row (read only: every row of a W-rank
    group with this status shares it)."""
    return torch.full((W, 1), code, dtype=torch.int64, device=device)


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
    latency is shorter than a turn (the benchmarks' emulated link has tens of microseconds, a turn
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
    start = host_bounds(flat)  # received order: (w, l) blocks
    counts_B = [counts_WL[w][l] for l in range(L) for w in range(W)]
    first = host_bounds(counts_B)  # grouped order: (l, w) blocks
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
