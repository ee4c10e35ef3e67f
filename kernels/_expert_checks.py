"""Argument checks of the expert launchers (lancet_rt.kernels.grouped_gemm, .segment_sum, .swiglu): each
raises a TypeError or ValueError that names the argument and what was expected."""

from __future__ import annotations

from typing import Sequence

import torch

from ._common import interpreting
from .reference import ACTIVATIONS  # the activations' names; their semantics are the references'

#: Triton decides at definition time whether @triton.jit kernels run in the CPU interpreter.
_INTERPRET = interpreting()
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_float(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def _check_ndim(name: str, t: torch.Tensor, ndim: int, letters: Sequence[str]) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D [{', '.join(letters)}], got shape {tuple(t.shape)}")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    if device.type != "cuda" and not _INTERPRET:
        raise ValueError(
            f"{name} is on {device}: the Triton kernels need CUDA tensors "
            f"(or TRITON_INTERPRET=1 set before kernels are imported)"
        )


def _check_same_dtype(name: str, t: torch.Tensor, dtype: torch.dtype, other: str) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must have the dtype of {other} ({dtype}), got {t.dtype}")


def _check_offsets(offsets: torch.Tensor, E: int, R: int, device: torch.device) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets_E1 must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets_E1 must be int32 or int64, got {offsets.dtype}")
    if offsets.shape != (E + 1,):
        raise ValueError(f"offsets_E1 must have shape [E + 1] = [{E + 1}], got {tuple(offsets.shape)}")
    if E == 0 and R > 0:
        raise ValueError(f"no experts (E = 0) but {R} rows")
    _check_device("offsets_E1", offsets, device)


def _check_rows(name: str, rows, R: int, device: torch.device) -> None:
    """A row map: None, or an int32/int64 [R] tensor on ``device`` (a permutation of [0, R): not
    checked, that would synchronise)."""
    if rows is None:
        return
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(rows).__name__}")
    if rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {rows.dtype}")
    if tuple(rows.shape) != (R,):
        raise ValueError(f"{name} must have shape [R] = [{R}], got {tuple(rows.shape)}")
    _check_device(name, rows, device)


def _check_out(out, shape: tuple, dtype: torch.dtype, device: torch.device, name: str = "out") -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {list(shape)} on {device}, "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )
    return out


def _check_bias(name: str, bias, shape: tuple, dtype: torch.dtype, device: torch.device, weight: str) -> None:
    """A per-expert bias: a tensor of ``shape`` in the weight's dtype, on its device."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(bias).__name__}")
    _check_same_dtype(name, bias, dtype, weight)
    if tuple(bias.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(bias.shape)}")
    _check_device(name, bias, device)


def _check_activation(activation, alpha, limit) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, value in (("alpha", alpha), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not limit > 0:  # also rejects NaN
        raise ValueError(f"limit must be > 0, got {limit}")
