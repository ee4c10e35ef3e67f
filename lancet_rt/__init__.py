"""lancet-rt: whole-graph all-to-all overlap for Mixture-of-Experts training in eager PyTorch."""
from .balance import BalancedChunks
from .ep_checkpoint import load_checkpoint, load_hf, save_checkpoint, save_hf
from .comm import ExpertParallelGroup, TorchGroup
from .experts import Experts
from .emulated import EmulatedGroup
from .moe import MoE
from .router import Router, update_expert_bias
from .recompute import checkpoint, checkpoint_context
from .overlap import Overlapped
from .hf import from_hf
from .trace import Trace, tracing

__all__ = ["MoE", "Router", "Experts", "Overlapped", "EmulatedGroup", "ExpertParallelGroup", "TorchGroup",
           "tracing", "Trace", "update_expert_bias", "checkpoint", "checkpoint_context", "from_hf",
           "save_checkpoint", "load_checkpoint", "save_hf", "load_hf", "BalancedChunks"]
__version__ = "0.1.0"
