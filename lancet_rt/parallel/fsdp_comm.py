"""FSDP2's collectives under the group monitor: numbered, bounded, a failed or absent peer named.

FSDP2 (``torch.distributed.fsdp.fully_shard``, torch 2.13) issues its own collectives: each unit's
all-gather (``dist.all_gather_single``; an asynchronous one is waited in
``foreach_all_gather_copy_out`` by ``Work.wait()``, with no timeout) and reduce-scatter
(``dist.reduce_scatter_single``, synchronous), and under HSDP an all-reduce. On gloo an unanswered
one waits for the process group's own timeout (30 minutes by default) and ends naming nobody.

Two ways to bound them: a watchdog that aborts the process group when a peer fails or the timeout
passes, or the collectives issued through our monitor. The watchdog does not compose with gloo:
``torch.distributed.distributed_c10d._abort_process_group`` "currently only works with the NCCL
backend" (its docstring), so nothing can end a gloo wait inside FSDP2; where it works (NCCL), FSDP2
then raises the backend's error. FSDP2 does take custom collectives, per unit, through public API
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``): :class:`MonitoredAllGather`
and :class:`MonitoredReduceScatter` issue the very collective FSDP2's defaults issue, with the same
arguments, through :func:`lancet_rt.parallel.mesh.monitor` of the unit's process group. Each is
numbered like every other lancet collective on that group, preceded on gloo by the header
all-gather (ranks out of step are a CollectiveMismatch, never a silent pairing of one step's
reduce-scatter with another's all-gather), waited in slices that read the peers' failure records,
bounded by ``LANCET_TIMEOUT_S``, and a lost peer is a PeerError or PeerTimeout naming its global
rank. On NCCL the monitor's watchdog follows them (no host sync added). An asynchronous all-gather
returns a ``dist.Work`` whose ``wait()`` is the monitor's. Not covered: HSDP's all-reduce over
``dp_replicate`` (FSDP2 calls ``dist.all_reduce`` itself, with no hook): its group's gloo timeout is
set to the monitor's, so it is bounded, but a failure there names no rank.

A rank whose forward raises after FSDP2's collectives started (a bad batch, an out-of-memory) left
its peers in one of them: :func:`break_on_forward_error` (a forward hook with ``always_call`` on
the model) writes a failure record on each of the model's FSDP process groups, so a peer waiting
in an FSDP2 collective raises PeerError naming it within :data:`lancet_rt.comm.monitor.POLL_S`
instead of at the timeout. The groups are unusable afterwards (their next collective raises
GroupError at once), as after any failure in the middle of a step.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from lancet_rt.comm.faults import PeerError
from lancet_rt.parallel import mesh as _mesh

try:  # the interfaces FSDP2's set_custom_* take (torch >= 2.7)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - older torch: install() leaves FSDP2's own collectives
    _AllGather = _ReduceScatter = object


class _Work(dist.Work):
    """An asynchronous collective as FSDP2 waits for it (``isinstance(work, dist.Work)``), its wait the monitor's."""

    def __init__(self, watched):
        super().__init__()
        self._watched = watched

    def wait(self, timeout=None) -> bool:
        self._watched.wait()
        return True

    def is_completed(self) -> bool:
        return self._watched.is_completed()


class MonitoredAllGather(_AllGather):
    """FSDP2's all-gather (``dist.all_gather_single``) through the unit group's monitor."""

    def __init__(self, unit: str):
        self.what = f"FSDP all-gather {unit}"

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        mon = _mesh.monitor(group)
        n = input_tensor.numel()
        watched = mon.issue(
            self.what,
            lambda: dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True),
            (input_tensor.dtype, [n] * mon.size, [n] * mon.size),
        )
        if async_op:
            return _Work(watched)
        watched.wait()
        return None


class MonitoredReduceScatter(_ReduceScatter):
    """FSDP2's reduce-scatter (``dist.reduce_scatter_single``) through the unit group's monitor."""

    def __init__(self, unit: str):
        self.what = f"FSDP reduce-scatter {unit}"

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        mon = _mesh.monitor(group)
        n = output_tensor.numel()
        watched = mon.issue(
            self.what,
            lambda: dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, op=op, group=group, async_op=True
            ),
            (input_tensor.dtype, [n] * mon.size, [n] * mon.size),
        )
        if async_op:
            return _Work(watched)
        watched.wait()
        return None


def install(units: list, meshes: list) -> list:
    """Give each FSDP2 unit of ``units`` ((unit, name) pairs) the monitored collectives; returns the
    process groups of ``meshes`` (the units' meshes: 1-D, or HSDP's (replicate, shard)) with more
    than one rank. HSDP's replicate groups get the monitor's timeout as their gloo timeout."""
    if _AllGather is object:  # pragma: no cover - older torch
        return []
    for unit, name in units:
        unit.set_custom_all_gather(MonitoredAllGather(name))
        unit.set_custom_reduce_scatter(MonitoredReduceScatter(name))
    groups: dict = {}
    for mesh in meshes:
        for d in range(mesh.ndim):
            g = mesh.get_group(d)
            if dist.get_world_size(g) > 1:
                groups[id(g)] = g
                backend = _gloo(g) if d < mesh.ndim - 1 else None
                if backend is not None:  # HSDP's all-reduce over the replicate dimension: FSDP2 issues it itself
                    backend._set_default_timeout(datetime.timedelta(seconds=_mesh.monitor(g).timeout_s))
    return list(groups.values())


def _gloo(group):
    try:
        backend = group._get_backend(torch.device("cpu"))
        return backend if hasattr(backend, "_set_default_timeout") else None
    except Exception:  # not a gloo group
        return None


def break_on_forward_error(groups: list):
    """A forward hook (register with ``always_call=True``) that, when the forward raised, marks each
    of ``groups``' monitors broken with a failure record naming this rank and quoting the error."""

    def hook(module, args, output):
        exc = sys.exc_info()[1]
        if exc is None or output is not None:  # a forward that returned (called from inside an except block)
            return None
        cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        for g in groups:
            mon = _mesh.monitor(g)
            if mon.size > 1 and mon.broken is None:
                mon.break_(
                    mon.error(
                        PeerError,
                        f"{mon.label} {mon.name(mon.rank)} raised in the forward of a "
                        f"fully_shard model, after FSDP2's collectives of the step started ({cause})",
                        [mon.rank],
                    )
                )
        if hasattr(exc, "add_note"):
            exc.add_note(
                "lancet-rt: the model's FSDP2 groups were told (their peers raise PeerError naming this "
                "rank) and are unusable now"
            )
        return None

    return hook
