"""Grouped GEMM for the MoE experts: one launch per projection over all local experts.

The rows a rank receives are grouped by local expert: segment e is ``offsets[e]:offsets[e+1]`` of
``x_RK``, and expert e's weight is ``w_ENK[e]`` (the Hugging Face layout, out features first). The
launchers here have the signatures and results of their references in :mod:`lancet_rt.kernels.reference`:

================  ======================================  =========================  =============
launcher          computes                                reference                  FLOPs
================  ======================================  =========================  =============
grouped_mm        y[r] = x[r] @ w[e].T (+ b[e])           grouped_mm_ref             2 R N K
grouped_mm_dx     dx[r] = dy[r] @ w[e]                    grouped_mm_dx_ref          2 R N K
grouped_mm_dw     dw[e] = dy_seg.T @ x_seg (0 if empty)   grouped_mm_dw_ref          2 R N K
gate_up_swiglu    gu = x @ w[e].T (+ b[e]), h = act(g, u) gate_up_swiglu_ref         2 R (2F) D
segment_sum       s[e] = sum of g_seg's rows (0 if empty) segment_sum_ref            memory-bound (kernels/segment_sum.py)
swiglu_fwd/_bwd   elementwise act and its gradient        swiglu_fwd_ref / _bwd_ref  memory-bound (kernels/swiglu.py)
================  ======================================  =========================  =============

Expert variants (GPT-OSS's experts are all three): an optional per-expert bias on ``grouped_mm`` and
``gate_up_swiglu`` (``HAS_BIAS``), the activation ``act`` = "swiglu" (silu(g) * u) or "swiglu_oai"
(GPT-OSS: (clamp(u, -limit, limit) + 1) * gc * sigmoid(alpha * gc), gc = min(g, limit); ``ACTIVATION``),
and the gate/up order of gate_up's weight rows, bias and gu: gate first, or ``interleaved`` (gate 2j,
up 2j + 1; ``INTERLEAVED``). Weights may be any strided view, so GPT-OSS's transposed parameters
(``gate_up_proj [E, D, 2F]``, ``down_proj [E, F, D]``) pass as their transposes, not copies.

Algorithm
---------
*Row-segment GEMMs* (``grouped_mm``, ``grouped_mm_dx``, ``gate_up_swiglu``). The output is cut into
BLOCK_M x BLOCK_N tiles, where an M tile never straddles two segments: segment e owns
``cdiv(n_e, BLOCK_M)`` M tiles. The segment sizes live on the device, so the host cannot count the
tiles without a synchronisation; it launches an upper bound instead. Since
``sum_e cdiv(n_e, BM) < R / BM + E``, at most ``cdiv(R, BM) + E - 1`` M tiles exist. Every program
loads the E + 1 offsets (a few hundred bytes, served from L2), takes the inclusive prefix sum of the
per-expert tile counts, and finds its expert as the number of prefix ends <= its M-tile index. A
program whose tile index is past the real tile count exits at once; there are at most E - 1 such M
tiles (times the N tiles), and the grouped ordering below puts them last in launch order. Empty
segments own no tiles and are skipped by the search; their output rows do not exist.
Program ids are mapped to (M tile, N tile) in groups of GROUP_M M tiles (the Triton matmul tutorial's
L2 swizzle): consecutive programs share the same weight columns (one expert's w[e] slab) and the
same GROUP_M row blocks, so both operands are mostly read from L2.
``grouped_mm_dx`` is the same kernel on the transposed weight view ``w[e].T`` (only strides change).

*Fused gate/up + SwiGLU* (``gate_up_swiglu``). ``w_E2FD`` holds the gate rows [0, F) and the up rows
[F, 2F). A program owns output columns j of h and computes the gate tile (weight rows j) and the up
tile (rows F + j) with two fp32 accumulators from the same x tile, so x is read once for both halves.
The epilogue rounds both to the output dtype, stores them into gu (columns j and F + j, kept for
backward), and computes ``h = silu(g) * u`` in fp32 *from the rounded values*, so h is
``swiglu_fwd_ref(gu)`` of the stored gu (up to fp32 rounding inside silu) without a second pass over gu.
A bias is added to both fp32 accumulators before that rounding. *Interleaved* gate/up rows 2j and 2j + 1
are adjacent, so a program instead loads one [BLOCK_K, 2 BLOCK_N] weight tile per step into one
[BLOCK_M, 2 BLOCK_N] accumulator (a plain GEMM over gu's columns: with GPT-OSS's [E, D, 2F] weight the
tile is contiguous along 2F), stores it as gu's interleaved columns, and splits it (reshape to
[BM, BN, 2], ``tl.split``) into the gate and up tiles of the activation: in sm_90 builds a layout
conversion through the shared memory the main loop is done with (no more shared memory per block, 16
more vector shared loads per thread in the bf16 128 x 128 PTX). Two accumulators or one twice as wide
hold the same registers; the split epilogue needs more (sm_90 builds of the bf16
128 x 128 tile with bias and "swiglu_oai": 248 registers against the default's 184 on Triton 3.9, 217
against 182 on 3.6; one block per SM either way, as its 144 KiB of shared memory allow), and fp32
configs are capped at 64 accumulator registers (:mod:`kernels._gemm_space`).

*Bias gradient* (``segment_sum``, kernels/segment_sum.py): per-expert sums of the output gradient's
rows, one deterministic launch.

*Weight gradient* (``grouped_mm_dw``). A reduction over each segment's rows, so it is its own launch:
the grid is E x cdiv(N, BN) x cdiv(K, BK) output tiles (sizes known on the host), experts outermost;
each program loops over its segment's rows in BLOCK_M steps (bounds read from the device) and writes
its [BN, BK] tile once. An empty segment runs no iteration and writes zeros.

All kernels accumulate in fp32 and write the input dtype (bf16, fp16 or fp32). fp32 inputs use exact
fp32 products by default (``allow_tf32=False``, ``input_precision="ieee"``) so they match an fp32
reference tightly; pass ``allow_tf32=True`` for the tensor-core rate at about 1e-3 relative error.
Index x stride products are formed in int64 (R * N and E * N * K pass 2^31 at real sizes, and so
can N * R through a column-major view). Products bounded by a tile, the in-tile reduction offsets
(< BLOCK_K) and the per-step pointer increments (BLOCK_K or BLOCK_M times a stride), stay int32 unless
that bound reaches 2^31 (a column-major x with millions of rows, say), when the ``TILE_I64``
heuristic switches them to int64: always in int64, they cost the fp32 TF32 dx kernel at 128 x 128 x 32
(4 warps) 56 bytes of spills and its dW up to 84 registers (``python -m bench.compile_check
--all-configs``). Masks stay int32.

Tuning
------
On CUDA each projection has its own autotuner (fwd, dx, gate_up, dw), over :func:`_gemm_configs`
pruned by :func:`_prune_configs` (registers, fewer where fp32 operands sit in registers, shared memory,
128-byte K steps, problem size; ``python -m bench.compile_check`` builds every survivor for sm_90). The key is
(N, K, E, a power-of-two bucket of the mean rows per expert) and the dtypes, never the raw row count,
so chunked runs with varying R do not retune. ``LANCET_GEMM_CONFIG="BM,BN,BK,num_warps,num_stages"``
pins one config for all four (``LANCET_GEMM_CONFIG_<FWD|DX|GATE_UP|DW>`` for one of them); for dW
the triple reads (output rows of N, output cols of K, reduction rows), i.e. it is always
"output tile rows, output tile cols, reduction step". Under ``TRITON_INTERPRET=1`` (the CPU lane) one
small fixed config is used, because the interpreter's cost grows with the tile size.

Limits
------
* Padding: each segment's last M tile is partly empty; the waste is at most E * BLOCK_M rows, about 3%
  at 4096 rows per expert and BM=128, but dominant for tiny segments.
* Non-persistent kernels with plain pointer loads (cp.async pipelining, wgmma via Triton): no TMA,
  no warp specialisation, no stream-K. Expect below cuBLAS's dense rate on H100/H200; the benchmark
  ``python -m bench.experts`` measures the fraction.
* dW has no split over rows: an expert's tiles loop over all its rows, so with very few output tiles
  (small N*K) and one large segment the GPU is under-filled. At D=4096, F>=2048 every expert has
  thousands of tiles.
* Offsets are trusted to be non-decreasing with offsets[0] = 0 and offsets[E] = R (checking would
  need a host sync); they are clamped to [0, R] in the kernels so bad offsets cannot fault. Rows
  outside every segment are not written, as in the reference.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._expert_checks import (_INTERPRET, _check_activation, _check_bias, _check_device, _check_float, _check_ndim,
                             _check_offsets, _check_out, _check_same_dtype)
from ._gemm_space import CONFIG_ENV, _TILE_NAMES, _gemm_configs, _make_config, _pinned_config, _prune_configs, _tile_of
from .segment_sum import segment_sum  # the bias gradients: in the grouped_gemm op family (lancet_rt.ops)

# ------------------------------------------------------------------------------------------------
# Environment: the interpreter switch in kernels/_expert_checks.py, pinned configs in kernels/_gemm_space.py.
# ------------------------------------------------------------------------------------------------
# (output tile rows, output tile cols, reduction step, num_warps, num_stages) under the interpreter.
_INTERPRETER_CONFIG = (16, 32, 32, 4, 1)


# ================================================================================================
# Kernels
# ================================================================================================
@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a linear program id, GROUP_M row tiles at a time (L2 reuse)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + a @ b. DOT_FP32 upcasts the operands first; the launchers set it only under the CPU
    interpreter for bf16, whose tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584). A bf16
    product is exact in fp32, so the result is the tensor-core one up to summation order."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc=acc, input_precision=INPUT_PRECISION)


@triton.jit
def _k_loop(acc, x_ptrs, w_ptrs, x_step, w_step, mask_m, offs_k, K,
            BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + x_tile @ w_tile over the reduction: [BM, BK] x tiles and [BK, BN] w tiles, BLOCK_K per step
    (rows of x past mask_m and, unless EVEN_K, reduction steps past K read as zeros)."""
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            b_x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            b_w = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            b_x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b_w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = _dot(b_x, b_w, acc, INPUT_PRECISION, DOT_FP32)
        x_ptrs += x_step
        w_ptrs += w_step
    return acc


@triton.jit
def _segment_tile(offsets_ptr, pid_m, R, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Map the pid_m-th M tile over all segments to (expert, first row, row end, tile count).

    Segment e owns cdiv(n_e, BLOCK_M) tiles; the tiles are numbered expert by expert. Returns the
    total tile count too, so the caller can exit when pid_m is past it (the grid is an upper bound).
    """
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    # Clamp to [0, R] so that malformed offsets cannot address memory outside x and y.
    b_start = tl.load(offsets_ptr + offs_e, mask=mask_e, other=0).to(tl.int32)
    b_end = tl.load(offsets_ptr + offs_e + 1, mask=mask_e, other=0).to(tl.int32)
    b_start = tl.minimum(tl.maximum(b_start, 0), R)
    b_end = tl.maximum(tl.minimum(b_end, R), b_start)
    b_tiles = (b_end - b_start + BLOCK_M - 1) // BLOCK_M  # [BLOCK_E], 0 for empty segments
    b_tiles_end = tl.cumsum(b_tiles, axis=0)  # inclusive prefix: tiles of experts <= e
    num_tiles = tl.sum(b_tiles, axis=0)
    # Experts whose tiles all come before pid_m; empty experts are counted with their predecessor.
    expert = tl.sum((b_tiles_end <= pid_m).to(tl.int32), axis=0)
    sel = offs_e == expert
    first_tile = tl.sum(tl.where(sel, b_tiles_end - b_tiles, 0), axis=0)
    seg_start = tl.sum(tl.where(sel, b_start, 0), axis=0)
    row_end = tl.sum(tl.where(sel, b_end, 0), axis=0)
    row_start = seg_start + (pid_m - first_tile) * BLOCK_M
    return expert, row_start, row_end, num_tiles


@triton.jit
def _grouped_gemm_fwd_kernel(
    # pointers
    x_ptr,  # [R, K] rows grouped by expert
    w_ptr,  # [E, N, K] as seen through (stride_wn, stride_wk): w[e, n, k]
    b_ptr,  # [E, N] bias (read only with HAS_BIAS)
    y_ptr,  # [R, N] output, x's dtype
    offsets_ptr,  # [E + 1] int32/int64 segment bounds
    # sizes
    R, N, K, E,
    M_BUCKET,  # autotune key only: power-of-two bucket of the mean rows per expert
    # strides
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    stride_be, stride_bn,
    stride_ym, stride_yn,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next power of two >= E
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks in the main loop
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" (fp32 inputs only)
    DOT_FP32: tl.constexpr,  # interpreter-only bf16 workaround, see _dot
    HAS_BIAS: tl.constexpr = False,  # add b[e] to the fp32 accumulator before rounding
    TILE_I64: tl.constexpr = False,  # BLOCK_K x a K stride reaches 2^31: in-tile K offsets, K steps in int64
):
    """y[r, n] = sum_k x[r, k] * w[e(r), n, k] (+ b[e(r), n]), one BLOCK_M x BLOCK_N tile per program."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(R, BLOCK_M) + E - 1  # upper bound on sum_e cdiv(n_e, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    expert, row_start, row_end, num_tiles = _segment_tile(offsets_ptr, pid_m, R, E, BLOCK_M, BLOCK_E)
    if pid_m >= num_tiles:
        return

    offs_m = row_start + tl.arange(0, BLOCK_M)  # rows of x and y
    mask_m = offs_m < row_end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapped column index: weight loads stay in bounds without a mask; the store masks instead.
    offs_wn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)

    # Index x stride products in int64; those bounded by BLOCK_K x a stride where needed (module docstring).
    offs_kk = offs_k.to(tl.int64) if TILE_I64 else offs_k
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_kk[None, :] * stride_xk  # [BM, BK]
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + offs_kk[:, None] * stride_wk + offs_wn.to(tl.int64)[None, :] * stride_wn)  # [BK, BN]
    x_step = (tl.cast(stride_xk, tl.int64) if TILE_I64 else stride_xk) * BLOCK_K
    w_step = (tl.cast(stride_wk, tl.int64) if TILE_I64 else stride_wk) * BLOCK_K

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _k_loop(acc, x_ptrs, w_ptrs, x_step, w_step, mask_m, offs_k, K,
                  BLOCK_K, EVEN_K, INPUT_PRECISION, DOT_FP32)

    if HAS_BIAS:
        b_b = tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_wn.to(tl.int64) * stride_bn)
        acc += b_b.to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n.to(tl.int64)[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n[None, :] < N))


@triton.jit
def _glu(g, u, alpha, limit, ACTIVATION: tl.constexpr):
    """The activation of fp32 gate and up values: "swiglu" silu(g) * u, or "swiglu_oai" (GPT-OSS)
    (clamp(u, -limit, limit) + 1) * gc * sigmoid(alpha * gc) with gc = min(g, limit). The clamps
    propagate NaN, as torch.clamp does."""
    if ACTIVATION == "swiglu_oai":
        gc = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        uc = tl.maximum(tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL), -limit,
                        propagate_nan=tl.PropagateNan.ALL)
        h = (uc + 1.0) * (gc / (1.0 + tl.exp(-alpha * gc)))
    else:
        h = g / (1.0 + tl.exp(-g)) * u
    return h


@triton.jit
def _gate_up_swiglu_fwd_kernel(
    # pointers
    x_ptr,  # [R, D] rows grouped by expert
    w_ptr,  # [E, 2F, D] gate rows [0, F), up rows [F, 2F); INTERLEAVED: gate rows 2j, up rows 2j + 1
    b_ptr,  # [E, 2F] bias in w's row order (read only with HAS_BIAS)
    h_ptr,  # [R, F] output: the activation
    gu_ptr,  # [R, 2F] output: the pre-activation in w's row order, kept for backward
    offsets_ptr,  # [E + 1] int32/int64 segment bounds
    # sizes
    R, F, D, E,
    M_BUCKET,  # autotune key only
    # activation constants ("swiglu_oai" only)
    alpha, limit,
    # strides
    stride_xm, stride_xd,
    stride_we, stride_wf, stride_wd,
    stride_be, stride_bf,
    stride_hm, stride_hf,
    stride_gm, stride_gf,
    # meta-parameters (BLOCK_N tiles F, BLOCK_K tiles D)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False,  # gate and up alternate along 2F (the GPT-OSS layout)
    ACTIVATION: tl.constexpr = "swiglu",  # or "swiglu_oai", see _glu
    TILE_I64: tl.constexpr = False,
):
    """gu = x @ w[e].T (+ b[e]) over one tile of h's columns j and their gate and up columns of gu,
    h[:, j] = act(gate_j, up_j)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(R, BLOCK_M) + E - 1
    num_pid_n = tl.cdiv(F, BLOCK_N)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    expert, row_start, row_end, num_tiles = _segment_tile(offsets_ptr, pid_m, R, E, BLOCK_M, BLOCK_E)
    if pid_m >= num_tiles:
        return

    offs_m = row_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns j of h (and of the gate half of gu)
    offs_k = tl.arange(0, BLOCK_K)

    offs_kk = offs_k.to(tl.int64) if TILE_I64 else offs_k
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_kk[None, :] * stride_xd  # [BM, BK]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_kk[:, None] * stride_wd
    x_step = (tl.cast(stride_xd, tl.int64) if TILE_I64 else stride_xd) * BLOCK_K
    w_step = (tl.cast(stride_wd, tl.int64) if TILE_I64 else stride_wd) * BLOCK_K
    out_ty = gu_ptr.dtype.element_ty

    if INTERLEAVED:
        # Gate and up of columns j are the adjacent rows 2j, 2j + 1 of w: one [BK, 2 BN] weight tile
        # and one [BM, 2 BN] accumulator cover both (a plain GEMM over gu's columns), split in the epilogue.
        offs_c = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)  # columns of gu
        offs_wc = offs_c % (2 * F)
        wc_ptrs = w_ptrs + offs_wc.to(tl.int64)[None, :] * stride_wf  # [BK, 2 BN]
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        acc = _k_loop(acc, x_ptrs, wc_ptrs, x_step, w_step, mask_m, offs_k, D,
                      BLOCK_K, EVEN_K, INPUT_PRECISION, DOT_FP32)
        if HAS_BIAS:
            b_b = tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_wc.to(tl.int64) * stride_bf)
            acc += b_b.to(tl.float32)[None, :]
        b_gu = acc.to(out_ty)
        gu_rows = gu_ptr + offs_m.to(tl.int64)[:, None] * stride_gm
        tl.store(gu_rows + offs_c.to(tl.int64)[None, :] * stride_gf, b_gu,
                 mask=mask_m[:, None] & (offs_c[None, :] < 2 * F))
        g, u = tl.split(tl.reshape(b_gu.to(tl.float32), (BLOCK_M, BLOCK_N, 2)))
    else:
        # A program owns columns j of h: the gate tile (weight rows j) and the up tile (rows F + j),
        # two accumulators fed by the same x tile.
        offs_wn = offs_n % F
        wg_ptrs = w_ptrs + offs_wn.to(tl.int64)[None, :] * stride_wf  # [BK, BN] gate: rows j
        wu_ptrs = w_ptrs + (offs_wn + F).to(tl.int64)[None, :] * stride_wf  # [BK, BN] up: rows F + j
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            if EVEN_K:
                b_x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                b_wg = tl.load(wg_ptrs)
                b_wu = tl.load(wu_ptrs)
            else:
                k_left = D - k * BLOCK_K
                b_x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b_wg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                b_wu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc_g = _dot(b_x, b_wg, acc_g, INPUT_PRECISION, DOT_FP32)
            acc_u = _dot(b_x, b_wu, acc_u, INPUT_PRECISION, DOT_FP32)
            x_ptrs += x_step
            wg_ptrs += w_step
            wu_ptrs += w_step
        if HAS_BIAS:
            b_rows = b_ptr + expert.to(tl.int64) * stride_be
            acc_g += tl.load(b_rows + offs_wn.to(tl.int64) * stride_bf).to(tl.float32)[None, :]
            acc_u += tl.load(b_rows + (offs_wn + F).to(tl.int64) * stride_bf).to(tl.float32)[None, :]
        # Epilogue: store gu, then h from the *rounded* gu, so h == swiglu_fwd_ref(gu) bit for bit.
        b_g = acc_g.to(out_ty)
        b_u = acc_u.to(out_ty)
        mask_out = mask_m[:, None] & (offs_n[None, :] < F)
        offs_n64 = offs_n.to(tl.int64)
        gu_rows = gu_ptr + offs_m.to(tl.int64)[:, None] * stride_gm
        tl.store(gu_rows + offs_n64[None, :] * stride_gf, b_g, mask=mask_out)
        tl.store(gu_rows + (offs_n64 + F)[None, :] * stride_gf, b_u, mask=mask_out)
        g = b_g.to(tl.float32)
        u = b_u.to(tl.float32)

    # h from the rounded gu (both branches), so h is swiglu_fwd_ref(gu) of the stored gu.
    b_h = _glu(g, u, alpha, limit, ACTIVATION)
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n.to(tl.int64)[None, :] * stride_hf
    tl.store(h_ptrs, b_h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n[None, :] < F))


@triton.jit
def _grouped_gemm_dw_kernel(
    # pointers
    dy_ptr,  # [R, N] output gradient, rows grouped by expert
    x_ptr,  # [R, K] forward input
    dw_ptr,  # [E, N, K] output: dw[e] = dy_seg.T @ x_seg, x's dtype
    offsets_ptr,  # [E + 1] int32/int64 segment bounds
    # sizes
    R, N, K, E,
    M_BUCKET,  # autotune key only
    # strides
    stride_dym, stride_dyn,
    stride_xm, stride_xk,
    stride_dwe, stride_dwn, stride_dwk,
    # meta-parameters: the output tile is BLOCK_N x BLOCK_K; BLOCK_M rows are reduced per step
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    TILE_I64: tl.constexpr = False,  # BLOCK_M x a row stride reaches 2^31: row steps in int64
):
    """dw[e, n, k] = sum over rows r of segment e of dy[r, n] * x[r, k]; zeros for an empty segment."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    tiles_per_expert = num_pid_n * num_pid_k
    expert = pid // tiles_per_expert  # experts outermost: one expert's rows stay hot in L2
    pid_n, pid_k = _swizzle(pid % tiles_per_expert, num_pid_n, num_pid_k, GROUP_M)

    row_start = tl.load(offsets_ptr + expert).to(tl.int32)
    row_end = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    row_start = tl.minimum(tl.maximum(row_start, 0), R)
    row_end = tl.maximum(tl.minimum(row_end, R), row_start)

    offs_m = tl.arange(0, BLOCK_M)  # reduction rows, relative to the current step
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_yn = offs_n % N  # wrapped: loads in bounds without masks, the store masks
    offs_xk = offs_k % K

    rows = (row_start + offs_m).to(tl.int64)
    dy_ptrs = dy_ptr + rows[None, :] * stride_dym + offs_yn.to(tl.int64)[:, None] * stride_dyn  # dy_seg.T
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_xk.to(tl.int64)[None, :] * stride_xk  # [BM, BK]
    dy_step = (tl.cast(stride_dym, tl.int64) if TILE_I64 else stride_dym) * BLOCK_M
    x_step = (tl.cast(stride_xm, tl.int64) if TILE_I64 else stride_xm) * BLOCK_M

    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m in range(0, tl.cdiv(row_end - row_start, BLOCK_M)):
        mask_m = offs_m < row_end - row_start - m * BLOCK_M
        b_dyt = tl.load(dy_ptrs, mask=mask_m[None, :], other=0.0)
        b_x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        acc = _dot(b_dyt, b_x, acc, INPUT_PRECISION, DOT_FP32)
        dy_ptrs += dy_step
        x_ptrs += x_step

    dw_ptrs = (dw_ptr + expert.to(tl.int64) * stride_dwe
               + offs_n.to(tl.int64)[:, None] * stride_dwn + offs_k.to(tl.int64)[None, :] * stride_dwk)
    mask_out = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=mask_out)


def _even_k(args) -> bool:
    return args["K" if "K" in args else "D"] % args["BLOCK_K"] == 0


_INT32_LIMIT = 2**31


def _tile_i64(block: str, *strides: str):
    """The TILE_I64 heuristic: whether ``block`` times one of ``strides`` (the bound of the in-tile
    offset and per-step pointer products) reaches 2^31."""
    def needs_int64(args) -> bool:
        return max(args[s] for s in strides) * args[block] >= _INT32_LIMIT
    return needs_int64


_FWD = triton.heuristics({"EVEN_K": _even_k, "TILE_I64": _tile_i64("BLOCK_K", "stride_xk", "stride_wk")})(
    _grouped_gemm_fwd_kernel)
_GATE_UP = triton.heuristics({"EVEN_K": _even_k, "TILE_I64": _tile_i64("BLOCK_K", "stride_xd", "stride_wd")})(
    _gate_up_swiglu_fwd_kernel)
_DW = triton.heuristics({"TILE_I64": _tile_i64("BLOCK_M", "stride_dym", "stride_xm")})(_grouped_gemm_dw_kernel)


@functools.lru_cache(maxsize=None)
def _autotuned(op: str):
    kernel = {"fwd": _FWD, "dx": _FWD, "gate_up": _GATE_UP, "dw": _DW}[op]
    # The gate_up key holds the weight layout: interleaved loads one [BK, 2 BN] tile, not two [BK, BN].
    keys = {"gate_up": ["F", "D", "E", "M_BUCKET", "INTERLEAVED"]}.get(op, ["N", "K", "E", "M_BUCKET"])
    # Keep tuned choices on disk across processes where this Triton supports it (3.2+).
    extra = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    # One autotuner per op (fwd and dx share a kernel but not a cache: their strides differ).
    return triton.autotune(configs=_gemm_configs(op), key=keys,
                           prune_configs_by={"early_config_prune": _prune_configs(op)}, **extra)(kernel)


_LAST_CONFIG: dict = {}  # op -> the config of its latest launch, for selected_config()


def _launch_gemm(op: str, grid, args: tuple, device: torch.device, **const) -> None:
    """Launch ``op`` with the pinned config, the interpreter config, or the CUDA autotuner."""
    kernel = {"fwd": _FWD, "dx": _FWD, "gate_up": _GATE_UP, "dw": _DW}[op]
    pinned = _pinned_config(op)
    if pinned is None and (device.type != "cuda" or _INTERPRET):
        pinned = _INTERPRETER_CONFIG
    if pinned is not None:
        cfg = _make_config(op, *pinned)
        kernel[grid](*args, **const, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        tuner = _autotuned(op)
        tuner[grid](*args, **const)
        cfg = tuner.best_config
    _LAST_CONFIG[op] = (*_tile_of(op, cfg), cfg.num_warps, cfg.num_stages)


def selected_config(op: str) -> Optional[str]:
    """The config of ``op``'s latest launch ("fwd", "dx", "gate_up" or "dw") in the
    ``LANCET_GEMM_CONFIG`` format (output tile rows, cols, reduction step, warps, stages), so a
    tuned config can be recorded and pinned; None before the first launch."""
    if op not in _TILE_NAMES:
        raise ValueError(f"op must be one of {sorted(_TILE_NAMES)}, got {op!r}")
    cfg = _LAST_CONFIG.get(op)
    return None if cfg is None else ",".join(map(str, cfg))


def _m_bucket(R: int, E: int) -> int:
    """Autotune key from the row count: a power of two of the mean rows per expert, in [16, 4096]."""
    return min(4096, max(16, triton.next_power_of_2(max(1, -(-R // max(E, 1))))))


def _dot_meta(dtype: torch.dtype, allow_tf32: bool) -> dict:
    """The dot constexprs: TF32 only when asked for fp32 inputs; fp32 operands for bf16 when interpreted."""
    return dict(INPUT_PRECISION="tf32" if (allow_tf32 and dtype == torch.float32) else "ieee",
                DOT_FP32=_INTERPRET and dtype == torch.bfloat16)


# ================================================================================================
# Launchers
# ================================================================================================
def _grouped_mm(op: str, x_RK: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor,
                out: Optional[torch.Tensor], allow_tf32: bool, bias_EN: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y[r] = x[r] @ w[e].T (+ bias[e]) over segments; w is any [E, N, K] view (dx passes w[e].T)."""
    R, K = x_RK.shape
    E, N, _ = w_ENK.shape
    y = _check_out(out, (R, N), x_RK.dtype, x_RK.device)
    if R == 0 or N == 0:
        return y
    if K == 0 and bias_EN is None:
        return y.zero_()
    grid = lambda META: ((triton.cdiv(R, META["BLOCK_M"]) + E - 1) * triton.cdiv(N, META["BLOCK_N"]),)  # noqa: E731
    b, b_strides = (w_ENK, (0, 0)) if bias_EN is None else (bias_EN, bias_EN.stride())  # unread without bias
    args = (x_RK, w_ENK, b, y, offsets_E1, R, N, K, E, _m_bucket(R, E),
            x_RK.stride(0), x_RK.stride(1),
            w_ENK.stride(0), w_ENK.stride(1), w_ENK.stride(2),
            *b_strides,
            y.stride(0), y.stride(1))
    _launch_gemm(op, grid, args, x_RK.device, BLOCK_E=max(16, triton.next_power_of_2(E)),
                 HAS_BIAS=bias_EN is not None, **_dot_meta(x_RK.dtype, allow_tf32))
    return y


def grouped_mm(x_RK: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor,
               bias_EN: Optional[torch.Tensor] = None, *,
               out: Optional[torch.Tensor] = None, allow_tf32: bool = False) -> torch.Tensor:
    """y[r] = x[r] @ w[e].T (+ bias[e]) for the rows r of segment e = offsets[e]:offsets[e+1]; one launch.

    Args:
        x_RK: [R, K] bf16/fp16/fp32 rows grouped by local expert (any strides).
        w_ENK: [E, N, K] weights, x's dtype (the Hugging Face layout: out features first; any
            strides, so GPT-OSS's [E, K, N] parameter passes as its transpose view).
        offsets_E1: int32/int64 [E + 1] segment bounds on x's device, offsets[0] = 0,
            offsets[E] = R, non-decreasing (not checked: that would synchronise).
        bias_EN: optional [E, N] per-expert bias in x's dtype, added to the fp32 accumulator
            before the one rounding to x's dtype.
        out: optional [R, N] output buffer in x's dtype.
        allow_tf32: fp32 inputs only: use TF32 tensor cores (about 1e-3 relative error).

    Returns:
        y_RN [R, N] in x's dtype.
    """
    _check_float("x_RK", x_RK)
    _check_float("w_ENK", w_ENK)
    _check_ndim("x_RK", x_RK, 2, "RK")
    _check_ndim("w_ENK", w_ENK, 3, "ENK")
    _check_same_dtype("w_ENK", w_ENK, x_RK.dtype, "x_RK")
    _check_device("x_RK", x_RK, x_RK.device)
    _check_device("w_ENK", w_ENK, x_RK.device)
    if w_ENK.shape[2] != x_RK.shape[1]:
        raise ValueError(f"w_ENK must be [E, N, K] with K = x_RK.shape[1] = {x_RK.shape[1]}, "
                         f"got shape {tuple(w_ENK.shape)}")
    _check_offsets(offsets_E1, w_ENK.shape[0], x_RK.shape[0], x_RK.device)
    _check_bias("bias_EN", bias_EN, w_ENK.shape[:2], x_RK.dtype, x_RK.device, "x_RK")
    return _grouped_mm("fwd", x_RK, w_ENK, offsets_E1, out, allow_tf32, bias_EN)


def grouped_mm_dx(dy_RN: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor, *,
                  out: Optional[torch.Tensor] = None, allow_tf32: bool = False) -> torch.Tensor:
    """dx[r] = dy[r] @ w[e] for the rows of segment e: the input gradient of :func:`grouped_mm`.

    Args:
        dy_RN: [R, N] output gradient, rows grouped by expert.
        w_ENK: [E, N, K] forward weights, dy's dtype.
        offsets_E1: int32/int64 [E + 1] segment bounds (as in :func:`grouped_mm`).
        out: optional [R, K] output buffer in dy's dtype.
        allow_tf32: fp32 inputs only: use TF32 tensor cores.

    Returns:
        dx_RK [R, K] in dy's dtype.
    """
    _check_float("dy_RN", dy_RN)
    _check_float("w_ENK", w_ENK)
    _check_ndim("dy_RN", dy_RN, 2, "RN")
    _check_ndim("w_ENK", w_ENK, 3, "ENK")
    _check_same_dtype("w_ENK", w_ENK, dy_RN.dtype, "dy_RN")
    _check_device("dy_RN", dy_RN, dy_RN.device)
    _check_device("w_ENK", w_ENK, dy_RN.device)
    if w_ENK.shape[1] != dy_RN.shape[1]:
        raise ValueError(f"w_ENK must be [E, N, K] with N = dy_RN.shape[1] = {dy_RN.shape[1]}, "
                         f"got shape {tuple(w_ENK.shape)}")
    _check_offsets(offsets_E1, w_ENK.shape[0], dy_RN.shape[0], dy_RN.device)
    # dx = dy @ w[e] is the forward kernel on the [E, K, N] view w[e].T: only the strides change.
    return _grouped_mm("dx", dy_RN, w_ENK.transpose(1, 2), offsets_E1, out, allow_tf32)


def grouped_mm_dw(dy_RN: torch.Tensor, x_RK: torch.Tensor, offsets_E1: torch.Tensor, *,
                  out: Optional[torch.Tensor] = None, allow_tf32: bool = False) -> torch.Tensor:
    """dw[e] = dy_seg.T @ x_seg over segment e, zeros for an empty segment: the weight gradient.

    Args:
        dy_RN: [R, N] output gradient, rows grouped by expert.
        x_RK: [R, K] forward input, dy's dtype.
        offsets_E1: int32/int64 [E + 1] segment bounds; E is taken from its length.
        out: optional [E, N, K] output buffer in x's dtype (every element is written).
        allow_tf32: fp32 inputs only: use TF32 tensor cores.

    Returns:
        dw_ENK [E, N, K] in x's dtype.
    """
    _check_float("dy_RN", dy_RN)
    _check_float("x_RK", x_RK)
    _check_ndim("dy_RN", dy_RN, 2, "RN")
    _check_ndim("x_RK", x_RK, 2, "RK")
    _check_same_dtype("dy_RN", dy_RN, x_RK.dtype, "x_RK")
    _check_device("x_RK", x_RK, x_RK.device)
    _check_device("dy_RN", dy_RN, x_RK.device)
    if dy_RN.shape[0] != x_RK.shape[0]:
        raise ValueError(f"dy_RN must have R = x_RK.shape[0] = {x_RK.shape[0]} rows, got {dy_RN.shape[0]}")
    if not isinstance(offsets_E1, torch.Tensor) or offsets_E1.dim() != 1 or offsets_E1.shape[0] < 1:
        raise ValueError("offsets_E1 must be a 1-D tensor of E + 1 >= 1 segment bounds")
    E = offsets_E1.shape[0] - 1
    R, K = x_RK.shape
    N = dy_RN.shape[1]
    _check_offsets(offsets_E1, E, R, x_RK.device)
    dw = _check_out(out, (E, N, K), x_RK.dtype, x_RK.device)
    if E == 0 or N == 0 or K == 0:
        return dw
    grid = lambda META: (E * triton.cdiv(N, META["BLOCK_N"]) * triton.cdiv(K, META["BLOCK_K"]),)  # noqa: E731
    args = (dy_RN, x_RK, dw, offsets_E1, R, N, K, E, _m_bucket(R, E),
            dy_RN.stride(0), dy_RN.stride(1),
            x_RK.stride(0), x_RK.stride(1),
            dw.stride(0), dw.stride(1), dw.stride(2))
    _launch_gemm("dw", grid, args, x_RK.device, **_dot_meta(x_RK.dtype, allow_tf32))
    return dw


def gate_up_swiglu(x_RD: torch.Tensor, w_E2FD: torch.Tensor, offsets_E1: torch.Tensor,
                   bias_E2F: Optional[torch.Tensor] = None, *, activation: str = "swiglu",
                   interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0,
                   out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                   allow_tf32: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The expert input projection with its activation fused into the epilogue.

    Args:
        x_RD: [R, D] rows grouped by local expert.
        w_E2FD: [E, 2F, D] x's dtype, any strides: ``experts.gate_up_proj`` (gate rows first), or
            with ``interleaved`` gate rows 2j and up rows 2j + 1 (GPT-OSS's ``gate_up_proj`` [E, D, 2F]
            passes as its transpose view, no copy).
        offsets_E1: int32/int64 [E + 1] segment bounds (as in :func:`grouped_mm`).
        bias_E2F: optional [E, 2F] bias in w's row order, x's dtype, added before the rounding.
        activation: "swiglu": h = silu(gate) * up; "swiglu_oai" (GPT-OSS): with g = min(gate, limit)
            and u = clamp(up, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g).
        interleaved: w's rows, the bias and gu alternate gate and up (GPT-OSS) instead of gate first.
        alpha, limit: the "swiglu_oai" constants (GPT-OSS's ``swiglu_alpha``, ``swiglu_limit``).
        out: optional (h [R, F], gu [R, 2F]) output buffers in x's dtype.
        allow_tf32: fp32 inputs only: use TF32 tensor cores.

    Returns:
        (h_RF, gu_R2F): gu = grouped_mm(x, w, bias), kept for backward (in w's row order), and
        h = swiglu_fwd(gu) of that gu, as rounded to x's dtype.
    """
    _check_float("x_RD", x_RD)
    _check_float("w_E2FD", w_E2FD)
    _check_ndim("x_RD", x_RD, 2, "RD")
    _check_ndim("w_E2FD", w_E2FD, 3, ("E", "2F", "D"))
    _check_same_dtype("w_E2FD", w_E2FD, x_RD.dtype, "x_RD")
    _check_device("x_RD", x_RD, x_RD.device)
    _check_device("w_E2FD", w_E2FD, x_RD.device)
    _check_activation(activation, alpha, limit)
    E, F2, D = w_E2FD.shape
    R = x_RD.shape[0]
    if D != x_RD.shape[1] or F2 % 2:
        raise ValueError(f"w_E2FD must be [E, 2F, D] with D = x_RD.shape[1] = {x_RD.shape[1]} and an even "
                         f"second dim, got shape {tuple(w_E2FD.shape)}")
    _check_offsets(offsets_E1, E, R, x_RD.device)
    _check_bias("bias_E2F", bias_E2F, (E, F2), x_RD.dtype, x_RD.device, "x_RD")
    F = F2 // 2
    if out is None:
        out = (None, None)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out must be None or a pair (h_RF, gu_R2F)")
    h = _check_out(out[0], (R, F), x_RD.dtype, x_RD.device, "out[0] (h_RF)")
    gu = _check_out(out[1], (R, F2), x_RD.dtype, x_RD.device, "out[1] (gu_R2F)")
    if R == 0 or F == 0:
        return h, gu
    if D == 0 and bias_E2F is None:  # gu = 0, and both activations map (0, 0) to 0
        return h.zero_(), gu.zero_()
    grid = lambda META: ((triton.cdiv(R, META["BLOCK_M"]) + E - 1) * triton.cdiv(F, META["BLOCK_N"]),)  # noqa: E731
    b, b_strides = (w_E2FD, (0, 0)) if bias_E2F is None else (bias_E2F, bias_E2F.stride())  # unread without bias
    args = (x_RD, w_E2FD, b, h, gu, offsets_E1, R, F, D, E, _m_bucket(R, E), float(alpha), float(limit),
            x_RD.stride(0), x_RD.stride(1),
            w_E2FD.stride(0), w_E2FD.stride(1), w_E2FD.stride(2),
            *b_strides,
            h.stride(0), h.stride(1),
            gu.stride(0), gu.stride(1))
    _launch_gemm("gate_up", grid, args, x_RD.device, BLOCK_E=max(16, triton.next_power_of_2(E)),
                 HAS_BIAS=bias_E2F is not None, INTERLEAVED=bool(interleaved), ACTIVATION=activation,
                 **_dot_meta(x_RD.dtype, allow_tf32))
    return h, gu


__all__ = ["grouped_mm", "grouped_mm_dx", "grouped_mm_dw", "gate_up_swiglu", "segment_sum", "selected_config",
           "CONFIG_ENV"]
