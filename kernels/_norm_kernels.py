"""Triton kernels of the fused residual add + RMSNorm (launchers: :mod:`lancet_rt.kernels.norm`).

A program owns BLOCK_R whole rows ([BLOCK_R, BLOCK_D] tile, BLOCK_D >= D): the statistics need the
whole row, and D <= 16384 for the models served. Statistics in float32. The row count ``R`` is not
specialised on (Triton specialises an int argument divisible by 16 or equal to 1), so a chunk of a new
length runs the kernel already compiled instead of compiling another mid-step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_rstd(b_sf, D, eps):
    """1 / rms of each row of the float32 [BLOCK_R, BLOCK_D] tile ``b_sf`` (zero past D): one
    expression for both kernels, so the backward's recomputation equals the forward's value on the
    same tile shape."""
    return 1.0 / tl.sqrt(tl.sum(b_sf * b_sf, axis=1) / D + eps)


@triton.jit(do_not_specialize=["R"])
def _add_rmsnorm_fwd_kernel(
    # pointers
    x_ptr,  # [R, D] input
    r_ptr,  # [R, D] residual (unused without HAS_RESIDUAL)
    w_ptr,  # [D] weight
    y_ptr,  # [R, D] output: normalised and scaled
    s_ptr,  # [R, D] output: x + residual (unused without HAS_RESIDUAL)
    rstd_ptr,  # [R] float32 output: 1 / rms(s) (unused without HAS_RSTD)
    # sizes
    R,
    D,
    eps,
    # strides
    stride_xr,
    stride_rr,
    stride_yr,
    stride_sr,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_RSTD: tl.constexpr,
):
    """s = x + r rounded to s's dtype (as the model adds), y = s * rstd * w in float32; rstd stored
    with HAS_RSTD (else the backward recomputes it from s, bit for bit: :func:`_row_rstd`)."""
    pid_r = tl.program_id(0)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < R
    mask = mask_r[:, None] & (offs_d[None, :] < D)
    b_s = tl.load(x_ptr + offs_r[:, None] * stride_xr + offs_d[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        b_r = tl.load(r_ptr + offs_r[:, None] * stride_rr + offs_d[None, :], mask=mask, other=0.0)
        b_s = (b_s.to(tl.float32) + b_r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + offs_r[:, None] * stride_sr + offs_d[None, :], b_s, mask=mask)
    b_sf = b_s.to(tl.float32)
    rstd = _row_rstd(b_sf, D, eps)
    if HAS_RSTD:
        tl.store(rstd_ptr + offs_r, rstd, mask=mask_r)
    b_w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    b_y = b_sf * rstd[:, None] * b_w[None, :]
    tl.store(y_ptr + offs_r[:, None] * stride_yr + offs_d[None, :], b_y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _add_rmsnorm_bwd_kernel(
    # pointers
    dy_ptr,  # [R, D] gradient of y
    dsn_ptr,  # [R, D] gradient of the returned sum (unused without HAS_DS)
    s_ptr,  # [R, D] saved sum
    rstd_ptr,  # [R] float32 saved 1 / rms(s) (unused with RECOMPUTE)
    w_ptr,  # [D] weight
    ds_ptr,  # [R, D] output: gradient of x (and of the residual)
    dw_ptr,  # [P, D] float32 output: one partial dweight per program
    # sizes
    R,
    D,
    eps,  # (read with RECOMPUTE only)
    # strides
    stride_dyr,
    stride_dsnr,
    stride_sr,
    stride_dsr,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DS: tl.constexpr,
    RECOMPUTE: tl.constexpr,
):
    """ds = rstd * (dy w - n mean(dy w n)) + dsn with n = s rstd; dw partial = sum over the program's
    rows of dy n. Grid-stride over row tiles, so the partials are [programs, D], not [R, D]. With
    RECOMPUTE, rstd comes from the tile of s as the forward computed it (no saved statistics)."""
    pid_r = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    b_w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    b_dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r0 in range(pid_r * BLOCK_R, R, tl.num_programs(0) * BLOCK_R):
        offs_r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask_r = offs_r < R
        mask = mask_r[:, None] & mask_d[None, :]
        b_s = tl.load(s_ptr + offs_r[:, None] * stride_sr + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        b_dy = tl.load(dy_ptr + offs_r[:, None] * stride_dyr + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if RECOMPUTE:
            rstd = _row_rstd(b_s, D, eps)
        else:
            rstd = tl.load(rstd_ptr + offs_r, mask=mask_r, other=0.0)
        b_n = b_s * rstd[:, None]
        b_dn = b_dy * b_w[None, :]
        mean = tl.sum(b_dn * b_n, axis=1) / D
        b_ds = rstd[:, None] * (b_dn - b_n * mean[:, None])
        if HAS_DS:
            b_ds += tl.load(dsn_ptr + offs_r[:, None] * stride_dsnr + offs_d[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(ds_ptr + offs_r[:, None] * stride_dsr + offs_d[None, :], b_ds.to(ds_ptr.dtype.element_ty), mask=mask)
        b_dw += tl.sum(b_dy * b_n, axis=0)
    tl.store(dw_ptr + pid_r * D + offs_d, b_dw, mask=mask_d)
