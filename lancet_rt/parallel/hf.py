"""A transformers MoE model onto a ``("dp", "ep")`` mesh in one call: from_hf, then an engine."""

from __future__ import annotations

from typing import Optional

from torch import nn

from lancet_rt.integrations.hf import from_hf
from lancet_rt.parallel import mesh as _mesh
from lancet_rt.parallel.fsdp import fully_shard
from lancet_rt.parallel.replicate import replicate

#: The engines :func:`parallelize_hf` applies after the conversion.
ENGINES = ("fully_shard", "replicate", None)


def _decoder_layers(model: nn.Module) -> list:
    """The base model's decoder layers (transformers keeps them in ``base_model.layers``), if any."""
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def parallelize_hf(
    model: nn.Module,
    mesh,
    *,
    engine: Optional[str] = "fully_shard",
    chunks=1,
    defer_wgrad: bool = False,
    capacity_factor: Optional[float] = None,
    **engine_kwargs,
) -> nn.Module:
    """:func:`lancet_rt.from_hf` with experts over ``mesh["ep"]``, then data parallelism over the mesh.

    Every rank passes the full transformers model (the same weights); it keeps its ep rank's experts.

    Args:
        model: a transformers ``*ForCausalLM`` (or base model) that :func:`lancet_rt.from_hf` supports.
        mesh: a DeviceMesh with dimensions ``("dp", "ep")``.
        engine: "fully_shard" (:func:`lancet_rt.parallel.fully_shard`, each decoder layer a unit),
            "replicate" (:func:`lancet_rt.parallel.replicate`), or None (expert parallelism only:
            reduce with :func:`~lancet_rt.parallel.sync_gradients` or :class:`~lancet_rt.parallel.GradientSync`
            over the mesh).
        chunks, defer_wgrad, capacity_factor: as for :func:`lancet_rt.from_hf`.
        engine_kwargs: passed to the engine (``bucket_mb`` for replicate, FSDP2 options for fully_shard).

    Returns:
        ``model``, converted and wrapped.
    """

    _mesh.check_mesh(mesh)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine is None and engine_kwargs:
        raise ValueError(f"engine=None takes no engine options, got {sorted(engine_kwargs)}")
    from_hf(model, mesh["ep"].get_group(), chunks=chunks, defer_wgrad=defer_wgrad, capacity_factor=capacity_factor)
    _mesh.check_expert_groups(model, mesh)  # (engine=None too: sync_gradients/GradientSync check it again per use)
    if engine == "fully_shard":
        engine_kwargs.setdefault("blocks", _decoder_layers(model))
        fully_shard(model, mesh, **engine_kwargs)
    elif engine == "replicate":
        replicate(model, mesh, **engine_kwargs)
    return model
