"""Gating kernels: the Triton programs behind :mod:`lancet_rt.kernels.gating` and their config spaces.

Semantics are those of :mod:`lancet_rt.kernels.reference` (docs/design.md, routing contract); the
launchers live in :mod:`lancet_rt.kernels.gating`.

Forward algorithm
-----------------
The logits are read exactly once. A program owns a contiguous *span* of tokens and walks it in
tiles of ``BLOCK_T`` tokens x ``BLOCK_E = next_pow2(E)`` experts held in registers. Per tile:

1. softmax (max, exp, sum: the logsumexp falls out for the z-loss) or sigmoid;
2. top-k by K rounds of "max, then the lowest index holding the max" over the remaining
   candidates. This is exactly a stable descending sort cut at K, so ties go to the lower expert.
   A NaN score (a NaN logit; under softmax also a +inf logit or an all -inf row) ranks first,
   as in ``torch.sort``, and makes the token's normalised weights NaN, as in the reference.
   Normalising divides by the chosen scores' sum + 1e-20 (the contract's ``NORM_EPS``), so a token
   whose sigmoid scores all underflow to 0 gets weights 0. The round in which expert e was taken is kept in a
   ``[BLOCK_T, BLOCK_E]`` matrix ``kidx``;
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
scores (top-two sums) as two row maxima, with no loop over groups (:mod:`lancet_rt.kernels._topk`).

Crossing spans needs a scan over the programs. It is done without atomics, in two launches:

* ``_gating_fwd_kernel`` (grid ``NB = cdiv(T, span)``): the above; writes the rank within the
  span into ``slot_TK`` and per-span counts / score sums / lse^2 sums into ``[NB, E]`` scratch;
* ``_gating_finish_kernel``: ``cdiv(E, 32)`` *sums* programs, then the *slot* programs, each over a
  contiguous range of the ``T * K`` assignments. A sums program reduces its 32 expert columns of the span
  counts and sums in span order (``counts_E``, ``used_E``, ``score_sum_E``, the kept rows and totals; the
  first also ``zsq_sum``). A slot program makes the first slot of each span it touches itself, from the
  raw span counts: one pass over them (``used[e] + sum_{b' < b} count[b', e]`` for its first span ``b``,
  and with the rows every column's sum, ``counts_E``), then span by span, gathered on each assignment's
  expert lane; ``slot = first slot of the span + rank``, ``-1`` at or past the capacity. The sums
  programs write nothing the slot programs read, so neither waits for the other.

The launch that writes the call's counts and sums (the single program, or the sums programs) also writes
the kept rows per expert (``HAS_KEPT``) and adds them and the sums to a batch's running totals in place
(``HAS_TOTALS``; ``_store_kept``): the caller's ops after the call, done where the values already are.
The launch that writes the final slots (the single program, after a barrier, in a pass over the call's
``T * K`` assignments; or the slot programs) can also write the dispatch rows (``HAS_ROWS``): ``base[e] +
slot``, ``base`` the exclusive scan of the kept rows per expert less the carried counter, made in
registers from the ``E`` counts as ``permute.dispatch_rows`` makes it, so the same int32 arithmetic.

Integer results are exact and every float reduction has a fixed order, so outputs are
bit-identical run to run for a given config (a different tuned ``BLOCK_T`` or span changes
only the float summation order of ``score_sum_E`` / ``zsq_sum``). When the whole call fits
one program (small T, e.g. a decode step or a tiny chunk) the scan is fused and the forward
is a single launch. No launcher synchronises with the host.

A decoupled look-back scan (CUB style) would fuse the two launches, but it spins on flags
written by other programs, relies on forward progress of earlier programs and cannot be
checked in the interpreter. Instead each slot program re-reads the span counts it needs, which
costs reads, not a launch: ``NB * E`` int32 per slot program with the rows (up to its first span
without them), from L2. The launcher gives a slot program as many 1024-assignment steps as keep
the slot programs at most ``span`` in number, so these reads stay at most about the logits' own
``T * E * 4`` bytes. At T = 16384 tokens, E = 128, K = 8 on 132 SMs: spans of 32 tokens, NB = 512,
a 256 KiB count table; 4 sums programs read it and the score table once (512 KiB); 32 slot
programs of 4096 assignments read it once each (8 MiB in all, as the 8 MiB of logits).

Bytes moved (the floor the benchmark divides by), with ``f`` the logits element size:
  forward   ``T*E*f`` (logits) + ``T*K*(4 + f + 4)`` (expert, weight, slot) + small ``O(E)``;
            the multi-program path adds ``T*K*12`` (slot fix-up; ``+4`` with the rows) +
            ``NB*E*(8 + 2f)`` (span counts and sums, written and read once) + ``P*NB*E*4`` (the
            ``P <= span`` slot programs' passes over the counts, at most about ``T*E*4``);
  backward  ``T*E*2f`` (logits in, grad out) + ``T*K*(4 + 4)`` (experts, grad weights) + ``O(E)``.

Backward
--------
One pass over token tiles. With ``s`` the scores, ``p = softmax(logits)``, ``S_t`` the sum of the
token's K chosen scores and ``Z_t`` the sum of all its scores, the incoming gradients map to a
gradient on the scores ``g_s`` and then on the logits:

* weights, normalised: ``g_s[e] += (g_w[e] - sum_k g_w[k] * w[k]) / S_t`` on the chosen experts
  (``g_s[e] += g_w[e]`` without normalisation);
* aux statistics: ``g_s[e] += (g_P[e] - sum_e' g_P[e'] * s[e'] / Z_t) / Z_t``;
* ``S_t`` and ``Z_t`` include the contract's ``+ 1e-20`` (``reference.NORM_EPS``), as in the forward;
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

import triton
import triton.language as tl

from ._common import interpreting, pinned_config
from ._topk import kept_groups, select_topk
from .reference import NORM_EPS

#: reference.NORM_EPS, added to each sum a weight or an aux score is divided by. The kernels make it
#: with ``tl.full`` in the logits' dtype: a bare literal would be a float32 constant, inexact in float64.
_NORM_EPS = tl.constexpr(NORM_EPS)

_ENV_FWD_CONFIG = "LANCET_GATING_FWD_CONFIG"
_ENV_BWD_CONFIG = "LANCET_GATING_BWD_CONFIG"


# ----------------------------------------------------------------------------------------------
# Config spaces
# ----------------------------------------------------------------------------------------------


def _token_tile_configs():
    """Every BLOCK_T x num_warps candidate; the prune keeps those that fit the expert width."""
    return [triton.Config({"BLOCK_T": bt}, num_warps=nw) for bt in (4, 8, 16, 32) for nw in (1, 2, 4, 8)]


def _token_tile_keep(config: triton.Config, block_e: int, grouped: bool = False) -> bool:
    """Keep tiles that give every thread 1..16 elements of the [BLOCK_T, BLOCK_E] tile: the
    forward keeps ~6 tile-shaped values live (scores, candidates, k index, rank, offsets, mask),
    and sm_90 builds spill a little past 16. Group-limited selection keeps a few more transients: 1..8
    (at 16 some builds spill). Register counts per Triton version: bench/results/HISTORY.md."""
    per_thread = config.kwargs["BLOCK_T"] * block_e / (32 * config.num_warps)
    return 1 <= per_thread <= (8 if grouped else 16)


def _token_tile_prune(env_var):
    """The early prune of a token-tile config space: the pinned config (``env_var``) if any, else the
    tiles that fit ``_token_tile_keep``, one of them under the interpreter."""

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
@triton.jit
def _store_kept(
    kept_ptr, tot_kept_ptr, tot_score_ptr, offs_e, mask_e, b_used, b_counts, b_score, capacity, HAS_KEPT, HAS_TOTALS
):
    """The call's kept rows (its counts, up to the room ``capacity`` leaves above the carried ``used``:
    min(counts, max(capacity - used, 0)), in int64) into ``kept_ptr`` (HAS_KEPT), and with its score
    sums added to the running totals in place (HAS_TOTALS): the same int64 and float additions the
    caller would make after the call."""
    b_kept = tl.minimum(b_counts.to(tl.int64), tl.maximum(capacity - b_used.to(tl.int64), 0))
    if HAS_KEPT:
        tl.store(kept_ptr + offs_e, b_kept.to(tl.int32), mask=mask_e)
    if HAS_TOTALS:
        tl.store(tot_kept_ptr + offs_e, tl.load(tot_kept_ptr + offs_e, mask=mask_e, other=0) + b_kept, mask=mask_e)
        b_tot = tl.load(tot_score_ptr + offs_e, mask=mask_e, other=0.0)
        tl.store(tot_score_ptr + offs_e, b_tot + b_score, mask=mask_e)


@triton.jit
def _rows_base(b_used, b_counts, capacity):
    """``base[e]``: the dispatch row of slot 0 of expert e (the rows of experts < e this call keeps, an
    exclusive scan of the kept rows ``min(counts, max(capacity - used, 0))``, less the carried ``used``),
    in int32 over the given expert lanes (padded lanes: counts 0), as ``dispatch_rows`` makes it."""
    b_kept = tl.minimum(b_counts.to(tl.int64), tl.maximum(capacity - b_used.to(tl.int64), 0)).to(tl.int32)
    return tl.cumsum(b_kept, axis=0) - b_kept - b_used


@triton.jit
def _rows_of_slots(b_base, b_lane, b_slot):
    """Row of each assignment from its final slot (-1: dropped) and its expert's lane in ``b_base``."""
    return tl.where(b_slot >= 0, tl.gather(b_base, b_lane, 0) + b_slot, -1)


@triton.autotune(
    configs=_token_tile_configs(),
    key=["E", "K", "SINGLE_PROGRAM", "BLOCK_E", "BLOCK_G"],
    prune_configs_by={"early_config_prune": _token_tile_prune(_ENV_FWD_CONFIG)},
    restore_value=["tot_kept_ptr", "tot_score_ptr", "tot_zsq_ptr"],  # (timing runs add to the totals too)
)
@triton.jit(do_not_specialize=["T", "span", "capacity"])  # row counts: one compiled variant for any chunk
def _gating_fwd_kernel(
    # Pointers
    logits_ptr,  # [T, E] float32 | float64 router logits (strided)
    bias_ptr,  # [E] float expert bias, selection only (unused unless HAS_BIAS)
    used_ptr,  # [E] int32 slots claimed by earlier chunks
    expert_ptr,  # [T, K] int32 out: chosen experts, best first
    weight_ptr,  # [T, K] out, logits dtype: combine weights
    slot_ptr,  # [T, K] int32 out: final slot (SINGLE_PROGRAM) or rank within the span
    count_ptr,  # SINGLE_PROGRAM: [E] int32 counts_E; else [NB, E] int32 span counts
    used_out_ptr,  # [E] int32 out: used_E + counts_E (SINGLE_PROGRAM only)
    score_ptr,  # SINGLE_PROGRAM: [E] score_sum_E; else [NB, E] span partial sums
    zsq_ptr,  # SINGLE_PROGRAM: [] zsq_sum; else [NB] span partial sums
    kept_ptr,  # [E] int32 out: the call's kept rows (SINGLE_PROGRAM and HAS_KEPT only)
    tot_kept_ptr,  # [E] int64 in/out: running kept rows (SINGLE_PROGRAM and HAS_TOTALS only)
    tot_score_ptr,  # [E] in/out: running score_sum_E, logits dtype (idem)
    tot_zsq_ptr,  # [] in/out: running zsq_sum, logits dtype (idem)
    row_ptr,  # [T, K] int32 out: dispatch rows, -1 when dropped (SINGLE_PROGRAM and HAS_ROWS only)
    # Sizes
    T,
    E,
    K,
    span,  # tokens per program
    capacity,  # slots per expert (INT32_MAX when dropless)
    n_group,  # expert groups (1 unless GROUPED)
    group_size,  # E / n_group
    topk_group,  # groups kept per token
    scale_hi,  # scaling = scale_hi + scale_lo (two float32 halves; used if HAS_SCALE)
    scale_lo,
    # Strides
    stride_lt,
    stride_le,
    # Meta-parameters
    SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SINGLE_PROGRAM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_KEPT: tl.constexpr,  # write the call's kept rows
    HAS_TOTALS: tl.constexpr,  # add the call's kept rows, score_sum_E and zsq_sum to the tot_* sums
    HAS_ROWS: tl.constexpr,  # write the dispatch rows (a pass over the call's expert and slot outputs)
    BLOCK_G: tl.constexpr,  # next_pow2(n_group) (1 unless GROUPED)
    BLOCK_GS: tl.constexpr,  # next_pow2(group_size) (unused unless GROUPED)
    BLOCK_E: tl.constexpr,  # expert lanes: next_pow2(E), or BLOCK_G * BLOCK_GS if GROUPED
    BLOCK_T: tl.constexpr,
):
    # -- phase 1: the program's span of tokens and its expert lanes --
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
    b_eps = tl.full([BLOCK_T], _NORM_EPS, acc_dtype)
    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(acc_dtype)
    if HAS_SCALE:
        b_scale = tl.cast(scale_hi, acc_dtype) + tl.cast(scale_lo, acc_dtype)

    # -- phase 2: per-span accumulators (carried capacity, running counts, aux sums) --
    b_used = tl.load(used_ptr + offs_e, mask=mask_e, other=0)
    b_run = tl.zeros([BLOCK_E], dtype=tl.int32)  # assignments per expert so far in the span
    b_score_acc = tl.zeros([BLOCK_E], dtype=acc_dtype)  # sum of normalised scores
    b_zsq_acc = tl.zeros([BLOCK_T], dtype=acc_dtype)  # sum of lse^2, per tile row

    for t0 in range(t_start, t_end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < t_end
        offs_t64 = offs_t.to(tl.int64)

        # -- phase 3: load the tile's logits and score them (softmax or sigmoid, lse) --
        # Scores. Padded expert lanes are -inf so they vanish from softmax and never win top-k;
        # padded token rows read 0 (finite) and are masked out of every store and sum.
        b_l = tl.load(
            logits_ptr + offs_t64[:, None] * stride_lt + offs_e[None, :] * stride_le,
            mask=mask_t[:, None] & mask_e[None, :],
            other=0.0,
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

        # -- phase 4: top-k selection (kidx: the round each chosen expert was taken in) --
        if HAS_BIAS or GROUPED:
            # Selection by scores + bias, within the token's best groups; weights from the scores.
            b_sel = b_s
            if HAS_BIAS:
                b_sel = b_s + b_bias[None, :]
            b_allowed = tl.broadcast_to(mask_e[None, :], [BLOCK_T, BLOCK_E])
            if GROUPED:
                b_allowed = b_allowed & kept_groups(b_sel, mask_e, n_group, topk_group, BLOCK_T, BLOCK_G, BLOCK_GS)
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
            b_topsum = tl.zeros([BLOCK_T], dtype=acc_dtype)  # sum of chosen scores, in k order
            for k in range(K):
                b_best = tl.max(b_cand, axis=1)
                b_arg = tl.min(tl.where(b_cand == b_best[:, None], offs_e[None, :], BLOCK_E), axis=1)
                b_hit = offs_e[None, :] == b_arg[:, None]
                b_kidx = tl.where(b_hit, k, b_kidx)
                b_cand = tl.where(b_hit, float("-inf"), b_cand)
                b_topsum += tl.where(b_best == float("inf"), float("nan"), b_best)

        # -- phase 5: scatter expert, weight and slot rank to t * K + kidx --
        # Scatter expert, weight and slot of every chosen (t, e) to t * K + kidx (int32: the
        # launcher checks T * K < 2^31).
        mask_tk = (b_kidx >= 0) & mask_t[:, None]
        offs_tk = offs_t[:, None] * K + b_kidx
        if NORMALIZE:
            b_w = b_s / (b_topsum + b_eps)[:, None]  # (+ eps: all-zero scores give 0, not NaN)
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

        # -- phase 6: aux statistics of the tile --
        # Aux statistics: scores normalised to sum 1 per token, and lse^2.
        b_tot = tl.sum(b_s, axis=1) + b_eps
        b_score_acc += tl.sum(tl.where(mask_t[:, None], b_s / b_tot[:, None], 0.0), axis=0)
        b_zsq_acc += tl.where(mask_t, b_lse * b_lse, 0.0)

    # -- phase 7: write the span's (or, single program, the call's) counts and sums --
    if SINGLE_PROGRAM:
        b_zsq = tl.sum(b_zsq_acc, axis=0)
        tl.store(count_ptr + offs_e, b_run, mask=mask_e)
        tl.store(used_out_ptr + offs_e, b_used + b_run, mask=mask_e)
        tl.store(score_ptr + offs_e, b_score_acc, mask=mask_e)
        tl.store(zsq_ptr, b_zsq)
        if HAS_KEPT or HAS_TOTALS:
            _store_kept(
                kept_ptr,
                tot_kept_ptr,
                tot_score_ptr,
                offs_e,
                mask_e,
                b_used,
                b_run,
                b_score_acc,
                capacity,
                HAS_KEPT,
                HAS_TOTALS,
            )
        if HAS_TOTALS:
            tl.store(tot_zsq_ptr, tl.load(tot_zsq_ptr) + b_zsq)
        if HAS_ROWS:
            # -- phase 8: the dispatch rows, from the expert and slot this program stored (the barrier
            # makes every thread's stores visible to the others; the loads read them from L2, not a
            # cached line) and the call's kept rows --
            tl.debug_barrier()
            b_base = _rows_base(b_used, b_run, capacity)
            for i0 in range(0, T * K, BLOCK_T * BLOCK_E):
                offs = i0 + tl.arange(0, BLOCK_T * BLOCK_E)  # int32: T * K < 2^31
                mask = offs < T * K
                b_sl = tl.load(slot_ptr + offs, mask=mask, other=-1, cache_modifier=".cg")
                b_ex = tl.load(expert_ptr + offs, mask=mask & (b_sl >= 0), other=0, cache_modifier=".cg")
                if GROUPED:  # (expert e's lane: group-major, BLOCK_GS lanes per group)
                    b_ex = (b_ex // group_size) * BLOCK_GS + b_ex % group_size
                tl.store(row_ptr + offs, _rows_of_slots(b_base, b_ex, b_sl), mask=mask)
    else:
        tl.store(count_ptr + pid * E + offs_e, b_run, mask=mask_e)
        tl.store(score_ptr + pid * E + offs_e, b_score_acc, mask=mask_e)
        tl.store(zsq_ptr + pid, tl.sum(b_zsq_acc, axis=0))


@triton.jit(do_not_specialize=["N", "NB", "span_k", "per_prog", "capacity"])  # row counts: one variant
def _gating_finish_kernel(
    # Pointers
    expert_ptr,  # [T * K] int32
    slot_ptr,  # [T * K] int32 in: rank within the span; out: slot, -1 when dropped
    span_count_ptr,  # [NB, E] int32 span counts (read only)
    span_score_ptr,  # [NB, E] span partial score sums
    span_zsq_ptr,  # [NB] span partial lse^2 sums
    used_ptr,  # [E] int32 carried used capacity
    count_ptr,  # [E] int32 out: counts_E
    used_out_ptr,  # [E] int32 out: used_E + counts_E
    score_ptr,  # [E] out: score_sum_E
    zsq_ptr,  # [] out: zsq_sum
    kept_ptr,  # [E] int32 out: the call's kept rows (HAS_KEPT only)
    tot_kept_ptr,  # [E] int64 in/out: running kept rows (HAS_TOTALS only)
    tot_score_ptr,  # [E] in/out: running score_sum_E (idem)
    tot_zsq_ptr,  # [] in/out: running zsq_sum (idem)
    row_ptr,  # [T * K] int32 out: dispatch rows, -1 when dropped (HAS_ROWS only)
    # Sizes
    N,  # assignments: T * K
    NB,  # spans
    E,
    span_k,  # assignments per span: span * K
    per_prog,  # assignments per slot program (a multiple of BLOCK)
    capacity,  # slots per expert (INT32_MAX when dropless)
    # Meta-parameters
    HAS_KEPT: tl.constexpr,
    HAS_TOTALS: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    SCAN_BLOCK_B: tl.constexpr,  # spans per step of a sums program
    SCAN_BLOCK_E: tl.constexpr,  # expert columns per sums program
    BLOCK: tl.constexpr,  # assignments per step of a slot program
    BLOCK_B: tl.constexpr,  # spans per step of a slot program's pass over the span counts
    BLOCK_E: tl.constexpr,  # next_pow2(E): a slot program's expert lanes
):
    # The first cdiv(E, SCAN_BLOCK_E) programs are sums programs, the others slot programs. The sums
    # programs write nothing the slot programs read, so they need no order between them.
    pid = tl.program_id(0)
    n_sums = tl.cdiv(E, SCAN_BLOCK_E)
    if pid < n_sums:
        # -- sums program: the call's counts, carried counter, score sums and kept rows (and totals) of
        # SCAN_BLOCK_E expert columns, reducing the span counts and sums in span order --
        offs_e = pid * SCAN_BLOCK_E + tl.arange(0, SCAN_BLOCK_E)
        mask_e = offs_e < E
        b_used = tl.load(used_ptr + offs_e, mask=mask_e, other=0)
        b_carry = b_used
        b_score = tl.zeros([SCAN_BLOCK_E], dtype=span_score_ptr.dtype.element_ty)
        for b0 in range(0, NB, SCAN_BLOCK_B):
            offs_b = b0 + tl.arange(0, SCAN_BLOCK_B)
            mask = (offs_b < NB)[:, None] & mask_e[None, :]
            offs = offs_b[:, None] * E + offs_e[None, :]
            b_carry += tl.sum(tl.load(span_count_ptr + offs, mask=mask, other=0), axis=0)
            b_score += tl.sum(tl.load(span_score_ptr + offs, mask=mask, other=0.0), axis=0)
        tl.store(count_ptr + offs_e, b_carry - b_used, mask=mask_e)
        tl.store(used_out_ptr + offs_e, b_carry, mask=mask_e)
        tl.store(score_ptr + offs_e, b_score, mask=mask_e)
        if HAS_KEPT or HAS_TOTALS:
            _store_kept(
                kept_ptr,
                tot_kept_ptr,
                tot_score_ptr,
                offs_e,
                mask_e,
                b_used,
                b_carry - b_used,
                b_score,
                capacity,
                HAS_KEPT,
                HAS_TOTALS,
            )
        # The z-loss partials, reduced in span order by the first sums program.
        if pid == 0:
            b_zsq = tl.zeros([SCAN_BLOCK_B], dtype=span_zsq_ptr.dtype.element_ty)
            for b0 in range(0, NB, SCAN_BLOCK_B):
                offs_b = b0 + tl.arange(0, SCAN_BLOCK_B)
                b_zsq += tl.load(span_zsq_ptr + offs_b, mask=offs_b < NB, other=0.0)
            b_zsq_sum = tl.sum(b_zsq, axis=0)
            tl.store(zsq_ptr, b_zsq_sum)
            if HAS_TOTALS:
                tl.store(tot_zsq_ptr, tl.load(tot_zsq_ptr) + b_zsq_sum)
    else:
        # -- slot program: assignments [a_start, a_end); slot = the first slot of its span + its rank in
        # the span, -1 past capacity; with HAS_ROWS its dispatch row. The spans' first slots are made
        # here from the raw span counts (integers: the values a scan over them gives). (Its names differ
        # from the sums branch's: Triton merges the names both branches assign.) --
        a_start = (pid - n_sums) * per_prog
        a_end = a_start + tl.minimum(per_prog, N - a_start)
        b_cur = a_start // span_k  # the span the next step starts in
        lanes = tl.arange(0, BLOCK_E)
        mask_lanes = lanes < E
        # One pass over the span counts: b_pre, the first slot of span b_cur per expert (the carried
        # counter plus the spans before it), and with the rows the call's counts (all spans) for their base.
        b_carried = tl.load(used_ptr + lanes, mask=mask_lanes, other=0)
        b_pre = b_carried
        b_counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        if HAS_ROWS:
            n_pass = NB
        else:
            n_pass = b_cur
        for s0 in range(0, n_pass, BLOCK_B):
            offs_s = s0 + tl.arange(0, BLOCK_B)
            b_cnt = tl.load(
                span_count_ptr + offs_s[:, None] * E + lanes[None, :],
                mask=(offs_s < n_pass)[:, None] & mask_lanes[None, :],
                other=0,
            )
            b_pre += tl.sum(tl.where((offs_s < b_cur)[:, None], b_cnt, 0), axis=0)
            if HAS_ROWS:
                b_counts += tl.sum(b_cnt, axis=0)
        if HAS_ROWS:
            b_base = _rows_base(b_carried, b_counts, capacity)
        # Per step, the spans it touches (b_cur..b_hi) in order: a span's first slots are b_pre, gathered
        # on each of its assignments' expert lanes; b_pre then steps over every span but the last (the next
        # step may continue it).
        for i0 in range(a_start, a_end, BLOCK):
            offs_a = i0 + tl.arange(0, BLOCK)  # int32: N = T * K < 2^31
            mask_a = offs_a < a_end
            b_e = tl.load(expert_ptr + offs_a, mask=mask_a, other=0)
            b_span = offs_a // span_k
            b_hi = (tl.minimum(i0 + BLOCK, a_end) - 1) // span_k
            b_first = tl.zeros([BLOCK], dtype=tl.int32)
            for b in range(b_cur, b_hi + 1):
                b_first = tl.where(b_span == b, tl.gather(b_pre, b_e, 0), b_first)
                b_row = tl.load(span_count_ptr + b * E + lanes, mask=mask_lanes, other=0)
                b_pre += tl.where(b < b_hi, b_row, 0)
            b_cur = b_hi
            b_slot = b_first + tl.load(slot_ptr + offs_a, mask=mask_a, other=0)
            b_slot = tl.where(b_slot < capacity, b_slot, -1)
            tl.store(slot_ptr + offs_a, b_slot, mask=mask_a)
            if HAS_ROWS:
                b_row_TK = _rows_of_slots(b_base, tl.where(b_slot >= 0, b_e, 0), b_slot)
                tl.store(row_ptr + offs_a, b_row_TK, mask=mask_a)


@triton.autotune(
    configs=_token_tile_configs(),
    key=["E", "K"],
    prune_configs_by={"early_config_prune": _token_tile_prune(_ENV_BWD_CONFIG)},
)
@triton.jit(do_not_specialize=["T"])  # row counts: one compiled variant for any chunk
def _gating_bwd_kernel(
    # Pointers
    logits_ptr,  # [T, E] float32 | float64 (strided)
    expert_ptr,  # [T, K] int32 chosen experts (strided)
    grad_w_ptr,  # [T, K] grad of weight_TK (strided; unused unless HAS_GRAD_W)
    grad_p_ptr,  # [E] grad of score_sum_E (strided; unused unless HAS_GRAD_P)
    grad_z_ptr,  # [] grad of zsq_sum (unused unless HAS_GRAD_Z)
    grad_logits_ptr,  # [T, E] out, contiguous, logits dtype
    # Sizes
    T,
    E,
    K,
    scale_hi,  # the weights' scaling = scale_hi + scale_lo (float32 halves; used if HAS_SCALE)
    scale_lo,
    # Strides
    stride_lt,
    stride_le,
    stride_et,
    stride_ek,
    stride_gt,
    stride_gk,
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
    # -- phase 1: load the tile's logits, recompute softmax and scores --
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    acc_dtype = logits_ptr.dtype.element_ty
    b_eps = tl.full([BLOCK_T], _NORM_EPS, acc_dtype)

    b_l = tl.load(
        logits_ptr + offs_t64[:, None] * stride_lt + offs_e[None, :] * stride_le,
        mask=mask_t[:, None] & mask_e[None, :],
        other=0.0,
    )
    b_l = tl.where(mask_e[None, :], b_l, float("-inf"))
    b_max = tl.max(b_l, axis=1)
    b_exp = tl.exp(b_l - b_max[:, None])
    b_den = tl.sum(b_exp, axis=1)
    b_p = b_exp / b_den[:, None]  # softmax, 0 on padded lanes
    if SIGMOID:
        b_s = tl.where(mask_e[None, :], tl.sigmoid(b_l), 0.0)
    else:
        b_s = b_p

    # -- phase 2: gradient on the scores from the weights' and aux statistics' gradients --
    b_gs = tl.zeros([BLOCK_T, BLOCK_E], dtype=acc_dtype)  # gradient on the scores
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
            b_topsum = tl.sum(tl.where(b_sel, b_s, 0.0), axis=1) + b_eps  # (padded rows: 0 / eps)
            b_dot = tl.sum(tl.where(b_sel, b_gw * b_s, 0.0), axis=1) / b_topsum  # sum_k g_w * w
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
        b_tot = tl.sum(b_s, axis=1) + b_eps
        b_dot = tl.sum(b_gp[None, :] * b_s, axis=1) / b_tot
        b_gs += (b_gp[None, :] - b_dot[:, None]) / b_tot[:, None]

    # -- phase 3: through the score function (and the z-loss) to the logits; store --
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
