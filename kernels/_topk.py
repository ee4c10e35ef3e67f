"""Top-k over the expert lanes of a [BLOCK_T, BLOCK_E] register tile: the selection of the gating
forward kernel (:mod:`lancet_rt.kernels.gating`) when experts are chosen by a biased score and/or within
the token's best groups (DeepSeek-V3's router: ``e_score_correction_bias``, ``n_group``,
``topk_group``). Device functions only, inlined into the kernel; the plain selection (scores
only, no groups) stays in the kernel as it was.

Semantics (:func:`lancet_rt.kernels.reference.gating_fwd_ref`): a stable descending sort of the selection
score, NaN first, ties to the lower index, with the experts of non-kept groups after all others.
A biased selection score can be +-inf, so unlike the plain path no value can stand for "taken":
a per-lane integer code orders equal keys instead (see :func:`select_topk`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def select_topk(b_sel, b_allowed, K, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """The round (0..K-1) in which each lane of a [BLOCK_T, BLOCK_E] tile is chosen, else -1:
    K rounds of (max, then the first lane at the max) over the allowed lanes of ``b_sel``.

    Equal to a stable descending sort (NaN first) with the disallowed lanes moved last, for any
    selection score (a biased one may be +-inf): a lane's *code* breaks ties among equal keys,
    lowest first: lane + 0 (NaN, competing as +inf), + BLOCK_E (other allowed), + 2 BLOCK_E
    (disallowed, key -inf), + (3 + k) BLOCK_E once taken in round k (key -inf), so an allowed -inf
    lane still beats every disallowed or taken one, and the round is read back from the code.
    """
    lanes = tl.arange(0, BLOCK_E)[None, :]
    b_ok = b_sel == b_sel
    b_key = tl.where(b_allowed, tl.where(b_ok, b_sel, float("inf")), float("-inf"))
    b_code = lanes + tl.where(b_allowed, tl.where(b_ok, BLOCK_E, 0), 2 * BLOCK_E)
    for k in range(K):
        b_best = tl.max(b_key, axis=1)
        b_lane = tl.min(tl.where(b_key == b_best[:, None], b_code, 2**30), axis=1) % BLOCK_E
        b_hit = lanes == b_lane[:, None]
        b_key = tl.where(b_hit, float("-inf"), b_key)
        b_code = tl.where(b_hit, lanes + (3 + k) * BLOCK_E, b_code)
    return tl.where(b_code >= 3 * BLOCK_E, b_code // BLOCK_E - 3, -1)


@triton.jit
def kept_groups(
    b_sel, mask_e, n_group, topk_group, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr
):
    """[BLOCK_T, BLOCK_G * BLOCK_GS] bool: the lanes whose group is among the token's
    ``topk_group`` best, for a tile in the group-major lane layout of the forward kernel.

    How: the tile is reshaped to [BLOCK_T, BLOCK_G, BLOCK_GS] (each group on its own row; a
    relabelling of the same registers) and each group's score, the sum of its top two selection
    scores, is two row maxima: m1, then m2 = the max without the lanes equal to m1, or m1 itself
    when two lanes hold it (a duplicated best). A group holding a NaN scores NaN (its sorted top
    two start with the NaN, as in the reference). The topk_group best of the [BLOCK_T, BLOCK_G]
    group scores are then picked in rounds as in :func:`select_topk` (NaN first, ties to the lower
    group), and the kept flags are broadcast back over the group's lanes. Extra work per tile:
    about six tile-wide operations, whatever the number of groups; extra live registers: none
    tile-sized beyond the transient ones (the group tiles are BLOCK_GS times smaller).
    """
    b_sel3 = tl.reshape(b_sel, [BLOCK_T, BLOCK_G, BLOCK_GS])
    mask3 = tl.reshape(mask_e, [BLOCK_G, BLOCK_GS])[None, :, :]
    b_nan = tl.sum(tl.where(b_sel3 == b_sel3, 0.0, b_sel3), axis=2)  # NaN if the group holds one, else 0
    b_key3 = tl.where(mask3, tl.where(b_sel3 == b_sel3, b_sel3, float("inf")), float("-inf"))
    b_m1 = tl.max(b_key3, axis=2)
    if BLOCK_GS == 1:  # one expert per group: its own score
        b_score = b_m1 + b_nan
    else:
        b_is1 = b_key3 == b_m1[:, :, None]
        b_m2 = tl.max(tl.where(b_is1, float("-inf"), b_key3), axis=2)
        b_m2 = tl.where(tl.sum(b_is1.to(tl.int32), axis=2) > 1, b_m1, b_m2)
        b_score = b_m1 + b_m2 + b_nan

    groups = tl.arange(0, BLOCK_G)[None, :]
    mask_g = groups < n_group
    b_ok = b_score == b_score
    b_key = tl.where(mask_g, tl.where(b_ok, b_score, float("inf")), float("-inf"))
    b_code = groups + tl.where(mask_g, tl.where(b_ok, BLOCK_G, 0), 2 * BLOCK_G)
    b_kept = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int32)
    for _ in range(topk_group):
        b_best = tl.max(b_key, axis=1)
        b_group = tl.min(tl.where(b_key == b_best[:, None], b_code, 3 * BLOCK_G), axis=1) % BLOCK_G
        b_hit = groups == b_group[:, None]
        b_kept = tl.where(b_hit, 1, b_kept)
        b_key = tl.where(b_hit, float("-inf"), b_key)
        b_code = tl.where(b_hit, groups + 2 * BLOCK_G, b_code)
    b_kept3 = tl.broadcast_to(b_kept[:, :, None], [BLOCK_T, BLOCK_G, BLOCK_GS])
    return tl.reshape(b_kept3, [BLOCK_T, BLOCK_G * BLOCK_GS]) != 0
