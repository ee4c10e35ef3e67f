"""Gating: scores, top-k, capacity slots and aux/z statistics, in Triton.

Semantics are those of :func:`kernels.reference.gating_fwd_ref` and :func:`gating_bwd_ref`
(DESIGN.md, routing contract); the launchers here have the same signatures (plus an optional
keyword-only ``out=``) and return the same types. Turning slots into dispatch rows is the permute
family's (:func:`kernels.permute.dispatch_rows`).

Forward algorithm
-----------------
The logits are read exactly once. A program owns a contiguous *span* of tokens and walks it in
tiles of ``BLOCK_T`` tokens x ``BLOCK_E = next_pow2(E)`` experts held in registers. Per tile:

1. softmax (max, exp, sum: the logsumexp falls out for the z-loss) or sigmoid;
2. top-k by K rounds of "max, then the lowest index holding the max" over the remaining
   candidates. This is exactly a stable descending sort cut at K, so ties go to the lower expert.
   A NaN score (a NaN logit; under softmax also a +inf logit or an all -inf row) ranks first,
   as in ``torch.sort``, and makes the token's normalised weights NaN, as in the reference.
   The round in which expert e was taken is kept in a ``[BLOCK_T, BLOCK_E]`` matrix ``kidx``;
3. expert, weight and slot are scattered to ``t * K + kidx`` in one masked store each (every
   ``(t, k)`` has exactly one writer, and a tile's K-wide rows are contiguous, so stores coalesce);
4. slot ranks: a token takes K *distinct* experts, so an assignment's rank among this call's
   assignments to its expert in flat ``t * K + k`` order is the number of earlier *tokens* that
   chose the same expert: an exclusive ``cumsum`` of the selection mask down the token axis, plus
   a running per-expert count carried from tile to tile within the span;
5. per-span partial sums of counts, normalised scores and lse^2.

DeepSeek-V3's router (``expert_bias``, ``n_group`` / ``topk_group``, ``scaling``) changes only
step 2, under constexpr switches (the plain path compiles as before): experts are ranked by
``scores + bias`` and, with groups, only within the token's ``topk_group`` best groups; the
weights stay the unbiased scores (normalised, then times ``scaling``). With groups the expert
lanes are laid out group-major, each group padded to ``BLOCK_GS = next_pow2(E / n_group)``
lanes (``BLOCK_E = next_pow2(n_group) * BLOCK_GS``; the same as ``next_pow2(E)`` for
DeepSeek-V3's 256 = 8 x 32), so a reshape to ``[BLOCK_T, n_group, BLOCK_GS]`` gives the group
scores (top-two sums) as two row maxima, with no loop over groups (:mod:`kernels._topk`).

Crossing spans needs a scan over the programs. It is done without atomics, in three launches:

* ``_gating_fwd_kernel``  (grid ``NB = cdiv(T, span)``): the above; writes the rank within the
  span into ``slot_TK`` and per-span counts / score sums / lse^2 sums into ``[NB, E]`` scratch;
* ``_gating_scan_kernel`` (grid ``cdiv(E, 32)``): per expert column, an exclusive scan of the
  span counts in program order, seeded with the carried ``used_E``; overwrites the counts with
  each span's first slot, and reduces the float partials in a fixed order;
* ``_gating_slot_kernel`` (grid over ``T * K``): ``slot = span_start[span, e] + rank``, then
  ``-1`` at or past the capacity.

Integer results are exact and every float reduction has a fixed order, so outputs are
bit-identical run to run for a given config (a different tuned ``BLOCK_T`` or span changes
only the float summation order of ``score_sum_E`` / ``zsq_sum``). When the whole call fits
one program (small T, e.g. a decode step or a tiny chunk) the scan is fused and the forward
is a single launch. No launcher synchronises with the host.

A decoupled look-back scan (CUB style) would fuse the three launches, but it spins on flags
written by other programs, relies on forward progress of earlier programs and cannot be
checked in the interpreter; the scan here costs two small launches touching ``O(NB * E + T * K)``
integers.

Bytes moved (the floor the benchmark divides by), with ``f`` the logits element size:
  forward   ``T*E*f`` (logits) + ``T*K*(4 + f + 4)`` (expert, weight, slot) + small ``O(E)``;
            the multi-program path adds ``T*K*12`` (slot fix-up) + ``NB*E*(12 + 2f)`` (scan);
  backward  ``T*E*2f`` (logits in, grad out) + ``T*K*(4 + 4)`` (experts, grad weights) + ``O(E)``.

Backward
--------
One pass over token tiles. With ``s`` the scores, ``p = softmax(logits)``, ``S_t`` the sum of the
token's K chosen scores and ``Z_t`` the sum of all its scores, the incoming gradients map to a
gradient on the scores ``g_s`` and then on the logits:

* weights, normalised: ``g_s[e] += (g_w[e] - sum_k g_w[k] * w[k]) / S_t`` on the chosen experts
  (``g_s[e] += g_w[e]`` without normalisation);
* aux statistics: ``g_s[e] += (g_P[e] - sum_e' g_P[e'] * s[e'] / Z_t) / Z_t``;
* softmax: ``g_l = s * (g_s - sum_e g_s[e] * s[e])``; sigmoid: ``g_l = g_s * s * (1 - s)``;
* z-loss: ``g_l += g_z * 2 * lse_t * p``.

Configs
-------
``BLOCK_T`` and ``num_warps`` of the forward and backward kernels are autotuned on CUDA, keyed on
(E, K), the dtypes and (forward) single-program vs spans, never on T, over a space pruned to
1..16 tile elements per thread (no register spills on sm_90). The span is not tuned: it is
32..512 tokens, a power of two sized for ~4 programs per SM.
``LANCET_GATING_FWD_CONFIG`` / ``LANCET_GATING_BWD_CONFIG`` pin one, e.g.
``"BLOCK_T=16,num_warps=4"``. Under ``TRITON_INTERPRET=1`` the largest tile is used, untimed.
"""
from __future__ import annotations

import functools
import struct
from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (check_out as _check_out, check_tensor as _check_tensor, interpreting, pinned_config,
                      run_autotuned)

from ._topk import kept_groups, select_topk
from .reference import GatingOutput, check_router_args, check_scaling

__all__ = ["gating_fwd", "gating_bwd", "GatingOutput"]

_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38
_MAX_EXPERTS = 1024          # BLOCK_E lives in registers; 1024 still leaves a 4-token tile
_SCAN_BLOCK_E = 32           # expert columns per scan program
_SCAN_BLOCK_B = 64           # spans per scan step
_FLAT_BLOCK = 1024           # assignments per program of the flat [T * K] kernels
_SPAN_MIN, _SPAN_MAX = 32, 512
_PROGRAMS_PER_SM = 4
# A call this small runs as one program with the scan fused (one launch): up to this many
# tokens, and at most this many logits. Tests lower the first to force the multi-program path.
_SINGLE_PROGRAM_MAX_T = 128
_SINGLE_PROGRAM_MAX_ELEMENTS = 16384

_ENV_FWD_CONFIG = "LANCET_GATING_FWD_CONFIG"
_ENV_BWD_CONFIG = "LANCET_GATING_BWD_CONFIG"


# ----------------------------------------------------------------------------------------------
# Config spaces
# ----------------------------------------------------------------------------------------------


def _token_tile_configs():
    return [
        triton.Config({"BLOCK_T": bt}, num_warps=nw)
        for bt in (4, 8, 16, 32)
        for nw in (1, 2, 4, 8)
    ]


def _token_tile_keep(config: triton.Config, block_e: int, grouped: bool = False) -> bool:
    """Keep tiles that give every thread 1..16 elements of the [BLOCK_T, BLOCK_E] tile: the
    forward keeps ~6 tile-shaped values live (scores, candidates, k index, rank, offsets, mask),
    about 12 registers per element on sm_90, and spills past ~20. Group-limited selection keeps
    a few more transients: 1..8 (at 16, Triton 3.6 reaches 255 registers and some builds spill)."""
    per_thread = config.kwargs["BLOCK_T"] * block_e / (32 * config.num_warps)
    return 1 <= per_thread <= (8 if grouped else 16)


def _token_tile_prune(env_var):
    def prune(configs, named_args, **kwargs):
        pinned = pinned_config(env_var)
        if pinned is not None:
            return [pinned]
        block_e = kwargs["BLOCK_E"]
        kept = [c for c in configs if _token_tile_keep(c, block_e, kwargs.get("GROUPED", False))]
        if not kept:  # tiny E: the largest tile; huge E: the smallest
            kept = [min(configs, key=lambda c: abs(c.kwargs["BLOCK_T"] * block_e / (32 * c.num_warps) - 8))]
        if interpreting():  # untimed: fewest tiles, fewest interpreted ops
            return [max(kept, key=lambda c: (c.kwargs["BLOCK_T"], -c.num_warps))]
        return kept

    return prune


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_token_tile_configs(),
    key=["E", "K", "SINGLE_PROGRAM", "BLOCK_E", "BLOCK_G"],
    prune_configs_by={"early_config_prune": _token_tile_prune(_ENV_FWD_CONFIG)},
)
@triton.jit
def _gating_fwd_kernel(
    # Pointers
    logits_ptr,      # [T, E] float32 | float64 router logits (strided)
    bias_ptr,        # [E] float expert bias, selection only (unused unless HAS_BIAS)
    used_ptr,        # [E] int32 slots claimed by earlier chunks
    expert_ptr,      # [T, K] int32 out: chosen experts, best first
    weight_ptr,      # [T, K] out, logits dtype: combine weights
    slot_ptr,        # [T, K] int32 out: final slot (SINGLE_PROGRAM) or rank within the span
    count_ptr,       # SINGLE_PROGRAM: [E] int32 counts_E; else [NB, E] int32 span counts
    used_out_ptr,    # [E] int32 out: used_E + counts_E (SINGLE_PROGRAM only)
    score_ptr,       # SINGLE_PROGRAM: [E] score_sum_E; else [NB, E] span partial sums
    zsq_ptr,         # SINGLE_PROGRAM: [] zsq_sum; else [NB] span partial sums
    # Sizes
    T, E, K,
    span,            # tokens per program
    capacity,        # slots per expert (INT32_MAX when dropless)
    n_group,         # expert groups (1 unless GROUPED)
    group_size,      # E / n_group
    topk_group,      # groups kept per token
    scale_hi,        # scaling = scale_hi + scale_lo (two float32 halves; used if HAS_SCALE)
    scale_lo,
    # Strides
    stride_lt, stride_le,
    # Meta-parameters
    SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SINGLE_PROGRAM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_G: tl.constexpr,     # next_pow2(n_group) (1 unless GROUPED)
    BLOCK_GS: tl.constexpr,    # next_pow2(group_size) (unused unless GROUPED)
    BLOCK_E: tl.constexpr,     # expert lanes: next_pow2(E), or BLOCK_G * BLOCK_GS if GROUPED
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    t_start = pid * span
    t_end = tl.minimum(t_start + span, T)
    if GROUPED:
        # Group-major lanes, BLOCK_GS per group: lane g * BLOCK_GS + j holds expert g * group_size + j,
        # so a [BLOCK_T, BLOCK_G, BLOCK_GS] reshape of a tile puts each group on its own row.
        lanes = tl.arange(0, BLOCK_E)
        offs_e = (lanes // BLOCK_GS) * group_size + lanes % BLOCK_GS
        mask_e = (lanes % BLOCK_GS < group_size) & (lanes // BLOCK_GS < n_group)
    else:
        offs_e = tl.arange(0, BLOCK_E)
        mask_e = offs_e < E
    acc_dtype = logits_ptr.dtype.element_ty
    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(acc_dtype)
    if HAS_SCALE:
        b_scale = tl.cast(scale_hi, acc_dtype) + tl.cast(scale_lo, acc_dtype)

    b_used = tl.load(used_ptr + offs_e, mask=mask_e, other=0)
    b_run = tl.zeros([BLOCK_E], dtype=tl.int32)          # assignments per expert so far in the span
    b_score_acc = tl.zeros([BLOCK_E], dtype=acc_dtype)   # sum of normalised scores
    b_zsq_acc = tl.zeros([BLOCK_T], dtype=acc_dtype)     # sum of lse^2, per tile row

    for t0 in range(t_start, t_end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < t_end
        offs_t64 = offs_t.to(tl.int64)

        # Scores. Padded expert lanes are -inf so they vanish from softmax and never win top-k;
        # padded token rows read 0 (finite) and are masked out of every store and sum.
        b_l = tl.load(
            logits_ptr + offs_t64[:, None] * stride_lt + offs_e[None, :] * stride_le,
            mask=mask_t[:, None] & mask_e[None, :], other=0.0,
        )
        b_l = tl.where(mask_e[None, :], b_l, float("-inf"))
        b_max = tl.max(b_l, axis=1)
        b_exp = tl.exp(b_l - b_max[:, None])
        b_den = tl.sum(b_exp, axis=1)
        b_lse = b_max + tl.log(b_den)
        # An infinite row max (a +inf logit, or every logit -inf) makes b_den NaN; torch.logsumexp
        # gives that max instead, or NaN when the row also holds a NaN (b_nan: NaN then, else 0).
        b_nan = tl.sum(tl.where(b_l == b_l, 0.0, b_l), axis=1)
        b_lse = tl.where((b_max == float("inf")) | (b_max == float("-inf")), b_max + b_nan, b_lse)
        if SIGMOID:
            b_s = tl.where(mask_e[None, :], tl.sigmoid(b_l), 0.0)
        else:
            b_s = b_exp / b_den[:, None]

        if HAS_BIAS or GROUPED:
            # Selection by scores + bias, within the token's best groups; weights from the scores.
            b_sel = b_s
            if HAS_BIAS:
                b_sel = b_s + b_bias[None, :]
            b_allowed = tl.broadcast_to(mask_e[None, :], [BLOCK_T, BLOCK_E])
            if GROUPED:
                b_allowed = b_allowed & kept_groups(b_sel, mask_e, n_group, topk_group,
                                                     BLOCK_T, BLOCK_G, BLOCK_GS)
            b_kidx = select_topk(b_sel, b_allowed, K, BLOCK_T, BLOCK_E)
            b_topsum = tl.sum(tl.where(b_kidx >= 0, b_s, 0.0), axis=1)
        else:
            # Top-k: K rounds of (max, lowest index at the max) = stable descending sort cut at K.
            # torch.sort ranks NaN above everything; tl.max skips NaN, so a NaN score competes as
            # +inf (scores are otherwise in [0, 1]) and turns back into NaN in the sum the weights
            # divide by.
            b_cand = tl.where(b_s == b_s, b_s, float("inf"))
            b_cand = tl.where(mask_e[None, :], b_cand, float("-inf"))
            b_kidx = tl.full([BLOCK_T, BLOCK_E], -1, dtype=tl.int32)
            b_topsum = tl.zeros([BLOCK_T], dtype=acc_dtype)   # sum of chosen scores, in k order
            for k in range(K):
                b_best = tl.max(b_cand, axis=1)
                b_arg = tl.min(tl.where(b_cand == b_best[:, None], offs_e[None, :], BLOCK_E), axis=1)
                b_hit = offs_e[None, :] == b_arg[:, None]
                b_kidx = tl.where(b_hit, k, b_kidx)
                b_cand = tl.where(b_hit, float("-inf"), b_cand)
                b_topsum += tl.where(b_best == float("inf"), float("nan"), b_best)

        # Scatter expert, weight and slot of every chosen (t, e) to t * K + kidx (int32: the
        # launcher checks T * K < 2^31).
        mask_tk = (b_kidx >= 0) & mask_t[:, None]
        offs_tk = offs_t[:, None] * K + b_kidx
        if NORMALIZE:
            b_w = b_s / b_topsum[:, None]
        else:
            b_w = b_s
        if HAS_SCALE:
            b_w = b_w * b_scale
        tl.store(expert_ptr + offs_tk, tl.broadcast_to(offs_e[None, :], [BLOCK_T, BLOCK_E]), mask=mask_tk)
        tl.store(weight_ptr + offs_tk, b_w.to(weight_ptr.dtype.element_ty), mask=mask_tk)

        # Rank among this call's assignments to the same expert: experts within a token are
        # distinct, so it is the count of earlier tokens (in the span) that chose it.
        b_one = mask_tk.to(tl.int32)
        b_rank = b_run[None, :] + tl.cumsum(b_one, axis=0) - b_one
        if SINGLE_PROGRAM:
            b_slot = b_used[None, :] + b_rank
            b_slot = tl.where(b_slot < capacity, b_slot, -1)
        else:
            b_slot = b_rank
        tl.store(slot_ptr + offs_tk, b_slot, mask=mask_tk)
        b_run += tl.sum(b_one, axis=0)

        # Aux statistics: scores normalised to sum 1 per token, and lse^2.
        b_tot = tl.sum(b_s, axis=1)
        b_score_acc += tl.sum(tl.where(mask_t[:, None], b_s / b_tot[:, None], 0.0), axis=0)
        b_zsq_acc += tl.where(mask_t, b_lse * b_lse, 0.0)

    if SINGLE_PROGRAM:
        tl.store(count_ptr + offs_e, b_run, mask=mask_e)
        tl.store(used_out_ptr + offs_e, b_used + b_run, mask=mask_e)
        tl.store(score_ptr + offs_e, b_score_acc, mask=mask_e)
        tl.store(zsq_ptr, tl.sum(b_zsq_acc, axis=0))
    else:
        tl.store(count_ptr + pid * E + offs_e, b_run, mask=mask_e)
        tl.store(score_ptr + pid * E + offs_e, b_score_acc, mask=mask_e)
        tl.store(zsq_ptr + pid, tl.sum(b_zsq_acc, axis=0))


@triton.jit
def _gating_scan_kernel(
    # Pointers
    span_count_ptr,  # [NB, E] int32 in: span counts; out: first slot of each span (exclusive scan + used)
    span_score_ptr,  # [NB, E] span partial score sums
    span_zsq_ptr,    # [NB] span partial lse^2 sums
    used_ptr,        # [E] int32 carried used capacity
    count_ptr,       # [E] int32 out: counts_E
    used_out_ptr,    # [E] int32 out: used_E + counts_E
    score_ptr,       # [E] out: score_sum_E
    zsq_ptr,         # [] out: zsq_sum
    # Sizes
    NB, E,
    # Meta-parameters
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid_e = tl.program_id(0)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E

    b_used = tl.load(used_ptr + offs_e, mask=mask_e, other=0)
    b_carry = b_used
    b_score = tl.zeros([BLOCK_E], dtype=span_score_ptr.dtype.element_ty)
    for b0 in range(0, NB, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask = (offs_b < NB)[:, None] & mask_e[None, :]
        offs = offs_b[:, None] * E + offs_e[None, :]
        b_cnt = tl.load(span_count_ptr + offs, mask=mask, other=0)
        tl.store(span_count_ptr + offs, b_carry[None, :] + tl.cumsum(b_cnt, axis=0) - b_cnt, mask=mask)
        b_carry += tl.sum(b_cnt, axis=0)
        b_score += tl.sum(tl.load(span_score_ptr + offs, mask=mask, other=0.0), axis=0)
    tl.store(count_ptr + offs_e, b_carry - b_used, mask=mask_e)
    tl.store(used_out_ptr + offs_e, b_carry, mask=mask_e)
    tl.store(score_ptr + offs_e, b_score, mask=mask_e)

    if pid_e == 0:
        b_zsq = tl.zeros([BLOCK_B], dtype=span_zsq_ptr.dtype.element_ty)
        for b0 in range(0, NB, BLOCK_B):
            offs_b = b0 + tl.arange(0, BLOCK_B)
            b_zsq += tl.load(span_zsq_ptr + offs_b, mask=offs_b < NB, other=0.0)
        tl.store(zsq_ptr, tl.sum(b_zsq, axis=0))


@triton.jit
def _gating_slot_kernel(
    # Pointers
    expert_ptr,      # [T * K] int32
    slot_ptr,        # [T * K] int32 in: rank within the span; out: slot, -1 when dropped
    span_start_ptr,  # [NB, E] int32 first slot of each span
    # Sizes
    N, E,
    span_k,          # assignments per span: span * K
    capacity,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)   # int32: N = T * K < 2^31
    mask = offs < N
    b_e = tl.load(expert_ptr + offs, mask=mask, other=0)
    b_rank = tl.load(slot_ptr + offs, mask=mask, other=0)
    b_span = offs // span_k
    b_slot = tl.load(span_start_ptr + b_span * E + b_e, mask=mask, other=0) + b_rank
    tl.store(slot_ptr + offs, tl.where(b_slot < capacity, b_slot, -1), mask=mask)


@triton.autotune(
    configs=_token_tile_configs(),
    key=["E", "K"],
    prune_configs_by={"early_config_prune": _token_tile_prune(_ENV_BWD_CONFIG)},
)
@triton.jit
def _gating_bwd_kernel(
    # Pointers
    logits_ptr,       # [T, E] float32 | float64 (strided)
    expert_ptr,       # [T, K] int32 chosen experts (strided)
    grad_w_ptr,       # [T, K] grad of weight_TK (strided; unused unless HAS_GRAD_W)
    grad_p_ptr,       # [E] grad of score_sum_E (strided; unused unless HAS_GRAD_P)
    grad_z_ptr,       # [] grad of zsq_sum (unused unless HAS_GRAD_Z)
    grad_logits_ptr,  # [T, E] out, contiguous, logits dtype
    # Sizes
    T, E, K,
    scale_hi,         # the weights' scaling = scale_hi + scale_lo (float32 halves; used if HAS_SCALE)
    scale_lo,
    # Strides
    stride_lt, stride_le,
    stride_et, stride_ek,
    stride_gt, stride_gk,
    stride_pe,
    # Meta-parameters
    SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_GRAD_W: tl.constexpr,
    HAS_GRAD_P: tl.constexpr,
    HAS_GRAD_Z: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    acc_dtype = logits_ptr.dtype.element_ty

    b_l = tl.load(
        logits_ptr + offs_t64[:, None] * stride_lt + offs_e[None, :] * stride_le,
        mask=mask_t[:, None] & mask_e[None, :], other=0.0,
    )
    b_l = tl.where(mask_e[None, :], b_l, float("-inf"))
    b_max = tl.max(b_l, axis=1)
    b_exp = tl.exp(b_l - b_max[:, None])
    b_den = tl.sum(b_exp, axis=1)
    b_p = b_exp / b_den[:, None]                      # softmax, 0 on padded lanes
    if SIGMOID:
        b_s = tl.where(mask_e[None, :], tl.sigmoid(b_l), 0.0)
    else:
        b_s = b_p

    b_gs = tl.zeros([BLOCK_T, BLOCK_E], dtype=acc_dtype)   # gradient on the scores
    if HAS_GRAD_W:
        # Spread the K weight gradients onto their experts' columns.
        b_gw = tl.zeros([BLOCK_T, BLOCK_E], dtype=acc_dtype)
        b_sel = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        for k in range(K):
            b_ek = tl.load(expert_ptr + offs_t64 * stride_et + k * stride_ek, mask=mask_t, other=-1)
            b_gk = tl.load(grad_w_ptr + offs_t64 * stride_gt + k * stride_gk, mask=mask_t, other=0.0)
            b_hit = offs_e[None, :] == b_ek[:, None]
            b_gw = tl.where(b_hit, b_gk.to(acc_dtype)[:, None], b_gw)
            b_sel = b_sel | b_hit
        # weight = scaling * (normalised) score: the scaling multiplies this term's per-token
        # factor (a per-element product in the loop spills at 32 x 64 tiles on 8 warps).
        if HAS_SCALE:
            b_scale = tl.cast(scale_hi, acc_dtype) + tl.cast(scale_lo, acc_dtype)
        if NORMALIZE:
            b_topsum = tl.sum(tl.where(b_sel, b_s, 0.0), axis=1)
            b_topsum = tl.where(mask_t, b_topsum, 1.0)  # padded rows choose nothing: avoid 0/0
            b_dot = tl.sum(tl.where(b_sel, b_gw * b_s, 0.0), axis=1) / b_topsum   # sum_k g_w * w
            if HAS_SCALE:
                b_gs += tl.where(b_sel, (b_gw - b_dot[:, None]) * (b_scale / b_topsum)[:, None], 0.0)
            else:
                b_gs += tl.where(b_sel, (b_gw - b_dot[:, None]) / b_topsum[:, None], 0.0)
        elif HAS_SCALE:
            b_gs += b_gw * b_scale
        else:
            b_gs += b_gw
    if HAS_GRAD_P:
        b_gp = tl.load(grad_p_ptr + offs_e * stride_pe, mask=mask_e, other=0.0).to(acc_dtype)
        b_tot = tl.sum(b_s, axis=1)
        b_dot = tl.sum(b_gp[None, :] * b_s, axis=1) / b_tot
        b_gs += (b_gp[None, :] - b_dot[:, None]) / b_tot[:, None]

    if SIGMOID:
        b_gl = b_gs * b_s * (1.0 - b_s)
    else:
        b_gl = b_s * (b_gs - tl.sum(b_gs * b_s, axis=1)[:, None])
    if HAS_GRAD_Z:
        b_gz = tl.load(grad_z_ptr).to(acc_dtype)
        b_lse = b_max + tl.log(b_den)
        b_gl += (2.0 * b_gz) * b_lse[:, None] * b_p

    tl.store(
        grad_logits_ptr + offs_t64[:, None] * E + offs_e[None, :],
        b_gl.to(grad_logits_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_e[None, :],
    )


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _plan_span(T: int, block_e: int, device: torch.device) -> int:
    """Tokens per forward program: all of them when small, else ~_PROGRAMS_PER_SM programs per SM."""
    if T <= _SINGLE_PROGRAM_MAX_T and T * block_e <= _SINGLE_PROGRAM_MAX_ELEMENTS:
        return max(T, 1)
    span = triton.next_power_of_2(triton.cdiv(T, _PROGRAMS_PER_SM * _num_sms(device)))
    return min(max(span, _SPAN_MIN), _SPAN_MAX)


def _split_scaling(scaling: float):
    """``scaling`` as two float32 values whose sum is it to ~48 bits: exact in a float32 kernel
    (the first one, as torch rounds a Python scalar), and float64 kernels add the second."""
    if not abs(scaling) <= _FLOAT32_MAX:
        raise ValueError(f"scaling must be at most {_FLOAT32_MAX:.4g} (float32), got {scaling!r}")
    hi = struct.unpack("f", struct.pack("f", scaling))[0]
    return hi, struct.unpack("f", struct.pack("f", scaling - hi))[0]


_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8)
_LOGIT_DTYPES = (torch.float32, torch.float64)


def gating_fwd(
    logits_TE: torch.Tensor,
    top_k: int,
    used_E: Optional[torch.Tensor] = None,
    *,
    capacity: Optional[int] = None,
    score_fn: str = "softmax",
    normalize_topk: bool = True,
    expert_bias: Optional[torch.Tensor] = None,
    n_group: int = 1,
    topk_group: Optional[int] = None,
    scaling: float = 1.0,
    out: Optional[GatingOutput] = None,
) -> GatingOutput:
    """Scores, top-k, capacity slots and aux/z statistics for one chunk of router logits.

    Same semantics as :func:`kernels.reference.gating_fwd_ref` (DeepSeek-V3's biased,
    group-limited selection included).

    Args:
        logits_TE: float32 (or float64) [T, E] router logits, any strides.
        top_k: experts per token, 1 <= top_k <= topk_group * E / n_group.
        used_E: integer [E] slots claimed by earlier chunks of the same batch (None: zeros).
        capacity: slots per expert for the whole batch, or None for dropless.
        score_fn: "softmax" or "sigmoid".
        normalize_topk: divide the K weights of a token by their sum.
        expert_bias: None or float [E] on the logits' device, added to the scores to select
            experts (not to the weights); no gradient.
        n_group: groups of E / n_group consecutive experts (dividing E); 1: no restriction.
        topk_group: groups a token may choose from, 1..n_group (None: n_group).
        scaling: finite factor > 0 on the K weights, after the normalisation.
        out: optional preallocated :class:`GatingOutput` (contiguous, the dtypes and shapes
            below) written in place; ``out.used_E`` must not alias ``used_E``.

    Returns:
        :class:`GatingOutput`: expert_TK int32 [T, K], weight_TK [T, K], slot_TK int32 [T, K],
        counts_E int32 [E], used_E int32 [E], score_sum_E [E], zsq_sum [] (floats in the
        logits dtype).
    """
    _check_tensor("logits_TE", logits_TE, ndim=2, dtypes=_LOGIT_DTYPES)
    T, E = logits_TE.shape
    dev = logits_TE.device
    if not 1 <= E <= _MAX_EXPERTS:
        raise ValueError(f"logits_TE must have 1..{_MAX_EXPERTS} experts (columns), got {E}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, E={E}], got {top_k!r}")
    if score_fn not in ("softmax", "sigmoid"):
        raise ValueError(f"score_fn must be 'softmax' or 'sigmoid', got {score_fn!r}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity must be None or an int >= 0, got {capacity!r}")
    if T * top_k > _INT32_MAX:
        raise ValueError(f"T * top_k must fit int32, got {T} * {top_k}")
    topk_group = check_router_args(E, top_k, expert_bias, n_group, topk_group, scaling, dev)
    scale_hi, scale_lo = _split_scaling(scaling)
    K = top_k
    grouped = n_group > 1
    if grouped:   # group-major lanes (see _gating_fwd_kernel): each group padded to a power of two
        block_g, block_gs = triton.next_power_of_2(n_group), triton.next_power_of_2(E // n_group)
        block_e = block_g * block_gs
        if block_e > _MAX_EXPERTS:
            raise ValueError(f"n_group={n_group} with E={E} needs {block_g} x {block_gs} expert lanes, "
                             f"more than {_MAX_EXPERTS}")
    else:
        block_g, block_gs, block_e = 1, 1, triton.next_power_of_2(E)
    bias = logits_TE if expert_bias is None else expert_bias.contiguous()   # logits: never read
    if used_E is None:
        used_E = torch.zeros(E, dtype=torch.int32, device=dev)
    else:
        _check_tensor("used_E", used_E, shape=(E,), dtypes=_INT_DTYPES, device=dev)
        used_E = used_E.to(torch.int32).contiguous()
    cap = _INT32_MAX if capacity is None else min(capacity, _INT32_MAX)

    shapes = GatingOutput((T, K), (T, K), (T, K), (E,), (E,), (E,), ())
    dtypes = GatingOutput(torch.int32, logits_TE.dtype, torch.int32, torch.int32, torch.int32,
                          logits_TE.dtype, logits_TE.dtype)
    if out is None:
        out = GatingOutput(*(torch.empty(s, dtype=d, device=dev) for s, d in zip(shapes, dtypes)))
    else:
        if not isinstance(out, GatingOutput):
            raise TypeError(f"out must be a GatingOutput, got {type(out).__name__}")
        for field, t, s, d in zip(GatingOutput._fields, out, shapes, dtypes):
            _check_out(f"out.{field}", t, s, d, dev)
        if out.used_E.data_ptr() == used_E.data_ptr():
            raise ValueError("out.used_E must not alias used_E")

    if T == 0:
        out.counts_E.zero_()
        out.used_E.copy_(used_E)
        out.score_sum_E.zero_()
        out.zsq_sum.zero_()
        return out

    span = _plan_span(T, block_e, dev)
    n_spans = triton.cdiv(T, span)
    meta = dict(SIGMOID=score_fn == "sigmoid", NORMALIZE=bool(normalize_topk), HAS_BIAS=expert_bias is not None,
                HAS_SCALE=scaling != 1.0, GROUPED=grouped, BLOCK_G=block_g, BLOCK_GS=block_gs, BLOCK_E=block_e)
    sizes = (T, E, K, span, cap, n_group, E // n_group, topk_group, scale_hi, scale_lo, *logits_TE.stride())
    if n_spans == 1:
        args = (logits_TE, bias, used_E, out.expert_TK, out.weight_TK, out.slot_TK,
                out.counts_E, out.used_E, out.score_sum_E, out.zsq_sum, *sizes)
        run_autotuned(_gating_fwd_kernel, (1,), args, dict(SINGLE_PROGRAM=True, **meta), _ENV_FWD_CONFIG)
        return out

    span_count = torch.empty(n_spans, E, dtype=torch.int32, device=dev)
    span_score = torch.empty(n_spans, E, dtype=logits_TE.dtype, device=dev)
    span_zsq = torch.empty(n_spans, dtype=logits_TE.dtype, device=dev)
    args = (logits_TE, bias, used_E, out.expert_TK, out.weight_TK, out.slot_TK,
            span_count, out.used_E, span_score, span_zsq, *sizes)
    run_autotuned(_gating_fwd_kernel, (n_spans,), args, dict(SINGLE_PROGRAM=False, **meta), _ENV_FWD_CONFIG)
    _gating_scan_kernel[(triton.cdiv(E, _SCAN_BLOCK_E),)](
        span_count, span_score, span_zsq, used_E,
        out.counts_E, out.used_E, out.score_sum_E, out.zsq_sum,
        n_spans, E,
        BLOCK_B=_SCAN_BLOCK_B, BLOCK_E=_SCAN_BLOCK_E,
    )
    _gating_slot_kernel[(triton.cdiv(T * K, _FLAT_BLOCK),)](
        out.expert_TK, out.slot_TK, span_count,
        T * K, E, span * K, cap,
        BLOCK=_FLAT_BLOCK,
    )
    return out


def gating_bwd(
    logits_TE: torch.Tensor,
    expert_TK: torch.Tensor,
    grad_weight_TK: Optional[torch.Tensor],
    grad_score_sum_E: Optional[torch.Tensor],
    grad_zsq_sum: Optional[torch.Tensor],
    *,
    score_fn: str = "softmax",
    normalize_topk: bool = True,
    scaling: float = 1.0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradient of the logits from the gradients of ``weight_TK``, ``score_sum_E`` and ``zsq_sum``.

    Same semantics as :func:`kernels.reference.gating_bwd_ref`; any incoming gradient may be None.

    Args:
        logits_TE: float32 (or float64) [T, E], any strides.
        expert_TK: integer [T, K] from :func:`gating_fwd` (distinct experts per token).
        grad_weight_TK: float [T, K] or None (any strides, e.g. expanded).
        grad_score_sum_E: float [E] or None.
        grad_zsq_sum: float [] (or one element) or None.
        score_fn, normalize_topk, scaling: as given to :func:`gating_fwd` (the expert bias and
            groups only select, so the backward does not need them).
        out: optional contiguous [T, E] buffer in the logits dtype.

    Returns:
        grad_logits_TE, same dtype and shape as ``logits_TE`` (contiguous).
    """
    _check_tensor("logits_TE", logits_TE, ndim=2, dtypes=_LOGIT_DTYPES)
    T, E = logits_TE.shape
    dev = logits_TE.device
    if not 1 <= E <= _MAX_EXPERTS:
        raise ValueError(f"logits_TE must have 1..{_MAX_EXPERTS} experts (columns), got {E}")
    if score_fn not in ("softmax", "sigmoid"):
        raise ValueError(f"score_fn must be 'softmax' or 'sigmoid', got {score_fn!r}")
    check_scaling(scaling)
    scale_hi, scale_lo = _split_scaling(scaling)
    _check_tensor("expert_TK", expert_TK, ndim=2, dtypes=_INT_DTYPES, device=dev)
    if expert_TK.shape[0] != T or not 1 <= expert_TK.shape[1] <= E:
        raise ValueError(f"expert_TK must have shape [T={T}, K<=E={E}], got {tuple(expert_TK.shape)}")
    K = expert_TK.shape[1]
    float_dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if grad_weight_TK is not None:
        _check_tensor("grad_weight_TK", grad_weight_TK, shape=(T, K), dtypes=float_dtypes, device=dev)
    if grad_score_sum_E is not None:
        _check_tensor("grad_score_sum_E", grad_score_sum_E, shape=(E,), dtypes=float_dtypes, device=dev)
    if grad_zsq_sum is not None:
        _check_tensor("grad_zsq_sum", grad_zsq_sum, dtypes=float_dtypes, device=dev)
        if grad_zsq_sum.numel() != 1:
            raise ValueError(f"grad_zsq_sum must have one element, got shape {tuple(grad_zsq_sum.shape)}")
    if out is None:
        out = torch.empty(T, E, dtype=logits_TE.dtype, device=dev)
    else:
        _check_out("out", out, (T, E), logits_TE.dtype, dev)
    if grad_weight_TK is None and grad_score_sum_E is None and grad_zsq_sum is None:
        return out.zero_()
    if T == 0:
        return out

    if expert_TK.dtype != torch.int32:
        expert_TK = expert_TK.to(torch.int32)
    dummy = logits_TE  # stands in for an absent gradient; never read (HAS_* is False)
    grad_w = dummy if grad_weight_TK is None else grad_weight_TK
    grad_p = dummy if grad_score_sum_E is None else grad_score_sum_E
    grad_z = dummy if grad_zsq_sum is None else grad_zsq_sum
    stride_gt, stride_gk = (0, 0) if grad_weight_TK is None else grad_weight_TK.stride()
    stride_pe = 0 if grad_score_sum_E is None else grad_score_sum_E.stride(0)
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_T"]),)  # noqa: E731
    args = (logits_TE, expert_TK, grad_w, grad_p, grad_z, out,
            T, E, K, scale_hi, scale_lo,
            *logits_TE.stride(), *expert_TK.stride(), stride_gt, stride_gk, stride_pe)
    meta = dict(SIGMOID=score_fn == "sigmoid", NORMALIZE=bool(normalize_topk),
                HAS_GRAD_W=grad_weight_TK is not None, HAS_GRAD_P=grad_score_sum_E is not None,
                HAS_GRAD_Z=grad_zsq_sum is not None, HAS_SCALE=scaling != 1.0, BLOCK_E=triton.next_power_of_2(E))
    run_autotuned(_gating_bwd_kernel, grid, args, meta, _ENV_BWD_CONFIG)
    return out
