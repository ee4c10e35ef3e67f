"""Grouped GEMM kernels: the Triton programs behind :mod:`lancet_rt.kernels.grouped_gemm`.

The launchers, their configs and the heuristics that pick each kernel variant live in
:mod:`lancet_rt.kernels.grouped_gemm`; the shapes and names below are the launchers'.

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

*Row maps* (``GATHER_X``, ``SCATTER_Y``; in dW ``GATHER_DY``, ``GATHER_X``). The tiles walk the rows
in grouped (expert-major) order; a row map lets an operand or the output keep another row order: grouped
row g loads operand row ``rows[g]`` or stores to output row ``rows[g]``. The experts receive their rows
in rank-major order and return them so, and the map between the two orders is a permutation the
dispatch made on the device: read through it, the regrouping costs no copy. Only addresses change, so
the results are those of the kernels on the regrouped rows, bit for bit. The map is trusted to be a
permutation of [0, R) (checking would need a host sync); its entries are clamped to [0, R) so a bad map
cannot fault.

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
128 x 128 tile with bias and "swiglu_oai", counts per Triton version in bench/results/HISTORY.md; one block
per SM either way, as its 144 KiB of shared memory allow), and fp32 configs are capped at 64
accumulator registers (:mod:`lancet_rt.kernels._gemm_space`).

*Fused activation gradient* (``grouped_mm_dx`` with ``gu_R2F``, ``GLU_GRAD``). The down projection's dX
is dH, which only the activation's gradient reads: the epilogue rounds the dH tile to the output dtype
(as a stored dH would be), loads the tile's gate and up columns of the saved gu and stores
``swiglu_bwd(gu, dH)`` into dgu instead, with the elementwise kernel's own arithmetic (``_glu_grad``),
so dgu is the two launches' bit for bit, without dH's buffer or its second pass.

*Bias gradient* (``segment_sum``, :mod:`lancet_rt.kernels.segment_sum`): per-expert sums of the output gradient's
rows, one deterministic launch.

*Weight gradients* (``grouped_mm_dw``, ``grouped_mm_dw_pair``): reductions over each segment's rows,
in :mod:`lancet_rt.kernels._grouped_gemm_dw_kernels` (with the helpers here).

All kernels accumulate in fp32 and write the input dtype (bf16, fp16 or fp32). fp32 inputs use exact
fp32 products by default (``allow_tf32=False``, ``input_precision="ieee"``) so they match an fp32
reference tightly; pass ``allow_tf32=True`` for the tensor-core rate at about 1e-3 relative error.
Index x stride products are formed in int64 (R * N and E * N * K pass 2^31 at real sizes, and so
can N * R through a column-major view). Products bounded by a tile, the in-tile reduction offsets
(< BLOCK_K) and the per-step pointer increments (BLOCK_K or BLOCK_M times a stride), stay int32 unless
that bound reaches 2^31 (a column-major x with millions of rows, say), when the ``TILE_I64``
heuristic switches them to int64: always in int64, they made the fp32 TF32 dx kernel at 128 x 128 x 32
(4 warps) spill and its dW need more registers (``python -m bench.kernels.compile_check --all-configs``;
figures in bench/results/HISTORY.md). Masks stay int32.

"""

import triton
import triton.language as tl


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
def _mapped_rows(rows_ptr, offs_m, mask_m, R, MAPPED: tl.constexpr):
    """int64 rows of the grouped rows offs_m: through the row map (clamped to [0, R)) if MAPPED."""
    if MAPPED:
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        return tl.minimum(tl.maximum(rows, 0), R - 1)
    return offs_m.to(tl.int64)


@triton.jit
def _k_loop(
    acc,
    x_ptrs,
    w_ptrs,
    x_step,
    w_step,
    mask_m,
    offs_k,
    K,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
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
    # -- phase 1: load the segment bounds (clamped) and count each segment's M tiles --
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
    # -- phase 2: find the expert owning tile pid_m, and the tile's rows --
    # Experts whose tiles all come before pid_m; empty experts are counted with their predecessor.
    expert = tl.sum((b_tiles_end <= pid_m).to(tl.int32), axis=0)
    sel = offs_e == expert
    first_tile = tl.sum(tl.where(sel, b_tiles_end - b_tiles, 0), axis=0)
    seg_start = tl.sum(tl.where(sel, b_start, 0), axis=0)
    row_end = tl.sum(tl.where(sel, b_end, 0), axis=0)
    row_start = seg_start + (pid_m - first_tile) * BLOCK_M
    return expert, row_start, row_end, num_tiles


@triton.jit(do_not_specialize=["R"])  # row counts: one compiled variant for any chunk
def _grouped_gemm_fwd_kernel(
    # pointers
    x_ptr,  # [R, K] rows grouped by expert
    w_ptr,  # [E, N, K] as seen through (stride_wn, stride_wk): w[e, n, k]
    b_ptr,  # [E, N] bias (read only with HAS_BIAS)
    y_ptr,  # [R, N] output, x's dtype
    offsets_ptr,  # [E + 1] int32/int64 segment bounds
    xr_ptr,  # [R] int32/int64 row map of x (read only with GATHER_X): grouped row g is x[xr[g]]
    yr_ptr,  # [R] int32/int64 row map of y (read only with SCATTER_Y): grouped row g goes to y[yr[g]]
    gu_ptr,  # [R, 2N] grouped pre-activation (read only with GLU_GRAD; y is then its gradient dgu)
    # sizes
    R,
    N,
    K,
    E,
    M_BUCKET,  # autotune key only: power-of-two bucket of the mean rows per expert
    # activation constants (GLU_GRAD with "swiglu_oai" only)
    alpha,
    limit,
    # strides
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_ym,
    stride_yn,
    stride_gm,
    stride_gf,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next power of two >= E
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks in the main loop
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" (fp32 inputs only)
    DOT_FP32: tl.constexpr,  # interpreter-only bf16 workaround, see _dot
    HAS_BIAS: tl.constexpr = False,  # add b[e] to the fp32 accumulator before rounding
    TILE_I64: tl.constexpr = False,  # BLOCK_K x a K stride reaches 2^31: in-tile K offsets, K steps in int64
    GATHER_X: tl.constexpr = False,  # x's rows through xr
    SCATTER_Y: tl.constexpr = False,  # y's rows through yr
    GLU_GRAD: tl.constexpr = False,  # the product is dH: store dgu = the activation's gradient into y
    INTERLEAVED: tl.constexpr = False,  # (GLU_GRAD) gu's gate and up columns alternate
    ACTIVATION: tl.constexpr = "swiglu",  # (GLU_GRAD) see _glu_grad
):
    """y[r, n] = sum_k x[r, k] * w[e(r), n, k] (+ b[e(r), n]), one BLOCK_M x BLOCK_N tile per program
    (r a grouped row; x's and y's rows through their row maps where given)."""
    # -- phase 1: map the program to (expert, M tile, N tile); exit past the real tiles --
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(R, BLOCK_M) + E - 1  # upper bound on sum_e cdiv(n_e, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    expert, row_start, row_end, num_tiles = _segment_tile(offsets_ptr, pid_m, R, E, BLOCK_M, BLOCK_E)
    if pid_m >= num_tiles:
        return

    # -- phase 2: row, column and reduction offsets, operand pointers --
    offs_m = row_start + tl.arange(0, BLOCK_M)  # rows of x and y
    mask_m = offs_m < row_end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapped column index: weight loads stay in bounds without a mask; the store masks instead.
    offs_wn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)

    # Index x stride products in int64; those bounded by BLOCK_K x a stride where needed (module docstring).
    offs_kk = offs_k.to(tl.int64) if TILE_I64 else offs_k
    x_rows = _mapped_rows(xr_ptr, offs_m, mask_m, R, GATHER_X)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_kk[None, :] * stride_xk  # [BM, BK]
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + offs_kk[:, None] * stride_wk
        + offs_wn.to(tl.int64)[None, :] * stride_wn
    )  # [BK, BN]
    x_step = (tl.cast(stride_xk, tl.int64) if TILE_I64 else stride_xk) * BLOCK_K
    w_step = (tl.cast(stride_wk, tl.int64) if TILE_I64 else stride_wk) * BLOCK_K

    # -- phase 3: main loop over the reduction --
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _k_loop(acc, x_ptrs, w_ptrs, x_step, w_step, mask_m, offs_k, K, BLOCK_K, EVEN_K, INPUT_PRECISION, DOT_FP32)

    # -- phase 4: epilogue: bias, one rounding, masked store --
    if HAS_BIAS:
        b_b = tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_wn.to(tl.int64) * stride_bn)
        acc += b_b.to(tl.float32)[None, :]
    mask_out = mask_m[:, None] & (offs_n[None, :] < N)
    if GLU_GRAD:  # (grouped rows: dgu and gu are kept for the weight gradients)
        _glu_grad_epilogue(
            acc,
            gu_ptr,
            y_ptr,
            offs_m,
            offs_n,
            mask_out,
            N,
            alpha,
            limit,
            stride_gm,
            stride_gf,
            stride_ym,
            stride_yn,
            INTERLEAVED,
            ACTIVATION,
        )
    else:
        y_rows = _mapped_rows(yr_ptr, offs_m, mask_m, R, SCATTER_Y)
        y_ptrs = y_ptr + y_rows[:, None] * stride_ym + offs_n.to(tl.int64)[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_out)


@triton.jit
def _glu(g, u, alpha, limit, ACTIVATION: tl.constexpr):
    """The activation of fp32 gate and up values: "swiglu" silu(g) * u, or "swiglu_oai" (GPT-OSS)
    (clamp(u, -limit, limit) + 1) * gc * sigmoid(alpha * gc) with gc = min(g, limit). The clamps
    propagate NaN, as torch.clamp does."""
    if ACTIVATION == "swiglu_oai":
        gc = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        uc = tl.maximum(
            tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL), -limit, propagate_nan=tl.PropagateNan.ALL
        )
        h = (uc + 1.0) * (gc / (1.0 + tl.exp(-alpha * gc)))
    else:
        h = g / (1.0 + tl.exp(-g)) * u
    return h


@triton.jit
def _glu_grad(g, u, dh, alpha, limit, ACTIVATION: tl.constexpr):
    """(dgate, dup) of fp32 gate and up values and the gradient dh of the activation (_glu), in fp32.
    "swiglu": dgate = dh * u * s * (1 + g * (1 - s)), dup = dh * g * s with s = sigmoid(g).
    "swiglu_oai", with gc = min(g, limit), uc = clamp(u, -limit, limit), s = sigmoid(alpha * gc):
    dgate = dh * (uc + 1) * s * (1 + alpha * gc * (1 - s)) where g <= limit, else 0;
    dup = dh * gc * s where -limit <= u <= limit, else 0 (torch.clamp's gradient)."""
    if ACTIVATION == "swiglu_oai":
        gc = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        uc = tl.maximum(
            tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL), -limit, propagate_nan=tl.PropagateNan.ALL
        )
        s = 1.0 / (1.0 + tl.exp(-alpha * gc))
        dg = tl.where(g <= limit, dh * (uc + 1.0) * s * (1.0 + alpha * gc * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dh * gc * s, 0.0)
    else:
        s = 1.0 / (1.0 + tl.exp(-g))
        dg = dh * u * s * (1.0 + g * (1.0 - s))
        du = dh * g * s
    return dg, du


@triton.jit
def _glu_grad_epilogue(
    acc,
    gu_ptr,
    dgu_ptr,
    offs_m,
    offs_n,
    mask_out,
    F,
    alpha,
    limit,
    stride_gm,
    stride_gf,
    stride_dgm,
    stride_dgf,
    INTERLEAVED: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    """Store the activation's gradient of the dH tile ``acc`` (rows offs_m, columns offs_n of h) into
    dgu: dH rounded to dgu's dtype, gate and up read from gu (columns j and F + j, or 2j and 2j + 1)."""
    out_ty = dgu_ptr.dtype.element_ty
    dh = acc.to(out_ty).to(tl.float32)
    offs_n64 = offs_n.to(tl.int64)
    gate_col = 2 * offs_n64 if INTERLEAVED else offs_n64
    up_col = 2 * offs_n64 + 1 if INTERLEAVED else offs_n64 + F
    gu_rows = gu_ptr + offs_m.to(tl.int64)[:, None] * stride_gm
    g = tl.load(gu_rows + gate_col[None, :] * stride_gf, mask=mask_out, other=0.0).to(tl.float32)
    u = tl.load(gu_rows + up_col[None, :] * stride_gf, mask=mask_out, other=0.0).to(tl.float32)
    dg, du = _glu_grad(g, u, dh, alpha, limit, ACTIVATION)
    dgu_rows = dgu_ptr + offs_m.to(tl.int64)[:, None] * stride_dgm
    tl.store(dgu_rows + gate_col[None, :] * stride_dgf, dg.to(out_ty), mask=mask_out)
    tl.store(dgu_rows + up_col[None, :] * stride_dgf, du.to(out_ty), mask=mask_out)


@triton.jit(do_not_specialize=["R"])  # row counts: one compiled variant for any chunk
def _gate_up_swiglu_fwd_kernel(
    # pointers
    x_ptr,  # [R, D] rows grouped by expert
    w_ptr,  # [E, 2F, D] gate rows [0, F), up rows [F, 2F); INTERLEAVED: gate rows 2j, up rows 2j + 1
    b_ptr,  # [E, 2F] bias in w's row order (read only with HAS_BIAS)
    h_ptr,  # [R, F] output: the activation
    gu_ptr,  # [R, 2F] output: the pre-activation in w's row order, kept for backward
    offsets_ptr,  # [E + 1] int32/int64 segment bounds
    xr_ptr,  # [R] int32/int64 row map of x (read only with GATHER_X): grouped row g is x[xr[g]]
    # sizes
    R,
    F,
    D,
    E,
    M_BUCKET,  # autotune key only
    # activation constants ("swiglu_oai" only)
    alpha,
    limit,
    # strides
    stride_xm,
    stride_xd,
    stride_we,
    stride_wf,
    stride_wd,
    stride_be,
    stride_bf,
    stride_hm,
    stride_hf,
    stride_gm,
    stride_gf,
    # meta-parameters (BLOCK_N tiles F, BLOCK_K tiles D)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False,  # gate and up alternate along 2F (the GPT-OSS layout)
    ACTIVATION: tl.constexpr = "swiglu",  # or "swiglu_oai", see _glu
    TILE_I64: tl.constexpr = False,
    GATHER_X: tl.constexpr = False,  # x's rows through xr (h and gu stay in grouped order)
):
    """gu = x @ w[e].T (+ b[e]) over one tile of h's columns j and their gate and up columns of gu,
    h[:, j] = act(gate_j, up_j)."""
    # -- phase 1: map the program to (expert, M tile, N tile); exit past the real tiles --
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(R, BLOCK_M) + E - 1
    num_pid_n = tl.cdiv(F, BLOCK_N)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    expert, row_start, row_end, num_tiles = _segment_tile(offsets_ptr, pid_m, R, E, BLOCK_M, BLOCK_E)
    if pid_m >= num_tiles:
        return

    # -- phase 2: row, column and reduction offsets, operand pointers --
    offs_m = row_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns j of h (and of the gate half of gu)
    offs_k = tl.arange(0, BLOCK_K)

    offs_kk = offs_k.to(tl.int64) if TILE_I64 else offs_k
    x_rows = _mapped_rows(xr_ptr, offs_m, mask_m, R, GATHER_X)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_kk[None, :] * stride_xd  # [BM, BK]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_kk[:, None] * stride_wd
    x_step = (tl.cast(stride_xd, tl.int64) if TILE_I64 else stride_xd) * BLOCK_K
    w_step = (tl.cast(stride_wd, tl.int64) if TILE_I64 else stride_wd) * BLOCK_K
    out_ty = gu_ptr.dtype.element_ty

    # -- phase 3: gate and up GEMMs with their bias; store gu (interleaved: one wide tile) --
    if INTERLEAVED:
        # Gate and up of columns j are the adjacent rows 2j, 2j + 1 of w: one [BK, 2 BN] weight tile
        # and one [BM, 2 BN] accumulator cover both (a plain GEMM over gu's columns), split in the epilogue.
        offs_c = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)  # columns of gu
        offs_wc = offs_c % (2 * F)
        wc_ptrs = w_ptrs + offs_wc.to(tl.int64)[None, :] * stride_wf  # [BK, 2 BN]
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        acc = _k_loop(
            acc, x_ptrs, wc_ptrs, x_step, w_step, mask_m, offs_k, D, BLOCK_K, EVEN_K, INPUT_PRECISION, DOT_FP32
        )
        if HAS_BIAS:
            b_b = tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_wc.to(tl.int64) * stride_bf)
            acc += b_b.to(tl.float32)[None, :]
        b_gu = acc.to(out_ty)
        gu_rows = gu_ptr + offs_m.to(tl.int64)[:, None] * stride_gm
        tl.store(
            gu_rows + offs_c.to(tl.int64)[None, :] * stride_gf, b_gu, mask=mask_m[:, None] & (offs_c[None, :] < 2 * F)
        )
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

    # -- phase 4: the activation of the rounded gate and up; store h --
    # h from the rounded gu (both branches), so h is swiglu_fwd_ref(gu) of the stored gu.
    b_h = _glu(g, u, alpha, limit, ACTIVATION)
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n.to(tl.int64)[None, :] * stride_hf
    tl.store(h_ptrs, b_h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n[None, :] < F))
