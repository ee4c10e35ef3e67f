"""Cache keys of real models: device identity, link, MoE shape and token count.

The same function derives the key in the ``lancet-autotune`` command and in ``chunks="auto"``, so
an entry the command writes is the one a training run finds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.utils import _pytree as pytree

import lancet_rt

from .cache import CacheKey, token_bucket
from .gpu import DeviceIdentity, device_identity
from .profiling import LinkModel


@dataclass(frozen=True)
class LinkInfo:
    """The link part of a cache key.

    Attributes:
        backend: ``"emulated"``, ``"nccl"``, ``"gloo"``, ``"local"`` (no expert parallelism), ...
        gbps: bandwidth in GB/s: configured (emulated) or measured; None when unknown or free.
        latency_us: the configured latency of an emulated link; None otherwise.
        measured: ``gbps`` was measured (lookups then tolerate a factor of 2).
    """

    backend: str
    gbps: Optional[float] = None
    latency_us: Optional[float] = None
    measured: bool = False

    def __str__(self) -> str:
        text = self.backend
        if self.gbps is not None:
            text += f" {'~' if self.measured else ''}{self.gbps:g} GB/s"
        if self.latency_us is not None:
            text += f" {self.latency_us:g} us"
        return text


def link_descriptor(group, device, *, measure: bool = True) -> LinkInfo:
    """The link of an expert-parallel group, as the cache key holds it.

    Args:
        group: ``moe.group``: None (no expert parallelism), an :class:`lancet_rt.EmulatedGroup`
            (its configured bandwidth and latency), a :class:`lancet_rt.TorchGroup` (its backend and
            a measured bandwidth; measuring runs collectives, so every rank must call this
            together), or another :class:`lancet_rt.ExpertParallelGroup` (its type name and its
            ``bandwidth_gbps``/``latency_us`` attributes if it has them).
        device: where the model runs (NCCL measures with CUDA buffers).
        measure: measure a real group's bandwidth (False: leave it None).

    Returns:
        A :class:`LinkInfo`; a free emulated link has bandwidth None.
    """
    if group is None:
        return LinkInfo("local")
    if isinstance(group, lancet_rt.EmulatedGroup):
        gbps = None if math.isinf(group.bandwidth_gbps) else group.bandwidth_gbps
        return LinkInfo("emulated", gbps, group.latency_us)
    if isinstance(group, lancet_rt.TorchGroup):
        if measure and group.size > 1:
            gbps = measured_gbps(group, device)
            return LinkInfo(group.backend, gbps, None, measured=gbps is not None)
        return LinkInfo(group.backend)
    return LinkInfo(type(group).__name__, getattr(group, "bandwidth_gbps", None), getattr(group, "latency_us", None))


def measured_gbps(group, device) -> Optional[float]:
    """A real group's all-to-all bandwidth in GB/s, measured with 1 and 8 MB transfers.

    Every rank gets the same value: the ranks' timings are reduced to their maximum first. None when
    the two sizes took no measurably different time (a link too fast to tell at these sizes). The
    fit also becomes the group's link model (:meth:`lancet_rt.TorchGroup.set_link`), which sizes the
    windows deferred weight gradients run in.

    The value keys the autotune cache, and a re-measurement of the same link must find the entry:
    two warm-up transfers per size (a fresh process's first transfers are the slowest), the fastest
    of five timed ones, and lookups that accept a factor of 2 (:meth:`lancet_rt.autotune.cache.TuneCache.lookup`).
    """

    model = LinkModel.measure(
        group, device=device, nbytes=(1 << 20, 8 << 20), warmup=2, reps=5, agree=lambda xs: agree_max(group, xs)
    )
    if math.isinf(model.gbps):
        return None
    if isinstance(group, lancet_rt.TorchGroup):
        group.set_link(model.gbps, model.latency_ms * 1e3)
    return model.gbps


def agree_max(group, values: Sequence[float]) -> list[float]:
    """The element-wise maximum of ``values`` over the ranks of a real group (identity otherwise)."""
    if group is None or isinstance(group, lancet_rt.EmulatedGroup) or group.size == 1:
        return list(values)
    scaled = torch.tensor([round(v * 1e3) for v in values], dtype=torch.int64)  # us as int64
    rows = group.all_gather(scaled)
    return [v / 1e3 for v in rows.max(dim=0).values.tolist()]


def moe_layers_of(model) -> list:
    """The :class:`lancet_rt.MoE` layers of a model (or of an Overlapped wrapper), in module order."""
    if isinstance(model, lancet_rt.Overlapped):
        return model.moe_layers()
    return [m for m in model.modules() if isinstance(m, lancet_rt.MoE)]


def count_tokens(args: tuple, kwargs: dict, d_model: int) -> int:
    """Tokens per step from a model's inputs: the first tensor that Overlapped cuts along dim 0.

    Hidden states ``[..., d_model]`` count ``numel / d_model`` tokens; anything else (token ids
    ``[B, S]``) counts ``numel``.
    """
    for v in pytree.tree_leaves((args, kwargs)):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if v.is_floating_point() and v.shape[-1] == d_model and v.dim() > 1:
                return max(1, v.numel() // d_model)
            return max(1, v.numel())
    raise ValueError("the model got no tensor argument with a dimension to count tokens in")


def key_for_layers(
    layers: Sequence, tokens: int, *, identity: Optional[DeviceIdentity] = None, link: Optional[tuple] = None
) -> CacheKey:
    """The cache key of a model whose MoE layers are ``layers`` at ``tokens`` tokens per step.

    Args:
        layers: the model's :class:`lancet_rt.MoE` layers (the first one's shape and group key the
            entry; models mixing MoE shapes are keyed by their first).
        tokens: tokens per step on this rank.
        identity: the device identity (default: from the first layer's parameters).
        link: a precomputed :func:`link_descriptor` (default: derived, measuring a real group).

    Returns:
        The :class:`CacheKey`.
    """
    if not layers:
        raise ValueError("layers must hold at least one lancet_rt.MoE layer")
    m = layers[0]
    if not isinstance(m, lancet_rt.MoE):
        raise TypeError(f"layers must hold lancet_rt.MoE layers, got {type(m).__name__}")
    device = m.router.weight.device
    ident = identity if identity is not None else device_identity(device)
    if link is None:
        link = link_descriptor(m.group, device)
    if not isinstance(link, LinkInfo):
        raise TypeError(f"link must be a LinkInfo, got {type(link).__name__}")
    return CacheKey(
        device=ident.key,
        device_name=ident.name,
        ep_world_size=m.ep_size,
        link_backend=link.backend,
        link_gbps=link.gbps,
        link_latency_us=link.latency_us,
        link_measured=link.measured,
        dtype=str(m.router.weight.dtype).replace("torch.", ""),
        d_model=m.d_model,
        d_ffn=m.d_ffn,
        num_experts=m.num_experts,
        top_k=m.top_k,
        capacity_factor=m.capacity_factor,
        tokens_bucket=token_bucket(tokens),
    )
