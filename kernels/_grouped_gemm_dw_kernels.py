"""Grouped GEMM weight-gradient kernels: the dW programs behind :mod:`lancet_rt.kernels.grouped_gemm`
(``grouped_mm_dw``, ``grouped_mm_dw_pair``); the row-segment GEMMs and the shared tile helpers are in
:mod:`lancet_rt.kernels._grouped_gemm_kernels`, whose notes on precision and int64 indexing hold here too.

Algorithm
---------
*Weight gradient* (``grouped_mm_dw``). A reduction over each segment's rows, so it is its own launch:
the grid is E x cdiv(N, BN) x cdiv(K, BK) output tiles (sizes known on the host), experts outermost;
each program loops over its segment's rows in BLOCK_M steps (bounds read from the device) and writes
its [BN, BK] tile once. An empty segment runs no iteration and writes zeros. With ``accumulate``
(``ACCUMULATE``) the tile is added to the output's old value instead, in the output's dtype as
PyTorch's ``a + b`` of two gradients: so the chunks of a chunked step sum their gradients of one
weight in its dW launches, with no buffer per chunk and no separate add, bit for bit the engine's sum.

*Two weight gradients in one launch* (``grouped_mm_dw_pair``). A chunk's expert backward needs both
dW GEMMs, gate_up's (dgu^T x, or x^T dgu in the GPT-OSS layout) and down's (dy^T h, or h^T dy), and
both reduce over the same row segments. On a GPU the host must issue a chunk's work faster than the
GPU runs it, and each launch is host time per chunk, so the pair is one grid: programs
[0, E * tiles(A)) own problem A's output tiles, the rest problem B's, each with its own operands, row
maps, output, ``accumulate``, sizes and strides. A program runs the same per-tile code as the single
kernel (``_dw_tile``), so at the same tile config both results are bit for bit those of the two
launches; one config serves both (tuned on both problems' sizes, pinned by dW's variable). It moves
the bytes the two launches move: each program reads its expert's rows of its problem's two operands
(the columns of its tile) and writes its tile once (reading it first with ``accumulate``); only the
second launch's fixed host cost goes. Like the single kernel it uses no atomics and never waits on
another program. Each branch's main loop has its own pipelined operand buffers in shared memory (sm_90
builds: twice the single kernel's at the same config), so the pair's configs are pruned for twice the
stages (:mod:`lancet_rt.kernels._gemm_space`).
"""

import triton
import triton.language as tl

from ._grouped_gemm_kernels import _dot, _mapped_rows, _swizzle


@triton.jit
def _added(a, b, DTYPE: tl.constexpr):
    """a + b for two DTYPE tiles, as PyTorch adds them: in float32, then rounded to DTYPE to nearest,
    ties to even. bfloat16 is rounded on the bits: the CPU interpreter's float32 -> bfloat16 cast
    truncates (and its "rtne" rounds ties up), while PyTorch's ``a + b`` rounds to even; a NaN gives
    PyTorch's quiet NaN (0x7FC0)."""
    s = a.to(tl.float32) + b.to(tl.float32)
    if DTYPE == tl.bfloat16:
        u = s.to(tl.uint32, bitcast=True)
        hi = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        hi = tl.where(s != s, 0x7FC0, hi)
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return s.to(DTYPE)


@triton.jit
def _dw_tile(
    pid,
    dy_ptr,
    x_ptr,
    dw_ptr,
    offsets_ptr,
    dyr_ptr,
    xr_ptr,
    R,
    N,
    K,
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_dwe,
    stride_dwn,
    stride_dwk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    TILE_I64: tl.constexpr,
    GATHER_DY: tl.constexpr,
    GATHER_X: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """Output tile ``pid`` (experts outermost) of one dW problem: the whole per-tile computation of
    _grouped_gemm_dw_kernel, shared with _grouped_gemm_dw_pair_kernel so both give the same bits."""
    # -- phase 1: map the program to (expert, N tile, K tile) and load its segment bounds --
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    tiles_per_expert = num_pid_n * num_pid_k
    expert = pid // tiles_per_expert  # experts outermost: one expert's rows stay hot in L2
    pid_n, pid_k = _swizzle(pid % tiles_per_expert, num_pid_n, num_pid_k, GROUP_M)

    row_start = tl.load(offsets_ptr + expert).to(tl.int32)
    row_end = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    row_start = tl.minimum(tl.maximum(row_start, 0), R)
    row_end = tl.maximum(tl.minimum(row_end, R), row_start)

    # -- phase 2: offsets and pointers over the segment's rows --
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

    # -- phase 3: reduce over the segment's rows, BLOCK_M per step --
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m in range(0, tl.cdiv(row_end - row_start, BLOCK_M)):
        mask_m = offs_m < row_end - row_start - m * BLOCK_M
        if GATHER_DY:  # this step's rows of dy through the row map
            dy_rows = _mapped_rows(dyr_ptr, row_start + m * BLOCK_M + offs_m, mask_m, R, True)
            dy_ptrs = dy_ptr + dy_rows[None, :] * stride_dym + offs_yn.to(tl.int64)[:, None] * stride_dyn
        if GATHER_X:
            x_rows = _mapped_rows(xr_ptr, row_start + m * BLOCK_M + offs_m, mask_m, R, True)
            x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_xk.to(tl.int64)[None, :] * stride_xk
        b_dyt = tl.load(dy_ptrs, mask=mask_m[None, :], other=0.0)
        b_x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        acc = _dot(b_dyt, b_x, acc, INPUT_PRECISION, DOT_FP32)
        dy_ptrs += dy_step
        x_ptrs += x_step

    # -- phase 4: masked store of the [BN, BK] tile (zeros for an empty segment) --
    dw_ptrs = (
        dw_ptr
        + expert.to(tl.int64) * stride_dwe
        + offs_n.to(tl.int64)[:, None] * stride_dwn
        + offs_k.to(tl.int64)[None, :] * stride_dwk
    )
    mask_out = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    b_dw = acc.to(dw_ptr.dtype.element_ty)  # (rounded as an overwriting launch stores it)
    if ACCUMULATE:
        b_dw = _added(tl.load(dw_ptrs, mask=mask_out, other=0.0), b_dw, dw_ptr.dtype.element_ty)
    tl.store(dw_ptrs, b_dw, mask=mask_out)


@triton.jit(do_not_specialize=["R"])  # row counts: one compiled variant for any chunk
def _grouped_gemm_dw_kernel(
    # pointers
    dy_ptr,  # [R, N] output gradient, rows grouped by expert
    x_ptr,  # [R, K] forward input
    dw_ptr,  # [E, N, K] output: dw[e] = dy_seg.T @ x_seg (added to it with ACCUMULATE), x's dtype
    offsets_ptr,  # [E + 1] int32/int64 segment bounds
    dyr_ptr,  # [R] int32/int64 row map of dy (read only with GATHER_DY): grouped row g is dy[dyr[g]]
    xr_ptr,  # [R] int32/int64 row map of x (read only with GATHER_X): grouped row g is x[xr[g]]
    # sizes
    R,
    N,
    K,
    E,
    M_BUCKET,  # autotune key only
    # strides
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_dwe,
    stride_dwn,
    stride_dwk,
    # meta-parameters: the output tile is BLOCK_N x BLOCK_K; BLOCK_M rows are reduced per step
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    TILE_I64: tl.constexpr = False,  # BLOCK_M x a row stride reaches 2^31: row steps in int64
    GATHER_DY: tl.constexpr = False,  # dy's rows through dyr
    GATHER_X: tl.constexpr = False,  # x's rows through xr
    ACCUMULATE: tl.constexpr = False,  # dw += the tile rounded to dw's dtype (dw's old value read)
):
    """dw[e, n, k] = sum over rows r of segment e of dy[r, n] * x[r, k]; zeros for an empty segment
    (r a grouped row; dy's and x's rows through their row maps where given). With ACCUMULATE, dw[e, n, k]
    becomes round(dw[e, n, k] + round(that sum)) instead: the two gradients' sum in dw's dtype, as
    ``a + b`` in PyTorch gives it (both rounded to dw's dtype, added in float32, rounded once)."""
    _dw_tile(
        tl.program_id(0),
        dy_ptr,
        x_ptr,
        dw_ptr,
        offsets_ptr,
        dyr_ptr,
        xr_ptr,
        R,
        N,
        K,
        stride_dym,
        stride_dyn,
        stride_xm,
        stride_xk,
        stride_dwe,
        stride_dwn,
        stride_dwk,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        GROUP_M,
        INPUT_PRECISION,
        DOT_FP32,
        TILE_I64,
        GATHER_DY,
        GATHER_X,
        ACCUMULATE,
    )


@triton.jit(do_not_specialize=["R"])  # row counts: one compiled variant for any chunk
def _grouped_gemm_dw_pair_kernel(
    # pointers: problem A (dw = dy_seg.T @ x_seg), then problem B (dwb = dyb_seg.T @ xb_seg)
    dy_ptr,  # [R, N] A's output gradient
    x_ptr,  # [R, K] A's forward input
    dw_ptr,  # [E, N, K] A's output, x's dtype
    dyb_ptr,  # [R, N_B] B's output gradient
    xb_ptr,  # [R, K_B] B's forward input
    dwb_ptr,  # [E, N_B, K_B] B's output, x's dtype
    offsets_ptr,  # [E + 1] int32/int64 segment bounds, the same for both problems
    dyr_ptr,  # [R] row map of dy (GATHER_DY)
    xr_ptr,  # [R] row map of x (GATHER_X)
    dybr_ptr,  # [R] row map of dyb (GATHER_DY_B)
    xbr_ptr,  # [R] row map of xb (GATHER_X_B)
    # sizes
    R,
    N,
    K,
    N_B,
    K_B,
    E,
    M_BUCKET,  # autotune key only
    # strides
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_dwe,
    stride_dwn,
    stride_dwk,
    stride_dybm,
    stride_dybn,
    stride_xbm,
    stride_xbk,
    stride_dwbe,
    stride_dwbn,
    stride_dwbk,
    # meta-parameters: one tile config for both problems (BLOCK_N x BLOCK_K output tiles, BLOCK_M rows a step)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    TILE_I64: tl.constexpr = False,  # A's row steps in int64
    TILE_I64_B: tl.constexpr = False,  # B's row steps in int64
    GATHER_DY: tl.constexpr = False,
    GATHER_X: tl.constexpr = False,
    GATHER_DY_B: tl.constexpr = False,
    GATHER_X_B: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = False,  # A: dw += its tile
    ACCUMULATE_B: tl.constexpr = False,  # B: dwb += its tile
):
    """Two dW problems over the same row segments in one grid: programs [0, E * tiles(N, K)) compute
    A's tiles, the rest B's, each exactly as _grouped_gemm_dw_kernel would (the same _dw_tile)."""
    pid = tl.program_id(0)
    tiles_a = E * tl.cdiv(N, BLOCK_N) * tl.cdiv(K, BLOCK_K)
    if pid < tiles_a:
        _dw_tile(
            pid,
            dy_ptr,
            x_ptr,
            dw_ptr,
            offsets_ptr,
            dyr_ptr,
            xr_ptr,
            R,
            N,
            K,
            stride_dym,
            stride_dyn,
            stride_xm,
            stride_xk,
            stride_dwe,
            stride_dwn,
            stride_dwk,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            GROUP_M,
            INPUT_PRECISION,
            DOT_FP32,
            TILE_I64,
            GATHER_DY,
            GATHER_X,
            ACCUMULATE,
        )
    else:
        _dw_tile(
            pid - tiles_a,
            dyb_ptr,
            xb_ptr,
            dwb_ptr,
            offsets_ptr,
            dybr_ptr,
            xbr_ptr,
            R,
            N_B,
            K_B,
            stride_dybm,
            stride_dybn,
            stride_xbm,
            stride_xbk,
            stride_dwbe,
            stride_dwbn,
            stride_dwbk,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            GROUP_M,
            INPUT_PRECISION,
            DOT_FP32,
            TILE_I64_B,
            GATHER_DY_B,
            GATHER_X_B,
            ACCUMULATE_B,
        )
