"""lancet-rt: whole-graph all-to-all overlap for Mixture-of-Experts training in eager PyTorch."""

from lancet_rt.checkpoint.dcp import load_checkpoint, save_checkpoint
from lancet_rt.checkpoint.hf import load_hf, save_hf
from lancet_rt.comm.emulated import EmulatedGroup
from lancet_rt.comm.group import ExpertParallelGroup, TorchGroup
from lancet_rt.integrations.hf import from_hf
from lancet_rt.moe.experts import Experts
from lancet_rt.moe.layer import MoE
from lancet_rt.routing.router import Router, update_expert_bias
from lancet_rt.runtime.recompute import checkpoint, checkpoint_context
from lancet_rt.schedule.balance import BalancedChunks
from lancet_rt.schedule.overlap import Overlapped
from lancet_rt.schedule.warmup import warmup
from lancet_rt.trace import Trace, tracing

__all__ = [
    "warmup",
    "MoE",
    "Router",
    "Experts",
    "Overlapped",
    "EmulatedGroup",
    "ExpertParallelGroup",
    "TorchGroup",
    "tracing",
    "Trace",
    "update_expert_bias",
    "checkpoint",
    "checkpoint_context",
    "from_hf",
    "save_checkpoint",
    "load_checkpoint",
    "save_hf",
    "load_hf",
    "BalancedChunks",
]
__version__ = "0.1.0"
