"""lancet-rt: whole-graph all-to-all overlap for Mixture-of-Experts training in eager PyTorch."""
from .checkpoint import load_checkpoint, load_hf, save_checkpoint, save_hf
from .comm import ExpertParallelGroup, TorchGroup
from .experts import Experts
from .emulated import EmulatedGroup
from .moe import MoE, Router
from .overlap import Overlapped
from .trace import Trace, tracing

__all__ = ["MoE", "Router", "Experts", "Overlapped", "EmulatedGroup", "ExpertParallelGroup", "TorchGroup",
           "tracing", "Trace"]
__version__ = "0.1.0"
