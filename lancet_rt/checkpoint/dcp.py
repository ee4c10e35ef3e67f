"""Checkpoints of expert-parallel models: saved at one expert-parallel size, loaded at any other.

A model whose :class:`~lancet_rt.MoE` layers shard their experts over W ranks holds, on rank r, rows
[r*L, (r+1)*L) (L = E/W) of every parameter of each layer's ``experts`` module (dim 0 is the
expert); everything else is replicated. Two formats:

- :func:`save_checkpoint` / :func:`load_checkpoint`: ``torch.distributed.checkpoint`` (DCP), model and
  optimizer. Expert shards go to DCP as DTensors ``Shard(0)`` on a 1-D DeviceMesh over the EP group,
  so the checkpoint records their global [E, ...] shape, and DCP reshards on load. The save planner
  writes each expert row as its own chunk: DCP reads whole chunks, so at any later EP size a rank
  reads exactly the experts it holds. Replicated tensors are written once (DCP's deduplication).
- :func:`~lancet_rt.checkpoint.hf.save_hf` / :func:`~lancet_rt.checkpoint.hf.load_hf` (in :mod:`lancet_rt.checkpoint.hf`): the
  Hugging Face ``save_pretrained`` layout, in the on-disk format transformers itself writes; each
  rank writes the safetensors files of its own experts and reads only its experts' tensors.

Every rank validates before anything is written or read and the ranks agree on the outcome with one
all-gather, so a checkpoint that does not fit the model raises the same error on every rank. With
NCCL, as for DCP itself, each rank's CUDA device must be set (``torch.cuda.set_device``) first.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lancet_rt.checkpoint._common import (_agree, _bad_argument, _digest, _expert_shards, _listing, _process_group, _Shard,
                                         _tensor_id)

__all__ = ["save_checkpoint", "load_checkpoint"]


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
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, _meshes[key], [Shard(0)], run_check=False, shape=shape, stride=stride)


@dataclass
class _DCPState:
    flat: dict            # DCP key -> tensor / DTensor / object
    shards: dict          # DCP key -> _Shard, for expert tensors
    optim_keys: list      # (DCP key, param FQN, state name) of the optimizer state
    has_optim: bool

    def signature(self) -> list:
        out = []
        for k, v in self.flat.items():
            if isinstance(v, torch.Tensor):
                s = self.shards.get(k)
                out.append((k, s.global_shape(v) if s else tuple(v.shape), str(v.dtype)))
            else:
                out.append((k,))
        return out


def _dcp_state(model: nn.Module, optimizer, pg) -> _DCPState:
    """The flat DCP state dict: ``model.<fqn>``, ``optim.state.<fqn>.<name>``, ``optim.param_groups``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

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
    state = _DCPState({}, {}, [], osd is not None)
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


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process call that it assumes one; here that is the documented intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _row_planner(state: _DCPState):
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
                    items.append(dataclasses.replace(item, type=WriteItemType.SHARD,
                                                     index=MetadataIndex(item.index.fqn, offsets),
                                                     tensor_data=dataclasses.replace(item.tensor_data, chunk=row)))
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def lookup_object(self, index):
            if index.fqn not in state.shards:
                return super().lookup_object(index)
            v = self.state_dict[index.fqn]
            i = index.offset[0] - state.shards[index.fqn].offset
            return (v.to_local() if hasattr(v, "to_local") else v)[i:i + 1]

    return _ExpertRowSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def save_checkpoint(model: nn.Module, path, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Save ``model`` (and ``optimizer``) with ``torch.distributed.checkpoint``, loadable at any EP size.

    Call on every rank of ``process_group`` (a collective). Expert parameters (and their optimizer
    moments) are stored with their global shape [E, ...], each expert as its own chunk written by
    the rank that holds it; replicated tensors are written once and must be equal on every rank.

    Args:
        model: a module holding :class:`lancet_rt.MoE` layers whose ``ep_group`` is None or a
            ProcessGroup (an :class:`~lancet_rt.EmulatedGroup` is rejected with a TypeError).
        path: the checkpoint directory (created; DCP's ``.metadata`` is written last).
        optimizer: optionally a ``torch.optim.Optimizer`` over ``model``'s parameters; its state and
            param groups are saved through DCP's ``get_state_dict`` (keys are parameter FQNs).
        process_group: the group that saves together (default: the default group when
            torch.distributed is initialized, else a single-process save). Every EP group must lie
            within it.

    Raises:
        TypeError, ValueError: on every rank, before anything is written, for a model DCP cannot
            save as sharded, or when the ranks' models or optimizers differ in structure.
    """
    import torch.distributed.checkpoint as dcp

    pg, use_dist = _process_group(process_group)
    error, state, digest = None, None, None
    try:
        path = os.fspath(path)
        state = _dcp_state(model, optimizer, pg)
        digest = _digest(state.signature())
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others would hang
        error = _bad_argument(exc, "path")
    _agree(error, pg, use_dist, digest)
    with _single_process_quiet():
        dcp.save(state.flat, checkpoint_id=path, planner=_row_planner(state), process_group=pg,
                 no_dist=not use_dist)


def _check_dcp(state: _DCPState, path: str) -> None:
    """ValueError naming what differs between the checkpoint at ``path`` and the model."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is a bad argument
        raise ValueError(f"path: no readable torch.distributed.checkpoint at {path!r} "
                         f"({type(exc).__name__}: {exc})") from exc
    if state.has_optim and not any(k.startswith("optim.") for k in saved):
        raise ValueError(f"path: the checkpoint at {path!r} holds no optimizer state (saved without optimizer=); "
                         f"load it with optimizer=None")
    missing = [k for k in state.flat if k not in saved]
    compared = ("model.", "optim.") if state.has_optim else ("model.",)  # saved optimizer state may go unread
    unexpected = [k for k in saved if k.startswith(compared) and k not in state.flat]
    problems = []
    for key, v in state.flat.items():
        if key not in saved or not isinstance(v, torch.Tensor):
            continue
        md = saved[key]
        shard = state.shards.get(key)
        want = shard.global_shape(v) if shard else tuple(v.shape)
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key} is not a tensor in the checkpoint")
        elif tuple(md.size) != want:
            if shard and len(md.size) == len(want) and tuple(md.size[1:]) == want[1:]:
                problems.append(f"{key}: the checkpoint has E={md.size[0]} experts, the model's layer "
                                f"{shard.layer!r} has E={shard.num_experts}")
            else:
                problems.append(f"{key}: shape {tuple(md.size)} in the checkpoint, {want} in the model")
    if missing:
        problems.append(f"missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {_listing(unexpected)}")
    if problems:
        raise ValueError(f"path: the checkpoint at {path!r} does not fit the model: " + "; ".join(problems))


def _param_groups_error(saved: list, current: list) -> Optional[ValueError]:
    if len(saved) != len(current):
        return ValueError(f"optimizer: has {len(current)} param groups, the checkpoint's optimizer {len(saved)}")
    for i, (a, b) in enumerate(zip(saved, current)):
        if set(a["params"]) != set(b["params"]):
            return ValueError(
                f"optimizer: param group {i} differs from the checkpoint's: only in the checkpoint: "
                f"[{_listing(sorted(set(a['params']) - set(b['params'])))}], only here: "
                f"[{_listing(sorted(set(b['params']) - set(a['params'])))}]")
    return None


def load_checkpoint(model: nn.Module, path, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    process_group: Optional[dist.ProcessGroup] = None) -> None:
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

    Raises:
        TypeError, ValueError: on every rank, before any tensor is read, naming what differs (E of
            a layer, a shape, missing or unexpected keys, no optimizer state, other param groups).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    pg, use_dist = _process_group(process_group)
    error, state = None, None
    try:
        path = os.fspath(path)
        state = _dcp_state(model, optimizer, pg)
        _check_dcp(state, path)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others would hang
        error = _bad_argument(exc, "path")
    _agree(error, pg, use_dist)

    def read(entries: dict) -> None:
        with _single_process_quiet():
            dcp.load(entries, checkpoint_id=path,
                     planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                     process_group=pg, no_dist=not use_dist)

    if optimizer is not None:
        # The param groups are one pickled object: read and compared first, so that an optimizer
        # grouping other parameters fails before any tensor is read.
        groups = {"optim.param_groups": None}
        read(groups)
        _agree(_param_groups_error(groups["optim.param_groups"], state.flat["optim.param_groups"]), pg, use_dist)
    # Tensors and DTensors alias the parameters and the optimizer's state: DCP loads in place.
    read(state.flat)
    if optimizer is not None:
        osd = {"state": {}, "param_groups": state.flat["optim.param_groups"]}
        for key, fqn, name in state.optim_keys:
            v = state.flat[key]
            osd["state"].setdefault(fqn, {})[name] = v.to_local() if hasattr(v, "to_local") else v
        set_optimizer_state_dict(model, optimizer, osd)
