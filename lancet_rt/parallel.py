"""Gradient synchronisation for data + expert parallelism over one group.

Dense parameters (attention, norms, router) are replicated on every rank and see only the local
batch: their gradients are averaged over the group. Expert parameters live on one rank and already
received every rank's tokens through the all-to-alls: their gradients are divided by the group size
so that all gradients are those of the mean loss over the global batch.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from .experts import Experts


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
