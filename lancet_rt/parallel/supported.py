"""What each data-parallel engine supports of the MoE layers' options, checked before its first collective.

The engines (:func:`~lancet_rt.parallel.replicate`, :func:`~lancet_rt.parallel.fully_shard`,
:func:`~lancet_rt.parallel.sync_gradients`, :class:`~lancet_rt.parallel.GradientSync`) read only the
model, so every rank refuses the same model the same way, before any collective:

- ``dispatcher="allreduce"`` with any engine that reduces expert gradients: the ranks of such a
  layer's group hold the same tokens (tensor-parallel, PPMoE), so its expert gradients are already
  whole on each rank, and the engines' expert divisor (dp x ep, right for the all-to-all dispatch,
  whose experts see ep ranks' tokens) would make them ep times too small;
- ``shadow_experts`` with ``fully_shard``: a fetch broadcasts an expert's whole weights from its
  owner, and FSDP2 holds a dp shard of them (a DTensor).
"""

from __future__ import annotations

from torch import nn

from lancet_rt.moe.layer import MoE


def check_layers(model: nn.Module, engine: str, *, shards: bool = False) -> None:
    """A ValueError naming the layer, its option and ``engine`` unless ``engine`` supports every MoE
    layer of ``model``.

    Args:
        model: the model the engine is applied to.
        engine: its name in the message (``"lancet_rt.parallel.replicate"``, ...).
        shards: the engine shards the experts (FSDP2).
    """

    for name, m in model.named_modules():
        if not isinstance(m, MoE):
            continue
        where = f"{engine}: MoE layer {name or '<root>'}"
        if m.config.dispatcher == "allreduce" and m.ep_size > 1:
            raise ValueError(
                f"{where} has dispatcher='allreduce', which {engine} does not support: the {m.ep_size} ranks of "
                f"its ep_group hold the same tokens, so their expert gradients are already whole and the "
                f"engine's divide by dp x ep would leave them {m.ep_size}x too small; use dispatcher='alltoall' "
                f"(or average the gradients over the data-parallel replicas yourself)"
            )
        if shards and m.shadow_experts:
            raise ValueError(
                f"{where} has shadow_experts={m.shadow_experts}, which {engine} does not support: shadowing "
                f"broadcasts an expert's whole weights from its owner and FSDP2 holds a shard of them; use "
                f"shadow_experts=0, or lancet_rt.parallel.replicate / GradientSync"
            )
