"""Kernel selection: the Triton launchers or their PyTorch references, with one signature.

On CUDA the layer uses Triton, on CPU the references; ``LANCET_KERNELS=triton|torch`` forces one.
With ``TRITON_INTERPRET=1`` the Triton path runs on CPU (how CI tests it).
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from . import env

_OP_NAMES = {
    "gating": ["gating_fwd", "gating_bwd"],
    "permute": ["dispatch_rows", "permute_fwd", "permute_bwd", "unpermute_fwd", "unpermute_bwd"],
    "grouped_gemm": ["grouped_mm", "grouped_mm_dx", "grouped_mm_dw", "gate_up_swiglu"],
    "swiglu": ["swiglu_fwd", "swiglu_bwd"],
}
_cache: dict[str, SimpleNamespace] = {}


def _reference_ops() -> SimpleNamespace:
    from kernels import reference as ref

    names = [n for group in _OP_NAMES.values() for n in group]
    return SimpleNamespace(name="torch", **{n: getattr(ref, n + "_ref") for n in names})


def _triton_ops() -> SimpleNamespace:
    ops = {}
    for module, names in _OP_NAMES.items():
        mod = importlib.import_module(f"kernels.{module}")
        ops.update({n: getattr(mod, n) for n in names})
    return SimpleNamespace(name="triton", **ops)


def implementation(device: torch.device) -> str:
    """Which implementation the layer uses on ``device``: "triton" or "torch"."""
    forced = env.kernels_override()
    if forced is not None:
        if forced == "triton" and device.type != "cuda" and not env.triton_interpret():
            raise ValueError(
                f"{env.KERNELS}=triton on device {device} needs CUDA or {env.TRITON_INTERPRET}=1"
            )
        return forced
    return "triton" if device.type == "cuda" else "torch"


def get_ops(device: torch.device) -> SimpleNamespace:
    """The op namespace for ``device``."""
    name = implementation(device)
    if name not in _cache:
        _cache[name] = _triton_ops() if name == "triton" else _reference_ops()
    return _cache[name]
