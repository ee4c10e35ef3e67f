"""Per-expert segment sums: the gradients of the experts' biases (``grouped_mm``'s ``bias_EN``,
``gate_up_swiglu``'s ``bias_E2F`` in lancet_rt.kernels.grouped_gemm), one launch for all local experts.

A per-expert bias's gradient is the sum of its segment's output-gradient rows. One program per
(expert, column tile) loops over the segment's rows (bounds read from the device, no host sync),
accumulating a [BLOCK_M, BLOCK_N] fp32 partial sum reduced once at the end: no atomics, the same bits
every run. It is its own launch rather than a side reduction of the dW
GEMM, whose configs are register-bound already (fp32 ones capped for spills) and whose pipelined
operand tiles go to shared memory, not through registers a row sum could reuse. It reads the
gradient once: 2 R N bytes in bf16 against the dW GEMM's 2 R N K FLOPs, i.e. at an H100's datasheet
peak rates (296 dense bf16 FLOPs in the time of one byte of HBM traffic) 296 / K of the dW GEMM's time,
a tenth at GPT-OSS's K = 2880 (an estimate, not measured; one dW of the four GEMMs of the experts' backward).

Reference: ``lancet_rt.kernels.reference.segment_sum_ref``. In the kernel selection (lancet_rt.ops) it belongs
to the grouped GEMM family, which re-exports it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import on_tensor_device
from ._expert_checks import _INTERPRET, _check_device, _check_float, _check_ndim, _check_offsets, _check_out


@triton.jit(do_not_specialize=["R"])  # row counts: one compiled variant for any chunk
def _segment_sum_kernel(
    # pointers
    g_ptr,  # [R, N] rows grouped by expert
    s_ptr,  # [E, N] output: s[e] = sum of segment e's rows, g's dtype
    offsets_ptr,  # [E + 1] int32/int64 segment bounds
    # sizes
    R,
    N,
    # strides
    stride_gm,
    stride_gn,
    stride_se,
    stride_sn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """s[e, n] = sum over rows r of segment e of g[r, n], in fp32; zeros for an empty segment.

    One program per (expert, column tile) loops over its segment's rows: a [BM, BN] fp32 partial sum,
    reduced over BM once at the end (the same order every run: deterministic, no atomics)."""
    expert = tl.program_id(0)
    pid_n = tl.program_id(1)
    row_start = tl.load(offsets_ptr + expert).to(tl.int32)
    row_end = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    row_start = tl.minimum(tl.maximum(row_start, 0), R)
    row_end = tl.maximum(tl.minimum(row_end, R), row_start)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    g_ptrs = g_ptr + (row_start + offs_m).to(tl.int64)[:, None] * stride_gm + offs_n.to(tl.int64)[None, :] * stride_gn
    g_step = tl.cast(stride_gm, tl.int64) * BLOCK_M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m in range(0, tl.cdiv(row_end - row_start, BLOCK_M)):
        mask_m = offs_m < row_end - row_start - m * BLOCK_M
        acc += tl.load(g_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        g_ptrs += g_step
    b_s = tl.sum(acc, axis=0)
    s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn
    tl.store(s_ptrs, b_s.to(s_ptr.dtype.element_ty), mask=mask_n)


def _segment_sum_blocks(N: int, E: int, device: torch.device) -> Tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). On CUDA 64-row steps over column tiles of 128 (bf16: 256 bytes
    per row), narrowed to 64 or 32 columns while that keeps fewer than ~264 programs (2 per H100 SM):
    the rows of a segment are not split, so narrow tiles are the parallelism when E_local is small."""
    if device.type != "cuda" or _INTERPRET:
        return 16, min(32, triton.next_power_of_2(max(N, 1))), 4
    block_n = 128
    while block_n > 32 and E * triton.cdiv(N, block_n) < 264:
        block_n //= 2
    return 64, block_n, 4


@on_tensor_device
def segment_sum(g_RN: torch.Tensor, offsets_E1: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s[e] = the sum of rows offsets[e]:offsets[e+1] of g (zeros for an empty segment): the
    gradient of a per-expert bias (``bias_EN`` of :func:`lancet_rt.kernels.grouped_gemm.grouped_mm`, ``bias_E2F``
    of ``gate_up_swiglu``) from the gradient of its output. One launch, fp32 accumulation, no atomics: the
    same bits every run. Memory-bound: reads g once.

    Args:
        g_RN: [R, N] bf16/fp16/fp32 rows grouped by local expert (any strides).
        offsets_E1: int32/int64 [E + 1] segment bounds (as in ``grouped_mm``); E from its length.
        out: optional [E, N] output buffer in g's dtype (every element is written).

    Returns:
        s_EN [E, N] in g's dtype.
    """
    _check_float("g_RN", g_RN)
    _check_ndim("g_RN", g_RN, 2, "RN")
    _check_device("g_RN", g_RN, g_RN.device)
    if not isinstance(offsets_E1, torch.Tensor) or offsets_E1.dim() != 1 or offsets_E1.shape[0] < 1:
        raise ValueError("offsets_E1 must be a 1-D tensor of E + 1 >= 1 segment bounds")
    E = offsets_E1.shape[0] - 1
    R, N = g_RN.shape
    _check_offsets(offsets_E1, E, R, g_RN.device)
    s = _check_out(out, (E, N), g_RN.dtype, g_RN.device)
    if E == 0 or N == 0:
        return s
    block_m, block_n, num_warps = _segment_sum_blocks(N, E, g_RN.device)
    _segment_sum_kernel[(E, triton.cdiv(N, block_n))](
        g_RN,
        s,
        offsets_E1,
        R,
        N,
        g_RN.stride(0),
        g_RN.stride(1),
        s.stride(0),
        s.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return s


__all__ = ["segment_sum"]
