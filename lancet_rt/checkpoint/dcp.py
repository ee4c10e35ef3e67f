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

Neither format can destroy the last good checkpoint or leave a model half loaded: a save writes into
a staging directory beside the target and swaps it in only after every rank wrote
(:mod:`lancet_rt.checkpoint._atomic`); a load checks the files' presence and sizes, reads into new
tensors, and changes the model only once every rank read everything. The agreements and DCP's
collectives go through the group's monitor (bounded by ``LANCET_TIMEOUT_S``, a lost peer named).
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

from lancet_rt.checkpoint import _atomic
from lancet_rt.checkpoint._common import (CheckpointError, _agree, _bad_argument, _dcp_failure, _digest, _expert_shards,
                                         _listing, _process_group, _Shard, _tensor_id)

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


def path_argument(value, name: str) -> str:
    """``os.fspath(value)`` of a checkpoint's directory argument ``name``: a TypeError naming it unless
    ``value`` is a str or an ``os.PathLike`` of one, a ValueError if it is empty (every public
    checkpoint function's path goes through here, inside its cross-rank agreement)."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a directory path (a str or os.PathLike), got {type(value).__name__}")
    if not text:
        raise ValueError(f"{name} must not be empty")
    return text


def save_checkpoint(model: nn.Module, path, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Save ``model`` (and ``optimizer``) with ``torch.distributed.checkpoint``, loadable at any EP size.

    Call on every rank of ``process_group`` (a collective). Expert parameters (and their optimizer
    moments) are stored with their global shape [E, ...], each expert as its own chunk written by
    the rank that holds it; replicated tensors are written once and must be equal on every rank.

    Args:
        model: a module holding :class:`lancet_rt.MoE` layers whose ``ep_group`` is None or a
            ProcessGroup (an :class:`~lancet_rt.EmulatedGroup` is rejected with a TypeError).
        path: the checkpoint directory, the same on every rank (written as ``.<name>.lancet-saving``
            beside it and swapped in once complete; files in an existing directory that the save
            does not write are kept).
        optimizer: optionally a ``torch.optim.Optimizer`` over ``model``'s parameters; its state and
            param groups are saved through DCP's ``get_state_dict`` (keys are parameter FQNs).
        process_group: the group that saves together (default: the default group when
            torch.distributed is initialized, else a single-process save). Every EP group must lie
            within it.

    Raises:
        TypeError, ValueError: on every rank, before anything is written, for a model DCP cannot
            save as sharded, when the ranks' models or optimizers differ in structure, or when the
            ranks pass different paths.
        CheckpointError: on every rank, when writing failed on some rank (named); the checkpoint
            at ``path`` is then the previous one, untouched.
        PeerError, PeerTimeout: a rank died or stopped answering during the save (named).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    pg, use_dist = _process_group(process_group)
    rank = dist.get_rank(pg) if use_dist else 0
    error, state, digest = None, None, None
    try:
        path = os.path.abspath(path_argument(path, "path"))
        state = _dcp_state(model, optimizer, pg)
        digest = _digest(state.signature())
        if rank == 0:
            _atomic.prepare(path)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others would hang
        error = _bad_argument(exc, "path")
    _agree(error, pg, use_dist, digest, same=("path", path))
    error = None
    try:  # into the staging directory: the checkpoint at ``path`` stays the last good one until the swap
        with _single_process_quiet(), _bounded(pg, use_dist, "checkpoint save (DCP)"):
            dcp.save(state.flat, storage_writer=FileSystemWriter(_atomic.staging(path)), planner=_row_planner(state),
                     process_group=pg, no_dist=not use_dist)
    except _checkpoint_exception() as exc:  # every rank has it (DCP gathers the failures)
        error = _dcp_failure(exc, path, "writing")
    _agree(error, pg, use_dist)
    error = None
    if rank == 0:
        try:
            _atomic.commit(path, "dcp", dist.get_world_size(pg) if use_dist else 1)
        except OSError as exc:
            error = CheckpointError(f"path: swapping the new checkpoint in at {path!r} failed on rank 0: {exc}")
    _agree(error, pg, use_dist)


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _bounded(pg, use_dist: bool, what: str):
    """DCP's collectives bounded by the group monitor's timeout, a lost peer raised by name."""
    if not use_dist:
        return contextlib.nullcontext()
    from lancet_rt.comm.group import as_group

    return as_group(pg).monitor.bounded(what)


def _check_dcp(state: _DCPState, path: str) -> None:
    """ValueError naming what differs between the checkpoint at ``path`` and the model."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(path).read_metadata()
        saved = metadata.state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is a bad argument
        raise ValueError(f"path: no readable torch.distributed.checkpoint at {path!r} "
                         f"({type(exc).__name__}: {exc})") from exc
    _check_files(metadata.storage_data or {}, path)
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


def _check_files(storage_data: dict, path: str) -> None:
    """ValueError naming a data file that is missing or shorter than the metadata says (a truncated copy)."""
    ends: dict = {}
    for index, info in storage_data.items():
        end = info.offset + info.length
        if end > ends.get(info.relative_path, (-1, ""))[0]:
            ends[info.relative_path] = (end, index.fqn)
    problems = []
    for rel, (end, fqn) in sorted(ends.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            problems.append(f"file {rel!r} (holding {fqn}) is missing")
        elif os.path.getsize(file) < end:
            problems.append(f"file {rel!r} is truncated: {os.path.getsize(file)} bytes, its data for {fqn} ends at "
                            f"byte {end}")
    if problems:
        raise ValueError(f"path: the checkpoint at {path!r} is damaged: " + "; ".join(problems[:4]))


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

    The tensors are read into new ones (memory: one more copy of this rank's state while loading)
    and copied into the model and the optimizer only once every rank has read all of its part.

    Raises:
        TypeError, ValueError: on every rank, before any tensor is read, naming what differs (E of
            a layer, a shape, missing or unexpected keys, no optimizer state, other param groups)
            or a data file that is missing or truncated; and, with the model unchanged, a file
            that cannot be read (naming the file, the key and the rank).
        CheckpointError: reading failed otherwise on some rank; the model is unchanged.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    pg, use_dist = _process_group(process_group)
    rank = dist.get_rank(pg) if use_dist else 0
    error, state = None, None
    try:
        path = _atomic.resolve(path_argument(path, "path"))
        state = _dcp_state(model, optimizer, pg)
        _check_dcp(state, path)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others would hang
        error = _bad_argument(exc, "path")
    _agree(error, pg, use_dist)

    def read(entries: dict) -> Optional[Exception]:
        try:
            with _single_process_quiet(), _bounded(pg, use_dist, "checkpoint load (DCP)"):
                dcp.load(entries, storage_reader=_NamingReader(path, rank),
                         planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                         process_group=pg, no_dist=not use_dist)
        except _checkpoint_exception() as exc:  # every rank has it (DCP gathers the failures)
            return _dcp_failure(exc, path, "reading")
        return None

    if optimizer is not None:
        # The param groups are one pickled object: read and compared first, so that an optimizer
        # grouping other parameters fails before any tensor is read.
        groups = {"optim.param_groups": None}
        _agree(read(groups), pg, use_dist)
        _agree(_param_groups_error(groups["optim.param_groups"], state.flat["optim.param_groups"]), pg, use_dist)
    # Read into new tensors; the parameters and the optimizer's state change only once every rank read all.
    fresh = {k: _fresh(v) for k, v in state.flat.items()}
    _agree(read(fresh), pg, use_dist)
    with torch.no_grad():
        for k, v in state.flat.items():
            if isinstance(v, torch.Tensor):
                _local(v).copy_(_local(fresh[k]))
            else:
                state.flat[k] = fresh[k]
    if optimizer is not None:
        osd = {"state": {}, "param_groups": state.flat["optim.param_groups"]}
        for key, fqn, name in state.optim_keys:
            osd["state"].setdefault(fqn, {})[name] = _local(state.flat[key])
        set_optimizer_state_dict(model, optimizer, osd)


def _local(v: torch.Tensor) -> torch.Tensor:
    return v.to_local() if hasattr(v, "to_local") else v


def _fresh(v):
    """A new tensor like ``v`` (a DTensor keeps its mesh, placements and global shape); other values as they are."""
    if not isinstance(v, torch.Tensor):
        return v
    if not hasattr(v, "to_local"):
        return torch.empty_like(v)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(torch.empty_like(v.to_local()), v.device_mesh, v.placements, run_check=False,
                              shape=v.shape, stride=v.stride())


def _naming_reader_class():
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        """DCP's file reader; a failure names the file, the key and the rank (a ValueError: bad data)."""

        def __init__(self, path: str, rank: int):
            super().__init__(path)
            self.rank, self.current = rank, None

        def _slice_file(self, file, sinfo):
            self.current = sinfo
            return super()._slice_file(file, sinfo)

        def read_data(self, plan, planner):
            self.current = None
            try:
                return super().read_data(plan, planner)
            except Exception as exc:  # noqa: BLE001 - DCP gathers it into every rank's CheckpointException
                s = self.current
                keys = [i.fqn for i, info in self.storage_data.items() if info is s] if s is not None else []
                where = f"file {s.relative_path!r}, key {keys[0] if keys else '?'}" if s is not None else "a file"
                raise ValueError(f"{where} of {self.path!s} could not be read on rank {self.rank} "
                                 f"({type(exc).__name__}: {str(exc).strip()[:300]})") from exc

    return Reader


def _NamingReader(path: str, rank: int):
    return _naming_reader_class()(path, rank)
