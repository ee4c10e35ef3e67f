"""Elementwise expert activations and their gradients over [R, 2F] pre-activations.

The expert forward fuses the activation into the gate_up GEMM's epilogue
(``lancet_rt.kernels.grouped_gemm.gate_up_swiglu``), and the experts' backward its gradient into the
dH GEMM's (``grouped_mm_dx(..., gu_R2F=)``, the same arithmetic: ``_glu_grad``); these standalone
kernels serve any caller holding gu and dH. Two activations
(``lancet_rt.kernels._grouped_gemm_kernels._glu``): "swiglu", silu(gate) * up, and "swiglu_oai",
GPT-OSS's clamped variant; and two column orders: gate columns first, or
``interleaved`` (gate 2j, up 2j + 1, GPT-OSS's), which a program reads and writes as one contiguous
[BLOCK_R, 2 BLOCK_F] tile split into gate and up in registers. Memory-bound: forward reads 2F and
writes F values per row, backward reads 3F and writes 2F; computed in fp32 and stored in gu's dtype.
References: ``lancet_rt.kernels.reference.swiglu_fwd_ref`` / ``swiglu_bwd_ref``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import on_tensor_device
from ._expert_checks import (
    _INTERPRET,
    _check_activation,
    _check_device,
    _check_float,
    _check_ndim,
    _check_out,
    _check_same_dtype,
)
from ._grouped_gemm_kernels import _glu, _glu_grad


@triton.jit
def _load_gu(
    gu_ptr,
    offs_r,
    offs_f,
    R,
    F,
    stride_gm,
    stride_gf,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """(gate, up) of rows offs_r and columns offs_f of a [R, 2F] pre-activation, in fp32."""
    gu_rows = gu_ptr + offs_r[:, None] * stride_gm
    if INTERLEAVED:
        offs_c = tl.program_id(1) * (2 * BLOCK_F) + tl.arange(0, 2 * BLOCK_F)
        mask_c = (offs_r[:, None] < R) & (offs_c[None, :] < 2 * F)
        b_gu = tl.load(gu_rows + offs_c.to(tl.int64)[None, :] * stride_gf, mask=mask_c, other=0.0)
        g, u = tl.split(tl.reshape(b_gu.to(tl.float32), (BLOCK_R, BLOCK_F, 2)))
    else:
        mask = (offs_r[:, None] < R) & (offs_f[None, :] < F)
        offs_f64 = offs_f.to(tl.int64)  # F * stride_gf passes 2^31 through a column-major gu
        g = tl.load(gu_rows + offs_f64[None, :] * stride_gf, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_rows + (offs_f64 + F)[None, :] * stride_gf, mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit(do_not_specialize=["R"])  # row counts: one compiled variant for any chunk
def _swiglu_fwd_kernel(
    # pointers
    gu_ptr,  # [R, 2F] gate columns [0, F), up columns [F, 2F); INTERLEAVED: gate 2j, up 2j + 1
    h_ptr,  # [R, F] output
    # sizes
    R,
    F,
    # activation constants ("swiglu_oai" only)
    alpha,
    limit,
    # strides
    stride_gm,
    stride_gf,
    stride_hm,
    stride_hf,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
    ACTIVATION: tl.constexpr = "swiglu",
):
    """h = act(gate, up) in fp32, stored in h's dtype."""
    pid_r = tl.program_id(0)
    pid_f = tl.program_id(1)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    g, u = _load_gu(gu_ptr, offs_r, offs_f, R, F, stride_gm, stride_gf, BLOCK_R, BLOCK_F, INTERLEAVED)
    b_h = _glu(g, u, alpha, limit, ACTIVATION)
    mask = (offs_r[:, None] < R) & (offs_f[None, :] < F)
    h_ptrs = h_ptr + offs_r[:, None] * stride_hm + offs_f.to(tl.int64)[None, :] * stride_hf
    tl.store(h_ptrs, b_h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])  # row counts: one compiled variant for any chunk
def _swiglu_bwd_kernel(
    # pointers
    gu_ptr,  # [R, 2F] forward pre-activation
    dh_ptr,  # [R, F] gradient of h
    dgu_ptr,  # [R, 2F] output: gradient of gu, in gu's column order
    # sizes
    R,
    F,
    # activation constants ("swiglu_oai" only)
    alpha,
    limit,
    # strides
    stride_gm,
    stride_gf,
    stride_dhm,
    stride_dhf,
    stride_dgm,
    stride_dgf,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
    ACTIVATION: tl.constexpr = "swiglu",
):
    """ "swiglu": dgate = dh * u * s * (1 + g * (1 - s)), dup = dh * g * s with s = sigmoid(g).
    "swiglu_oai", with gc = min(g, limit), uc = clamp(u, -limit, limit), s = sigmoid(alpha * gc):
    dgate = dh * (uc + 1) * s * (1 + alpha * gc * (1 - s)) where g <= limit, else 0;
    dup = dh * gc * s where -limit <= u <= limit, else 0 (torch.clamp's gradient). In fp32."""
    pid_r = tl.program_id(0)
    pid_f = tl.program_id(1)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (offs_r[:, None] < R) & (offs_f[None, :] < F)
    offs_f64 = offs_f.to(tl.int64)
    g, u = _load_gu(gu_ptr, offs_r, offs_f, R, F, stride_gm, stride_gf, BLOCK_R, BLOCK_F, INTERLEAVED)
    dh = tl.load(dh_ptr + offs_r[:, None] * stride_dhm + offs_f64[None, :] * stride_dhf, mask=mask, other=0.0).to(
        tl.float32
    )
    dg, du = _glu_grad(g, u, dh, alpha, limit, ACTIVATION)
    out_ty = dgu_ptr.dtype.element_ty
    dgu_rows = dgu_ptr + offs_r[:, None] * stride_dgm
    if INTERLEAVED:
        offs_c = pid_f * (2 * BLOCK_F) + tl.arange(0, 2 * BLOCK_F)
        b_dgu = tl.reshape(tl.join(dg, du), (BLOCK_R, 2 * BLOCK_F))
        tl.store(
            dgu_rows + offs_c.to(tl.int64)[None, :] * stride_dgf,
            b_dgu.to(out_ty),
            mask=(offs_r[:, None] < R) & (offs_c[None, :] < 2 * F),
        )
    else:
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


@on_tensor_device
def swiglu_fwd(
    gu_R2F: torch.Tensor,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """h = act(gate, up) of a pre-activation, computed in fp32.

    Args:
        gu_R2F: [R, 2F] pre-activation (bf16/fp16/fp32, any strides): gate = gu[:, :F], up = gu[:, F:],
            or with ``interleaved`` gate = gu[:, 0::2], up = gu[:, 1::2].
        activation: "swiglu": silu(gate) * up; "swiglu_oai" (GPT-OSS): with g = min(gate, limit) and
            u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g).
        interleaved: gu's column order (see gu_R2F).
        alpha, limit: the "swiglu_oai" constants.
        out: optional [R, F] output buffer in gu's dtype.

    Returns:
        h_RF [R, F] in gu's dtype.
    """
    _check_gu(gu_R2F)
    _check_activation(activation, alpha, limit)
    R, F = gu_R2F.shape[0], gu_R2F.shape[1] // 2
    h = _check_out(out, (R, F), gu_R2F.dtype, gu_R2F.device)
    if R == 0 or F == 0:
        return h
    block_r, block_f, num_warps = _swiglu_blocks(F, gu_R2F.device)
    grid = (triton.cdiv(R, block_r), triton.cdiv(F, block_f))
    _swiglu_fwd_kernel[grid](
        gu_R2F,
        h,
        R,
        F,
        float(alpha),
        float(limit),
        gu_R2F.stride(0),
        gu_R2F.stride(1),
        h.stride(0),
        h.stride(1),
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        INTERLEAVED=bool(interleaved),
        ACTIVATION=activation,
        num_warps=num_warps,
    )
    return h


@on_tensor_device
def swiglu_bwd(
    gu_R2F: torch.Tensor,
    grad_h_RF: torch.Tensor,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradient of :func:`swiglu_fwd` with respect to gu, computed in fp32.

    For "swiglu_oai" the clamps pass the gradient where torch.clamp's does (gate <= limit,
    -limit <= up <= limit, bounds included), zero elsewhere.

    Args:
        gu_R2F: [R, 2F] forward pre-activation.
        grad_h_RF: [R, F] gradient of h, gu's dtype.
        activation, interleaved, alpha, limit: as in :func:`swiglu_fwd`.
        out: optional [R, 2F] output buffer in gu's dtype.

    Returns:
        grad_gu_R2F [R, 2F] in gu's dtype and column order: [dgate, dup], or interleaved.
    """
    _check_gu(gu_R2F)
    _check_activation(activation, alpha, limit)
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
        gu_R2F,
        grad_h_RF,
        dgu,
        R,
        F,
        float(alpha),
        float(limit),
        gu_R2F.stride(0),
        gu_R2F.stride(1),
        grad_h_RF.stride(0),
        grad_h_RF.stride(1),
        dgu.stride(0),
        dgu.stride(1),
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        INTERLEAVED=bool(interleaved),
        ACTIVATION=activation,
        num_warps=num_warps,
    )
    return dgu


__all__ = ["swiglu_fwd", "swiglu_bwd"]
