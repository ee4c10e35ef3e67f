"""Data parallelism beside expert parallelism, on one group or a ``("dp", "ep")`` DeviceMesh.

:func:`sync_gradients` and :class:`GradientSync` (explicit all-reduces, after or during backward),
:func:`replicate` (DDP-style, every backward), :func:`fully_shard` (FSDP2: experts sharded over dp,
the rest over dp x ep). Every one leaves the gradients of the mean loss over the global batch.
"""

from lancet_rt.parallel.dcp import load_sharded, save_sharded
from lancet_rt.parallel.fsdp import fully_shard
from lancet_rt.parallel.hf import parallelize_hf
from lancet_rt.parallel.replicate import Replicated, replicate
from lancet_rt.parallel.sync import GradientSync, dense_parameters, expert_parameters, sync_gradients

__all__ = [
    "sync_gradients",
    "GradientSync",
    "expert_parameters",
    "dense_parameters",
    "replicate",
    "Replicated",
    "fully_shard",
    "parallelize_hf",
    "save_sharded",
    "load_sharded",
]
