"""The asymmetric emulated link: W ranks that route alike but receive unequally (stragglers).

:class:`~lancet_rt.comm.emulated.EmulatedGroup` assumes every rank receives exactly what it sends,
so with skewed routing no rank ever waits for a hot one. :class:`SkewedGroup` keeps rank 0 the one
that computes, and models the other W - 1 ranks from rank 0's real routing: **every rank routes
like rank 0** (rank i sends ``splits[j]`` rows to rank j, ``splits`` being rank 0's input splits of
this all-to-all, which the real router produced, skewed or not). Then rank j receives
``W * splits[j]`` rows, and a hot rank (an expert the router prefers) receives several times the mean.

What it models, per all-to-all:

* **The slowest pair's transfer.** Every rank's port moves ``max(rows it sends off rank, rows it
  receives off rank)`` rows, ``max(sum(splits) - splits[j], (W - 1) * splits[j])`` for rank j; the
  collective ends when the busiest port is done: the link is held ``latency + max_j(...) * row bytes /
  bandwidth``. With balanced splits this is exactly :class:`EmulatedGroup`'s hold.
* **The hot rank's expert work.** A transfer that returns rows from the experts (the forward's
  combine, the backward's dispatch gradient) cannot start before the hottest rank has computed its
  ``W * max(splits)`` rows. The hot rank is one device: it runs the chunks' expert work one after
  another, each starting when its outbound transfer has ended and the previous one is done, for
  ``W * max(splits) * expert_ms_per_row`` (times ``backward_factor`` inside a backward pass: 1 by
  default, the experts' dX, after which the runtime issues the gradient's return; dW comes later). The outbound
  transfer is the previous unanswered one with the same splits in the same pass
  (forward or backward); the pairing is FIFO. On a free link (infinite bandwidth, no latency: the
  benchmarks' compute-only timing) nothing is held back.

**The mitigation** (``order="ready"``, default ``"fifo"``): the link serves transfers in the order
their data is ready rather than the order they were issued, so a return held back for the hot rank
does not block the link for the transfers behind it (the next chunks' dispatches, whose data is
ready): they take the gap. A Lina-style priority, for the ready transfers over the straggler-bound
ones; a real runtime gets it by issuing a chunk's return when its hot rank is due (from the counts it
already holds and the expert time per row) and the ready chunks' transfers first. Data and results
are unchanged (exact): only the link's timeline moves.

**Hot-expert shadowing** (``MoE(shadow_experts=N)``, :mod:`lancet_rt.moe.dispatch.shadow`, the mitigation that
moves the hot rank's load) needs nothing of its own here: its all-to-alls carry splits without the shadowed
experts' rows (a smaller busiest port, fewer hot rows to wait for), and its weight broadcast and gradient
reduce hold the link for their bytes (:meth:`EmulatedGroup.broadcast`, :meth:`EmulatedGroup.reduce`); every
modelled rank computes its own rows of the shadowed experts, as rank 0 does.

What it does not model: rank 0's own data stays symmetric (it receives and computes the rows it
sends, ``sum(splits)``: the mean rank's work, not the ``W * splits[0]`` rows the asymmetric world
would give it), ranks that route differently from rank 0 (a routing source shapes rank 0's router
instead: :mod:`lancet_rt.routing.traces`), contention between pairs beyond the busiest port, the other
ranks' non-expert work (taken equal to rank 0's) and their schedulers. CPU link only.

Attributes (besides :class:`EmulatedGroup`'s): ``straggler_ms``, the time transfers were held back
for the hot rank's experts since :meth:`reset`; ``skew_ms``, the link time added by the busiest
port over the balanced hold.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Sequence

import torch

from lancet_rt import trace as _trace
from lancet_rt.comm.emulated import EmulatedGroup, _CpuLink, _LinkWork


class _SkewLink(_CpuLink):
    """The CPU link, whose all-to-alls may be told not to start before a given time; in ``ready`` order
    a later transfer whose data is ready takes a gap the link would idle in before such a one."""

    def __init__(self):
        super().__init__()
        self._reserved: list = []  # (start, end) of every committed transfer not ended yet, by start

    def _commit(self, work: _LinkWork, start: float, now: float) -> None:
        busy = self._busy_until
        super()._commit(work, start, now)
        self._busy_until = max(busy, work.expected_end)  # a backfilled transfer ends before the last one
        self._reserved = sorted([iv for iv in self._reserved if iv[1] > now] + [(start, work.expected_end)])

    def submit_not_before(self, work: _LinkWork, not_before: float, ready_order: bool = False) -> float:
        """Commit ``work`` at ``max(now, link free, not_before)``, or in ``ready_order`` in the earliest gap
        from ``max(now, not_before)`` that fits it; returns how long ``not_before`` held it back."""
        if work.copy is not None:
            work.copy()
        with self._lock:
            now = time.perf_counter()
            self._advance(now)
            ready = max(now + self.handshake_s, self._busy_until)
            start = max(ready, not_before)
            if ready_order:
                start = max(now + self.handshake_s, not_before)
                for a, b in self._reserved:  # by start: the first gap that fits
                    if b <= start:
                        continue
                    if start + work.hold_s <= a:
                        break
                    start = b
            self._commit(work, start, now)
            return max(min(start, not_before) - ready, 0.0)


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task() != -1 if task is not None else not torch.is_grad_enabled()


def port_rows(splits: Sequence[int], world_size: int) -> int:
    """Rows over the busiest rank's port when every rank sends ``splits`` (rank j's port: the rows
    it sends off rank or receives off rank, whichever is more)."""
    total = sum(splits)
    return max((max(total - s, (world_size - 1) * s) for s in splits), default=0)


class SkewedGroup(EmulatedGroup):
    """An :class:`EmulatedGroup` whose W ranks route like rank 0 and so receive unequally (module docstring).

    Args:
        world_size, bandwidth_gbps, latency_us, counts_channel: as :class:`EmulatedGroup`.
        expert_ms_per_row: the experts' forward time per row (ms) on a modelled rank; 0 models the
            link's skew only.
        backward_factor: the experts' backward time before the gradient returns, over their forward
            (default 1: dX, two GEMMs like the forward's; dW runs after the return is issued).
        device: "cpu" only.
        order: "fifo" (the link serves transfers in issue order, as one NCCL stream does) or "ready"
            (the mitigation: a transfer held back for the hot rank lets later ready ones use the gap).
    """

    def __init__(
        self,
        world_size: int,
        bandwidth_gbps: float = math.inf,
        latency_us: float = 0.0,
        device="cpu",
        *,
        counts_channel: str = "shared",
        expert_ms_per_row: float = 0.0,
        backward_factor: float = 1.0,
        order: str = "fifo",
        handshake_us: float = 0.0,
    ):
        if torch.device(device).type != "cpu":
            raise ValueError(f"device must be 'cpu' (SkewedGroup models a CPU link), got {device!r}")
        for name, v in (("expert_ms_per_row", expert_ms_per_row), ("backward_factor", backward_factor)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if order not in ("fifo", "ready"):
            raise ValueError(f"order must be 'fifo' or 'ready', got {order!r}")
        super().__init__(world_size, bandwidth_gbps, latency_us, device, counts_channel=counts_channel)
        self.order = order
        self._cpu_link = _SkewLink()
        self.handshake_us = handshake_us  # (on the new link too)
        self.expert_ms_per_row = float(expert_ms_per_row)
        self.backward_factor = float(backward_factor)
        self._outbound: dict = {}  # (backward?, splits) -> deque of the outbound transfers' planned ends
        self._hot_free = 0.0  # perf_counter() time the modelled hot rank's expert work is done

    def reset(self) -> None:
        super().reset()
        self.straggler_ms = 0.0
        self.skew_ms = 0.0

    def cancel_pending(self) -> None:
        super().cancel_pending()
        self._outbound.clear()
        self._hot_free = 0.0

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]
    ):
        """Move the rows as :class:`EmulatedGroup` does; hold the link for the busiest port, and start
        a returning transfer only when the hot rank's experts are done (module docstring)."""
        if list(output_splits) != list(input_splits):
            raise ValueError("SkewedGroup: every rank routes like rank 0, so rank 0 sends and receives the same splits")
        splits = tuple(int(s) for s in input_splits)
        W = self._size
        row_bytes = input.element_size() * math.prod(input.shape[1:])
        nbytes = port_rows(splits, W) * row_bytes
        self.skew_ms += self.hold_ms(nbytes) - self.hold_ms((sum(splits) - splits[0]) * row_bytes)
        key = (_in_backward(), splits)
        pending = self._outbound.get(key)
        not_before = 0.0
        returning = bool(pending)
        if returning:
            out_end = pending.popleft()
            if not pending:
                del self._outbound[key]
            if not (math.isinf(self.bandwidth_gbps) and self.latency_us == 0):  # a free link holds nothing back
                factor = self.backward_factor if key[0] else 1.0
                hot_s = W * max(splits, default=0) * self.expert_ms_per_row * factor * 1e-3
                not_before = self._hot_free = max(out_end, self._hot_free) + hot_s
        src, dst = input.detach(), output.detach()
        copy = (lambda: dst.copy_(src)) if src.numel() else None
        ms = self.hold_ms(nbytes)
        self.modeled_ms += ms
        self.transfers += 1
        self.off_rank_bytes += nbytes
        work = _LinkWork(self._cpu_link, ms * 1e-3, copy)
        self.straggler_ms += self._cpu_link.submit_not_before(work, not_before, self.order == "ready") * 1e3
        _trace.record_link(work, nbytes)
        if not returning:
            self._outbound.setdefault(key, collections.deque()).append(work.expected_end)
        return work

    def __repr__(self) -> str:
        return (
            f"SkewedGroup(world_size={self._size}, bandwidth_gbps={self.bandwidth_gbps}, latency_us={self.latency_us}, "
            f"counts_channel={self.counts_channel!r}, expert_ms_per_row={self.expert_ms_per_row}, "
            f"backward_factor={self.backward_factor}, order={self.order!r})"
        )
