"""lancet-rt: whole-graph all-to-all overlap for Mixture-of-Experts training in eager PyTorch."""
from .comm import ExpertParallelGroup, TorchGroup
from .experts import Experts
from .moe import MoE, Router

__all__ = ["MoE", "Router", "Experts", "ExpertParallelGroup", "TorchGroup"]
__version__ = "0.1.0"
