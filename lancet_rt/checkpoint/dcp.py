"""Checkpoints of expert-parallel models: saved at one expert-parallel size, loaded at any other.

A model whose :class:`~lancet_rt.MoE` layers shard their experts over W ranks holds, on rank r, rows
[r*L, (r+1)*L) (L = E/W) of every parameter of each layer's ``experts`` module (dim 0 is the
expert); everything else is replicated. Two formats:

- :func:`save_checkpoint` / :func:`load_checkpoint`: ``torch.distributed.checkpoint`` (DCP), model and
  optimizer. Expert shards go to DCP as DTensors ``Shard(0)`` on a 1-D DeviceMesh over the EP group,
  so the checkpoint records their global [E, ...] shape, and DCP reshards on load. The save planner
  writes each expert row as its own chunk: DCP reads whole chunks, so at any later EP size a rank
  reads exactly the experts it holds. Replicated tensors are written once (DCP's deduplication).
- :func:`~lancet_rt.checkpoint.hf.save_hf` / :func:`~lancet_rt.checkpoint.hf.load_hf` (in
  :mod:`lancet_rt.checkpoint.hf`): the
  Hugging Face ``save_pretrained`` layout, in the on-disk format transformers itself writes; each
  rank writes the safetensors files of its own experts and reads only its experts' tensors.

Every rank validates before anything is written or read and the ranks agree on the outcome with one
all-gather, so a checkpoint that does not fit the model raises the same error on every rank. With
NCCL, as for DCP itself, each rank's CUDA device must be set (``torch.cuda.set_device``) first.

Neither format can destroy the last good checkpoint or leave a model half loaded: a save writes into
a staging directory beside the target and swaps it in only after every rank wrote
(:mod:`lancet_rt.checkpoint._atomic`); a load checks the files' presence and sizes, reads into new
tensors, and changes the model only once every rank read everything. DCP checkpoints carry an XXH3-64 checksum
of every item, checked on load. The agreements and DCP's collectives go through the group's monitor
(bounded by ``LANCET_TIMEOUT_S``, a lost peer named). The protocol and the DCP reading and writing
are shared with :func:`lancet_rt.parallel.save_sharded` (:mod:`lancet_rt.checkpoint.dcp_io`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lancet_rt.checkpoint import dcp_io
from lancet_rt.checkpoint._common import CheckpointError, _expert_shards, _process_group, _Shard, _tensor_id

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError"]


# ------------------------------------------------------------------ DCP
_meshes: dict = {}


def _as_global(local: torch.Tensor, shard: Optional[_Shard]):
    """A DTensor Shard(0) over the shard's EP group carrying the global [E, ...] shape (or ``local``)."""
    if shard is None or shard.group is None:
        return local
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    key = (shard.group, local.device.type)
    if key not in _meshes:
        _meshes[key] = DeviceMesh.from_group(shard.group, local.device.type)
    shape = shard.global_shape(local)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, _meshes[key], [Shard(0)], run_check=False, shape=shape, stride=stride)


def refuse_fully_shard(model, call: str, instead: str) -> None:
    """A :func:`lancet_rt.parallel.fully_shard` model (FSDP2: DTensor parameters) cannot go through
    ``call``: a ValueError pointing to ``instead`` (before anything is written or read)."""
    from torch.distributed.tensor import DTensor

    if isinstance(model, nn.Module) and any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            f"model: is sharded by lancet_rt.parallel.fully_shard (FSDP2: its parameters are DTensors), "
            f"which {call} does not take; use lancet_rt.parallel.{instead}(model, mesh, path, optimizer) "
            f"(the same layout: either load reads the other's checkpoints)"
        )


def _dcp_state(model: nn.Module, optimizer, pg, call: str) -> dcp_io.State:
    """The flat DCP state dict: ``model.<fqn>``, ``optim.state.<fqn>.<name>``, ``optim.param_groups``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    refuse_fully_shard(model, call, call.replace("_checkpoint", "_sharded"))
    by_id = _expert_shards(model, pg)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if optimizer is not None:
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("optimizer: holds parameters that are not model's")
    if optimizer is None:
        msd, osd = get_model_state_dict(model), None
    else:
        msd, osd = get_state_dict(model, optimizer)
    state = dcp_io.State({}, {}, [], osd is not None, planner=None)
    state.planner = lambda: _row_planner(state)
    param_shard = {}
    for fqn, v in msd.items():
        shard = by_id.get(_tensor_id(v)) if isinstance(v, torch.Tensor) else None
        key = "model." + fqn
        state.flat[key] = _as_global(v, shard)
        if shard is not None:
            state.shards[key] = param_shard[fqn] = shard
    if osd is not None:
        for fqn, entries in osd["state"].items():
            shard = param_shard.get(fqn)
            for name, v in entries.items():
                key = f"optim.state.{fqn}.{name}"
                # Moments of an expert parameter are sharded like it; scalars (Adam's step) are replicated.
                if shard is not None and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == shard.rows:
                    state.flat[key] = _as_global(v, shard)
                    state.shards[key] = shard
                else:
                    state.flat[key] = v
                state.optim_keys.append((key, fqn, name))
        state.flat["optim.param_groups"] = osd["param_groups"]
    return state


def _row_planner(state: dcp_io.State):
    """DCP's default save planner, with each expert DTensor written one row (expert) per chunk."""
    import dataclasses

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItemType

    class _ExpertRowSavePlanner(DefaultSavePlanner):
        # Unsharded expert tensors (EP size 1) are split too: a later EP size reads only its rows.
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = []
            for item in plan.items:
                if item.index.fqn not in state.shards or item.type == WriteItemType.BYTE_IO:
                    items.append(item)
                    continue
                chunk = item.tensor_data.chunk
                for i in range(chunk.sizes[0]):
                    offsets = torch.Size((chunk.offsets[0] + i,) + tuple(chunk.offsets[1:]))
                    row = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((1,) + tuple(chunk.sizes[1:])))
                    items.append(
                        dataclasses.replace(
                            item,
                            type=WriteItemType.SHARD,
                            index=MetadataIndex(item.index.fqn, offsets),
                            tensor_data=dataclasses.replace(item.tensor_data, chunk=row),
                        )
                    )
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def lookup_object(self, index):
            if index.fqn not in state.shards:
                return super().lookup_object(index)
            v = self.state_dict[index.fqn]
            i = index.offset[0] - state.shards[index.fqn].offset
            return (v.to_local() if hasattr(v, "to_local") else v)[i : i + 1]

    return _ExpertRowSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def save_checkpoint(
    model: nn.Module,
    path,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Save ``model`` (and ``optimizer``) with ``torch.distributed.checkpoint``, loadable at any EP size.

    Call on every rank of ``process_group`` (a collective). Expert parameters (and their optimizer
    moments) are stored with their global shape [E, ...], each expert as its own chunk written by
    the rank that holds it; replicated tensors are written once and must be equal on every rank.
    Every item's XXH3-64 checksum goes into the checkpoint's metadata (checked by every load).

    Args:
        model: a module holding :class:`lancet_rt.MoE` layers whose ``ep_group`` is None or a
            ProcessGroup (an :class:`~lancet_rt.EmulatedGroup` is rejected with a TypeError).
        path: the checkpoint directory, the same on every rank (written as ``.<name>.lancet-saving``
            beside it and swapped in once complete; files in an existing directory that the save
            does not write are kept). A symbolic link is written at its target; a dangling one or
            a loop is a ValueError before anything is written.
        optimizer: optionally a ``torch.optim.Optimizer`` over ``model``'s parameters; its state and
            param groups are saved through DCP's ``get_state_dict`` (keys are parameter FQNs).
        process_group: the group that saves together (default: the default group when
            torch.distributed is initialized, else a single-process save). Every EP group must lie
            within it.

    Raises:
        TypeError, ValueError: on every rank, before anything is written, for a model DCP cannot
            save as sharded (a :func:`lancet_rt.parallel.fully_shard` one: use ``save_sharded``),
            when the ranks' models or optimizers differ in structure, or when the ranks pass
            different paths.
        CheckpointError: on every rank, when writing failed on some rank (named), or another save
            to ``path`` is in progress (a lock beside it); the checkpoint at ``path`` is then the
            previous one, untouched.
        OSError: ENOSPC on every rank when the disk filled up, naming ``path`` (the staging
            directory removed, the previous checkpoint untouched).
        PeerError, PeerTimeout: a rank died or stopped answering during the save (named).
    """
    pg, use_dist = _process_group(process_group)
    dcp_io.save(lambda: _dcp_state(model, optimizer, pg, "save_checkpoint"), path, pg, use_dist)


def load_checkpoint(
    model: nn.Module,
    path,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` at any EP size into ``model`` (in place).

    Call on every rank of ``process_group``; with torch.distributed uninitialized it loads in a
    single process (every MoE layer must then hold all its experts). Each rank reads the replicated
    tensors and only the expert rows it holds.

    Args:
        model: as for :func:`save_checkpoint`, at any EP size dividing E.
        path: the checkpoint directory.
        optimizer: optionally the optimizer to restore (state and param groups); the checkpoint must
            have been saved with one. Without it, saved optimizer state is ignored.
        process_group: as for :func:`save_checkpoint`.

    The tensors are read into new ones (memory: one more copy of this rank's state while loading)
    and copied into the model and the optimizer only once every rank has read all of its part.

    Raises:
        TypeError, ValueError: on every rank, before any tensor is read, naming what differs (E of
            a layer, a shape, missing or unexpected keys, no optimizer state, other param groups)
            or a data file that is missing or truncated, a damaged ``.metadata`` (its chunks against
            their tensors' shapes, its SHA-256 against the save's), ranks naming different
            checkpoints (path or contents); and, with the model unchanged, a file
            that cannot be read or whose bytes changed since the save (its XXH3-64 checksum; naming the
            file, the key and the global rank).
        CheckpointError: reading failed otherwise on some rank; the model is unchanged.
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    pg, use_dist = _process_group(process_group)
    state = dcp_io.load(lambda: _dcp_state(model, optimizer, pg, "load_checkpoint"), path, pg, use_dist)
    if optimizer is not None:
        osd = {"state": {}, "param_groups": state.flat["optim.param_groups"]}
        for key, fqn, name in state.optim_keys:
            osd["state"].setdefault(fqn, {})[name] = dcp_io.local(state.flat[key])
        set_optimizer_state_dict(model, optimizer, osd)
