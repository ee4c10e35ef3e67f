"""Every timer the benchmarks share: one run of a callable (CUDA events or the wall clock), the
median and quantiles of many, steps interleaved across links, and the link's per-step cost used to
calibrate a bandwidth to a comm/compute ratio.

The timers never import another bench module, so every benchmark can import them without a cycle.
"""

from __future__ import annotations

import atexit
import gc
import statistics
import time
from typing import Callable, Optional

import torch


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, rep: int = 10) -> dict:
    """Median and 20/80% quantiles of ``fn``'s time in ms (triton.testing.do_bench on CUDA).

    Args:
        fn: the callable timed.
        device: where it runs.
        warmup, rep: untimed and timed runs on CPU (do_bench picks its own on CUDA).

    Returns:
        ``dict(ms=, ms_q20=, ms_q80=)``.
    """
    if device.type == "cuda":
        import triton.testing

        q20, med, q80 = triton.testing.do_bench(fn, quantiles=[0.2, 0.5, 0.8], warmup=25, rep=100)
        return dict(ms=med, ms_q20=q20, ms_q80=q80)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    return dict(ms=statistics.median(times), ms_q20=q[0], ms_q80=q[3])


_FROZEN = False


def collect_garbage() -> None:
    """A full collection before a timed run; the first one also freezes what survives it (the
    imported modules, the model: ``gc.freeze``), so later collections scan only what was made since.
    With torch's compiler stack imported a full collection took longer than the toy steps it
    preceded (bench/results/HISTORY.md); frozen, microseconds. Unfrozen at exit, so the interpreter's shutdown
    still frees everything."""
    global _FROZEN
    gc.collect()
    if not _FROZEN:
        gc.freeze()
        atexit.register(gc.unfreeze)
        _FROZEN = True


def wall_ms(fn) -> float:
    """Wall time of ``fn`` in ms with the garbage collector paused (as timeit does): collections of
    autograd graphs would otherwise land in random steps."""
    collect_garbage()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    finally:
        gc.enable()


def step_ms(fn, device=None) -> float:
    """One timed run of ``fn``: CUDA events on a GPU, the wall clock (garbage collector paused) on CPU."""
    if device is not None and torch.device(device).type == "cuda":
        # Events around exactly one run: do_bench (bench_ms) would repeat fn for ~125 ms per call,
        # which turned each "one step" of the interleaved rounds into dozens of steps on a GPU.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    return wall_ms(fn)


class PhaseTimer:
    """Host wall time and, on CUDA, GPU time of consecutive phases of one run (a step's forward, then
    its backward): :meth:`start` synchronizes the device, so neither clock counts work queued before,
    then each :meth:`lap` ends a phase. Nothing synchronizes between the phases: the host runs ahead
    of the GPU as in training, and each phase's GPU time is the span between CUDA events recorded on
    the current stream at its start and end (so it includes any time the GPU waited for the host
    inside the phase). :meth:`result` waits for the last event and reads both clocks.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._host: list = []
        self._events: list = []

    def _mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        self._host.append(time.perf_counter())

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._host, self._events = [], []
        self._mark()

    def lap(self) -> None:
        self._mark()

    def result(self) -> list:
        """``[(host_us, gpu_us or None)]``, one pair per phase (gpu_us None off CUDA)."""
        host = [(b - a) * 1e6 for a, b in zip(self._host, self._host[1:])]
        if not self.cuda:
            return [(h, None) for h in host]
        self._events[-1].synchronize()
        gpu = [a.elapsed_time(b) * 1e3 for a, b in zip(self._events, self._events[1:])]
        return list(zip(host, gpu))


def time_interleaved(
    steps: dict, link, links: dict, reps: int, statistic: str = "min", device=None, raw: Optional[dict] = None
) -> dict:
    """``{(link name, step name): ms}``: every step on every link, interleaved step by step after one
    warm-up each, so that a slow period of a shared machine weighs on all of them alike; each
    summarised by ``statistic`` (min or median).

    Args:
        steps: name -> a callable running one training step.
        link: the :class:`lancet_rt.EmulatedGroup` whose bandwidth and latency ``links`` set.
        links: link name -> (bandwidth_gbps, latency_us).
        reps: timed rounds.
        raw: if given, filled with ``{(link name, step name): [ms of each round]}`` (a step's runs
            on the links of one round are adjacent in time, in alternating order).
    """
    for fn in steps.values():
        fn()
    times = {(lk, s): [] for lk in links for s in steps}
    for rep in range(reps):
        for s, fn in steps.items():
            # The links' order alternates: the first run after another step pays for the switch.
            for lk, (bw, lat) in list(links.items()) if rep % 2 == 0 else list(links.items())[::-1]:
                link.bandwidth_gbps, link.latency_us = bw, lat
                times[(lk, s)].append(step_ms(fn, device))
    if raw is not None:
        raw.update(times)
    reduce = min if statistic == "min" else statistics.median
    return {k: reduce(v) for k, v in times.items()}


def link_per_step(link, step) -> tuple:
    """(modeled ms, off-rank bytes, transfers) of one run of ``step`` on ``link``'s current setting."""
    link.reset()
    step()
    return link.modeled_ms, link.off_rank_bytes, link.transfers


def bandwidth_for_ratio(ratio: float, compute_ms: float, nbytes: int, transfers: int, latency_us: float) -> float:
    """The bandwidth (GB/s) at which ``nbytes`` in ``transfers`` collectives take ``ratio x compute_ms``."""
    budget_ms = ratio * compute_ms - transfers * latency_us * 1e-3
    if budget_ms <= 0:
        raise SystemExit(f"latency {latency_us} us x {transfers} transfers alone exceeds {ratio} x {compute_ms:.2f} ms")
    return nbytes / (budget_ms * 1e-3) / 1e9


def keep_freed_memory() -> bool:
    """glibc only: keep freed memory in the process, as a GPU's caching allocator does.

    By default glibc gives every block over 128 KB (an activation here) its own mapping and returns
    it to the OS when freed, so each step faults its activations' pages in again; with a backward
    on a second thread (Overlapped.accumulate) the two threads' allocator arenas double that. Page
    faults were most of the CPU-time difference between schedules, none of it the schedules' own.
    Returns whether the allocator took the settings (False off glibc).
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
