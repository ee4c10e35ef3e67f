"""Elementwise SwiGLU and its gradient over [R, 2F] pre-activations (gate columns first).

The expert forward fuses SwiGLU into the gate_up GEMM's epilogue (``kernels.grouped_gemm.
gate_up_swiglu``); these standalone kernels serve the backward (``swiglu_bwd``, from the saved gu)
and any caller holding gu. Memory-bound: forward reads 2F and writes F values per row, backward
reads 3F and writes 2F; computed in fp32 and stored in gu's dtype. References:
``kernels.reference.swiglu_fwd_ref`` / ``swiglu_bwd_ref``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .grouped_gemm import (_INTERPRET, _check_device, _check_float, _check_ndim, _check_out,
                           _check_same_dtype)


@triton.jit
def _swiglu_fwd_kernel(
    # pointers
    gu_ptr,  # [R, 2F] gate columns [0, F), up columns [F, 2F)
    h_ptr,  # [R, F] output
    # sizes
    R, F,
    # strides
    stride_gm, stride_gf,
    stride_hm, stride_hf,
    # meta-parameters
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """h = silu(gate) * up in fp32, stored in h's dtype."""
    pid_r = tl.program_id(0)
    pid_f = tl.program_id(1)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (offs_r[:, None] < R) & (offs_f[None, :] < F)
    offs_f64 = offs_f.to(tl.int64)  # F * stride_gf passes 2^31 through a column-major gu
    gu_rows = gu_ptr + offs_r[:, None] * stride_gm
    g = tl.load(gu_rows + offs_f64[None, :] * stride_gf, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_rows + (offs_f64 + F)[None, :] * stride_gf, mask=mask, other=0.0).to(tl.float32)
    b_h = g / (1.0 + tl.exp(-g)) * u
    h_ptrs = h_ptr + offs_r[:, None] * stride_hm + offs_f64[None, :] * stride_hf
    tl.store(h_ptrs, b_h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    # pointers
    gu_ptr,  # [R, 2F] forward pre-activation
    dh_ptr,  # [R, F] gradient of h
    dgu_ptr,  # [R, 2F] output: gradient of gu
    # sizes
    R, F,
    # strides
    stride_gm, stride_gf,
    stride_dhm, stride_dhf,
    stride_dgm, stride_dgf,
    # meta-parameters
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """dgate = dh * u * s * (1 + g * (1 - s)), dup = dh * g * s with s = sigmoid(g), in fp32."""
    pid_r = tl.program_id(0)
    pid_f = tl.program_id(1)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (offs_r[:, None] < R) & (offs_f[None, :] < F)
    offs_f64 = offs_f.to(tl.int64)  # F * stride_gf passes 2^31 through a column-major gu
    gu_rows = gu_ptr + offs_r[:, None] * stride_gm
    g = tl.load(gu_rows + offs_f64[None, :] * stride_gf, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_rows + (offs_f64 + F)[None, :] * stride_gf, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs_r[:, None] * stride_dhm + offs_f64[None, :] * stride_dhf,
                 mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    dg = dh * u * s * (1.0 + g * (1.0 - s))
    du = dh * g * s
    out_ty = dgu_ptr.dtype.element_ty
    dgu_rows = dgu_ptr + offs_r[:, None] * stride_dgm
    tl.store(dgu_rows + offs_f64[None, :] * stride_dgf, dg.to(out_ty), mask=mask)
    tl.store(dgu_rows + (offs_f64 + F)[None, :] * stride_dgf, du.to(out_ty), mask=mask)


def _swiglu_blocks(F: int, device: torch.device) -> Tuple[int, int, int]:
    """(BLOCK_R, BLOCK_F, num_warps): 4096 elements per program on CUDA, small tiles when interpreted."""
    if device.type != "cuda" or _INTERPRET:
        block_f = min(64, triton.next_power_of_2(max(F, 1)))
        return 16, block_f, 4
    block_f = min(1024, triton.next_power_of_2(max(F, 1)))
    return max(1, 4096 // block_f), block_f, 4


def _check_gu(gu_R2F: torch.Tensor) -> None:
    _check_float("gu_R2F", gu_R2F)
    _check_ndim("gu_R2F", gu_R2F, 2, ("R", "2F"))
    _check_device("gu_R2F", gu_R2F, gu_R2F.device)
    if gu_R2F.shape[1] % 2:
        raise ValueError(f"gu_R2F must have an even number of columns [R, 2F], got shape {tuple(gu_R2F.shape)}")


def swiglu_fwd(gu_R2F: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h = silu(gate) * up with gate = gu[:, :F], up = gu[:, F:], computed in fp32.

    Args:
        gu_R2F: [R, 2F] pre-activation (bf16/fp16/fp32, any strides).
        out: optional [R, F] output buffer in gu's dtype.

    Returns:
        h_RF [R, F] in gu's dtype.
    """
    _check_gu(gu_R2F)
    R, F = gu_R2F.shape[0], gu_R2F.shape[1] // 2
    h = _check_out(out, (R, F), gu_R2F.dtype, gu_R2F.device)
    if R == 0 or F == 0:
        return h
    block_r, block_f, num_warps = _swiglu_blocks(F, gu_R2F.device)
    grid = (triton.cdiv(R, block_r), triton.cdiv(F, block_f))
    _swiglu_fwd_kernel[grid](
        gu_R2F, h, R, F,
        gu_R2F.stride(0), gu_R2F.stride(1), h.stride(0), h.stride(1),
        BLOCK_R=block_r, BLOCK_F=block_f, num_warps=num_warps,
    )
    return h


def swiglu_bwd(gu_R2F: torch.Tensor, grad_h_RF: torch.Tensor, *,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gradient of :func:`swiglu_fwd` with respect to gu, computed in fp32.

    Args:
        gu_R2F: [R, 2F] forward pre-activation.
        grad_h_RF: [R, F] gradient of h, gu's dtype.
        out: optional [R, 2F] output buffer in gu's dtype.

    Returns:
        grad_gu_R2F [R, 2F] in gu's dtype: [dgate, dup].
    """
    _check_gu(gu_R2F)
    _check_float("grad_h_RF", grad_h_RF)
    _check_ndim("grad_h_RF", grad_h_RF, 2, "RF")
    _check_same_dtype("grad_h_RF", grad_h_RF, gu_R2F.dtype, "gu_R2F")
    _check_device("grad_h_RF", grad_h_RF, gu_R2F.device)
    R, F = gu_R2F.shape[0], gu_R2F.shape[1] // 2
    if tuple(grad_h_RF.shape) != (R, F):
        raise ValueError(f"grad_h_RF must have shape [R, F] = [{R}, {F}], got {tuple(grad_h_RF.shape)}")
    dgu = _check_out(out, (R, 2 * F), gu_R2F.dtype, gu_R2F.device)
    if R == 0 or F == 0:
        return dgu
    block_r, block_f, num_warps = _swiglu_blocks(F, gu_R2F.device)
    grid = (triton.cdiv(R, block_r), triton.cdiv(F, block_f))
    _swiglu_bwd_kernel[grid](
        gu_R2F, grad_h_RF, dgu, R, F,
        gu_R2F.stride(0), gu_R2F.stride(1),
        grad_h_RF.stride(0), grad_h_RF.stride(1),
        dgu.stride(0), dgu.stride(1),
        BLOCK_R=block_r, BLOCK_F=block_f, num_warps=num_warps,
    )
    return dgu


__all__ = ["swiglu_fwd", "swiglu_bwd"]
