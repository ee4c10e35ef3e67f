"""Fused residual add + RMSNorm: ``s = x + residual``, ``y = s / rms(s) * weight``, and its backward.

One read of x and the residual, one write of y and s (the next layer's residual), float32 statistics
for bf16/fp16 rows. Memory-bound: forward moves 4 R D elements (3 without a residual), backward 4 (3).
References: :func:`lancet_rt.kernels.reference_dense.add_rmsnorm_fwd_ref` / ``add_rmsnorm_bwd_ref``.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import triton

from ._common import check_out, check_tensor, interpreting, on_tensor_device
from ._norm_kernels import _add_rmsnorm_bwd_kernel, _add_rmsnorm_fwd_kernel

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _rows(D: int, device: torch.device) -> Tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps): ~4096 elements per program on CUDA, few programs when interpreted."""
    block_d = triton.next_power_of_2(max(D, 1))
    if device.type != "cuda" or interpreting():
        return 16, block_d, 4
    return max(1, 4096 // block_d), block_d, 4 if block_d <= 4096 else 8


def _check_rows(name: str, t, like: torch.Tensor) -> None:
    check_tensor(name, t, shape=like.shape, dtypes=(like.dtype,), device=like.device)
    _row_stride(name, t)


def _check_lead(name: str, t) -> None:
    """``t`` is [R, D] rows, or [..., D] rows (contiguous): the caller's shape, no reshape to 2-D."""
    check_tensor(name, t, dtypes=_FLOATS)
    if t.dim() < 2:
        raise ValueError(f"{name} must be [R, D] or [..., D] (2-D or more), got shape {tuple(t.shape)}")
    _row_stride(name, t)


def _row_stride(name: str, t) -> int:
    """The stride between ``t``'s rows of D: its first dimension's for [R, D] (unit stride along D), D
    for a contiguous [..., D] (its leading dimensions flattened, as ``reshape(-1, D)`` would)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along D")
    if t.dim() == 2:
        return t.stride(0)
    if not t.is_contiguous():
        raise ValueError(f"{name} with more than 2 dimensions must be contiguous, got strides {t.stride()}")
    return t.shape[-1]


@on_tensor_device
def add_rmsnorm_fwd(
    x_RD: torch.Tensor,
    residual_RD: Optional[torch.Tensor],
    weight_D: torch.Tensor,
    eps: float = 1e-6,
    *,
    out: Optional[torch.Tensor] = None,
    out_sum: Optional[torch.Tensor] = None,
    with_rstd: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Fused ``s = x + residual``; ``y = s * rsqrt(mean(s^2) + eps) * weight``.

    Args:
        x_RD: [R, D] bf16/fp16/fp32, unit stride along D; or contiguous [..., D], whose leading dimensions
            are the rows (y and s then have its shape, rstd is [R] over the flattened rows: no reshape).
        residual_RD: [R, D] like x, or None (plain RMSNorm; the returned sum is x itself).
        weight_D: [D] float weight (any float dtype; read in float32).
        eps: added to the mean square.
        out, out_sum: optional contiguous [R, D] buffers for y and s.
        with_rstd: False: no rstd is stored (None returned in its place); :func:`add_rmsnorm_bwd` then
            recomputes it from s, the same value, with one allocation less in the forward.

    Returns:
        (y_RD, s_RD, rstd_R float32, or None without ``with_rstd``).
    """
    _check_lead("x_RD", x_RD)
    stride_x = _row_stride("x_RD", x_RD)
    if residual_RD is not None:
        _check_rows("residual_RD", residual_RD, x_RD)
    D = x_RD.shape[-1]
    if D == 0:
        raise ValueError("x_RD must have D >= 1 features, got shape (R, 0)")
    R = x_RD.numel() // D
    check_tensor("weight_D", weight_D, shape=(D,), dtypes=_FLOATS, device=x_RD.device)
    y = torch.empty_like(x_RD, memory_format=torch.contiguous_format) if out is None else out
    if out is not None:
        check_out("out", out, x_RD.shape, x_RD.dtype, x_RD.device)
    s = x_RD
    if residual_RD is not None:
        s = torch.empty_like(y) if out_sum is None else out_sum
        if out_sum is not None:
            check_out("out_sum", out_sum, x_RD.shape, x_RD.dtype, x_RD.device)
    if not isinstance(with_rstd, bool):
        raise TypeError(f"with_rstd must be a bool, got {type(with_rstd).__name__}")
    rstd = torch.empty(R, device=x_RD.device, dtype=torch.float32) if with_rstd else None
    if R == 0:
        return y, s, rstd
    block_r, block_d, num_warps = _rows(D, x_RD.device)
    r = residual_RD if residual_RD is not None else x_RD
    _add_rmsnorm_fwd_kernel[(triton.cdiv(R, block_r),)](
        x_RD,
        r,
        weight_D.contiguous(),
        y,
        s,
        y if rstd is None else rstd,
        R,
        D,
        float(eps),
        stride_x,
        _row_stride("residual_RD", r),
        _row_stride("out", y),
        _row_stride("out_sum", s),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        HAS_RESIDUAL=residual_RD is not None,
        HAS_RSTD=with_rstd,
        num_warps=num_warps,
    )
    return y, s, rstd


@on_tensor_device
def add_rmsnorm_bwd(
    grad_y_RD: torch.Tensor,
    grad_s_RD: Optional[torch.Tensor],
    s_RD: torch.Tensor,
    rstd_R: Optional[torch.Tensor],
    weight_D: torch.Tensor,
    *,
    eps: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    partials: Optional[Callable[[tuple], Optional[torch.Tensor]]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`add_rmsnorm_fwd`.

    Args:
        grad_y_RD: [R, D] gradient of y, s's dtype (or [..., D], s's shape, as the forward took).
        grad_s_RD: [R, D] gradient of the returned sum, or None.
        s_RD, rstd_R: saved by the forward; rstd_R None (a forward without ``with_rstd``): recomputed
            from s with ``eps``, bit for bit the forward's value.
        weight_D: [D] weight.
        eps: the forward's eps, when rstd_R is None (and only then).
        out: optional contiguous buffer for grad_s, s's shape and dtype.
        partials: optional callable taking the shape ``(programs, D)`` of the weight gradient's float32
            partial sums (one row per program, summed here before returning) and giving a contiguous
            float32 tensor of that shape for them, or None to have them allocated here: e.g. one buffer
            that calls running one after the other in stream order share (each reads its partials
            before the next call writes them).

    Returns:
        (grad_s_RD: the gradient of x and of the residual, in s's dtype; grad_weight_D in weight's dtype).
    """
    _check_lead("s_RD", s_RD)
    _check_rows("grad_y_RD", grad_y_RD, s_RD)
    if grad_s_RD is not None:
        _check_rows("grad_s_RD", grad_s_RD, s_RD)
    D = s_RD.shape[-1]
    R = s_RD.numel() // D if D else 0
    if rstd_R is None:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"eps must be a float when rstd_R is None, got {type(eps).__name__}")
    elif eps is not None:
        raise ValueError("eps is read only to recompute rstd: pass rstd_R=None with it")
    else:
        check_tensor("rstd_R", rstd_R, shape=(R,), dtypes=(torch.float32,), device=s_RD.device)
    check_tensor("weight_D", weight_D, shape=(D,), dtypes=_FLOATS, device=s_RD.device)
    if out is not None:
        check_out("out", out, s_RD.shape, s_RD.dtype, s_RD.device)
    if partials is not None and not callable(partials):
        raise TypeError(f"partials must be a callable or None, got {type(partials).__name__}")
    ds = torch.empty_like(s_RD, memory_format=torch.contiguous_format) if out is None else out
    if R == 0:
        return ds, torch.zeros_like(weight_D)
    block_r, block_d, num_warps = _rows(D, s_RD.device)
    # Grid-stride: a bounded number of programs (about 4 per SM on an H100; 3 when interpreted, so the
    # tests run the loop), each summing its rows' dweight.
    programs = min(triton.cdiv(R, block_r), 3 if interpreting() or s_RD.device.type != "cuda" else 528)
    dw = None if partials is None else partials((programs, D))
    if dw is None:
        dw = torch.empty(programs, D, device=s_RD.device, dtype=torch.float32)
    else:
        check_out("partials", dw, (programs, D), torch.float32, s_RD.device)
    g = grad_s_RD if grad_s_RD is not None else grad_y_RD
    _add_rmsnorm_bwd_kernel[(programs,)](
        grad_y_RD,
        g,
        s_RD,
        s_RD if rstd_R is None else rstd_R,
        weight_D.contiguous(),
        ds,
        dw,
        R,
        D,
        0.0 if eps is None else float(eps),
        _row_stride("grad_y_RD", grad_y_RD),
        _row_stride("grad_s_RD", g),
        _row_stride("s_RD", s_RD),
        _row_stride("ds", ds),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        HAS_DS=grad_s_RD is not None,
        RECOMPUTE=rstd_R is None,
        num_warps=num_warps,
    )
    return ds, dw.sum(0).to(weight_D.dtype)


__all__ = ["add_rmsnorm_fwd", "add_rmsnorm_bwd"]
