"""The emulated link: one process as rank 0 of a symmetric expert-parallel world.

Every rank of the emulated world is assumed to route like this one (the same load), so the rows
rank 0 sends to rank r are exactly as many as it receives from rank r. The data therefore moves as
on one rank (an all-to-all copies its input to its output) while the link is held for
``latency + off-rank bytes / bandwidth``, off-rank bytes being those not addressed to rank 0. Local
experts get the same number of rows, and the link the same bytes, as in the real world; only the
experts' identities alias (expert r * E_local + l computes with local expert l's weights).

The link is a FIFO like a communication stream: a transfer starts when the one before it has ended.
On CPU a background thread holds it (sleeping, so computation runs meanwhile); on CUDA a timed
kernel on a communication stream holds it and the consumer's stream waits on an event.
"""
from __future__ import annotations

import math
import queue
import sys
import threading
import time
from typing import Optional, Sequence

import torch

from . import trace as _trace
from .comm import check_link, link_ms


class _LinkWork:
    """A transfer on the CPU link. ``wait()`` blocks until it has arrived."""

    def __init__(self, hold_s: float, copy):
        self.hold_s = hold_s
        self.copy = copy
        self.start = self.end = None
        self.expected_end: Optional[float] = None  # perf_counter() deadline, once known
        self._done = threading.Event()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        self._done.wait()
        return True


class _CpuLink:
    """A single background thread serving transfers in order.

    The thread needs the GIL to start and finish a transfer; with CPython's default switch interval
    (5 ms) it could wait that long behind the computing main thread, so creating a CPU link lowers
    the interval to 0.5 ms (process-wide: ``sys.setswitchinterval``).
    """

    SWITCH_INTERVAL_S = 5e-4

    def __init__(self):
        if sys.getswitchinterval() > self.SWITCH_INTERVAL_S:
            sys.setswitchinterval(self.SWITCH_INTERVAL_S)
        self._q: "queue.Queue[_LinkWork]" = queue.Queue()
        self._busy_until = 0.0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="lancet-emulated-link", daemon=True)
        self._thread.start()

    def submit(self, work: _LinkWork) -> None:
        with self._lock:
            now = time.perf_counter()
            start = max(now, self._busy_until)
            work.expected_end = start + work.hold_s
            self._busy_until = work.expected_end
            inline = work.hold_s == 0 and start == now  # a free transfer on an idle link
        if inline:
            work.start = now
            if work.copy is not None:
                work.copy()
            work.end = time.perf_counter()
            work._done.set()
        else:
            self._q.put(work)

    def _serve(self) -> None:
        # Each transfer ends at the time planned when it was submitted (a FIFO of fixed-length
        # holds), so a late wake-up of this thread (it needs the GIL) never lengthens the link.
        while True:
            work = self._q.get()
            work.start = time.perf_counter()
            if work.copy is not None:
                work.copy()
            remaining = work.expected_end - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            work.end = time.perf_counter()
            work._done.set()


class _CudaWork:
    def __init__(self, event: torch.cuda.Event, stream):
        self.event, self.stream = event, stream

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


_cycles_per_ms: dict = {}


def _sleep_cycles_per_ms(device) -> float:
    """Calibrate torch.cuda._sleep (a one-thread kernel spinning on clock64(): its argument is SM
    clock cycles, about 1.5-2e6 per ms on an H100/H200) once per device.

    Timed on the device's current stream with CUDA events; call it outside the communication
    stream's context (a one-off host sync of about 20 ms) so it never lands inside a transfer.
    """
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _cycles_per_ms:
        with torch.cuda.device(device):
            cycles = 20_000_000
            torch.cuda._sleep(cycles)  # warm-up, long enough for the SM clock to leave idle
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            _cycles_per_ms[device] = cycles / start.elapsed_time(end)
    return _cycles_per_ms[device]


class EmulatedGroup:
    """An :class:`~lancet_rt.comm.ExpertParallelGroup` emulating ``world_size`` symmetric ranks.

    Args:
        world_size: W, the emulated expert-parallel world size (experts per rank = E / W).
        bandwidth_gbps: link bandwidth per rank in GB/s (1e9 bytes/s) for off-rank bytes;
            ``math.inf`` for a free link.
        latency_us: fixed cost of every collective, in microseconds.
        device: "cpu" or a CUDA device; where the link is held.

    Attributes:
        modeled_ms: total link time modeled so far (sum over transfers; reset with :meth:`reset`).
        transfers: number of transfers so far.
        off_rank_bytes: bytes sent off rank so far.
    """

    def __init__(self, world_size: int, bandwidth_gbps: float = math.inf, latency_us: float = 0.0,
                 device="cpu"):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self._size = world_size
        self.bandwidth_gbps, self.latency_us = check_link(bandwidth_gbps, latency_us)
        self.device = torch.device(device)
        self._cpu_link = _CpuLink() if self.device.type == "cpu" else None
        self._stream = None
        self.reset()

    def __deepcopy__(self, memo):
        return self  # a group is a handle: copies of a model share it

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return 0

    def reset(self) -> None:
        self.modeled_ms = 0.0
        self.transfers = 0
        self.off_rank_bytes = 0

    def hold_ms(self, off_rank_bytes: int) -> float:
        """Modeled time of one collective moving ``off_rank_bytes`` off rank."""
        return link_ms(off_rank_bytes, self.bandwidth_gbps, self.latency_us)

    def _comm_stream(self):
        if self._stream is None:
            # High priority, as a link is: when the compute stream's kernels fill the SMs, the
            # link's copy and timed kernel take the next free slot instead of queueing behind a
            # whole GEMM grid, so a transfer starts when the link is free, not when compute lets it.
            self._stream = torch.cuda.Stream(self.device, priority=-1)
        return self._stream

    def _submit(self, off_rank_bytes: int, copy=None, src=None, dst=None):
        ms = self.hold_ms(off_rank_bytes)
        self.modeled_ms += ms
        self.transfers += 1
        self.off_rank_bytes += off_rank_bytes
        if self._cpu_link is not None:
            work = _LinkWork(ms * 1e-3, copy)
            self._cpu_link.submit(work)
            _trace.record_link(work, off_rank_bytes)
            return work
        # Calibrate (once) before anything is queued on the link: the calibration syncs the host
        # and would otherwise sit inside this transfer and its trace span.
        cycles = int(ms * _sleep_cycles_per_ms(self.device)) if ms > 0 else 0
        stream = self._comm_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer's data is ready
        with torch.cuda.stream(stream):
            span = _trace.cuda_link_span(stream, off_rank_bytes)
            if dst is not None:
                dst.copy_(src)
                dst.record_stream(stream)
                src.record_stream(stream)
            if cycles > 0:
                torch.cuda._sleep(cycles)
            event = torch.cuda.Event()
            event.record(stream)
            if span is not None:
                span.end()
        return _CudaWork(event, stream)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int]):
        """Rows to self stay; the rest cross the link. Symmetry: output equals input."""
        if list(output_splits) != list(input_splits):
            raise ValueError("EmulatedGroup: a symmetric world sends and receives the same splits")
        row_bytes = input.element_size() * math.prod(input.shape[1:])
        off_rank = (sum(input_splits) - input_splits[0]) * row_bytes
        # The link moves data outside autograd, like a collective: detached tensors, so a copy on the
        # link thread (where grad mode is on by default) never enters the graph.
        src, dst = input.detach(), output.detach()
        if self._cpu_link is not None:
            return self._submit(off_rank, copy=(lambda: dst.copy_(src)) if src.numel() else None)
        return self._submit(off_rank, src=src, dst=dst)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum"):
        """Start an all-reduce (sum) of ``tensor`` in place over the emulated world; returns a handle
        whose ``wait()`` makes the result valid (on CUDA: for the current stream).

        By symmetry every rank holds this tensor, so the sum is W x tensor. The link is held as for a
        ring all-reduce, ``latency + 2 (W - 1) / W x bytes / bandwidth`` (each rank sends, and
        receives, that many bytes), in the same FIFO as the all-to-alls.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if op != "sum":
            raise ValueError(f"op must be 'sum', got {op!r}")
        W = self._size
        data = tensor.detach()
        nbytes = 2 * (W - 1) * data.numel() * data.element_size() // W
        if self._cpu_link is not None:
            return self._submit(nbytes, copy=(lambda: data.mul_(W)) if W > 1 and data.numel() else None)
        return self._submit(nbytes, src=data * W, dst=data) if W > 1 and data.numel() else self._submit(nbytes)

    def exchange(self, send_WN: torch.Tensor):
        """The counts exchange: by symmetry every rank receives what this one sends. Like a real
        collective it queues behind the transfers in flight (latency only, no bytes)."""
        from .comm import Exchange, _side_stream

        if self._cpu_link is not None:
            host = send_WN.detach().to(torch.int64).cpu().clone()
            return Exchange(host, self._submit(0), host)
        done = self._submit(0)  # on the communication stream, behind the transfers in flight
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
        return (f"EmulatedGroup(world_size={self._size}, bandwidth_gbps={self.bandwidth_gbps}, "
                f"latency_us={self.latency_us}, device={self.device})")
