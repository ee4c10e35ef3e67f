"""Gradient synchronisation for data + expert parallelism over one group.

Dense parameters (attention, norms, router) are replicated on every rank and see only the local
batch: their gradients are averaged over the group. Expert parameters live on one rank and already
received every rank's tokens through the all-to-alls: their gradients are divided by the group size
so that all gradients are those of the mean loss over the global batch.

:func:`sync_gradients` does it after backward, in one all-reduce. :class:`GradientSync` does it
during backward, bucket by bucket as gradients become ready (as DDP does), and cuts each bucket's
all-reduce into pieces that queue behind the all-to-alls (Lina, ATC'23), so the all-reduce never
delays the backward's all-to-alls by more than one piece.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lancet_rt.moe.experts import Experts


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters of every :class:`~lancet_rt.Experts` module in ``model``."""
    for m in model.modules():
        if isinstance(m, Experts):
            yield from m.parameters()


def dense_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Every parameter of ``model`` that is not an expert parameter."""
    experts = {id(p) for p in expert_parameters(model)}
    return (p for p in model.parameters() if id(p) not in experts)


@torch.no_grad()
def sync_gradients(model: nn.Module, group=None) -> None:
    """Average dense gradients over ``group`` and scale expert gradients by 1 / group size.

    Args:
        model: the model after ``backward()``.
        group: the data/expert-parallel process group (None: the default group).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    grads = [p.grad for p in dense_parameters(model) if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    for p in expert_parameters(model):
        if p.grad is not None:
            p.grad /= world



class GradientSync:
    """Data-parallel gradient all-reduce during backward: bucket by bucket, in pieces, behind the
    all-to-alls (Lina, ATC'23).

    A context manager around the backward whose gradients it reduces::

        sync = GradientSync(model, group, piece_mb=1)
        with sync:
            loss.backward()   # each bucket's all-reduce starts as soon as its gradients are ready
        # here every piece has arrived and the gradients are those of the global mean loss

    Buckets hold the parameters in reverse registration order (about the order backward produces
    their gradients, as DDP's), up to ``bucket_mb`` each; a bucket starts when every one of its
    gradients has been accumulated (``register_post_accumulate_grad_hook``, so deferred dW, which
    reaches the accumulators at the flush, counts). Hooks outside the ``with`` do nothing, so the
    earlier microbatches of a gradient-accumulation step do not reduce. Parameters that got no
    gradient count as zero in the reduction and keep ``grad=None``.

    ``low_priority`` needs a group that can order its transfers: on :class:`lancet_rt.EmulatedGroup`
    a piece starts only when no all-to-all waits for the link (:meth:`EmulatedGroup.all_reduce`).
    On a ProcessGroup the pieces are issued in order (a communicator runs its collectives in
    order; a data-parallel group of its own lets NCCL run them beside the all-to-alls); the
    buckets are still reduced during backward.

    Args:
        model: the module whose gradients are reduced.
        group: a torch.distributed ProcessGroup, a :class:`lancet_rt.EmulatedGroup`, or None (the
            default process group).
        params: "dense" (data + expert parallelism over ``group``, as :func:`sync_gradients`: dense
            gradients averaged, expert gradients divided by W) or "all" (every gradient averaged:
            replicas of the whole model).
        bucket_mb: bucket size in MB (1e6 bytes); a parameter larger than it is a bucket of its own.
        piece_mb: the largest all-reduce issued, in MB; a bucket is cut into pieces of at most this
            size (None: one all-reduce per bucket).
        low_priority: issue the pieces at low priority (Lina's rule, see above).

    Attributes:
        issued: all-reduces issued by the last ``with`` (pieces).
    """

    def __init__(self, model: nn.Module, group=None, *, params: str = "dense", bucket_mb: float = 25.0,
                 piece_mb: Optional[float] = None, low_priority: bool = True):
        from lancet_rt.comm.emulated import EmulatedGroup

        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if group is not None and not isinstance(group, (dist.ProcessGroup, EmulatedGroup)):
            raise TypeError(f"group must be None, a ProcessGroup or a lancet_rt.EmulatedGroup, got {type(group).__name__}")
        if params not in ("dense", "all"):
            raise ValueError(f"params must be 'dense' or 'all', got {params!r}")
        for name, v in (("bucket_mb", bucket_mb), ("piece_mb", piece_mb)):
            if v is None and name == "piece_mb":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not isinstance(low_priority, bool):
            raise TypeError(f"low_priority must be a bool, got {type(low_priority).__name__}")
        self.group = group
        self.params = params
        self.piece_bytes = None if piece_mb is None else max(1, int(piece_mb * 1e6))
        self.low_priority = low_priority
        self.issued = 0
        self._active = False
        self._emulated = isinstance(group, EmulatedGroup)
        experts = {id(p) for p in expert_parameters(model)}
        reduced = [p for p in model.parameters() if p.requires_grad and (params == "all" or id(p) not in experts)]
        self._scaled = [p for p in model.parameters() if p.requires_grad and params == "dense" and id(p) in experts]
        self._buckets = _buckets(list(reversed(reduced)), int(bucket_mb * 1e6))
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in reduced]

    def _world_size(self) -> int:
        if self._emulated:
            return self.group.size
        return dist.get_world_size(self.group)

    def __enter__(self) -> "GradientSync":
        if self._active:
            raise RuntimeError("GradientSync: already inside its with block")
        for b in self._buckets:
            b.reset()
        self.issued = 0
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._active = False
        if exc_type is not None:
            for b in self._buckets:  # a failed backward: let what is in flight arrive, change nothing
                for w in b.works:
                    w.wait()
            return
        for b in self._buckets:  # buckets whose gradients did not all arrive (unused parameters)
            if b.flat is None:
                self._issue(b)
        world = self._world_size()
        with torch.no_grad():
            for b in self._buckets:
                for w in b.works:
                    w.wait()
                b.flat.div_(world)
                offset = 0
                for p in b.params:
                    n = p.numel()
                    if p.grad is not None:
                        p.grad.copy_(b.flat[offset:offset + n].view_as(p.grad))
                    offset += n
            for p in self._scaled:
                if p.grad is not None:
                    p.grad.div_(world)

    def remove(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _ready(self, p: torch.Tensor) -> None:
        if not self._active:
            return
        b = self._bucket_of[id(p)]
        b.ready += 1
        if b.ready == len(b.params):
            self._issue(b)

    @torch.no_grad()
    def _issue(self, b: "_Bucket") -> None:
        b.flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params])
        step = b.flat.numel() if self.piece_bytes is None else max(1, self.piece_bytes // b.flat.element_size())
        for piece in b.flat.split(step):
            if self._emulated:
                b.works.append(self.group.all_reduce(piece, "sum", low_priority=self.low_priority))
            else:
                b.works.append(dist.all_reduce(piece, group=self.group, async_op=True))
            self.issued += 1


class _Bucket:
    def __init__(self, params: list):
        self.params = params
        self.reset()

    def reset(self) -> None:
        self.ready = 0
        self.flat: Optional[torch.Tensor] = None
        self.works: list = []


def _buckets(params: list, bucket_bytes: int) -> list:
    """Consecutive parameters of one dtype and device, up to ``bucket_bytes`` a bucket."""
    out, cur, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if cur and (size + nbytes > bucket_bytes or (p.dtype, p.device) != (cur[0].dtype, cur[0].device)):
            out.append(_Bucket(cur))
            cur, size = [], 0
        cur.append(p)
        size += nbytes
    if cur:
        out.append(_Bucket(cur))
    return out
