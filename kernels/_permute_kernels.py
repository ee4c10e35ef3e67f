"""Permute kernels: the Triton programs behind :mod:`lancet_rt.kernels.permute` and their config spaces.

What each kernel computes, the bytes it moves and how its configs are pruned and pinned is in
:mod:`lancet_rt.kernels.permute`, whose launchers are the only callers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import interpreting, pinned_config

_ENV_PERMUTE_FWD_CONFIG = "LANCET_PERMUTE_FWD_CONFIG"
_ENV_UNPERMUTE_FWD_CONFIG = "LANCET_UNPERMUTE_FWD_CONFIG"
_ENV_UNPERMUTE_BWD_CONFIG = "LANCET_UNPERMUTE_BWD_CONFIG"


# ----------------------------------------------------------------------------------------------
# Config spaces
# ----------------------------------------------------------------------------------------------


def _row_tile_configs():
    """Every BLOCK_T x BLOCK_D x num_warps candidate; the prune keeps those that fit D."""
    return [
        triton.Config({"BLOCK_T": bt, "BLOCK_D": bd}, num_warps=nw)
        for bt in (1, 2, 4, 8, 16, 32)
        for bd in (64, 128, 256, 512, 1024, 2048)
        for nw in (4, 8)
    ]


def _row_tile_keep(config: triton.Config, D: int) -> bool:
    """Keep D tiles no wider than the row and no narrower than min(row, 512), at 8..16 elements
    per thread."""
    bt, bd = config.kwargs["BLOCK_T"], config.kwargs["BLOCK_D"]
    d2 = max(triton.next_power_of_2(D), 64)
    per_thread = bt * bd / (32 * config.num_warps)
    return min(d2, 512) <= bd <= d2 and 8 <= per_thread <= 16


def _row_tile_prune(env_var):
    """The early prune of the row-tile config space: the pinned config (``env_var``) if any, else the
    tiles that fit ``_row_tile_keep``, one of them under the interpreter."""

    def prune(configs, named_args, **kwargs):
        pinned = pinned_config(env_var)
        if pinned is not None:
            return [pinned]
        D = named_args["D"]
        kept = [c for c in configs if _row_tile_keep(c, D)] or [configs[0]]
        if interpreting():  # untimed: fewest programs, fewest interpreted ops
            return [max(kept, key=lambda c: (c.kwargs["BLOCK_T"] * c.kwargs["BLOCK_D"], -c.num_warps))]
        return kept

    return prune


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_row_tile_configs(),
    key=["D", "K"],
    prune_configs_by={"early_config_prune": _row_tile_prune(_ENV_PERMUTE_FWD_CONFIG)},
)
@triton.jit(do_not_specialize=["T", "S"])  # row counts: one compiled variant for any chunk
def _permute_fwd_kernel(
    # Pointers
    x_ptr,  # [T, D] tokens (strided)
    row_ptr,  # [T, K] int32 dispatch row of each assignment, -1 when dropped (contiguous)
    x_out_ptr,  # [S, D] out: rows in dispatch order (contiguous)
    src_ptr,  # [S] int32 out: flat assignment t * K + k of each row (unused without HAS_SRC)
    # Sizes
    T,
    D,
    K,
    S,
    # Strides
    stride_xt,
    stride_xd,
    # Meta-parameters
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SRC: tl.constexpr,
):
    # -- phase 1: the program's [BLOCK_T, BLOCK_D] tile of tokens, loaded once --
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_d = offs_d < D
    offs_t64 = offs_t.to(tl.int64)

    b_x = tl.load(
        x_ptr + offs_t64[:, None] * stride_xt + offs_d[None, :] * stride_xd, mask=mask_t[:, None] & mask_d[None, :]
    )
    # -- phase 2: scatter the tile to each kept assignment's row (one writer per row), and src_S --
    mask_src = (tl.zeros([BLOCK_T], dtype=tl.int32) + pid_d) == 0  # src_S: written by the first D tile
    for k in range(K):
        b_row = tl.load(row_ptr + offs_t64 * K + k, mask=mask_t, other=-1)
        mask_r = (b_row >= 0) & (b_row < S)
        tl.store(
            x_out_ptr + b_row.to(tl.int64)[:, None] * D + offs_d[None, :], b_x, mask=mask_r[:, None] & mask_d[None, :]
        )
        if HAS_SRC:
            tl.store(src_ptr + b_row, offs_t * K + k, mask=mask_r & mask_src)


@triton.autotune(
    configs=_row_tile_configs(),
    key=["D", "K"],
    prune_configs_by={"early_config_prune": _row_tile_prune(_ENV_UNPERMUTE_FWD_CONFIG)},
)
@triton.jit(do_not_specialize=["T", "S"])  # row counts: one compiled variant for any chunk
def _unpermute_fwd_kernel(
    # Pointers
    y_ptr,  # [S, D] rows in dispatch order (strided)
    row_ptr,  # [T, K] int32 dispatch row of each assignment, -1 when dropped (contiguous)
    weight_ptr,  # [T, K] combine weights (strided; read only when HAS_WEIGHT)
    out_ptr,  # [T, D] out: sum over kept k of weight * row (contiguous)
    # Sizes
    T,
    D,
    K,
    S,
    # Strides
    stride_ys,
    stride_yd,
    stride_wt,
    stride_wk,
    # Meta-parameters
    HAS_WEIGHT: tl.constexpr,  # False: permute_bwd (unit weights)
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # -- phase 1: the program's [BLOCK_T, BLOCK_D] output tile --
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_d = offs_d < D
    offs_t64 = offs_t.to(tl.int64)

    # -- phase 2: gather the kept rows, in k order, and sum them (weighted) in float32 --
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in range(K):
        b_row = tl.load(row_ptr + offs_t64 * K + k, mask=mask_t, other=-1)
        mask_r = (b_row >= 0) & (b_row < S)
        b_y = tl.load(
            y_ptr + b_row.to(tl.int64)[:, None] * stride_ys + offs_d[None, :] * stride_yd,
            mask=mask_r[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_WEIGHT:
            b_w = tl.load(weight_ptr + offs_t64 * stride_wt + k * stride_wk, mask=mask_r, other=0.0)
            acc += b_w.to(tl.float32)[:, None] * b_y
        else:
            acc += b_y
    # -- phase 3: one store in the output dtype --
    tl.store(
        out_ptr + offs_t64[:, None] * D + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_d[None, :],
    )


@triton.autotune(
    configs=_row_tile_configs(),
    key=["D", "K"],
    prune_configs_by={"early_config_prune": _row_tile_prune(_ENV_UNPERMUTE_BWD_CONFIG)},
)
@triton.jit(do_not_specialize=["T", "S"])  # row counts: one compiled variant for any chunk
def _unpermute_bwd_kernel(
    # Pointers
    grad_y_ptr,  # [T, D] gradient of the combined output (strided)
    y_ptr,  # [S, D] expert outputs in dispatch order (strided)
    row_ptr,  # [T, K] int32 dispatch row of each assignment, -1 when dropped (contiguous)
    weight_ptr,  # [T, K] combine weights (strided)
    grad_y_out_ptr,  # [S, D] out: weight * grad_y, in y's dtype (contiguous)
    grad_w_out_ptr,  # [T, K] float32 out: <y row, grad_y>, 0 when dropped (contiguous)
    # Sizes
    T,
    D,
    K,
    S,
    # Strides
    stride_gt,
    stride_gd,
    stride_ys,
    stride_yd,
    stride_wt,
    stride_wk,
    # Meta-parameters
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # -- phase 1: the program's BLOCK_T tokens --
    pid_t = tl.program_id(0)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_t64 = offs_t.to(tl.int64)

    for k in range(K):
        # -- phase 2, per k: the assignment's row and weight --
        b_row = tl.load(row_ptr + offs_t64 * K + k, mask=mask_t, other=-1)
        mask_r = (b_row >= 0) & (b_row < S)
        offs_r64 = b_row.to(tl.int64)
        b_w = tl.load(weight_ptr + offs_t64 * stride_wt + k * stride_wk, mask=mask_r, other=0.0).to(tl.float32)
        # -- phase 3, per k: walk D: the weight gradient's dot, and w * grad_y into the row --
        b_dot = tl.zeros([BLOCK_T], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            b_g = tl.load(
                grad_y_ptr + offs_t64[:, None] * stride_gt + offs_d[None, :] * stride_gd,
                mask=mask_t[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)
            b_y = tl.load(
                y_ptr + offs_r64[:, None] * stride_ys + offs_d[None, :] * stride_yd,
                mask=mask_r[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)
            b_dot += tl.sum(b_y * b_g, axis=1)
            tl.store(
                grad_y_out_ptr + offs_r64[:, None] * D + offs_d[None, :],
                (b_w[:, None] * b_g).to(grad_y_out_ptr.dtype.element_ty),
                mask=mask_r[:, None] & mask_d[None, :],
            )
        tl.store(grad_w_out_ptr + offs_t64 * K + k, tl.where(mask_r, b_dot, 0.0), mask=mask_t)


@triton.jit(do_not_specialize=["N"])  # row counts: one compiled variant for any chunk
def _dispatch_rows_kernel(
    # Pointers
    expert_ptr,  # [T * K] int32
    slot_ptr,  # [T * K] int32 slot, -1 when dropped
    kept_ptr,  # [E] int kept assignments per expert in this chunk
    used_ptr,  # [E] int carried used capacity before this chunk
    row_ptr,  # [T * K] int32 out: dispatch row, -1 when dropped
    # Sizes
    N,
    E,
    # Meta-parameters
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # -- each program: base[e] = first row of expert e minus used_E[e] (an exclusive scan of the kept
    # counts, E <= 1024 in registers: no [E] buffer and no second launch), then
    # row = base[e] + slot for kept assignments, -1 for dropped ones --
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    b_kept = tl.load(kept_ptr + offs_e, mask=mask_e, other=0).to(tl.int32)
    b_used = tl.load(used_ptr + offs_e, mask=mask_e, other=0).to(tl.int32)
    base = tl.cumsum(b_kept, axis=0) - b_kept - b_used
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # int32: N = T * K < 2^31
    mask = offs < N
    b_slot = tl.load(slot_ptr + offs, mask=mask, other=-1)
    b_e = tl.load(expert_ptr + offs, mask=mask & (b_slot >= 0), other=0)
    b_base = tl.gather(base, b_e, 0)
    tl.store(row_ptr + offs, tl.where(b_slot >= 0, b_base + b_slot, -1), mask=mask)


@triton.jit
def _regroup_rows_kernel(
    # Pointers
    counts_ptr,  # [W, L] int rows received from rank w for local expert l (any strides)
    to_expert_ptr,  # [R] int64 out: received row of each grouped (expert-major) row
    to_rank_ptr,  # [R] int64 out: grouped row of each received (rank-major) row
    offsets_ptr,  # [L + 1] int64 out: the experts' segment bounds in the grouped order
    # Sizes
    W,
    L,
    stride_w,
    stride_l,
    # Meta-parameters
    BLOCK_B: tl.constexpr,  # >= W * L
    BLOCK_L: tl.constexpr,  # >= L + 1
    BLOCK: tl.constexpr,  # rows per step
):
    # -- one program per (w, l) block: its start in the received order (blocks (w, l) in row-major
    # order) and in the grouped order (blocks (l, w)), from all W * L counts; then its rows --
    b = tl.program_id(0)
    w = b // L
    lb = b % L
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < W * L
    iw = offs_b // L
    il = offs_b % L
    c = tl.load(counts_ptr + iw * stride_w + il * stride_l, mask=mask_b, other=0).to(tl.int64)
    start = tl.sum(tl.where(offs_b < b, c, 0), axis=0)
    first = tl.sum(tl.where((il < lb) | ((il == lb) & (iw < w)), c, 0), axis=0)
    n = tl.sum(tl.where(offs_b == b, c, 0), axis=0)
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK).to(tl.int64)
        m = j < n
        tl.store(to_expert_ptr + first + j, start + j, mask=m)
        tl.store(to_rank_ptr + start + j, first + j, mask=m)
    # -- the first program also writes the bounds: offsets[l] = rows of the experts before l --
    offs_l = tl.arange(0, BLOCK_L)
    before = il[None, :] < offs_l[:, None]
    bounds = tl.sum(tl.where(before, c[None, :], 0), axis=1)
    last = tl.where(b == 0, L, -1)  # (the other programs store nothing)
    tl.store(offsets_ptr + offs_l, bounds, mask=offs_l <= last)
