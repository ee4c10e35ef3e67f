"""Where each gradient is reduced, for one group or a ``("dp", "ep")`` DeviceMesh.

Every rank routes its own local batch, so with data parallelism (dp) beside expert parallelism (ep):

* dense parameters (attention, norms, router, shared experts) are replicated on all dp x ep ranks and
  see only the local batch: their gradient is the mean over the dp x ep ranks;
* an expert lives on one ep rank of each dp replica and already received the tokens of its ep group
  through the all-to-alls: its gradient is the sum over the dp replicas divided by dp x ep.

Both are then the gradients of the mean loss over the global batch (equal local batch sizes). One
group is the case dp = 1. The divide runs in the collective where the backend can
(NCCL: ``PREMUL_SUM``, :func:`reduce_op`), else after a ``SUM`` (gloo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lancet_rt.comm.emulated import EmulatedGroup
from lancet_rt.comm.group import TorchGroup, as_group, is_wrapped
from lancet_rt.moe.layer import MoE

#: The mesh dimension names :func:`layout` accepts: data x expert parallelism, and HSDP's (the
#: experts replicated over "dp_replicate" and sharded over "dp" by fully_shard; dp is then both).
MESH_DIMS = ("dp", "ep")
HSDP_DIMS = ("dp_replicate", "dp", "ep")

_flat_groups: dict = {}
_meshes: dict = {}


@dataclass(frozen=True)
class Layout:
    """Groups and divisors of the two kinds of gradients.

    Attributes:
        dense_group: the group dense gradients are reduced over (dp x ep); None is the default group.
        expert_group: the group expert gradients are summed over (dp); None: no reduction (dp = 1).
        divisor: dp x ep, what every reduced gradient is divided by.
        ep: the expert-parallel size.
        emulated: ``dense_group`` is a :class:`lancet_rt.EmulatedGroup`.
    """

    dense_group: object
    expert_group: Optional[dist.ProcessGroup]
    divisor: int
    ep: int
    emulated: bool = False


def is_mesh(x) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(x, DeviceMesh)


def check_mesh(mesh, argument: str = "mesh") -> None:
    """A DeviceMesh named ``("dp", "ep")`` or ``("dp_replicate", "dp", "ep")``, else ValueError/TypeError
    (no collective)."""
    if not is_mesh(mesh):
        raise TypeError(f"{argument} must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.mesh_dim_names not in (MESH_DIMS, HSDP_DIMS):
        raise ValueError(
            f"{argument} must have the dimensions {MESH_DIMS} (init_device_mesh(..., "
            f"mesh_dim_names=('dp', 'ep'))) or {HSDP_DIMS}, got {mesh.mesh_dim_names}"
        )


def derived_mesh(mesh, order, names: tuple):
    """A DeviceMesh over ``mesh``'s ranks with its dimensions permuted by ``order`` and the trailing
    ones merged to ``len(names)`` dimensions; created once per mesh. A dimension that is one of
    ``mesh``'s reuses its process group (no collective: a permuted mesh is built from the groups
    that exist); a merged one gets new groups, the first time, on every rank of the world
    (:func:`new_groups`: bounded, an absent rank named)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh.mesh.permute(*order)
    ranks = ranks.reshape(tuple(ranks.shape[: len(names) - 1]) + (-1,)).contiguous()
    key = (mesh.device_type, tuple(ranks.flatten().tolist()), tuple(ranks.shape), names)
    if key not in _meshes:
        groups = []
        for d in range(len(names)):
            merged = order[d:] if d == len(names) - 1 else (order[d],)
            if len(merged) == 1:
                groups.append(mesh.get_group(merged[0]))
            else:  # the rows along the last dimension, one group each; this rank's is the one holding it
                rows = ranks.reshape(-1, ranks.shape[-1]).tolist()
                groups.append(new_groups(rows, f"mesh {names}"))
        _meshes[key] = DeviceMesh.from_group(groups, mesh.device_type, ranks, mesh_dim_names=names)
    return _meshes[key]


def new_groups(rank_lists: list, what: str) -> dist.ProcessGroup:
    """``dist.new_group`` for each list of global ranks, in order, on every rank of the world (as
    ``new_group`` needs); returns the group holding this rank (the default group for the whole
    world). Bounded: first an all-gather through the default group's monitor, so a rank that does
    not come is a :class:`PeerTimeout` naming it instead of a wait in ``new_group``'s rendezvous, then
    each group created with the monitor's timeout (which gloo also takes as the group's own)."""
    import datetime

    world = list(range(dist.get_world_size()))
    if any(sorted(r) == world for r in rank_lists):  # (new_group sorts the ranks: it would be the world's again)
        return dist.group.WORLD
    mon = monitor(None)
    if mon.size > 1:
        as_group(dist.group.WORLD).all_gather(torch.tensor([len(rank_lists)]), f"new groups ({what})")
    timeout = datetime.timedelta(seconds=mon.timeout_s)
    me = dist.get_rank()
    out = None
    for ranks in rank_lists:
        g = _created(ranks, timeout)
        if me in ranks:
            out = g
    return out


def _created(ranks: list, timeout):
    key = tuple(ranks)
    if key not in _flat_groups:
        _flat_groups[key] = dist.new_group(list(ranks), timeout=timeout)
    return _flat_groups[key]


def expert_dp_mesh(mesh):
    """The 1-D mesh of this rank's ep index over all data-parallel ranks (dp, or dp_replicate x dp)."""
    if mesh.ndim == 2:
        return mesh["dp"]
    return derived_mesh(mesh, (2, 0, 1), ("ep", "dp_all"))["dp_all"]


def flat_group(mesh) -> dist.ProcessGroup:
    """The process group of all ranks of ``mesh`` (dp x ep): the default group when the mesh is the
    whole world, else one new group per mesh, created once (every rank of the world must call this
    the first time, as ``new_group``)."""
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    if tuple(ranks) not in _flat_groups:
        new_groups([ranks], "the mesh's ranks")
    return _flat_groups[tuple(ranks)]


def layout(group_or_mesh) -> Layout:
    """The :class:`Layout` of ``group_or_mesh``: None (the default group), a ProcessGroup, a
    :class:`lancet_rt.EmulatedGroup` (dp = 1: experts are only divided), or a ``("dp", "ep")`` or
    ``("dp_replicate", "dp", "ep")`` mesh (dp is then dp_replicate x dp)."""

    if is_mesh(group_or_mesh):
        check_mesh(group_or_mesh, "group")
        ep = group_or_mesh.size(group_or_mesh.ndim - 1)
        dp = group_or_mesh.size() // ep
        expert_group = expert_dp_mesh(group_or_mesh).get_group() if dp > 1 else None
        return Layout(flat_group(group_or_mesh), expert_group, dp * ep, ep)
    if isinstance(group_or_mesh, EmulatedGroup):
        return Layout(group_or_mesh, None, group_or_mesh.size, group_or_mesh.size, emulated=True)
    if group_or_mesh is not None and not isinstance(group_or_mesh, dist.ProcessGroup):
        raise TypeError(
            "group must be None, a ProcessGroup, a lancet_rt.EmulatedGroup or a ('dp', 'ep') "
            f"DeviceMesh, got {type(group_or_mesh).__name__}"
        )
    world = dist.get_world_size(group_or_mesh)
    return Layout(group_or_mesh, None, world, world)


def reduce_op(group, divisor: int):
    """The all-reduce op that sums over ``group`` and divides by ``divisor``, and what is left to divide.

    NCCL: ``PREMUL_SUM`` with 1 / divisor (the divide happens in the collective; nothing left).
    Other backends (gloo has no ``PREMUL_SUM``): ``SUM``, then the caller divides by ``divisor``.

    Returns:
        (op, post_divisor).
    """
    if dist.get_backend(group) == "nccl":
        return dist._make_nccl_premul_sum(1.0 / divisor), 1
    return dist.ReduceOp.SUM, divisor


def check_expert_groups(model, mesh, argument: str = "mesh") -> None:
    """Every lancet MoE layer's expert-parallel group IS ``mesh``'s "ep" group on this rank: the same
    global ranks in the same order (ValueError naming both lists otherwise; no collective). A group
    of the right size over other ranks (``mesh["dp"]``: the transposed mesh) would have the engines
    broadcast one ep rank's experts over another's and reduce expert gradients over the wrong ranks."""

    want = dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1))
    for name, m in model.named_modules():
        if not isinstance(m, MoE):
            continue
        layer = name or "<root>"
        if m.group is None:
            have = [dist.get_rank()]
        elif isinstance(m.group, TorchGroup):
            have = dist.get_process_group_ranks(m.group.group)
        else:
            raise ValueError(
                f"{argument}: MoE layer {layer} has an ep_group of type {type(m.group).__name__}; on a "
                f"mesh it must be the mesh's 'ep' group: build the model with "
                f"ep_group=mesh['ep'].get_group()"
            )
        if have != want:
            size = (
                "as many as the mesh's 'ep' dimension but not its ranks (is it another dimension's group?)"
                if len(have) == len(want)
                else f"the mesh's 'ep' dimension has {len(want)}"
            )
            raise ValueError(
                f"{argument}: MoE layer {layer} is expert-parallel over {len(have)} rank(s), {size}: build the model "
                f"with ep_group=mesh['ep'].get_group() (the layer's group is over ranks {have}, the mesh's 'ep' "
                f"group over ranks {want}, global ranks, on rank {dist.get_rank()})"
            )


def check_one_group(model, group, argument: str = "group") -> None:
    """With one group (dp = 1) every MoE layer must be expert-parallel over exactly its ranks: a
    data-parallel group beside the layers' expert-parallel one needs the mesh (ValueError otherwise,
    the same on every rank: it reads only group memberships)."""

    if not dist.is_initialized():
        return
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    for name, m in model.named_modules():
        if not isinstance(m, MoE) or not (m.group is None or isinstance(m.group, TorchGroup)):
            continue
        mine = [dist.get_rank()] if m.group is None else dist.get_process_group_ranks(m.group.group)
        if sorted(mine) != sorted(ranks):
            raise ValueError(
                f"{argument}: MoE layer {name or '<root>'} is expert-parallel over ranks {sorted(mine)}, "
                f"the group holds ranks {sorted(ranks)}: one group means data and expert parallelism "
                "over the same ranks; for data parallelism beside expert parallelism pass the "
                "('dp', 'ep') DeviceMesh (init_device_mesh(..., mesh_dim_names=('dp', 'ep')))"
            )


def monitor(group):
    """The :class:`lancet_rt.comm.monitor.GroupMonitor` of process group ``group`` (None: the default
    group): one per process group, shared with the expert-parallel layers and the checkpoints on it
    (:func:`lancet_rt.comm.group.as_group`), created on first use (no collective). Its collectives are
    numbered, each wait bounded by ``LANCET_TIMEOUT_S`` (or the group's ``set_timeout``), a lost peer
    named; on gloo a header all-gather checks each checked collective's sizes first."""

    pg = dist.group.WORLD if group is None else group
    new = not is_wrapped(pg)
    mon = as_group(pg).monitor
    if new:  # only data parallelism uses it so far (an expert-parallel layer on it later shares it)
        mon.label = "data-parallel"
    return mon
