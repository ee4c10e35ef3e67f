"""Helpers shared by the DCP and Hugging Face checkpoint formats: expert shards, cross-rank agreement."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lancet_rt.comm.group import TorchGroup
from lancet_rt.moe.layer import MoE


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
                    f"experts)")
            group = moe.group.group
            if pg is not None and not set(dist.get_process_group_ranks(group)) <= set(dist.get_process_group_ranks(pg)):
                raise ValueError(f"process_group: must hold every rank of MoE layer {layer!r}'s ep_group "
                                 f"(ranks {dist.get_process_group_ranks(group)})")
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


class CheckpointError(RuntimeError):
    """Writing or reading a checkpoint failed on some rank (I/O, a corrupted file): raised on every rank,
    naming the rank, the file and the key; the model in memory and the last good checkpoint are unchanged."""


_ERROR_TYPES = {"TypeError": TypeError, "ValueError": ValueError, "CheckpointError": CheckpointError}


def _agree(error: Optional[Exception], pg, use_dist: bool, digest: Optional[str] = None, *,
           same: Optional[tuple] = None, what: str = "checkpoint agreement") -> None:
    """Every rank raises if any rank failed (or, with ``digest``, if the ranks' structures differ; with
    ``same`` = (argument, value), if the ranks passed different values). One object all-gather through
    the group's monitor: bounded by ``LANCET_TIMEOUT_S``, a lost peer named."""
    if not use_dist:
        if error is not None:
            raise error
        return
    from lancet_rt.comm.group import as_group

    mine = (None if error is None else (type(error).__name__, str(error)), digest, None if same is None else same[1])
    group = as_group(pg)
    rows = group.all_gather_object(mine, what)
    if error is not None:
        if type(error) in _ERROR_TYPES.values() and not str(error).startswith("rank "):
            named = type(error)(f"rank {group.rank}: {error}")  # every rank's message names the rank at fault
            raise named from error
        raise error
    for r, (err, _, _) in enumerate(rows):
        if err is not None:
            raise _ERROR_TYPES.get(err[0], ValueError)(f"rank {r}: {err[1]}")
    if same is not None and len({v for _, _, v in rows}) > 1:
        raise ValueError(f"{same[0]}: the ranks passed different values, and a checkpoint must be one directory: "
                         + ", ".join(f"rank {r}: {v!r}" for r, (_, _, v) in enumerate(rows)))
    if len({d for _, d, _ in rows}) > 1:
        groups: dict = {}
        for r, (_, d, _) in enumerate(rows):
            groups.setdefault(d, []).append(r)
        raise ValueError("model: the ranks hold differently structured models or optimizers (state-dict keys, "
                         f"shapes or dtypes differ); ranks agreeing with each other: {list(groups.values())}")


def _dcp_failure(exc: BaseException, path: str, doing: str) -> Exception:
    """DCP's CheckpointException (a BaseException, every rank's failures) as a CheckpointError, or a
    ValueError when every failing rank found bad data; naming the ranks and what they said."""
    failures = getattr(exc, "failures", {}) or {}
    parts, kinds = [], set()
    for r, pair in sorted(failures.items()):
        inner = pair[0] if isinstance(pair, tuple) else pair
        kinds.add(type(inner).__name__)
        parts.append(f"rank {r}: {type(inner).__name__}: {str(inner).strip().splitlines()[0] if str(inner).strip() else ''}")
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
