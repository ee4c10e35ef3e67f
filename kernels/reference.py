"""Plain PyTorch references for every lancet-rt kernel.

These functions define the semantics the Triton kernels must meet (docs/design.md, routing contract),
and they are the ``LANCET_KERNELS=torch`` path of the runtime, except the experts', whose CPU path is
:mod:`lancet_rt.kernels.cpu_backend` (tested against them). Tests and benchmarks import them from
here so the baseline cannot drift.

Shape letters: T tokens, E experts, K top-k, D model, F expert hidden, S dispatch rows
(kept assignments), R rows received by local experts, N/M GEMM output/input features.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .reference_experts import (  # noqa: F401 - the experts' references, re-exported (one namespace of _ref)
    ACTIVATIONS,
    _acc,
    _bounds,
    _check_activation,
    gate_up_swiglu_ref,
    grouped_mm_dw_pair_ref,
    grouped_mm_dw_ref,
    grouped_mm_dx_ref,
    grouped_mm_ref,
    segment_sum_ref,
    swiglu_bwd_ref,
    swiglu_fwd_ref,
)


class GatingOutput(NamedTuple):
    """Outputs of the gating step for one chunk of tokens.

    Attributes:
        expert_TK: int32 [T, K], the chosen experts, best first (ties to the lower index).
        weight_TK: float [T, K], the combine weights (renormalised over K if asked). Dropped
            assignments keep their weight here; their ``slot_TK`` is -1.
        slot_TK: int32 [T, K], the assignment's slot within its expert over the whole batch
            (``used_E[e]`` carried from earlier chunks plus its rank in this chunk, token order
            then k order), or -1 when the slot is at or past the capacity.
        counts_E: int32 [E], assignments per expert in this chunk, before dropping.
        used_E: int32 [E], the carried counter after this chunk: ``used_E_in + counts_E``.
        score_sum_E: float [E], the sum over this chunk's tokens of each token's scores
            normalised to sum 1 (for the aux loss P_e).
        zsq_sum: float [], the sum over this chunk's tokens of logsumexp(logits)^2.
    """

    expert_TK: torch.Tensor
    weight_TK: torch.Tensor
    slot_TK: torch.Tensor
    counts_E: torch.Tensor
    used_E: torch.Tensor
    score_sum_E: torch.Tensor
    zsq_sum: torch.Tensor


#: Added to every sum the routing divides by (a token's K chosen scores with ``normalize_topk``, its E
#: scores in the aux statistics), as transformers' DeepSeek-V3 router and torchtitan do: a token whose
#: scores all underflow to 0 (sigmoid, float32 logits below about -104) gets weights 0, not 0/0 = NaN.
#: It changes no float32 result whose sum is at least 2**-42 (``s + 1e-20 == s`` there), nor a
#: float64 one from 2**-13; softmax sums are at least 1/E.
NORM_EPS = 1e-20


def _scores(logits_TE: torch.Tensor, score_fn: str) -> torch.Tensor:
    if score_fn == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if score_fn == "sigmoid":
        return torch.sigmoid(logits_TE)
    raise ValueError(f"score_fn must be 'softmax' or 'sigmoid', got {score_fn!r}")


_BIAS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_router_args(E: int, top_k: int, expert_bias, n_group, topk_group, scaling, device) -> int:
    """Validate the router-variant arguments of the gating forward; returns ``topk_group`` resolved.

    Shared by :func:`gating_fwd_ref` and the Triton launcher, so both reject the same input.
    Raises TypeError / ValueError naming the argument.
    """
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor):
            raise TypeError(f"expert_bias must be None or a torch.Tensor, got {type(expert_bias).__name__}")
        if expert_bias.dtype not in _BIAS_DTYPES:
            raise TypeError(
                f"expert_bias must have a float dtype {[str(d) for d in _BIAS_DTYPES]}, got {expert_bias.dtype}"
            )
        if tuple(expert_bias.shape) != (E,):
            raise ValueError(
                f"expert_bias must have shape ({E},) (one entry per expert), got {tuple(expert_bias.shape)}"
            )
        if expert_bias.device != device:
            raise ValueError(f"expert_bias must be on {device} (the logits' device), got {expert_bias.device}")
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or E % n_group:
        raise ValueError(f"n_group must be an int >= 1 dividing E={E}, got {n_group!r}")
    if topk_group is None:
        topk_group = n_group
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be None or an int in [1, n_group={n_group}], got {topk_group!r}")
    if top_k > topk_group * (E // n_group):
        raise ValueError(
            f"top_k={top_k} must be <= topk_group * E / n_group = {topk_group} * {E // n_group}: "
            "the kept groups hold too few experts"
        )
    check_scaling(scaling)
    return topk_group


def check_scaling(scaling) -> None:
    """The gating backward's one router-variant argument (see :func:`check_router_args`)."""
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise TypeError(f"scaling must be a float, got {type(scaling).__name__}")
    if not (math.isfinite(scaling) and scaling > 0):
        raise ValueError(f"scaling must be finite and > 0, got {scaling!r}")


def _select_order(scores_TE, expert_bias, n_group, topk_group):
    """Experts of each token in selection order: best first by ``scores + expert_bias``, NaN
    first and ties to the lower index (a stable descending sort), experts outside the token's
    ``topk_group`` best groups after all the others."""
    T, E = scores_TE.shape
    sel_TE = scores_TE if expert_bias is None else scores_TE + expert_bias.to(scores_TE.dtype)
    _, order_TE = torch.sort(sel_TE, dim=-1, descending=True, stable=True)
    if n_group == 1:
        return order_TE
    # Group score: the sum of the group's top min(2, E / n_group) selection scores (DeepSeek-V3).
    top = torch.sort(sel_TE.view(T, n_group, E // n_group), dim=-1, descending=True, stable=True).values
    group_TG = top[..., 0] + top[..., 1] if E // n_group >= 2 else top[..., 0]
    _, group_order = torch.sort(group_TG, dim=-1, descending=True, stable=True)
    kept_TG = torch.zeros(T, n_group, dtype=torch.bool, device=scores_TE.device)
    kept_TG.scatter_(1, group_order[:, :topk_group], True)
    blocked_TE = ~kept_TG.repeat_interleave(E // n_group, dim=1)
    # A stable sort on "blocked" moves the other groups' experts last, keeping every order else.
    last = torch.sort(blocked_TE.gather(1, order_TE).to(torch.uint8), dim=-1, stable=True).indices
    return order_TE.gather(1, last)


def _topk_weights(scores_TE, expert_TK, normalize_topk, scaling=1.0):
    w_TK = torch.gather(scores_TE, 1, expert_TK if expert_TK.dtype == torch.int64 else expert_TK.long())
    if normalize_topk:
        w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + NORM_EPS)
    if scaling != 1.0:
        w_TK = w_TK * scaling
    return w_TK


def gating_fwd_ref(
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
) -> GatingOutput:
    """Scores, top-k, capacity slots and aux/z statistics for one chunk of router logits.

    Selection (DeepSeek-V3's router when ``expert_bias`` / ``n_group`` are given): experts are
    ranked by the selection score ``scores + expert_bias``; with ``n_group > 1`` the experts are
    ``n_group`` groups of E / n_group consecutive ones, each group scored by the sum of its top
    min(2, E / n_group) selection scores, and only the ``topk_group`` best groups' experts can be
    chosen. Rankings break ties to the lower index, and a NaN ranks first (as ``torch.sort``).
    The weights are the *unbiased* scores of the chosen experts, normalised if asked, then times
    ``scaling``.

    Args:
        logits_TE: float32 (or float64) [T, E] router logits.
        top_k: experts per token, 1 <= top_k <= topk_group * E / n_group.
        used_E: int32 [E] assignments claimed by earlier chunks of the same batch (None: zeros).
        capacity: slots per expert for the whole batch, or None for dropless.
        score_fn: "softmax" or "sigmoid".
        normalize_topk: divide the K weights of a token by their sum (+ :data:`NORM_EPS`).
        expert_bias: None or float [E] added to the scores for selection only (DeepSeek-V3's
            ``e_score_correction_bias``); it gets no gradient.
        n_group: expert groups, dividing E; 1 (default): no group restriction.
        topk_group: groups kept per token, 1..n_group (None: n_group).
        scaling: factor on the K weights after the normalisation (``routed_scaling_factor``).

    Returns:
        :class:`GatingOutput`.
    """
    T, E = logits_TE.shape
    dev = logits_TE.device
    topk_group = check_router_args(E, top_k, expert_bias, n_group, topk_group, scaling, dev)
    scores_TE = _scores(logits_TE, score_fn)
    order_TE = _select_order(scores_TE, expert_bias, n_group, topk_group)
    chosen_TK = order_TE[:, :top_k]
    weight_TK = _topk_weights(scores_TE, chosen_TK, normalize_topk, scaling)

    if used_E is None:
        used_E = torch.zeros(E, dtype=torch.int32, device=dev)
    slot, counts_E = _slots(chosen_TK.reshape(-1), used_E)
    if capacity is not None:
        slot.masked_fill_(slot >= capacity, -1)
    slot_TK = slot.view(T, top_k)

    # (softmax scores sum to 1 already: no renormalisation)
    norm_TE = scores_TE if score_fn == "softmax" else scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + NORM_EPS)
    score_sum_E = norm_TE.sum(dim=0)
    lse_T = torch.logsumexp(logits_TE, dim=-1)
    zsq_sum = torch.dot(lse_T, lse_T)
    return GatingOutput(
        chosen_TK.to(torch.int32), weight_TK, slot_TK, counts_E, used_E + counts_E, score_sum_E, zsq_sum
    )


#: Above this many [T * K, E] cells the slots come from a sort, not a one-hot running count.
_ONE_HOT_CELLS = 1 << 22


def _slots(flat_e: torch.Tensor, used_E: torch.Tensor) -> tuple:
    """(int32 slot of each assignment, int32 counts_E): ``used_E[e]`` plus the assignment's rank among
    this chunk's assignments to the same expert, in flat (token, then k) order."""
    A, E = flat_e.numel(), used_E.numel()
    if 0 < A * E <= _ONE_HOT_CELLS:
        # The running count of each expert down the assignments (a few ops: this is the CPU path,
        # run once per chunk): the assignment's own cell is its rank + 1.
        seen = torch.cumsum(flat_e.unsqueeze(1) == torch.arange(E, device=flat_e.device), 0, dtype=torch.int32)
        slot = (seen + (used_E - 1)).gather(1, flat_e.unsqueeze(1)).view(A)
        # (counts as a copy: a view of the last row would keep the [A, E] count alive with the counts)
        return slot.to(torch.int32), seen[-1].clone()
    counts_E = torch.bincount(flat_e, minlength=E)
    # Stable sort by expert, then position minus the group start.
    order = torch.argsort(flat_e, stable=True)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank = torch.empty_like(flat_e)
    rank[order] = torch.arange(A, device=flat_e.device) - starts_E[flat_e[order]]
    return (used_E[flat_e] + rank).to(torch.int32), counts_E.to(torch.int32)


def gating_bwd_ref(
    logits_TE: torch.Tensor,
    expert_TK: torch.Tensor,
    grad_weight_TK: Optional[torch.Tensor],
    grad_score_sum_E: Optional[torch.Tensor],
    grad_zsq_sum: Optional[torch.Tensor],
    *,
    score_fn: str = "softmax",
    normalize_topk: bool = True,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Gradient of the logits from the gradients of ``weight_TK``, ``score_sum_E`` and ``zsq_sum``.

    The top-k choice (expert bias and groups included) is piecewise constant, so only the weights'
    values (times ``scaling``) carry gradient. Any of the three incoming gradients may be None (zero).

    Returns:
        grad_logits_TE, same dtype and shape as ``logits_TE``.
    """
    check_scaling(scaling)
    if grad_weight_TK is None and grad_score_sum_E is None and grad_zsq_sum is None:
        return torch.zeros_like(logits_TE)
    scores_TE = _scores(logits_TE, score_fn)
    base = None  # the aux term's gradient of the scores
    if grad_score_sum_E is not None:
        g_E = grad_score_sum_E.to(scores_TE.dtype)
        if score_fn == "softmax":
            # score_sum = sum over tokens of s / sum_e(s), and softmax scores sum to 1: the
            # renormalisation is the identity, and g_E reaches the softmax Jacobian as it is
            base = g_E
        else:
            S_T1 = scores_TE.sum(dim=-1, keepdim=True) + NORM_EPS
            base = (g_E - (scores_TE * g_E).sum(dim=-1, keepdim=True) / S_T1) / S_T1
    grad_scores = None if base is None else base.expand_as(scores_TE)
    if grad_weight_TK is not None:
        # w_k = scaling * s[e_k] / G (G = the sum of the K chosen scores + NORM_EPS when normalising, else 1)
        e_TK = expert_TK.long()
        s_TK = scores_TE.gather(1, e_TK)
        gw_TK = grad_weight_TK.to(scores_TE.dtype)
        if scaling != 1.0:
            gw_TK = gw_TK * scaling
        if normalize_topk:
            G_T1 = s_TK.sum(dim=-1, keepdim=True) + NORM_EPS
            gw_TK = (gw_TK - (gw_TK * s_TK).sum(dim=-1, keepdim=True) / G_T1) / G_T1
        grad_scores = (torch.zeros_like(scores_TE) if grad_scores is None else grad_scores).scatter_add(1, e_TK, gw_TK)
    grad = None
    if grad_scores is not None:
        if score_fn == "softmax":  # s * (g - sum(g * s)): autograd's own softmax backward, one op
            grad = torch._softmax_backward_data(grad_scores, scores_TE, -1, scores_TE.dtype)
        else:
            grad = grad_scores * scores_TE * (1 - scores_TE)
    if grad_zsq_sum is not None:
        # d/dl of lse(l)^2 = 2 lse softmax(l)
        lse_T1 = torch.logsumexp(logits_TE, dim=-1, keepdim=True)
        softmax_TE = scores_TE if score_fn == "softmax" else torch.softmax(logits_TE, dim=-1)
        gz = (2 * grad_zsq_sum.to(logits_TE.dtype)) * lse_T1 * softmax_TE
        grad = gz if grad is None else grad + gz
    return grad.to(logits_TE.dtype)


def dispatch_rows_ref(
    expert_TK: torch.Tensor, slot_TK: torch.Tensor, used_E: torch.Tensor, kept_E: torch.Tensor
) -> torch.Tensor:
    """Row of each kept assignment in the dispatch layout (grouped by expert), -1 when dropped.

    Rows of expert e in this chunk are contiguous, in slot order, starting after the kept rows of
    experts < e. Since expert e lives on rank e // E_local, the layout is also grouped by rank.

    Args:
        expert_TK, slot_TK: from :func:`gating_fwd_ref`.
        used_E: int32 [E] the carried counter *before* this chunk.
        kept_E: int [E] kept assignments per expert in this chunk.
    """
    base_E = torch.cumsum(kept_E, 0, dtype=torch.int32) - kept_E - used_E  # row of slot 0 of each expert
    row = base_E[expert_TK] + slot_TK
    return row.masked_fill_(slot_TK < 0, -1).to(torch.int32)


def permute_fwd_ref(x_TD: torch.Tensor, row_TK: torch.Tensor, num_rows: int):
    """Copy token rows into the dispatch layout.

    Args:
        x_TD: [T, D] tokens.
        row_TK: int32 [T, K] destination row of each assignment, -1 when dropped. Kept rows are
            a bijection onto ``range(num_rows)``.
        num_rows: S, the number of kept assignments.

    Returns:
        (x_SD [S, D], src_S int32 [S]): the rows, and for each row the flat assignment index
        t * K + k it came from (the inverse map).
    """
    T, K = row_TK.shape
    # Scatter each assignment's index to its row; the dropped ones (row -1) all land in one extra
    # scratch row past the end, cut off.
    src = torch.empty(num_rows + 1, dtype=torch.int32, device=x_TD.device)
    src[row_TK.reshape(-1)] = torch.arange(T * K, dtype=torch.int32, device=x_TD.device)
    src_S = src[:num_rows]
    x_SD = x_TD.index_select(0, torch.div(src_S, K, rounding_mode="floor"))
    return x_SD, src_S


def _rows(x_SD: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """x_SD[row] (any index shape) with the dropped (-1) rows read as row 0, to be masked; zeros when
    S = 0 (every assignment of the chunk dropped: there is no row 0 to read)."""
    if x_SD.shape[0] == 0:
        return x_SD.new_zeros(tuple(row.shape) + tuple(x_SD.shape[1:]))
    return torch.embedding(x_SD, row.clamp(min=0))


def _assignment_rows(x_SD: torch.Tensor, row_TK: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(rows [T, K, D] in ``dtype``: x_SD's row of every assignment, kept [T, K, 1] or None when
    every assignment is kept); all K at once (one gather, not one per k: these references are the
    layer's CPU path, run once per chunk)."""
    T, K = row_TK.shape
    if x_SD.shape[0] == T * K:  # S = T K rows are a bijection onto the assignments: none dropped
        # (``embedding``, the row gather as one ATen op: a quarter of advanced indexing's host cost on
        # CPU at chunk sizes; a -1 here, a padded buffer passed for the kept rows, raises instead of
        # reading the last row)
        return torch.embedding(x_SD, row_TK).to(dtype), None
    return _rows(x_SD, row_TK).to(dtype), (row_TK >= 0).unsqueeze(2)


def _masked(kept, t: torch.Tensor) -> torch.Tensor:
    """``t`` with the dropped assignments' entries zero (``kept`` None: none dropped)."""
    return t if kept is None else torch.where(kept, t, 0.0)


def permute_bwd_ref(grad_x_SD: torch.Tensor, row_TK: torch.Tensor) -> torch.Tensor:
    """grad_x_TD[t] = sum over kept k of grad_x_SD[row_TK[t, k]] (float32 accumulation)."""
    rows, kept = _assignment_rows(grad_x_SD, row_TK, _acc(grad_x_SD))
    return _masked(kept, rows).sum(dim=1).to(grad_x_SD.dtype)


def unpermute_fwd_ref(y_SD: torch.Tensor, row_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum over kept k of weight_TK[t, k] * y_SD[row_TK[t, k]].

    Gather-based and float32-accumulated; the result has ``y_SD``'s dtype.
    """
    rows, kept = _assignment_rows(y_SD, row_TK, _acc(y_SD))
    return _masked(kept, weight_TK.unsqueeze(2).to(rows.dtype) * rows).sum(dim=1).to(y_SD.dtype)


def unpermute_bwd_ref(
    grad_y_TD: torch.Tensor,
    y_SD: torch.Tensor,
    row_TK: torch.Tensor,
    weight_TK: torch.Tensor,
    src_S: torch.Tensor,
):
    """Gradients of :func:`unpermute_fwd_ref`.

    Returns:
        (grad_y_SD [S, D] in y's dtype, grad_weight_TK float32 [T, K], zero where dropped).
    """
    T, K = row_TK.shape
    src = src_S  # (index_select takes int32 indices: no cast)
    acc = _acc(y_SD)
    w_S = weight_TK.reshape(-1).to(acc).index_select(0, src)
    tok_S = torch.div(src, K, rounding_mode="floor")  # (not ``src // K``: Tensor.__floordiv__ is a Python wrapper)
    gy_SD = grad_y_TD.to(acc).index_select(0, tok_S)  # each row's token's gradient (both products read it)
    grad_y_SD = (gy_SD * w_S.unsqueeze(1)).to(y_SD.dtype)
    # The weights' gradient, dot(y row, its token's gradient), in the rows' order, then gathered to
    # [T, K]: the products and the sums over D of a gather of y's rows to [T, K, D], without the gather
    y_S = y_SD if y_SD.shape[0] == src.shape[0] else y_SD[: src.shape[0]]  # (a padded buffer: its rows)
    dots, kept = _assignment_rows((y_S.to(acc) * gy_SD).sum(dim=1, keepdim=True), row_TK, acc)
    grad_w = _masked(kept, dots).squeeze(2)
    if weight_TK.dtype == torch.float64:
        grad_w = grad_w.to(torch.float64)
    return grad_y_SD, grad_w


def regroup_rows_ref(counts_WL: torch.Tensor, total: int, experts: Optional[int] = None):
    """Row maps between the received (rank-major) and the grouped (expert-major) order of an all-to-all.

    Row j of block (w, l) (rows received from rank w for local expert l) is received at
    ``start[w, l] + j`` (blocks in (w, l) order) and grouped at ``first[l, w] + j`` (blocks in
    (l, w) order).

    Args:
        counts_WL: integer [W, L] rows per (rank, local expert), on the rows' device (any strides).
        total: R, the sum of the counts (known on the host: the received split sizes).
        experts: L when only the first L columns are counts (None: all).

    Returns:
        (to_expert [R], to_rank [R], offsets_L1 [L + 1]), int64: ``to_expert[g]`` the received row of
        grouped row g, ``to_rank`` its inverse, ``offsets_L1`` the local experts' segment bounds in the
        grouped order.
    """
    if experts is not None:
        counts_WL = counts_WL[:, :experts]
    W, L = counts_WL.shape
    dev = counts_WL.device
    c_B = counts_WL.long().reshape(-1)  # (w, l) blocks
    start_B = torch.cumsum(c_B, 0) - c_B
    c_LW = counts_WL.long().t().reshape(-1)  # (l, w) blocks
    first_B = (torch.cumsum(c_LW, 0) - c_LW).view(L, W).t().reshape(-1)
    block_R = torch.repeat_interleave(torch.arange(W * L, device=dev), c_B, output_size=total)
    rows = torch.arange(total, device=dev)
    to_rank = first_B[block_R] + rows - start_B[block_R]
    to_expert = torch.empty_like(to_rank).index_put_((to_rank,), rows)
    offsets_L1 = torch.zeros(L + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts_WL.long().sum(0), 0, out=offsets_L1[1:])
    return to_expert, to_rank, offsets_L1
