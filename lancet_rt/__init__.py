"""lancet-rt: whole-graph all-to-all overlap for Mixture-of-Experts training in eager PyTorch."""
from .balance import BalancedChunks
from .comm import ExpertParallelGroup, TorchGroup
from .experts import Experts
from .emulated import EmulatedGroup
from .moe import MoE, Router
from .overlap import Overlapped
from .trace import Trace, tracing

__all__ = ["MoE", "Router", "Experts", "Overlapped", "EmulatedGroup", "ExpertParallelGroup", "TorchGroup",
           "tracing", "Trace", "BalancedChunks"]
__version__ = "0.1.0"
