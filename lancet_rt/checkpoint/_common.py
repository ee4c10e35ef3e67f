"""The safety layer every checkpoint path shares (``save_checkpoint``, ``save_sharded``, ``save_hf``
and their loads): expert shards, cross-rank agreement through the group's monitor, and the save
protocol (:func:`guarded_save`): agree, write into a staging directory, agree, swap it in, agree."""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lancet_rt.checkpoint import _atomic
from lancet_rt.comm.group import TorchGroup, as_group
from lancet_rt.moe.layer import MoE


# ------------------------------------------------------------------ shards and agreement
@dataclass(frozen=True)
class _Shard:
    """This rank's rows [offset, offset + rows) of one expert parameter, a [E, ...] tensor."""

    layer: str  # the MoE's module name, for messages
    num_experts: int
    offset: int
    rows: int
    group: Optional[dist.ProcessGroup]  # None: every expert is local

    def global_shape(self, local: torch.Tensor) -> tuple:
        return (self.num_experts,) + tuple(local.shape[1:])


def _tensor_id(t: torch.Tensor) -> tuple:
    # A state dict holds detached views of the parameters: same address, same shape.
    return (t.data_ptr(), tuple(t.shape), t.dtype)


def _expert_shards(model: nn.Module, pg=None) -> dict:
    """{tensor id: _Shard} for every parameter of every MoE layer's experts (EP groups within ``pg``)."""
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
                    f"experts)"
                )
            group = moe.group.group
            if pg is not None and not set(dist.get_process_group_ranks(group)) <= set(dist.get_process_group_ranks(pg)):
                raise ValueError(
                    f"process_group: must hold every rank of MoE layer {layer!r}'s ep_group "
                    f"(ranks {dist.get_process_group_ranks(group)})"
                )
        L = moe.num_local_experts
        for pname, p in moe.experts.named_parameters():
            if p.dim() == 0 or p.shape[0] != L:
                raise ValueError(
                    f"model: {layer}.experts.{pname} must have dim 0 = num_local_experts ({L}), "
                    f"got shape {tuple(p.shape)}"
                )
            shards[_tensor_id(p)] = _Shard(layer, moe.num_experts, moe.ep_rank * L, L, group)
    return shards


def _process_group(process_group):
    """(group, distributed?): the given group, else the default one when torch.distributed is up."""
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be None or a torch.distributed ProcessGroup, got {type(process_group).__name__}"
            )
        return process_group, True
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, True
    return None, False


class CheckpointError(RuntimeError):
    """Writing or reading a checkpoint failed on some rank (I/O, a corrupted file): raised on every rank,
    naming the rank, the file and the key; the model in memory and the last good checkpoint are unchanged."""


_ERROR_TYPES = {"TypeError": TypeError, "ValueError": ValueError, "CheckpointError": CheckpointError}


def _agree(
    error: Optional[Exception],
    pg,
    use_dist: bool,
    digest: Optional[str] = None,
    *,
    same: Optional[tuple] = None,
    what: str = "checkpoint agreement",
) -> None:
    """Every rank raises if any rank failed (or, with ``digest``, if the ranks' structures differ; with
    ``same`` = (argument, value), if the ranks passed different values; with ``same`` = (argument,
    (path, identity)), if they name different checkpoints). One object all-gather through the
    group's monitor: bounded by ``LANCET_TIMEOUT_S``, a lost peer named. An OSError keeps its errno."""
    if not use_dist:
        if error is not None:
            raise error
        return

    failed = None if error is None else (type(error).__name__, str(error), getattr(error, "errno", None))
    mine = (failed, digest, None if same is None else same[1])
    group = as_group(pg)
    rows = group.all_gather_object(mine, what)
    name = group.monitor.name  # global ranks (the group rank beside, where they differ)
    if error is not None:
        if type(error) in _ERROR_TYPES.values() and not str(error).startswith("rank "):
            named = type(error)(f"{name(group.rank)}: {error}")  # every rank's message names the rank at fault
            raise named from error
        raise error
    for r, (err, _, _) in enumerate(rows):
        if err is not None:
            if err[2] is not None and err[0] not in _ERROR_TYPES:
                raise OSError(err[2], f"{name(r)}: {err[1]}")
            raise _ERROR_TYPES.get(err[0], ValueError)(f"{name(r)}: {err[1]}")
    if same is not None and len({v for _, _, v in rows}) > 1:
        values = [v for _, _, v in rows]
        if isinstance(same[1], tuple):
            raise ValueError(_different_checkpoints(same[0], values, name))
        raise ValueError(
            f"{same[0]}: the ranks passed different values, and a checkpoint must be one directory: "
            + ", ".join(f"{name(r)}: {v!r}" for r, v in enumerate(values))
        )
    if len({d for _, d, _ in rows}) > 1:
        groups: dict = {}
        for r, (_, d, _) in enumerate(rows):
            groups.setdefault(d, []).append(group.monitor.global_ranks[r])
        raise ValueError(
            "model: the ranks hold differently structured models or optimizers (state-dict keys, "
            f"shapes or dtypes differ); (global) ranks agreeing with each other: {list(groups.values())}"
        )


def _different_checkpoints(argument: str, values: list, name) -> str:
    """The message of a load whose ranks name different checkpoints: (path, identity) per rank."""
    paths = {p for p, _ in values}
    what = (
        "different directories"
        if len(paths) > 1
        else "one directory whose contents changed between the ranks' reads (a save landed while they read it?)"
    )
    ranks = ", ".join(f"{name(r)}: {p!r} (identity {i[:12]})" for r, (p, i) in enumerate(values))
    return (
        f"{argument}: the ranks load different checkpoints ({what}): {ranks}; every rank must load the same "
        f"one (resolve a 'latest' link once, on one rank, and pass its target to all); nothing was loaded"
    )


def path_argument(value, name: str) -> str:
    """``os.fspath(value)`` of a checkpoint's directory argument ``name``: a TypeError naming it unless
    ``value`` is a str or an ``os.PathLike`` of one, a ValueError if it is empty (it would be the
    current directory); raised inside the cross-rank agreement, so on every rank."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a directory path (a str or os.PathLike), got {type(value).__name__}")
    if not text:
        raise ValueError(f"{name} must not be empty")
    return text


def guarded_save(
    prepare: Callable[[str], tuple],
    write: Callable,
    path,
    pg,
    use_dist: bool,
    *,
    fmt: str,
    argument: str = "path",
    finish: Optional[Callable] = None,
) -> None:
    """The save protocol of every checkpoint format, on every rank of ``pg``:

    1. the path checked (a symbolic link followed to its target, a dangling one or a loop refused);
       ``state, digest = prepare(abspath)`` (validation, the state to write; no collective); rank 0
       takes the save lock beside ``path`` (another save there in progress: a CheckpointError) and
       empties the staging directory; one agreement: any rank's error, different paths or
       differently structured states raise the same error on every rank, nothing written;
    2. ``write(state, stage, path)`` into the staging directory (its collectives bounded by the caller),
       returning the error to agree on (or None); agreed: a failure on any rank raises everywhere;
    3. rank 0: ``finish(state, stage)`` (files that need every rank's part), then the swap
       (:func:`lancet_rt.checkpoint._atomic.commit`); agreed.

    Until the swap, ``path`` holds the last good checkpoint, untouched; a failure removes the staging
    directory and releases the lock; a rank killed anywhere leaves ``path`` loadable, and its peers raise
    the monitor's PeerError naming it. A full disk is an OSError(ENOSPC) naming the path."""

    rank = dist.get_rank(pg) if use_dist else 0
    error, state, digest, held = None, None, None, None
    try:
        path = _atomic.target(path_argument(path, argument), argument)
        state, digest = prepare(path)
        if rank == 0:
            held = _atomic.SaveLock(path, CheckpointError)
            _atomic.prepare(path)
    except Exception as exc:  # every rank must learn of it, or the others would hang
        error = exc if isinstance(exc, CheckpointError) else _bad_argument(exc, argument)
    try:
        _agree(error, pg, use_dist, digest, same=(argument, path))
        stage = _atomic.staging(path)
        _agree(write(state, stage, path), pg, use_dist)
        error = None
        if rank == 0:
            try:
                if finish is not None:
                    finish(state, stage)
                _atomic.commit(path, fmt, dist.get_world_size(pg) if use_dist else 1)
            except Exception as exc:  # the peers wait in the agreement below
                error = write_failure(exc, path, stage, "swapping the new checkpoint in", argument)
        _agree(error, pg, use_dist)
    except BaseException:
        if held is not None:
            _atomic.discard(path)
        raise
    finally:
        if held is not None:
            held.release()


def write_failure(
    exc: BaseException, path: str, stage: str, doing: str, argument: str = "path", rank: int = 0
) -> Exception:
    """A failed write as the error every rank raises: an OSError(ENOSPC) naming ``path`` when the
    staging directory's file system is full (torch's writers lose the errno: "unexpected pos"), else
    a CheckpointError; the previous checkpoint is untouched either way."""
    free = _free_bytes(stage)
    if _is_no_space(exc) or (free is not None and free < _FULL_BYTES):
        err: Exception = OSError(
            errno.ENOSPC,
            f"{argument}: no space left on the device {doing} at {path!r} on "
            f"rank {rank} ({free} bytes free beside it; "
            f"{type(exc).__name__}: {str(exc).strip()[:200]}); the previous "
            f"checkpoint there is unchanged",
            path,
        )
    else:
        err = CheckpointError(f"{argument}: {doing} at {path!r} failed on rank {rank}: {exc}")
    err.__cause__ = exc
    return err


_FULL_BYTES = 1 << 20  # less free than this after a failed write: the disk filled up


def _free_bytes(where: str) -> Optional[int]:
    while where and not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        st = os.statvfs(where or ".")
    except OSError:
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def _is_no_space(exc: BaseException) -> bool:
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        failures = getattr(e, "failures", None) or {}
        todo.extend(p[0] if isinstance(p, tuple) else p for p in failures.values())
        todo.extend((e.__cause__, e.__context__))
    return False


def _dcp_failure(exc: BaseException, path: str, doing: str, pg=None) -> Exception:
    """DCP's CheckpointException (a BaseException, every rank's failures) as a CheckpointError, or a
    ValueError when every failing rank found bad data; naming the (global) ranks and what they said."""
    failures = getattr(exc, "failures", {}) or {}
    parts, kinds = [], set()
    for r, pair in sorted(failures.items()):
        inner = pair[0] if isinstance(pair, tuple) else pair
        kinds.add(type(inner).__name__)
        g = dist.get_global_rank(pg, r) if pg is not None else r
        first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
        parts.append(f"rank {g}{'' if g == r else f' (group rank {r})'}: {type(inner).__name__}: {first}")
    kind = ValueError if kinds == {"ValueError"} else CheckpointError
    err = kind(f"path: {doing} the checkpoint at {path!r} failed ({'; '.join(parts) or exc}); nothing was changed")
    err.__cause__ = exc
    return err


def _bad_argument(exc: Exception, what: str) -> Exception:
    """A failure while checking, as the TypeError/ValueError every rank raises (the cause chained)."""
    if isinstance(exc, (TypeError, ValueError)):
        return exc
    err = ValueError(f"{what}: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def _digest(items) -> str:
    return hashlib.sha256(repr(items).encode()).hexdigest()


def _listing(names, limit: int = 8) -> str:
    names = list(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
