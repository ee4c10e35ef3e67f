"""Checkpoints of expert-parallel models: saved at one expert-parallel size, loaded at any other.

A model whose :class:`~lancet_rt.MoE` layers shard their experts over W ranks holds, on rank r, rows
[r*L, (r+1)*L) (L = E/W) of every parameter of each layer's ``experts`` module (dim 0 is the
expert); everything else is replicated. Two formats:

- :func:`save_checkpoint` / :func:`load_checkpoint`: ``torch.distributed.checkpoint`` (DCP), model and
  optimizer. Expert shards go to DCP as DTensors ``Shard(0)`` on a 1-D DeviceMesh over the EP group,
  so the checkpoint records their global [E, ...] shape, and DCP reshards on load. The save planner
  writes each expert row as its own chunk: DCP reads whole chunks, so at any later EP size a rank
  reads exactly the experts it holds. Replicated tensors are written once (DCP's deduplication).
- :func:`save_hf` / :func:`load_hf`: the Hugging Face ``save_pretrained`` layout, in the on-disk
  format transformers itself writes (for Mixtral- and Qwen-MoE-style models it splits the fused
  expert tensors back into per-expert keys, ``...block_sparse_moe.experts.{e}.w1.weight``); each
  rank writes the safetensors files of its own experts and reads only its experts' rows.

Every rank validates before anything is written or read and the ranks agree on the outcome with one
all-gather, so a checkpoint that does not fit the model raises the same error on every rank.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .comm import TorchGroup
from .moe import MoE

__all__ = ["save_checkpoint", "load_checkpoint", "save_hf", "load_hf"]

_DEFAULT_SHARD_BYTES = 5 * 2**30
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


# ------------------------------------------------------------------ shards and agreement
@dataclass(frozen=True)
class _Shard:
    """This rank's rows [offset, offset + rows) of one expert parameter, a [E, ...] tensor."""

    layer: str                               # the MoE's module name, for messages
    num_experts: int
    offset: int
    rows: int
    group: Optional[dist.ProcessGroup]       # None: every expert is local

    def global_shape(self, local: torch.Tensor) -> tuple:
        return (self.num_experts,) + tuple(local.shape[1:])


def _tensor_id(t: torch.Tensor) -> tuple:
    # A state dict holds detached views of the parameters: same address, same shape.
    return (t.data_ptr(), tuple(t.shape), t.dtype)


def _expert_shards(model: nn.Module) -> dict:
    """{tensor id: _Shard} for every parameter of every MoE layer's experts."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    shards = {}
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        layer = name or "<model>"
        group = None
        if moe.ep_size > 1:
            if not isinstance(moe.group, TorchGroup):
                raise TypeError(
                    f"model: MoE layer {layer!r} has ep_group of type {type(moe.group).__name__}; checkpoints need "
                    f"None or a torch.distributed ProcessGroup (an EmulatedGroup has no ranks holding the other "
                    f"experts)")
            group = moe.group.group
        L = moe.num_local_experts
        for pname, p in moe.experts.named_parameters():
            if p.dim() == 0 or p.shape[0] != L:
                raise ValueError(f"model: {layer}.experts.{pname} must have dim 0 = num_local_experts ({L}), "
                                 f"got shape {tuple(p.shape)}")
            shards[_tensor_id(p)] = _Shard(layer, moe.num_experts, moe.ep_rank * L, L, group)
    return shards


def _process_group(process_group):
    """(group, distributed?): the given group, else the default one when torch.distributed is up."""
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be None or a torch.distributed ProcessGroup, "
                            f"got {type(process_group).__name__}")
        return process_group, True
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, True
    return None, False


_ERROR_TYPES = {"TypeError": TypeError, "ValueError": ValueError}


def _agree(error: Optional[Exception], pg, use_dist: bool, digest: Optional[str] = None) -> None:
    """Every rank raises if any rank failed (or, with ``digest``, if the ranks' structures differ)."""
    if not use_dist:
        if error is not None:
            raise error
        return
    mine = (None if error is None else (type(error).__name__, str(error)), digest)
    rows = [None] * dist.get_world_size(pg)
    dist.all_gather_object(rows, mine, group=pg)
    if error is not None:
        raise error
    for r, (err, _) in enumerate(rows):
        if err is not None:
            raise _ERROR_TYPES.get(err[0], ValueError)(f"rank {r}: {err[1]}")
    if len({d for _, d in rows}) > 1:
        groups: dict = {}
        for r, (_, d) in enumerate(rows):
            groups.setdefault(d, []).append(r)
        raise ValueError("model: the ranks hold differently structured models or optimizers (state-dict keys, "
                         f"shapes or dtypes differ); ranks agreeing with each other: {list(groups.values())}")


def _digest(items) -> str:
    return hashlib.sha256(repr(items).encode()).hexdigest()


def _listing(names, limit: int = 8) -> str:
    names = list(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


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


def _dcp_state(model: nn.Module, optimizer) -> _DCPState:
    """The flat DCP state dict: ``model.<fqn>``, ``optim.state.<fqn>.<name>``, ``optim.param_groups``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    by_id = _expert_shards(model)
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

    sharded = {k for k, s in state.shards.items() if s.group is not None}

    class _ExpertRowSavePlanner(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = []
            for item in plan.items:
                if item.index.fqn not in sharded or item.type != WriteItemType.SHARD:
                    items.append(item)
                    continue
                chunk = item.tensor_data.chunk
                for i in range(chunk.sizes[0]):
                    offsets = torch.Size((chunk.offsets[0] + i,) + tuple(chunk.offsets[1:]))
                    row = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((1,) + tuple(chunk.sizes[1:])))
                    items.append(dataclasses.replace(item, index=MetadataIndex(item.index.fqn, offsets),
                                                     tensor_data=dataclasses.replace(item.tensor_data, chunk=row)))
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def lookup_object(self, index):
            if index.fqn not in sharded:
                return super().lookup_object(index)
            shard = state.shards[index.fqn]
            i = index.offset[0] - shard.offset
            return self.state_dict[index.fqn].to_local()[i:i + 1]

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
        state = _dcp_state(model, optimizer)
        digest = _digest(state.signature())
    except (TypeError, ValueError) as exc:
        error = exc
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
    unexpected = [k for k in saved if k.startswith("model.") and k not in state.flat]
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
        TypeError, ValueError: on every rank, before anything is read, naming what differs (E of a
            layer, a shape, missing or unexpected keys, no optimizer state).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    pg, use_dist = _process_group(process_group)
    error, state = None, None
    try:
        path = os.fspath(path)
        state = _dcp_state(model, optimizer)
        _check_dcp(state, path)
    except (TypeError, ValueError) as exc:
        error = exc
    _agree(error, pg, use_dist)
    # Tensors and DTensors alias the parameters and the optimizer's state: DCP loads in place.
    with _single_process_quiet():
        dcp.load(state.flat, checkpoint_id=path,
                 planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 process_group=pg, no_dist=not use_dist)
    if optimizer is not None:
        osd = {"state": {}, "param_groups": state.flat["optim.param_groups"]}
        for key, fqn, name in state.optim_keys:
            v = state.flat[key]
            osd["state"].setdefault(fqn, {})[name] = v.to_local() if key in state.shards and hasattr(v, "to_local") else v
        set_optimizer_state_dict(model, optimizer, osd)


# ------------------------------------------------------------------ Hugging Face layout
def _is_hf(model) -> bool:
    # A transformers model exists only if transformers is imported: never import it (seconds) to ask.
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def _revert(model, tensors: dict) -> dict:
    """Model-named tensors -> the names and layout transformers writes on save (identity outside HF)."""
    if not _is_hf(model):
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


@dataclass
class _Part:
    """One on-disk tensor an expert parameter becomes: per expert (``name`` has ``{}``) or fused [E, ...]."""

    name: str
    fused: bool
    idx: torch.Tensor         # for one expert: flat indices into that expert's row, in the disk tensor's shape

    def key(self, e: int) -> str:
        return self.name if self.fused else self.name.format(e)

    def disk_shape(self, E: int) -> tuple:
        return ((E,) if self.fused else ()) + tuple(self.idx.shape)


@dataclass
class _ExpertParam:
    fqn: str
    param: torch.Tensor
    shard: _Shard
    parts: list


def _expert_templates(keys, E: int) -> dict:
    """{(prefix, suffix): name with {}} for on-disk keys numbered by expert 0..E-1 in one dotted field."""
    seen: dict = {}
    for key in keys:
        fields = key.split(".")
        for pos, f in enumerate(fields):
            if f.isdigit():
                seen.setdefault((tuple(fields[:pos]), tuple(fields[pos + 1:])), set()).add(int(f))
    return {k: ".".join(k[0] + ("{}",) + k[1]) for k, found in seen.items() if found == set(range(E)) and E > 1}


def _expert_parts(model, fqn: str, local: torch.Tensor, shard: _Shard) -> list:
    """How transformers stores one expert parameter, found by converting an index probe of one row."""
    E, row = shard.num_experts, tuple(local.shape[1:])
    n = math.prod(row)
    probe = torch.arange(n, dtype=torch.int32 if n < 2**31 else torch.int64).view((1,) + row)
    per_row = _revert(model, {fqn: probe})
    full = _revert(model, {fqn: torch.empty((E,) + row, dtype=local.dtype, device="meta")})
    templates = _expert_templates(full, E)
    parts = []
    for key, idx in per_row.items():
        if key in full and tuple(full[key].shape) == (E,) + tuple(idx.shape[1:]) and idx.shape[:1] == (1,):
            parts.append(_Part(key, True, idx[0]))
            continue
        fields = key.split(".")
        name = None
        for pos, f in enumerate(fields):
            t = templates.get((tuple(fields[:pos]), tuple(fields[pos + 1:])))
            if f == "0" and t is not None:
                name = t
        if name is None and E == 1 and key in full:
            name = key.replace("{", "{{").replace("}", "}}")
        if name is None or tuple(full[name.format(0)].shape) != tuple(idx.shape):
            raise ValueError(f"model: cannot map expert parameter {fqn} to the layout transformers saves "
                             f"(on-disk key {key!r} is neither fused [E, ...] nor numbered by expert)")
        parts.append(_Part(name, False, idx))
    flat = torch.cat([p.idx.reshape(-1).long() for p in parts]) if parts else torch.empty(0, dtype=torch.long)
    if flat.numel() != n or not torch.equal(flat.sort().values, torch.arange(n)):
        raise ValueError(f"model: transformers' saved layout of {fqn} does not hold each element once")
    return parts


@dataclass
class _HFLayout:
    dense: list               # (model key, disk key, tensor)
    experts: list             # _ExpertParam

    def signature(self) -> list:
        return ([(d, tuple(t.shape), str(t.dtype)) for _, d, t in self.dense]
                + [(p.fqn, [(q.name, q.disk_shape(p.shard.num_experts)) for q in p.parts], str(p.param.dtype))
                   for p in self.experts])


def _hf_layout(model: nn.Module) -> _HFLayout:
    shards = _expert_shards(model)
    sd = model.state_dict()
    if _is_hf(model):
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
            sd.pop(key, None)
        sd = remove_tied_weights_from_state_dict(sd, model)
    else:  # keep the first of tensors sharing storage (safetensors refuses aliases)
        seen, kept = set(), {}
        for k, v in sd.items():
            if _tensor_id(v) not in seen:
                seen.add(_tensor_id(v))
                kept[k] = v
        sd = kept
    dense = {k: v for k, v in sd.items() if _tensor_id(v) not in shards}
    meta = {k: v.to("meta") for k, v in dense.items()}
    names = {id(v): k for k, v in meta.items()}
    renamed = {}
    for disk, v in _revert(model, meta).items():
        if id(v) not in names:
            raise ValueError(f"model: transformers converts dense tensor {disk!r} on save (not a renaming); "
                             f"save_hf/load_hf support renamed dense tensors only")
        renamed[names[id(v)]] = disk
    layout = _HFLayout([(k, renamed[k], v) for k, v in dense.items()], [])
    for k, v in sd.items():
        shard = shards.get(_tensor_id(v))
        if shard is not None:
            layout.experts.append(_ExpertParam(k, v, shard, _expert_parts(model, k, v, shard)))
    return layout


def _writes(shard: _Shard, root: int) -> bool:
    """Whether this rank's EP group writes its experts: the one holding the saving group's rank 0."""
    return shard.group is None or root in dist.get_process_group_ranks(shard.group)


def _hf_tensors(layout: _HFLayout, rank: int, root: int, materialize: bool) -> Iterator:
    """(disk key, shape, dtype, tensor or None) of every tensor this rank writes, in one global order.

    With ``materialize``, fused expert tensors are gathered over their EP group (a collective at the
    same point of this order on every rank) to the rank that writes them.
    """
    if rank == 0:
        for _, disk, t in layout.dense:
            yield disk, tuple(t.shape), t.dtype, t if materialize else None
    for layer, p in enumerate(layout.experts):
        s, E = p.shard, p.shard.num_experts
        if not _writes(s, root):
            continue
        rows = p.param.detach().reshape(s.rows, -1)
        for part in p.parts:
            idx = part.idx.to(rows.device).reshape(-1).long()
            if part.fused:
                W = E // s.rows
                owner = layer % W
                local = rows[:, idx].reshape((s.rows,) + tuple(part.idx.shape)) if materialize else None
                if materialize and s.group is not None:
                    bufs = [torch.empty_like(local) for _ in range(W)] if s.offset // s.rows == owner else None
                    dist.gather(local, bufs, group=s.group, group_dst=owner)
                    local = torch.cat(bufs) if bufs is not None else None
                if s.offset // s.rows == owner:
                    yield part.key(0), part.disk_shape(E), p.param.dtype, local
            else:
                for i in range(s.rows):
                    t = rows[i, idx].reshape(part.idx.shape) if materialize else None
                    yield part.key(s.offset + i), part.disk_shape(E), p.param.dtype, t


def _pack(entries, max_bytes: int) -> list:
    """Consecutive entries grouped into files of at most ``max_bytes`` (a larger tensor alone)."""
    files, size = [], 0
    for key, shape, dtype, _ in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        if not files or (size + nbytes > max_bytes and size > 0):
            files.append([])
            size = 0
        files[-1].append((key, nbytes))
        size += nbytes
    return files


def save_hf(model: nn.Module, directory, *, max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
            process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Write ``model`` as the full, unsharded model in the Hugging Face ``save_pretrained`` layout.

    Call on every rank. Rank r writes the safetensors files of the experts it holds (per-expert
    keys, as transformers writes them; a tensor stored fused [E, ...] on disk is gathered over the
    EP group to one rank per layer, in turn); rank 0 writes the replicated tensors, then, once every
    file is written, ``model.safetensors.index.json`` and (for a transformers model) ``config.json``
    and ``generation_config.json``. No rank holds more than its own tensors plus one file's worth
    (``max_shard_bytes``), so memory stays that of the sharded model. For a transformers
    ``PreTrainedModel`` (as patched by ``lancet_rt.from_hf``, state-dict keys those of Hugging
    Face), ``AutoModelForCausalLM.from_pretrained(directory)`` loads the result; for any other
    module the files hold its own state-dict keys with experts fused [E, ...].

    Args:
        model: the model (on every rank), MoE layers with ``ep_group`` None or a ProcessGroup.
        directory: where to write (created).
        max_shard_bytes: the largest safetensors file a rank writes (a bigger tensor gets its own).
        process_group: the saving group (default: the default group when initialized); with data
            parallel replicas of the EP group, the replica holding its rank 0 writes.

    Raises:
        TypeError, ValueError: on every rank before anything is written (an emulated EP group, a
            layout transformers converts other than by renaming, ranks holding different models).
    """
    from safetensors.torch import save_file

    pg, use_dist = _process_group(process_group)
    rank = dist.get_rank(pg) if use_dist else 0
    root = dist.get_global_rank(pg, 0) if use_dist else 0
    error, layout, digest = None, None, None
    try:
        if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be an int >= 1, got {max_shard_bytes!r}")
        directory = os.fspath(directory)
        layout = _hf_layout(model)
        digest = _digest(layout.signature())
        os.makedirs(directory, exist_ok=True)
    except (TypeError, ValueError, OSError) as exc:
        error = exc if not isinstance(exc, OSError) else ValueError(f"directory: {exc}")
    _agree(error, pg, use_dist, digest)

    mine = _pack(_hf_tensors(layout, rank, root, materialize=False), max_shard_bytes)
    every = [mine]
    if use_dist:
        every = [None] * dist.get_world_size(pg)
        dist.all_gather_object(every, mine, group=pg)
    count = sum(len(f) for f in every)
    first = sum(len(f) for f in every[:rank])
    names = [_SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]

    error = None
    try:
        files = iter(enumerate(mine))
        j, planned, buffer = -1, [], {}
        for key, _, _, t in _hf_tensors(layout, rank, root, materialize=True):
            if not buffer:
                j, planned = next(files)
            buffer[key] = t.detach().contiguous().cpu()
            if len(buffer) == len(planned):
                _write_atomic(save_file, buffer, os.path.join(directory, names[first + j]))
                buffer = {}
    except OSError as exc:
        error = ValueError(f"directory: writing {directory!r} failed on rank {rank}: {exc}")
    _agree(error, pg, use_dist)
    if rank == 0:
        _finish_hf_dir(model, directory, names, every)
    if use_dist:
        dist.barrier(group=pg)


def _write_atomic(save_file, tensors: dict, path: str) -> None:
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def _finish_hf_dir(model, directory: str, names: list, every: list) -> None:
    """Rank 0, once every file is written: the index (or none for one file), the config, stale files out."""
    for f in os.listdir(directory):
        if (_SHARD_NAME.fullmatch(f) or f == _SINGLE) and f not in names:
            os.remove(os.path.join(directory, f))
    index = os.path.join(directory, _INDEX)
    if len(names) == 1:
        if os.path.exists(index):
            os.remove(index)
    else:
        files = [f for per_rank in every for f in per_rank]
        weight_map = {key: names[i] for i, entries in enumerate(files) for key, _ in entries}
        total = sum(nbytes for entries in files for _, nbytes in entries)
        with open(index + ".tmp", "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh,
                      indent=2)
        os.replace(index + ".tmp", index)
    if _is_hf(model):
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(directory)


def _weight_map(directory: str) -> dict:
    index = os.path.join(directory, _INDEX)
    single = os.path.join(directory, _SINGLE)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: _SINGLE for k in f.keys()}
    if os.path.isfile(index):
        with open(index) as fh:
            return json.load(fh)["weight_map"]
    raise ValueError(f"directory: neither {_SINGLE} nor {_INDEX} in {directory!r}")


class _Headers:
    """Shapes from safetensors headers, files opened once (safetensors maps them; nothing is read yet)."""

    def __init__(self, directory: str, weight_map: dict):
        self.directory, self.weight_map, self.open = directory, weight_map, {}

    def file(self, key: str):
        from safetensors import safe_open

        name = self.weight_map[key]
        if name not in self.open:
            self.open[name] = safe_open(os.path.join(self.directory, name), framework="pt")
        return self.open[name]

    def shape(self, key: str) -> tuple:
        return tuple(self.file(key).get_slice(key).get_shape())


def _plan_hf_load(layout: _HFLayout, headers: _Headers) -> tuple:
    """(dense plan, expert plan) for the files in ``headers``; ValueError naming everything missing or differing."""
    wm, missing, problems = headers.weight_map, [], []
    dense = []
    for key, disk, t in layout.dense:
        src = disk if disk in wm else key if key in wm else None
        if src is None:
            missing.append(disk)
        elif headers.shape(src) != tuple(t.shape):
            problems.append(f"{src}: shape {headers.shape(src)} in the checkpoint, {tuple(t.shape)} in the model")
        else:
            dense.append((src, t))
    experts = []
    for p in layout.experts:
        E = p.shard.num_experts
        parts = p.parts
        if not all(q.key(0) in wm for q in parts) and p.fqn in wm:  # written fused: save_original_format=False
            row = tuple(p.param.shape[1:])
            parts = [_Part(p.fqn, True, torch.arange(math.prod(row)).view(row))]
        for q in parts:
            absent = [q.key(e) for e in range(E) if q.key(e) not in wm]
            if absent:
                missing.extend(absent)
                continue
            if not q.fused:
                prefix, suffix = q.name.split("{}")
                extra = [k for k in wm if k.startswith(prefix) and k.endswith(suffix)
                         and k[len(prefix):len(k) - len(suffix)].isdigit() and int(k[len(prefix):len(k) - len(suffix)]) >= E]
                if extra:
                    problems.append(f"{p.fqn}: the checkpoint has {E + len(extra)} experts ({_listing(extra, 2)} "
                                    f"beyond), the model's layer {p.shard.layer!r} has E={E}")
                    continue
            for e in range(1 if q.fused else E):
                got, want = headers.shape(q.key(e)), q.disk_shape(E)
                if got != want:
                    what = (f"the checkpoint has E={got[0]} experts, the model's layer {p.shard.layer!r} has E={E}"
                            if q.fused and got[1:] == want[1:] else f"shape {got} in the checkpoint, {want} in the model")
                    problems.append(f"{q.key(e)}: {what}")
                    break
        experts.append((p, parts))
    if missing:
        problems.append(f"missing from the checkpoint: {_listing(missing)}")
    if problems:
        raise ValueError(f"directory: the checkpoint at {headers.directory!r} does not fit the model: "
                         + "; ".join(problems))
    return dense, experts


@torch.no_grad()
def load_hf(model: nn.Module, directory, *, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Load a Hugging Face ``save_pretrained`` directory into ``model`` sharded at any EP size (in place).

    Reads what :func:`save_hf` writes and what transformers' own ``save_pretrained`` writes for the
    unsharded model (per-expert keys, or fused [E, ...] tensors with ``save_original_format=False``).
    Each rank reads the replicated tensors and only its experts: the per-expert tensors of experts
    [r*L, (r+1)*L), or rows ``get_slice(name)[r*L:(r+1)*L]`` of a fused one. Values are cast to the
    parameters' dtype. Call on every rank (the ranks agree on validation with one all-gather).

    Args:
        model: as for :func:`save_hf`.
        directory: holding ``model.safetensors`` or ``model.safetensors.index.json`` and its files.
        process_group: as for :func:`save_hf`.

    Raises:
        TypeError, ValueError: on every rank before any tensor is read, naming what differs (E of a
            layer, shapes, missing keys).
    """
    pg, use_dist = _process_group(process_group)
    error, headers, plan = None, None, None
    try:
        directory = os.fspath(directory)
        layout = _hf_layout(model)
        headers = _Headers(directory, _weight_map(directory))
        plan = _plan_hf_load(layout, headers)
    except (TypeError, ValueError, OSError) as exc:
        error = exc if not isinstance(exc, OSError) else ValueError(f"directory: {exc}")
    _agree(error, pg, use_dist)
    dense, experts = plan
    for src, t in dense:
        t.copy_(headers.file(src).get_tensor(src))
    for p, parts in experts:
        s = p.shard
        rows = p.param.detach().view(s.rows, -1)
        for q in parts:
            idx = q.idx.to(rows.device).reshape(-1).long()
            if q.fused:
                values = headers.file(q.name).get_slice(q.name)[s.offset:s.offset + s.rows]
                rows[:, idx] = values.reshape(s.rows, -1).to(rows.device, rows.dtype)
            else:
                for i in range(s.rows):
                    key = q.key(s.offset + i)
                    rows[i, idx] = headers.file(key).get_tensor(key).reshape(-1).to(rows.device, rows.dtype)
