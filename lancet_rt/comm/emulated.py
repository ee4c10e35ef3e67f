"""The emulated link: one process as rank 0 of a symmetric expert-parallel world.

Every rank of the emulated world is assumed to route like this one (the same load), so the rows
rank 0 sends to rank r are exactly as many as it receives from rank r. The data therefore moves as
on one rank (an all-to-all copies its input to its output) while the link is held for
``latency + off-rank bytes / bandwidth``, off-rank bytes being those not addressed to rank 0. Local
experts get the same number of rows, and the link the same bytes, as in the real world; only the
experts' identities alias (expert r * E_local + l computes with local expert l's weights).

The link is a FIFO like a communication stream: a transfer starts when the one before it has ended.
On CPU the link is a timeline kept by the host: each transfer is planned when it is submitted (it
starts when the link frees, it ends a hold later), its data moves at once, and ``wait()`` sleeps
until its planned end (polling the clock for the last few hundred microseconds, so that it returns
on time: :func:`_sleep_until`), so computation runs meanwhile and nothing else (no thread, no GIL hand-off)
touches the host's time. On CUDA a timed kernel on a communication stream holds the link and the
consumer's stream waits on an event.

All-reduces (:meth:`EmulatedGroup.all_reduce`) share the link. A low-priority transfer waits in a
queue of its own and starts only when the link is free and no normal transfer waits for it (Lina,
ATC'23): a later all-to-all overtakes it; one already on the link is not preempted.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from typing import Optional, Sequence

import torch

from lancet_rt import trace as _trace
from lancet_rt.comm.emulated_cuda import _CudaLowWork, _CudaWork, _sleep_cycles_per_ms, link_stream
from lancet_rt.comm.group import Exchange, _side_stream
from lancet_rt.comm.link import check_link, link_ms


class _LinkWork:
    """A transfer on the CPU link. ``wait()`` blocks until it has arrived."""

    def __init__(self, link: "_CpuLink", hold_s: float, copy, kind: str = "all_to_all"):
        self._link = link
        self.hold_s = hold_s
        self.copy = copy
        self.kind = kind  # "all_to_all", "exchange" or "all_reduce"
        self.submitted = time.perf_counter()
        self.start = self.end = None  # planned when committed (perf_counter() times)
        self.expected_end: Optional[float] = None  # perf_counter() deadline, once known
        self.epoch = 0  # the link's epoch when committed; a cancelled epoch's transfers end at once

    def is_completed(self) -> bool:
        return self._link.completed(self)

    def wait(self) -> bool:
        self._link.wait(self)
        return True


class _CpuLink:
    """The CPU link's timeline.

    Normal transfers are committed when submitted: start = when the link frees, end = start + hold.
    Low-priority ones are committed lazily, whenever the link is asked anything: the first of them
    starts at the first moment the link is free (after its submission), since no normal transfer
    was waiting then (any earlier one is committed already). The data moves when a transfer is
    submitted (its consumer reads it only after ``wait()``). Thread-safe: the host and the autograd
    engine's threads may use the link.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.handshake_s = 0.0  # a transfer starts no sooner than this after its submission (EmulatedGroup)
        self._busy_until = 0.0
        self._epoch = 0
        self._low: "collections.deque[_LinkWork]" = collections.deque()  # not yet committed
        self._planned_all_reduce: "collections.deque[tuple[float, float]]" = collections.deque()
        self.behind_all_reduce_s = 0.0  # time normal transfers waited behind all-reduces

    def submit(self, work: _LinkWork, low_priority: bool = False) -> None:
        if work.copy is not None:
            work.copy()
        with self._lock:
            now = time.perf_counter()
            self._advance(now)
            if low_priority:
                self._low.append(work)
            else:
                self._commit(work, max(now + self.handshake_s, self._busy_until), now)

    def _commit(self, work: _LinkWork, start: float, now: float) -> None:
        work.start, work.expected_end = start, start + work.hold_s
        work.end = work.expected_end
        work.epoch = self._epoch
        self._busy_until = work.expected_end
        ar = self._planned_all_reduce
        while ar and ar[0][1] <= now:
            ar.popleft()
        if work.kind == "all_reduce":
            ar.append((start, work.expected_end))
        else:
            self.behind_all_reduce_s += sum(end - max(a, now) for a, end in ar)

    def _advance(self, now: float) -> None:
        """Commit the low-priority transfers the link has started by ``now``."""
        while self._low:
            start = max(self._low[0].submitted, self._busy_until)
            if start >= now:
                return
            self._commit(self._low.popleft(), start, start)

    def completed(self, work: _LinkWork) -> bool:
        with self._lock:
            now = time.perf_counter()
            self._advance(now)
            return work.expected_end is not None and (work.epoch != self._epoch or work.expected_end <= now)

    def wait(self, work: _LinkWork) -> None:
        while True:
            with self._lock:
                now = time.perf_counter()
                self._advance(now)
                if work.expected_end is not None and (work.epoch != self._epoch or work.expected_end <= now):
                    return
                if work.expected_end is not None:
                    until = work.expected_end
                else:  # a low-priority transfer not started yet: it starts when the link frees
                    until = max(self._busy_until, now) + work.hold_s
            _sleep_until(until, now)

    def cancel(self) -> None:
        """End every transfer in flight or queued now (a step that raised left them), and free the link."""
        with self._lock:
            now = time.perf_counter()
            self._epoch += 1
            self._busy_until = now
            for work in self._low:
                work.start = work.end = work.expected_end = now
            self._low.clear()
            self._planned_all_reduce.clear()

    def idle(self) -> bool:
        """No transfer holds the link or waits for it: a new one starts now."""
        with self._lock:
            now = time.perf_counter()
            self._advance(now)
            return self._busy_until <= now and not self._low


#: How long before a deadline :func:`_sleep_until` stops sleeping and polls the clock instead.
SPIN_S = 300e-6


def _sleep_until(deadline: float, now: float) -> None:
    """Return at ``deadline`` (a ``perf_counter()`` time), within microseconds.

    ``time.sleep`` returns late: by the thread's timer slack (50 us by default on Linux) plus the
    wake-up. A consumer of a real link resumes within microseconds of the transfer's end. A late
    wake-up costs a schedule whose link then goes idle: the sequential step, one transfer at a time,
    paid it at every wait, while Overlapped, whose link queues the next transfers, mostly did not
    (how late, and what it cost bench.overlap: bench/results/HISTORY.md). So the wait sleeps until
    :data:`SPIN_S` before the deadline and polls the clock for the rest, releasing the GIL at each
    poll (``os.sched_yield``; a ``time.sleep(0)`` takes the timer slack too) so that another thread
    (the autograd engine's, beside a forward) is never starved.
    """
    if deadline - now > SPIN_S:
        time.sleep(deadline - now - SPIN_S)
    while time.perf_counter() < deadline:
        os.sched_yield()


def _reduce_op_names() -> dict:
    try:
        from torch.distributed import ReduceOp
    except ImportError:  # pragma: no cover - torch built without distributed
        return {}
    return {
        ReduceOp.SUM: "sum",
        ReduceOp.AVG: "avg",
        ReduceOp.MAX: "max",
        ReduceOp.MIN: "min",
        ReduceOp.PRODUCT: "product",
    }


_REDUCE_OPS = _reduce_op_names()


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


class EmulatedGroup:
    """An :class:`~lancet_rt.comm.group.ExpertParallelGroup` emulating ``world_size`` symmetric ranks.

    Args:
        world_size: W, the emulated expert-parallel world size (experts per rank = E / W).
        bandwidth_gbps: link bandwidth per rank in GB/s (1e9 bytes/s) for off-rank bytes;
            ``math.inf`` for a free link.
        latency_us: fixed cost of every collective, in microseconds.
        device: "cpu" or a CUDA device; where the link is held.
        counts_channel: "shared" (default): the counts exchanges queue in the tokens' FIFO, as on
            a :class:`lancet_rt.TorchGroup` whose counts and tokens share one communicator; "own":
            on a channel of their own (latency only), as with ``TorchGroup(counts_group=...)``, so
            a chunk's counts never wait behind the tokens in flight.
        handshake_us: the control round trip before every transfer may start (CPU link), off the host
            and beside the transfers in flight: a transfer submitted at t starts at ``max(t +
            handshake, link free)``. What a split gloo group does on a real link (its header check on
            its control group, then gloo's ready-to-receive notice; :mod:`lancet_rt.comm.channels`):
            on an idle link the transfer starts a round trip late, behind another it costs nothing.
            ``bench.overlap`` sets it to the real link's measured small all-to-all time.

    Attributes:
        modeled_ms: total link time modeled so far (sum over transfers, counts exchanges included;
            reset with :meth:`reset`).
        transfers: number of transfers so far (counts exchanges included).
        off_rank_bytes: bytes sent off rank so far.
    """

    def __init__(
        self,
        world_size: int,
        bandwidth_gbps: float = math.inf,
        latency_us: float = 0.0,
        device="cpu",
        *,
        counts_channel: str = "shared",
        handshake_us: float = 0.0,
    ):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if (
            isinstance(handshake_us, bool)
            or not isinstance(handshake_us, (int, float))
            or not 0 <= handshake_us < math.inf
        ):
            raise ValueError(f"handshake_us must be a finite number >= 0, got {handshake_us!r}")
        if handshake_us and torch.device(device).type != "cpu":
            raise ValueError("handshake_us is modelled on the CPU link only (device='cpu')")
        if counts_channel not in ("own", "shared"):
            raise ValueError(f"counts_channel must be 'own' or 'shared', got {counts_channel!r}")
        self._size = world_size
        self.bandwidth_gbps, self.latency_us = check_link(bandwidth_gbps, latency_us)
        self.device = torch.device(device)
        self.counts_channel = counts_channel
        cpu = self.device.type == "cpu"
        self._cpu_link = _CpuLink() if cpu else None
        self._cpu_counts = _CpuLink() if cpu and counts_channel == "own" else None
        self._handshake_us = 0.0
        self.handshake_us = handshake_us
        self._stream = None
        self._counts_stream = None  # CUDA, counts_channel="own"
        self._last_event = None  # CUDA: the last transfer queued on the link
        self._low: "collections.deque[_CudaLowWork]" = collections.deque()  # CUDA: not yet started
        self.reset()

    def __deepcopy__(self, memo):
        return self  # a group is a handle: copies of a model share it

    @property
    def handshake_us(self) -> float:
        """The control round trip before each transfer may start (``__init__``'s argument)."""
        return self._handshake_us

    @handshake_us.setter
    def handshake_us(self, value: float) -> None:
        self._handshake_us = float(value)
        for link in (self._cpu_link, self._cpu_counts):
            if link is not None:
                link.handshake_s = self._handshake_us * 1e-6

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return 0

    def cancel_pending(self) -> None:
        """End the transfers a failed step left on the link (CPU link; on CUDA they end by
        themselves), so the next step starts on an idle link. :class:`lancet_rt.Overlapped` calls
        this when a step raises."""
        for link in (self._cpu_link, self._cpu_counts):
            if link is not None:
                link.cancel()

    def reset(self) -> None:
        self.modeled_ms = 0.0
        self.transfers = 0
        self.off_rank_bytes = 0
        if self._cpu_link is not None:
            self._cpu_link.behind_all_reduce_s = 0.0

    @property
    def behind_all_reduce_ms(self) -> float:
        """Time the other transfers spent queued behind all-reduces since :meth:`reset` (CPU link;
        on CUDA 0: not tracked)."""
        return 0.0 if self._cpu_link is None else self._cpu_link.behind_all_reduce_s * 1e3

    def hold_ms(self, off_rank_bytes: int) -> float:
        """Modeled time of one collective moving ``off_rank_bytes`` off rank."""
        return link_ms(off_rank_bytes, self.bandwidth_gbps, self.latency_us)

    def _comm_stream(self, kind: str = "all_to_all"):
        # NCCL's stream priority (emulated_cuda.link_stream): a transfer waits for SM slots as
        # NCCL's kernel would, not ahead of the compute stream's queued blocks.
        if kind == "exchange" and self.counts_channel == "own":
            if self._counts_stream is None:
                self._counts_stream = link_stream(self.device)
            return self._counts_stream
        if self._stream is None:
            self._stream = link_stream(self.device)
        return self._stream

    def _submit(self, off_rank_bytes: int, copy=None, tensors=(), kind: str = "all_to_all", low_priority: bool = False):
        """Hold the link for ``off_rank_bytes``; ``copy()`` moves the data (when submitted on CPU;
        on the communication stream when the transfer starts on CUDA, ``tensors`` kept alive there)."""
        ms = self.hold_ms(off_rank_bytes)
        self.modeled_ms += ms
        self.transfers += 1
        self.off_rank_bytes += off_rank_bytes
        if self._cpu_link is not None:
            link = self._cpu_counts if kind == "exchange" and self._cpu_counts is not None else self._cpu_link
            work = _LinkWork(link, ms * 1e-3, copy, kind)
            link.submit(work, low_priority)
            _trace.record_link(work, off_rank_bytes)
            return work
        if low_priority:
            work = _CudaLowWork(self, lambda: self._launch(ms, off_rank_bytes, copy, tensors))
            self._low.append(work)
            self._pump()
            return work
        return self._launch(ms, off_rank_bytes, copy, tensors, kind)

    def _launch(self, ms: float, off_rank_bytes: int, copy, tensors, kind: str = "all_to_all") -> "_CudaWork":
        # Calibrate (once) before anything is queued on the link: the calibration syncs the host
        # and would otherwise sit inside this transfer and its trace span.
        cycles = int(ms * _sleep_cycles_per_ms(self.device)) if ms > 0 else 0
        stream = self._comm_stream(kind)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer's data is ready
        with torch.cuda.stream(stream):
            span = _trace.cuda_link_span(stream, off_rank_bytes)
            if copy is not None:
                copy()
                for t in tensors:
                    t.record_stream(stream)
            if cycles > 0:
                torch.cuda._sleep(cycles)
            event = torch.cuda.Event()
            event.record(stream)
            if span is not None:
                span.end()
        if stream is self._stream:
            self._last_event = event  # the tokens' link is busy until then
        return _CudaWork(event, stream)

    def _pump(self, upto: Optional["_CudaLowWork"] = None) -> None:
        """Start low-priority CUDA transfers: one if the link is idle now; with ``upto``, every one
        queued up to it (it is being waited for)."""
        while self._low:
            if upto is None and self._last_event is not None and not self._last_event.query():
                return  # the link is busy
            work = self._low.popleft()
            work.launch()
            if upto is None or work is upto:
                return

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]
    ):
        """Rows to self stay; the rest cross the link. Symmetry: output equals input."""
        if list(output_splits) != list(input_splits):
            raise ValueError("EmulatedGroup: a symmetric world sends and receives the same splits")
        row_bytes = input.element_size() * math.prod(input.shape[1:])
        off_rank = (sum(input_splits) - input_splits[0]) * row_bytes
        # The link moves data outside autograd, like a collective: the copy runs with grad mode off
        # (wherever it runs), so it never enters the graph, and costs no detach, as NCCL's does not.
        copy = (lambda: _copy_untracked(output, input)) if input.numel() else None
        return self._submit(off_rank, copy, (input, output))

    def all_reduce(self, tensor: torch.Tensor, op="sum", *, low_priority: bool = False):
        """Start an all-reduce of ``tensor`` in place over the emulated world; returns a handle whose
        ``wait()`` makes the result valid (on CUDA: for the current stream).

        By symmetry every rank holds this tensor, so "sum" gives W x tensor, "avg", "max" and "min"
        leave it as it is, "product" gives tensor ** W. The link is held as for a ring all-reduce:
        ``latency + 2 (W - 1) / W x bytes / bandwidth`` (each rank sends, and receives, that many
        bytes), in the same FIFO as the all-to-alls, so it delays the transfers submitted after it.

        Args:
            tensor: any shape, dtype and device of this group (a contiguous tensor or view).
            op: "sum", "avg", "max", "min" or "product", or the matching ``torch.distributed.ReduceOp``.
            low_priority: start only when the link is free and no other transfer waits for it
                (Lina, ATC'23: an all-to-all submitted later overtakes it; one already on the link is
                not preempted, so cut a large all-reduce into pieces to bound that wait). On CUDA a
                low-priority transfer starts when it is submitted, or another one is waited on or
                polled, while the link is idle, and at the latest when it is waited on.

        Returns:
            A handle with ``wait()`` and ``is_completed()``.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != self.device.type:
            raise ValueError(f"tensor must be on this group's device type {self.device.type}, got {tensor.device}")
        name = op if isinstance(op, str) else _REDUCE_OPS.get(op) if _hashable(op) else None
        if name not in ("sum", "avg", "max", "min", "product"):
            raise ValueError(
                f"op must be 'sum', 'avg', 'max', 'min' or 'product' (or a torch.distributed "
                f"ReduceOp of those), got {op!r}"
            )
        W = self._size
        data = tensor.detach()
        if name == "sum" and W > 1 and data.numel():
            copy = lambda: data.mul_(W)
        elif name == "product" and W > 1 and data.numel():
            copy = lambda: data.pow_(W)
        else:
            copy = None
        nbytes = 2 * (W - 1) * data.numel() * data.element_size() // W
        return self._submit(nbytes, copy, (data,), "all_reduce", low_priority)

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start a broadcast of ``tensor`` from rank ``src``: by symmetry every rank holds it already, so the
        data stays; the link is held for its bytes (a pipelined broadcast moves them once through each port)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        return self._submit(tensor.numel() * tensor.element_size(), None, (tensor.detach(),), "all_reduce")

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op="sum"):
        """Start a reduction of ``tensor`` into rank ``dst``: the data as :meth:`all_reduce` gives it ("avg"
        leaves it), the link held for its bytes once (a pipelined reduce, like :meth:`broadcast`)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        W, data = self._size, tensor.detach()
        copy = (lambda: data.mul_(W)) if op == "sum" and W > 1 and data.numel() else None
        return self._submit(data.numel() * data.element_size(), copy, (data,), "all_reduce")

    def exchange(self, send_WN: torch.Tensor):
        """The counts exchange: by symmetry every rank receives what this one sends. It holds its
        channel for the latency (no bytes): its own channel, or with ``counts_channel="shared"``
        the tokens' FIFO, behind the transfers in flight, like a collective on their communicator."""

        if self._cpu_link is not None:
            # (a CPU link: already on the host; a fresh int64 row is received as it is, without a copy)
            host = _detached(send_WN).to(torch.int64)
            return Exchange(host, self._submit(0, kind="exchange"), host)
        done = self._submit(0, kind="exchange")  # on its channel's stream
        side = _side_stream(send_WN.device)
        side.wait_stream(torch.cuda.current_stream(send_WN.device))
        with torch.cuda.stream(side):
            side.wait_event(done.event)
            host = torch.empty(send_WN.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(send_WN.to(torch.int64), non_blocking=True)
            send_WN.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        return Exchange(host, event, host)

    def all_gather(self, vec_N: torch.Tensor) -> torch.Tensor:
        return vec_N.to(torch.int64).cpu().unsqueeze(0).expand(self._size, -1).clone()

    def __repr__(self) -> str:
        return (
            f"EmulatedGroup(world_size={self._size}, bandwidth_gbps={self.bandwidth_gbps}, "
            f"latency_us={self.latency_us}, device={self.device}, counts_channel={self.counts_channel!r}, "
            f"handshake_us={self.handshake_us})"
        )


def _copy_untracked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` outside autograd, as a collective writes its output."""
    with torch.no_grad():
        dst.copy_(src)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` outside autograd (as it is when autograd does not track it: no op)."""
    return t.detach() if t.requires_grad else t
