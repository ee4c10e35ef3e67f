"""DCP checkpoints of a model under :func:`lancet_rt.parallel.fully_shard`, loadable on any mesh.

FSDP2 makes each expert parameter a DTensor over ``mesh["dp"]`` whose global shape is the ep rank's
[E_local, ...]: the ep split is invisible to it, so DCP would see every ep rank writing its own
experts under one key. Here expert tensors (and their optimizer moments) go to DCP as DTensors over
the mesh read as ``("ep", "dp")`` with placements ``(Shard(0), Shard(0))``: global shape [E, ...],
rows split over ep first and then over dp, as fully_shard holds them (that mesh is built from the
mesh's own process groups: no collective). Dense tensors go as FSDP2's DTensors (global shapes
already). The keys are those of :func:`lancet_rt.save_checkpoint` (``model.<fqn>``,
``optim.state.<fqn>.<name>``, ``optim.param_groups``), so a checkpoint written here also loads with
:func:`lancet_rt.load_checkpoint` (in one process, or expert-parallel without FSDP2).

Both go through the checkpoint safety layer :func:`lancet_rt.save_checkpoint` uses
(:mod:`lancet_rt.checkpoint.dcp_io`), over the process group of the mesh's ranks: the MoE layers'
groups checked against the mesh and the path agreed before anything is written, a staging directory
swapped in once every rank wrote, XXH3-64 checksums in the metadata, files validated and read into
new tensors before any parameter changes, every collective bounded and a lost peer named.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lancet_rt.checkpoint import dcp_io
from lancet_rt.parallel import mesh as _mesh
from lancet_rt.parallel.sync import expert_parameters


def _global_expert(v: torch.Tensor, mesh) -> torch.Tensor:
    """An expert DTensor of fully_shard (over dp, or HSDP's (dp_replicate, dp)) as one over the mesh
    with "ep" first, of the global [E, ...] shape, aliasing the same local rows (DCP loads into it)."""
    from torch.distributed.tensor import DTensor, Shard

    ep = mesh.size(mesh.ndim - 1)
    local = v.to_local() if isinstance(v, DTensor) else v
    shape = (v.shape[0] * ep,) + tuple(v.shape[1:])
    stride = tuple(int(torch.Size(shape[i + 1 :]).numel()) for i in range(len(shape)))
    if mesh.ndim == 2:
        target, placements = _mesh.derived_mesh(mesh, (1, 0), ("ep", "dp")), [Shard(0), Shard(0)]
    else:
        target = _mesh.derived_mesh(mesh, (2, 0, 1), ("ep", "dp_replicate", "dp"))
        placements = [Shard(0)] + list(v.placements if isinstance(v, DTensor) else ())
    return DTensor.from_local(local, target, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _state(model: nn.Module, optimizer, mesh):
    """(the :class:`~lancet_rt.checkpoint.dcp_io.State`, model state dict, optimizer state dict) of a
    fully_shard model; the flat entries alias the two state dicts' tensors."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _mesh.check_expert_groups(model, mesh)
    experts = {id(p) for p in expert_parameters(model)}
    expert_fqns = {n for n, p in model.named_parameters() if id(p) in experts}
    msd, osd = get_state_dict(model, optimizer) if optimizer is not None else (get_model_state_dict(model), None)
    flat = {}
    for fqn, v in msd.items():
        flat["model." + fqn] = _global_expert(v, mesh) if fqn in expert_fqns else v
    if osd is not None:
        for fqn, entries in osd["state"].items():
            for name, v in entries.items():
                sharded = fqn in expert_fqns and isinstance(v, torch.Tensor) and v.dim() > 0
                flat[f"optim.state.{fqn}.{name}"] = _global_expert(v, mesh) if sharded else v
        flat["optim.param_groups"] = osd["param_groups"]
    state = dcp_io.State(flat, {}, [], osd is not None, planner=lambda: DefaultSavePlanner(flatten_state_dict=False))
    return state, msd, osd


def save_sharded(model: nn.Module, mesh, path, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Save a :func:`~lancet_rt.parallel.fully_shard` model (and optimizer) with DCP, on every rank.

    Args:
        model: the model after :func:`lancet_rt.parallel.fully_shard` over ``mesh``.
        mesh: its ``("dp", "ep")`` DeviceMesh (or HSDP's).
        path: the checkpoint directory, the same on every rank (written as ``.<name>.lancet-saving``
            beside it and swapped in once complete, as :func:`lancet_rt.save_checkpoint` does).
        optimizer: optionally its optimizer (state and param groups are saved).

    Raises:
        TypeError, ValueError: on every rank, before anything is written: a mesh or a model whose
            MoE layers are not expert-parallel over ``mesh["ep"]``, ranks passing different paths,
            differently structured models or optimizers.
        CheckpointError: on every rank, when writing failed on some rank (named), or another save
            to ``path`` is in progress; the checkpoint at ``path`` is then the previous one, untouched.
        OSError: ENOSPC on every rank when the disk filled up, naming ``path``.
        PeerError, PeerTimeout: a rank died, or did not call, or stopped answering (named).
    """
    _mesh.check_mesh(mesh)
    dcp_io.save(
        lambda: _state(model, optimizer, mesh)[0], path, _mesh.flat_group(mesh), True, "sharded checkpoint save (DCP)"
    )


def load_sharded(model: nn.Module, mesh, path, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Load a checkpoint of :func:`save_sharded` or :func:`lancet_rt.save_checkpoint`, saved on any
    mesh or expert-parallel size, into a :func:`~lancet_rt.parallel.fully_shard` model on ``mesh``.

    Args:
        model, mesh, optimizer: as for :func:`save_sharded` (now on the mesh to load at).
        path: the checkpoint directory.

    Raises:
        TypeError, ValueError: on every rank, before any parameter changes: what differs between the
            checkpoint and the model, a data file missing, truncated or changed since the save (its
            checksum), a damaged ``.metadata``, ranks naming different checkpoints; naming the
            file, the key and the global rank.
        CheckpointError: reading failed otherwise on some rank; the model is unchanged.
        PeerError, PeerTimeout: as for :func:`save_sharded`.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _mesh.check_mesh(mesh)
    held: dict = {}

    def build():
        state, held["msd"], held["osd"] = _state(model, optimizer, mesh)
        return state

    state = dcp_io.load(build, path, _mesh.flat_group(mesh), True)
    if optimizer is not None:  # the flat entries alias msd's and osd's tensors: hand them over
        held["osd"]["param_groups"] = state.flat["optim.param_groups"]
        set_state_dict(model, optimizer, model_state_dict=held["msd"], optim_state_dict=held["osd"])
