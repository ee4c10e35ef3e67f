"""Checkpoints in the Hugging Face ``save_pretrained`` layout, written and read at any EP size.

:func:`save_hf` writes the full, unsharded model as transformers itself would (for Mixtral- and
Qwen-MoE-style models transformers 5.x splits the fused expert tensors back into per-expert keys on
save, ``...block_sparse_moe.experts.{e}.w1.weight``; GPT-OSS-style models keep them fused [E, ...]);
each rank writes the files of its own experts. :func:`load_hf` reads such a directory, or one written
by the unsharded model's own ``save_pretrained``, each rank reading only its experts' tensors or rows.

How transformers lays out an expert parameter on disk is not hard-coded: it is found by running
transformers' own save-side conversion (``revert_weight_conversion``) on an index probe of one
expert row, which gives, for every on-disk tensor, the flat positions of the row it holds. Saving
gathers through those positions and loading scatters through them, so the two are exact inverses.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lancet_rt.checkpoint import _atomic
from lancet_rt.checkpoint._common import (
    _agree,
    _bad_argument,
    _digest,
    _expert_shards,
    _listing,
    _process_group,
    _Shard,
    _tensor_id,
    guarded_save,
    path_argument,
    write_failure,
)
from lancet_rt.checkpoint._hf_files import _SINGLE, _finish_hf_dir, _Headers, _is_hf, _read, _weight_map, _write_atomic
from lancet_rt.comm.faults import GroupError
from lancet_rt.comm.group import as_group

__all__ = ["save_hf", "load_hf"]

_DEFAULT_SHARD_BYTES = 5 * 2**30


def _revert(model, tensors: dict) -> dict:
    """Model-named tensors -> the names and layout transformers writes on save (identity outside HF)."""
    if not _is_hf(model):
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


@dataclass
class _Part:
    """One on-disk tensor an expert parameter becomes: per expert (``name`` has ``{}``) or fused [E, ...].

    For one expert, the disk tensor (``shape``) holds the elements ``idx`` of the expert's flat
    row, or, in the common case of a plain slice, the elements ``span`` = [start, stop): a view.
    """

    name: str
    fused: bool
    shape: tuple
    idx: Optional[torch.Tensor] = None
    span: Optional[tuple] = None

    def key(self, e: int) -> str:
        return self.name if self.fused else self.name.format(e)

    def disk_shape(self, E: int) -> tuple:
        return ((E,) if self.fused else ()) + self.shape

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [R, n] (R experts' flat rows) -> their disk tensors [R, *shape]."""
        picked = rows[:, self.span[0] : self.span[1]] if self.span else rows[:, self.idx.to(rows.device)]
        return picked.reshape((rows.shape[0],) + self.shape)

    def put(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """The inverse of :meth:`take`: write disk tensors [R, *shape] into rows [R, n] in place."""
        values = values.reshape(rows.shape[0], -1).to(rows.device, rows.dtype)
        if self.span:
            rows[:, self.span[0] : self.span[1]] = values
        else:
            rows[:, self.idx.to(rows.device)] = values


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
                seen.setdefault((tuple(fields[:pos]), tuple(fields[pos + 1 :])), set()).add(int(f))
    return {k: ".".join(k[0] + ("{}",) + k[1]) for k, found in seen.items() if found == set(range(E)) and E > 1}


def _probe(model, fqn: str, row: tuple) -> list:
    """(flat indices, span) of each on-disk tensor of one expert row, in transformers' output order.

    Found by converting an index probe (each element holds its own position) as transformers would
    on save; the check that every element lands exactly once is O(n).
    """
    n = math.prod(row)
    probe = torch.arange(n, dtype=torch.int32 if n < 2**31 else torch.int64).view((1,) + row)
    out, seen = [], torch.zeros(n, dtype=torch.bool)
    for idx in _revert(model, {fqn: probe}).values():
        flat = idx.reshape(-1).long()
        seen[flat] = True
        contiguous = flat.numel() > 0 and bool((flat[1:] - flat[:-1] == 1).all())
        span = (int(flat[0]), int(flat[0]) + flat.numel()) if contiguous else None
        out.append((None if span else flat, span, idx.numel()))
    if sum(k for _, _, k in out) != n or not bool(seen.all()):
        raise ValueError(f"model: transformers' saved layout of {fqn} does not hold each element once")
    return out


def _expert_parts(model, fqn: str, local: torch.Tensor, shard: _Shard, probes: dict) -> list:
    """How transformers stores one expert parameter: one _Part per on-disk tensor.

    The index probe is the costly step (O(row size)); layers whose parameters differ only by their
    numbers (the layer index) share one, matched in transformers' output order, shapes checked.
    """
    E, row = shard.num_experts, tuple(local.shape[1:])
    per_row = _revert(model, {fqn: torch.empty((1,) + row, dtype=torch.int32, device="meta")})
    full = _revert(model, {fqn: torch.empty((E,) + row, dtype=local.dtype, device="meta")})
    kind = (re.sub(r"\.\d+\.", ".#.", fqn), row)
    if kind not in probes:
        probes[kind] = _probe(model, fqn, row)
    if len(probes[kind]) != len(per_row):
        raise ValueError(f"model: transformers saves {fqn} unlike the other layers' {kind[0]}")
    templates = _expert_templates(full, E)
    parts = []
    for (key, meta), (idx, span, numel) in zip(per_row.items(), probes[kind]):
        shape = tuple(meta.shape)
        if math.prod(shape) != numel:
            raise ValueError(f"model: transformers saves {fqn} unlike the other layers' {kind[0]}")
        if key in full and tuple(full[key].shape) == (E,) + shape[1:] and shape[:1] == (1,):
            parts.append(_Part(key, True, shape[1:], idx, span))
            continue
        fields = key.split(".")
        name = None
        for pos, f in enumerate(fields):
            t = templates.get((tuple(fields[:pos]), tuple(fields[pos + 1 :])))
            if f == "0" and t is not None:
                name = t
        if name is None and E == 1 and key in full:
            name = key.replace("{", "{{").replace("}", "}}")
        if name is None or tuple(full[name.format(0)].shape) != shape:
            raise ValueError(
                f"model: cannot map expert parameter {fqn} to the layout transformers saves "
                f"(on-disk key {key!r} is neither fused [E, ...] nor numbered by expert)"
            )
        parts.append(_Part(name, False, shape, idx, span))
    return parts


@dataclass
class _HFLayout:
    dense: list  # (model key, disk key, tensor)
    experts: list  # _ExpertParam

    def signature(self) -> list:
        return [(d, tuple(t.shape), str(t.dtype)) for _, d, t in self.dense] + [
            (p.fqn, [(q.name, q.disk_shape(p.shard.num_experts)) for q in p.parts], str(p.param.dtype))
            for p in self.experts
        ]


def _hf_layout(model: nn.Module, pg) -> _HFLayout:
    shards = _expert_shards(model, pg)
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
            raise ValueError(
                f"model: transformers converts dense tensor {disk!r} on save (not a renaming); "
                f"save_hf/load_hf support renamed dense tensors only (a model without lancet MoE "
                f"layers saves with its own save_pretrained)"
            )
        renamed[names[id(v)]] = disk
    layout = _HFLayout([(k, renamed[k], v) for k, v in dense.items()], [])
    probes: dict = {}
    for k, v in sd.items():
        shard = shards.get(_tensor_id(v))
        if shard is not None:
            layout.experts.append(_ExpertParam(k, v, shard, _expert_parts(model, k, v, shard, probes)))
    return layout


def _writes(shard: _Shard, rank: int, root: int) -> bool:
    """Whether this rank writes its experts: its EP group holds the saving group's rank 0 (the first
    of data-parallel replicas), or, every expert local, it is that rank."""
    return rank == 0 if shard.group is None else root in dist.get_process_group_ranks(shard.group)


def _hf_tensors(layout: _HFLayout, rank: int, root: int, materialize: bool) -> Iterator:
    """(disk key, shape, dtype, tensor or None) of every tensor this rank writes, in one global order.

    With ``materialize``, fused expert tensors are gathered over their EP group (a collective at the
    same point of this order on every rank) to the rank that writes them.
    """
    if rank == 0:
        for _, disk, t in layout.dense:
            yield disk, tuple(t.shape), t.dtype, t if materialize else None
    for n, p in enumerate(layout.experts):
        s, E = p.shard, p.shard.num_experts
        if not _writes(s, rank, root):
            continue
        rows = p.param.detach().reshape(s.rows, -1)
        for part in p.parts:
            if part.fused:
                W = E // s.rows
                owner = n % W  # fused tensors gathered to the EP ranks in turn
                local = part.take(rows).contiguous() if materialize else None
                if materialize and s.group is not None:
                    bufs = [torch.empty_like(local) for _ in range(W)] if s.offset // s.rows == owner else None
                    _gather(local, bufs, s.group, owner)
                    local = torch.cat(bufs) if bufs is not None else None
                if s.offset // s.rows == owner:
                    yield part.key(0), part.disk_shape(E), p.param.dtype, local
            else:
                for i in range(s.rows):
                    t = part.take(rows[i : i + 1])[0] if materialize else None
                    yield part.key(s.offset + i), part.disk_shape(E), p.param.dtype, t


def _gather(local: torch.Tensor, bufs, group, owner: int) -> None:
    """``dist.gather`` to group rank ``owner`` through the group's monitor (numbered, bounded, checked)."""
    g = as_group(group)
    n, me = local.numel(), g.rank
    header = (local.dtype, [n if q == owner else 0 for q in range(g.size)], [n if me == owner else 0] * g.size)
    g.monitor.issue(
        "checkpoint expert gather",
        lambda: dist.gather(local, bufs, group=group, group_dst=owner, async_op=True),
        header,
    ).wait()


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


def save_hf(
    model: nn.Module,
    directory,
    *,
    max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
    process_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Write ``model`` as the full, unsharded model in the Hugging Face ``save_pretrained`` layout.

    Call on every rank. Rank r writes the safetensors files of the experts it holds (per-expert
    keys, as transformers writes them; a tensor stored fused [E, ...] on disk is gathered over the
    EP group to one rank per tensor, the ranks in turn); rank 0 writes the replicated tensors, then, once every
    file is written, ``model.safetensors.index.json`` and (for a transformers model) ``config.json``
    and ``generation_config.json``. No rank holds more than its own tensors plus one file's worth
    (``max_shard_bytes``), so memory stays that of the sharded model. For a transformers
    ``PreTrainedModel`` (as patched by ``lancet_rt.from_hf``, state-dict keys those of Hugging
    Face), ``AutoModelForCausalLM.from_pretrained(directory)`` loads the result; for any other
    module the files hold its own state-dict keys with experts fused [E, ...].

    Args:
        model: the model (on every rank), MoE layers with ``ep_group`` None or a ProcessGroup.
        directory: where to write, the same on every rank (written beside it and swapped in once
            complete, as :func:`~lancet_rt.checkpoint.dcp.save_checkpoint` does; other files in an
            existing directory, a tokenizer say, are kept).
        max_shard_bytes: the largest safetensors file a rank writes (a bigger tensor gets its own).
        process_group: the saving group (default: the default group when initialized); with data
            parallel replicas of the EP group, the replica holding its rank 0 writes.

    Raises:
        TypeError, ValueError: on every rank before anything is written (an emulated EP group, a
            layout transformers converts other than by renaming, ranks holding different models or
            passing different directories).
        CheckpointError: on every rank, when writing failed on some rank, or another save to
            ``directory`` is in progress; ``directory`` is untouched.
        OSError: ENOSPC on every rank when the disk filled up, naming ``directory``.
    """
    from safetensors.torch import save_file

    pg, use_dist = _process_group(process_group)
    rank = dist.get_rank(pg) if use_dist else 0
    root = dist.get_global_rank(pg, 0) if use_dist else 0
    files: dict = {}  # the file names and every rank's file plan, for the index rank 0 writes

    def prepare(_directory):
        if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be an int >= 1, got {max_shard_bytes!r}")
        layout = _hf_layout(model, pg)
        return layout, _digest(layout.signature())

    def write(layout: _HFLayout, stage: str, target: str) -> Optional[Exception]:
        mine = _pack(_hf_tensors(layout, rank, root, materialize=False), max_shard_bytes)
        every = as_group(pg).all_gather_object(mine, "checkpoint file plan") if use_dist else [mine]
        count = sum(len(f) for f in every)
        first = sum(len(f) for f in every[:rank])
        names = [_SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        files.update(names=names, every=every)
        try:
            plan = iter(enumerate(mine))
            j, planned, buffer = -1, [], {}
            for key, _, _, t in _hf_tensors(layout, rank, root, materialize=True):
                if not buffer:
                    j, planned = next(plan)
                buffer[key] = t.detach().contiguous().cpu()
                if len(buffer) == len(planned):
                    _write_atomic(save_file, buffer, os.path.join(stage, names[first + j]))
                    buffer = {}
        except GroupError:  # a collective failed: there is nothing to agree on
            raise
        except Exception as exc:  # OSError, safetensors' SafetensorError (a full disk: ENOSPC)
            return write_failure(exc, target, stage, "writing the checkpoint", "directory", rank)
        return None

    guarded_save(
        prepare,
        write,
        directory,
        pg,
        use_dist,
        fmt="hf",
        argument="directory",
        finish=lambda layout, stage: _finish_hf_dir(model, stage, files["names"], files["every"]),
    )


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
        elif headers.dtype_error(src, t.dtype):
            problems.append(headers.dtype_error(src, t.dtype))
        else:
            dense.append((src, t))
    experts = []
    for p in layout.experts:
        E = p.shard.num_experts
        parts = p.parts
        if not all(q.key(0) in wm for q in parts) and p.fqn in wm:  # written fused: save_original_format=False
            parts = [_Part(p.fqn, True, tuple(p.param.shape[1:]), span=(0, math.prod(p.param.shape[1:])))]
        for q in parts:
            present = [e for e in range(E) if q.key(e) in wm]
            if 0 < len(present) < E and present == list(range(len(present))):
                problems.append(
                    f"{p.fqn}: the checkpoint has E={len(present)} experts, the model's layer "
                    f"{p.shard.layer!r} has E={E}"
                )
                continue
            if len(present) < E:
                missing.extend(q.key(e) for e in range(E) if e not in present)
                continue
            if not q.fused:
                prefix, suffix = q.name.split("{}")
                numbers = (
                    k[len(prefix) : len(k) - len(suffix)] for k in wm if k.startswith(prefix) and k.endswith(suffix)
                )
                extra = [q.key(int(i)) for i in numbers if i.isdigit() and int(i) >= E]
                if extra:
                    problems.append(
                        f"{p.fqn}: the checkpoint has E={E + len(extra)} experts ({_listing(extra, 2)} "
                        f"beyond), the model's layer {p.shard.layer!r} has E={E}"
                    )
                    continue
            for e in range(1 if q.fused else E):
                got, want = headers.shape(q.key(e)), q.disk_shape(E)
                if got != want:
                    what = f"shape {got} in the checkpoint, {want} in the model"
                    if q.fused and got[1:] == want[1:]:
                        what = f"the checkpoint has E={got[0]} experts, the model's layer {p.shard.layer!r} has E={E}"
                    problems.append(f"{q.key(e)}: {what}")
                    break
                if headers.dtype_error(q.key(e), p.param.dtype):
                    problems.append(headers.dtype_error(q.key(e), p.param.dtype))
                    break
        experts.append((p, parts))
    if missing:
        problems.append(f"missing from the checkpoint: {_listing(missing)}")
    if problems:
        raise ValueError(
            f"directory: the checkpoint at {headers.directory!r} does not fit the model: " + "; ".join(problems)
        )
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
            layer, shapes, dtypes of another kind than the parameters', missing keys, a missing or
            damaged file, a header that differs from ``lancet-manifest.json``, ranks naming different
            checkpoints); and, the model unchanged (every
            tensor is read before any parameter changes), a tensor that cannot be read (the file, the
            key and the rank named).
    """
    pg, use_dist = _process_group(process_group)
    rank = dist.get_rank(pg) if use_dist else 0
    error, headers, plan, same = None, None, None, None
    try:
        directory = _atomic.resolve(path_argument(directory, "directory"))
        layout = _hf_layout(model, pg)
        headers = _Headers(directory, _weight_map(directory))
        same = ("directory", (os.path.realpath(directory), headers.identity))
        plan = _plan_hf_load(layout, headers)
    except Exception as exc:  # every rank must learn of it, or the others would hang
        error = _bad_argument(exc, "directory")
    _agree(error, pg, use_dist, same=same)  # every rank reads one checkpoint: the same path and headers
    # Everything is read into new tensors first; the parameters change only once every rank read all of it.
    dense, experts = plan
    updates, error = [], None
    try:
        for src, t in dense:
            updates.append((t, _read(headers, src, rank, lambda f, k: f.get_tensor(k))))
        for p, parts in experts:
            s = p.shard
            rows = p.param.detach().view(s.rows, -1)
            new = rows.clone()
            for q in parts:
                if q.fused:
                    q.put(new, _read(headers, q.name, rank, lambda f, k: f.get_slice(k)[s.offset : s.offset + s.rows]))
                else:
                    for i in range(s.rows):
                        key = q.key(s.offset + i)
                        q.put(new[i : i + 1], _read(headers, key, rank, lambda f, k: f.get_tensor(k)))
            updates.append((rows, new))
    except ValueError as exc:
        error = exc
    _agree(error, pg, use_dist)
    for t, new in updates:
        t.copy_(new)
