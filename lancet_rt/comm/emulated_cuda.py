"""The CUDA side of the emulated link (:class:`lancet_rt.EmulatedGroup` on a GPU): the link's streams,
a transfer's handle (an event on the communication stream), a low-priority transfer held on the host
until the link is idle, and the calibration of the timed kernel that holds the link.

The link's streams have NCCL's priority: torch's ``ProcessGroupNCCL`` issues its collectives on
streams of default priority (unless its ``is_high_priority_stream`` option is set). A high-priority
link stream would start each transfer on the next free SM slot, ahead of the compute stream's queued
blocks, where NCCL's kernel waits its turn: the emulated benchmark would flatter the overlap.
"""

from __future__ import annotations

import torch

#: The priority of the emulated link's CUDA streams: NCCL's default (0, the lowest; -1 is higher).
LINK_STREAM_PRIORITY = 0


def link_stream(device) -> "torch.cuda.Stream":
    """A new stream for the emulated link on ``device``, at NCCL's priority.

    Args:
        device: the CUDA device.

    Returns:
        A ``torch.cuda.Stream`` of priority :data:`LINK_STREAM_PRIORITY`.
    """
    return torch.cuda.Stream(device, priority=LINK_STREAM_PRIORITY)


class _CudaWork:
    def __init__(self, event: torch.cuda.Event, stream):
        self.event, self.stream = event, stream

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


class _CudaLowWork:
    """A low-priority transfer on the CUDA link, held on the host until the link is idle."""

    def __init__(self, group, launch):
        self._group, self._launch, self._work = group, launch, None

    def launch(self) -> None:
        if self._work is None:
            self._work = self._launch()

    def is_completed(self) -> bool:
        self._group._pump()
        return self._work is not None and self._work.is_completed()

    def wait(self) -> bool:
        self._group._pump(upto=self)
        return self._work.wait()


_cycles_per_ms: dict = {}


def _sleep_cycles_per_ms(device) -> float:
    """Calibrate torch.cuda._sleep (a one-thread kernel spinning on clock64(): its argument is SM
    clock cycles, about 1.5-2e6 per ms on an H100/H200) once per device.

    Timed on the device's current stream with CUDA events; call it outside the communication
    stream's context (it is a one-off host sync) so it never lands inside a transfer.
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
