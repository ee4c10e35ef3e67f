"""The dispatchers by name, and the one place that picks a layer's.

``MoE(dispatcher=...)`` names the family ("alltoall" or "allreduce"); the all-to-all's variants follow
from the layer's options, read at each forward (``pipeline_chunks`` and ``shadow_experts`` may change
after construction): :func:`kind`.
"""

from __future__ import annotations

from lancet_rt.moe.dispatch.allreduce import AllReduce
from lancet_rt.moe.dispatch.alltoall import AllToAll
from lancet_rt.moe.dispatch.base import Dispatcher
from lancet_rt.moe.dispatch.pipelined import Pipelined
from lancet_rt.moe.dispatch.shadow import Shadow

#: name -> dispatcher class.
REGISTRY: dict[str, type[Dispatcher]] = {cls.name: cls for cls in (AllToAll, Pipelined, Shadow, AllReduce)}


def kind(moe) -> str:
    """The name of the dispatcher ``moe`` runs now: "allreduce" with a group, else the all-to-all's
    "pipelined" (``pipeline_chunks > 1``), "shadow" (``shadow_experts`` with a group) or "alltoall"
    (without a group, an all-reduce layer runs the all-to-all's local path)."""
    if moe.group is not None and moe.config.dispatcher == "allreduce":
        return "allreduce"
    if moe.pipeline_chunks > 1:
        return "pipelined"
    return "shadow" if moe.shadow_experts and moe.group is not None else "alltoall"


def for_layer(moe, experts, shared_experts=None, shared_expert_gate=None) -> Dispatcher:
    """A dispatcher for one forward of ``moe`` (:func:`kind`), over the modules the layer hands it."""
    return REGISTRY[kind(moe)](moe, experts, shared_experts, shared_expert_gate)
