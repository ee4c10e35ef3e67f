"""Kernel selection: the Triton launchers or the PyTorch path, with one signature.

On CUDA the layer uses Triton, on CPU the PyTorch path; ``LANCET_KERNELS=triton|torch`` forces one.
The PyTorch path is the experts' CPU backend (:mod:`lancet_rt.kernels.cpu_backend`) and the other
families' references. With ``TRITON_INTERPRET=1`` the Triton path runs on CPU (how CI tests it). A
family whose kernels do not serve the layer's dtype runs its PyTorch path inside the Triton namespace:
float64 layers (for gradient checks) get float64 arithmetic from it, as the permute kernels accumulate
in float32 and the grouped GEMM and SwiGLU take 16- and 32-bit floats only.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Optional

import torch

from lancet_rt import env
from lancet_rt.kernels import cpu_backend, reference, reference_dense

_OP_NAMES = {
    "gating": ["gating_fwd", "gating_bwd"],
    "permute": ["dispatch_rows", "permute_fwd", "permute_bwd", "unpermute_fwd", "unpermute_bwd", "regroup_rows"],
    "grouped_gemm": [
        "grouped_mm",
        "grouped_mm_dx",
        "grouped_mm_dw",
        "grouped_mm_dw_pair",
        "gate_up_swiglu",
        "segment_sum",
    ],
    "swiglu": ["swiglu_fwd", "swiglu_bwd"],
    "norm": ["add_rmsnorm_fwd", "add_rmsnorm_bwd"],
    "linear_ce": ["ce_grad_fwd"],
}
# Dtypes each Triton family takes; the others fall back to the family's references.
_FAMILY_DTYPES = {
    "gating": None,  # the router's logits are float32 or float64 whatever the layer's dtype
    "permute": (torch.float32, torch.bfloat16, torch.float16),  # float32 accumulation
    "grouped_gemm": (torch.float32, torch.bfloat16, torch.float16),
    "swiglu": (torch.float32, torch.bfloat16, torch.float16),
    "norm": (torch.float32, torch.bfloat16, torch.float16),
    "linear_ce": (torch.float32, torch.bfloat16, torch.float16),  # the layer's dtype; logits are float32
}
_cache: dict[tuple, SimpleNamespace] = {}


def _reference(names: list[str]) -> dict:
    """The PyTorch path of ``names``: the CPU backend's function, else the reference."""
    return {
        n: getattr(cpu_backend, n, None) or getattr(reference, n + "_ref", None) or getattr(reference_dense, n + "_ref")
        for n in names
    }


def _reference_ops() -> SimpleNamespace:
    # host_offsets: the grouped GEMMs take segment bounds as host ints (the CPU backend loops over
    # segments on the host; the kernels read device offsets) and their ``out=``/``work=``
    # (kernels.cpu_backend.Workspace). gate_up_halves: gate_up_swiglu takes ``halves=True`` and
    # swiglu_bwd the GateUp it then gives (kernels.cpu_backend.GateUp)
    return SimpleNamespace(
        name="torch",
        host_offsets=True,
        gate_up_halves=True,
        **_reference([n for group in _OP_NAMES.values() for n in group]),
    )


def _triton_families() -> dict:
    """The Triton kernel modules by family (imported on first use: triton is a Linux-only dependency)."""
    from lancet_rt.kernels import gating, grouped_gemm, linear_ce, norm, permute, swiglu

    return {
        "gating": gating,
        "permute": permute,
        "grouped_gemm": grouped_gemm,
        "swiglu": swiglu,
        "norm": norm,
        "linear_ce": linear_ce,
    }


def _triton_ops(dtype) -> SimpleNamespace:
    ops, fallback = {}, []
    families = _triton_families()
    for module, names in _OP_NAMES.items():
        takes = _FAMILY_DTYPES[module]
        if dtype is not None and takes is not None and dtype not in takes:
            ops.update(_reference(names))
            fallback.append(module)
            continue
        ops.update({n: getattr(families[module], n) for n in names})
    if dtype in (None, torch.float32) and "grouped_gemm" not in fallback:
        ops.update({n: _honouring_tf32(ops[n]) for n in _TF32_OPS})
    return SimpleNamespace(
        name="triton",
        reference_families=tuple(fallback),
        host_offsets="grouped_gemm" in fallback,
        gate_up_halves={"grouped_gemm", "swiglu"} <= set(fallback),
        **ops,
    )


#: The grouped GEMMs, whose float32 products may use TF32 tensor cores (``allow_tf32``).
_TF32_OPS = ("grouped_mm", "grouped_mm_dx", "grouped_mm_dw", "grouped_mm_dw_pair", "gate_up_swiglu")


def tf32_enabled() -> bool:
    """torch's own switch for TF32 in float32 CUDA matmuls: ``torch.backends.cuda.matmul.fp32_precision
    == "tf32"`` (which ``allow_tf32 = True`` and ``torch.set_float32_matmul_precision("high")`` also
    set), or the legacy ``allow_tf32`` where the new setting does not exist."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return bool(matmul.allow_tf32)


def _honouring_tf32(fn):
    """``fn`` with ``allow_tf32`` read from torch's switch at each call, so float32 experts run on
    TF32 tensor cores exactly when ``nn.Linear`` does (a caller's explicit ``allow_tf32`` wins)."""

    def call(*args, **kwargs):
        kwargs.setdefault("allow_tf32", tf32_enabled())
        return fn(*args, **kwargs)

    return functools.update_wrapper(call, fn)  # (its name, module and docs are fn's)


def implementation(device: torch.device) -> str:
    """Which implementation the layer uses on ``device``: "triton" or "torch"."""
    forced = env.kernels_override()
    if forced is not None:
        if forced == "triton" and device.type != "cuda" and not env.triton_interpret():
            raise ValueError(f"{env.KERNELS}=triton on device {device} needs CUDA or {env.TRITON_INTERPRET}=1")
        return forced
    return "triton" if device.type == "cuda" else "torch"


def get_ops(device: torch.device, dtype: Optional[torch.dtype] = None) -> SimpleNamespace:
    """The op namespace for a layer on ``device`` whose activations have ``dtype``.

    On the Triton path, ``reference_families`` names the families that run their references
    because their kernels do not take ``dtype`` (None: every family's kernels).
    """
    name = implementation(device)
    key = (name, dtype if name == "triton" else None)
    if key not in _cache:
        _cache[key] = _triton_ops(dtype) if name == "triton" else _reference_ops()
    return _cache[key]


def on_device(device: Optional[torch.device]):
    """A context that makes ``device`` the current CUDA device (nothing off CUDA, or for None).

    The step's code that allocates or launches on "the current device" (Triton, a process group's
    small control tensors, pinned host buffers) then follows the tensors, not whichever GPU the
    process last selected: a rank that never called ``torch.cuda.set_device`` still runs on its own.

    Args:
        device: the device of the step's tensors.

    Returns:
        A context manager.
    """
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)
