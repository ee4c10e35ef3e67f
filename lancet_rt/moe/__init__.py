"""The MoE layer by stage: the layer (layer), its experts (experts) and the dispatchers (dispatch)."""

from lancet_rt.moe.experts import Experts
from lancet_rt.moe.layer import MoE

__all__ = ["MoE", "Experts"]
