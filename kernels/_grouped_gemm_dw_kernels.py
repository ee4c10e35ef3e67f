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
[0, E * tiles(A)) own problem A's output tiles, the rest problem B's. A program picks its problem at
run time (its pid against A's tile count) and takes that problem's operands, output, sizes, strides
and row map as runtime values, then runs the single kernel's tile computation (``_dw_tile``): the same
loads, tl.dot sequence over the same tiles and epilogue, so at the same tile config both results are
bit for bit those of the two launches; one config serves both (tuned on both problems' sizes, pinned
by dW's variable).

Why one tile loop: a kernel that called the tile code in two branches, one per problem with its own
compile-time flags, got one main loop per branch, and on sm_90 Triton gives each main loop its own
pipelined operand buffers in shared memory: twice a dW's, which pushed the pair off dW's bf16 tiles.
One loop needs one dW's shared memory (``bench.kernels.compile_check``: the same bytes as the single
kernel at each config), so the pair's config space and default are dW's. What differs between the
problems is therefore a runtime value: the row maps too. The experts map exactly one operand per
problem when their rows come in received order (the lancet layout gate_up's x and down's dy, GPT-OSS's
the other two), so each problem has at most one map and a runtime choice of the operand it maps
(``MAP``: none, dy or x); the unmapped operand reads the grouped rows themselves (a ``tl.where`` with
the map's masked load), and without any map (``HAS_ROWS`` false) none of that is compiled. The kernel
thus takes one element dtype, one ``accumulate`` and one map dtype for both problems; the launcher runs
other arguments (or a problem with both operands mapped) as the two launches.

It moves the bytes the two launches move: each program reads its expert's rows of its problem's two
operands (the columns of its tile) and writes its tile once (reading it first with ``accumulate``);
only the second launch's fixed host cost goes. Like the single kernel it uses no atomics and never
waits on another program.
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
    map_ptr,
    map_which,
    HAS_MAP: tl.constexpr,
):
    """Output tile ``pid`` (experts outermost) of one dW problem: the whole per-tile computation of
    _grouped_gemm_dw_kernel, shared with _grouped_gemm_dw_pair_kernel so both give the same bits.
    With HAS_MAP (the pair) one operand's rows go through ``map_ptr``, which one chosen at run time
    (``map_which``: 0 neither, 1 dy's, 2 x's); the other's are the grouped rows themselves."""
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
        if HAS_MAP:  # the same rows as the gathers above, the mapped operand picked at run time
            grouped = row_start + m * BLOCK_M + offs_m
            mapped = _mapped_rows(map_ptr, grouped, tl.where(map_which != 0, mask_m, False), R, True)
            dy_rows = tl.where(map_which == 1, mapped, grouped.to(tl.int64))
            x_rows = tl.where(map_which == 2, mapped, grouped.to(tl.int64))
            dy_ptrs = dy_ptr + dy_rows[None, :] * stride_dym + offs_yn.to(tl.int64)[:, None] * stride_dyn
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
        offsets_ptr,  # (no pair row map)
        0,
        False,
    )


@triton.jit(do_not_specialize=["R", "MAP", "MAP_B"])  # one compiled variant for any chunk and maps
def _grouped_gemm_dw_pair_kernel(
    # pointers: problem A (dw = dy_seg.T @ x_seg), then problem B (dwb = dyb_seg.T @ xb_seg), one dtype
    dy_ptr,  # [R, N] A's output gradient
    x_ptr,  # [R, K] A's forward input
    dw_ptr,  # [E, N, K] A's output, x's dtype
    dyb_ptr,  # [R, N_B] B's output gradient
    xb_ptr,  # [R, K_B] B's forward input
    dwb_ptr,  # [E, N_B, K_B] B's output, x's dtype
    offsets_ptr,  # [E + 1] int32/int64 segment bounds, the same for both problems
    rows_ptr,  # [R] A's row map (read only with HAS_ROWS and MAP != 0)
    rowsb_ptr,  # [R] B's row map, rows_ptr's dtype (read only with HAS_ROWS and MAP_B != 0)
    # sizes
    R,
    N,
    K,
    N_B,
    K_B,
    E,
    M_BUCKET,  # autotune key only
    MAP,  # A's mapped operand: 0 none, 1 dy, 2 x
    MAP_B,  # B's
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
    TILE_I64: tl.constexpr = False,  # either problem's row steps reach 2^31: row steps in int64
    HAS_ROWS: tl.constexpr = False,  # a problem has a row map (MAP or MAP_B not 0)
    ACCUMULATE: tl.constexpr = False,  # both problems: dw += its tile
):
    """Two dW problems over the same row segments in one grid: programs [0, E * tiles(N, K)) compute
    A's tiles, the rest B's. Each program picks its problem at run time (its pointers, sizes, strides
    and mapped operand) and runs the one tile computation, _dw_tile, as _grouped_gemm_dw_kernel does:
    one main loop, so one dW's shared memory."""
    pid = tl.program_id(0)
    tiles_a = E * tl.cdiv(N, BLOCK_N) * tl.cdiv(K, BLOCK_K)
    in_b = pid >= tiles_a
    if in_b:
        tile = pid - tiles_a
        dy, x, dw, rows = dyb_ptr, xb_ptr, dwb_ptr, rowsb_ptr
    else:
        tile = pid
        dy, x, dw, rows = dy_ptr, x_ptr, dw_ptr, rows_ptr
    _dw_tile(
        tile,
        dy,
        x,
        dw,
        offsets_ptr,
        rows,
        rows,
        R,
        tl.where(in_b, N_B, N),
        tl.where(in_b, K_B, K),
        tl.where(in_b, stride_dybm, stride_dym),
        tl.where(in_b, stride_dybn, stride_dyn),
        tl.where(in_b, stride_xbm, stride_xm),
        tl.where(in_b, stride_xbk, stride_xk),
        tl.where(in_b, stride_dwbe, stride_dwe),
        tl.where(in_b, stride_dwbn, stride_dwn),
        tl.where(in_b, stride_dwbk, stride_dwk),
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        GROUP_M,
        INPUT_PRECISION,
        DOT_FP32,
        TILE_I64,
        False,
        False,
        ACCUMULATE,
        rows,
        tl.where(in_b, MAP_B, MAP),
        HAS_ROWS,
    )
