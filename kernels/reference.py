"""Plain PyTorch references for every lancet-rt kernel.

These functions define the semantics the Triton kernels must meet (DESIGN.md, routing contract),
and they are the ``LANCET_KERNELS=torch`` path of the runtime. Tests and benchmarks import them
from here so the baseline cannot drift.

Shape letters: T tokens, E experts, K top-k, D model, F expert hidden, S dispatch rows
(kept assignments), R rows received by local experts, N/M GEMM output/input features.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


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


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(logits_TE: torch.Tensor, score_fn: str) -> torch.Tensor:
    if score_fn == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if score_fn == "sigmoid":
        return torch.sigmoid(logits_TE)
    raise ValueError(f"score_fn must be 'softmax' or 'sigmoid', got {score_fn!r}")


def _topk_weights(scores_TE, expert_TK, normalize_topk):
    w_TK = torch.gather(scores_TE, 1, expert_TK.long())
    if normalize_topk:
        w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
    return w_TK


def gating_fwd_ref(
    logits_TE: torch.Tensor,
    top_k: int,
    used_E: Optional[torch.Tensor] = None,
    *,
    capacity: Optional[int] = None,
    score_fn: str = "softmax",
    normalize_topk: bool = True,
) -> GatingOutput:
    """Scores, top-k, capacity slots and aux/z statistics for one chunk of router logits.

    Args:
        logits_TE: float32 (or float64) [T, E] router logits.
        top_k: experts per token, 1 <= top_k <= E.
        used_E: int32 [E] assignments claimed by earlier chunks of the same batch (None: zeros).
        capacity: slots per expert for the whole batch, or None for dropless.
        score_fn: "softmax" or "sigmoid".
        normalize_topk: divide the K weights of a token by their sum.

    Returns:
        :class:`GatingOutput`.
    """
    T, E = logits_TE.shape
    dev = logits_TE.device
    scores_TE = _scores(logits_TE, score_fn)
    # A stable descending sort keeps equal scores in index order: ties go to the lower expert.
    _, order_TE = torch.sort(scores_TE, dim=-1, descending=True, stable=True)
    expert_TK = order_TE[:, :top_k].to(torch.int32)
    weight_TK = _topk_weights(scores_TE, expert_TK, normalize_topk)

    if used_E is None:
        used_E = torch.zeros(E, dtype=torch.int32, device=dev)
    flat_e = expert_TK.reshape(-1).long()
    counts_E = torch.bincount(flat_e, minlength=E)
    # Rank of each assignment among this chunk's assignments to the same expert, in flat
    # (token, then k) order: stable sort by expert, then position minus the group start.
    order = torch.argsort(flat_e, stable=True)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank = torch.empty_like(flat_e)
    rank[order] = torch.arange(flat_e.numel(), device=dev) - starts_E[flat_e[order]]
    slot = used_E.long()[flat_e] + rank
    if capacity is not None:
        slot = torch.where(slot < capacity, slot, torch.full_like(slot, -1))
    slot_TK = slot.view(T, top_k).to(torch.int32)

    norm_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    score_sum_E = norm_TE.sum(dim=0)
    zsq_sum = (torch.logsumexp(logits_TE, dim=-1) ** 2).sum()
    return GatingOutput(
        expert_TK, weight_TK, slot_TK, counts_E.to(torch.int32),
        (used_E.long() + counts_E).to(torch.int32), score_sum_E, zsq_sum,
    )


def gating_bwd_ref(
    logits_TE: torch.Tensor,
    expert_TK: torch.Tensor,
    grad_weight_TK: Optional[torch.Tensor],
    grad_score_sum_E: Optional[torch.Tensor],
    grad_zsq_sum: Optional[torch.Tensor],
    *,
    score_fn: str = "softmax",
    normalize_topk: bool = True,
) -> torch.Tensor:
    """Gradient of the logits from the gradients of ``weight_TK``, ``score_sum_E`` and ``zsq_sum``.

    The top-k choice is piecewise constant, so only the weights' values carry gradient. Any of the
    three incoming gradients may be None (zero).

    Returns:
        grad_logits_TE, same dtype and shape as ``logits_TE``.
    """
    with torch.enable_grad():
        logits = logits_TE.detach().requires_grad_(True)
        scores = _scores(logits, score_fn)
        total = logits.new_zeros(())
        if grad_weight_TK is not None:
            w_TK = _topk_weights(scores, expert_TK, normalize_topk)
            total = total + (w_TK * grad_weight_TK).sum()
        if grad_score_sum_E is not None:
            norm = scores / scores.sum(dim=-1, keepdim=True)
            total = total + (norm.sum(dim=0) * grad_score_sum_E).sum()
        if grad_zsq_sum is not None:
            total = total + (torch.logsumexp(logits, dim=-1) ** 2).sum() * grad_zsq_sum
        if not total.requires_grad:
            return torch.zeros_like(logits_TE)
        (grad,) = torch.autograd.grad(total, logits)
    return grad


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
    start_E = torch.cumsum(kept_E.long(), 0) - kept_E.long()
    e = expert_TK.long()
    row = start_E[e] - used_E.long()[e] + slot_TK.long()
    return torch.where(slot_TK >= 0, row, torch.full_like(row, -1)).to(torch.int32)


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
    flat = row_TK.reshape(-1).long()
    kept = flat >= 0
    src_S = torch.empty(num_rows, dtype=torch.int32, device=x_TD.device)
    src_S[flat[kept]] = torch.nonzero(kept).squeeze(1).to(torch.int32)
    x_SD = x_TD.index_select(0, src_S.long() // K)
    return x_SD, src_S


def _rows(x_SD: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """x_SD[row] with the dropped (-1) rows read as row 0, to be masked; zeros when S = 0 (every
    assignment of the chunk dropped: there is no row 0 to read)."""
    if x_SD.shape[0] == 0:
        return x_SD.new_zeros((row.shape[0],) + tuple(x_SD.shape[1:]))
    return x_SD.index_select(0, row.clamp(min=0))


def permute_bwd_ref(grad_x_SD: torch.Tensor, row_TK: torch.Tensor) -> torch.Tensor:
    """grad_x_TD[t] = sum over kept k of grad_x_SD[row_TK[t, k]] (float32 accumulation)."""
    T, K = row_TK.shape
    acc = torch.zeros(T, grad_x_SD.shape[1], dtype=_acc(grad_x_SD), device=grad_x_SD.device)
    for k in range(K):
        row = row_TK[:, k].long()
        keep = (row >= 0).unsqueeze(1)
        acc += torch.where(keep, _rows(grad_x_SD, row).to(acc.dtype), 0.0)
    return acc.to(grad_x_SD.dtype)


def unpermute_fwd_ref(y_SD: torch.Tensor, row_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum over kept k (in k order) of weight_TK[t, k] * y_SD[row_TK[t, k]].

    Gather-based and float32-accumulated; the result has ``y_SD``'s dtype.
    """
    T, K = row_TK.shape
    acc = torch.zeros(T, y_SD.shape[1], dtype=_acc(y_SD), device=y_SD.device)
    for k in range(K):
        row = row_TK[:, k].long()
        keep = (row >= 0).unsqueeze(1)
        rows = _rows(y_SD, row).to(acc.dtype)
        acc += torch.where(keep, weight_TK[:, k : k + 1].to(acc.dtype) * rows, 0.0)
    return acc.to(y_SD.dtype)


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
    src = src_S.long()
    acc = _acc(y_SD)
    w_S = weight_TK.reshape(-1).to(acc).index_select(0, src)
    grad_y_SD = (grad_y_TD.index_select(0, src // K).to(acc) * w_S.unsqueeze(1)).to(y_SD.dtype)
    grad_w = torch.zeros(T, K, dtype=torch.promote_types(weight_TK.dtype, acc), device=y_SD.device)
    for k in range(K):
        row = row_TK[:, k].long()
        rows = _rows(y_SD, row).to(acc)
        dot = (rows * grad_y_TD.to(acc)).sum(dim=1)
        grad_w[:, k] = torch.where(row >= 0, dot, 0.0)
    return grad_y_SD, grad_w


def _bounds(offsets_E1: torch.Tensor):
    return offsets_E1.tolist()  # host sync: fine for a reference


def grouped_mm_ref(x_RK: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """y[r] = x[r] @ w[e].T for the rows r of segment e = offsets[e]:offsets[e+1].

    Args:
        x_RK: [R, K] rows grouped by local expert.
        w_ENK: [E, N, K] weights (the Hugging Face expert layout: out features first).
        offsets_E1: integer [E + 1] segment bounds, offsets[0] = 0, offsets[E] = R.

    Returns:
        y_RN [R, N] in x's dtype.
    """
    b = _bounds(offsets_E1)
    y = x_RK.new_empty(x_RK.shape[0], w_ENK.shape[1])
    for e in range(w_ENK.shape[0]):
        y[b[e] : b[e + 1]] = x_RK[b[e] : b[e + 1]] @ w_ENK[e].t()
    return y


def grouped_mm_dx_ref(dy_RN: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """dx[r] = dy[r] @ w[e] for the rows of segment e: the input gradient of :func:`grouped_mm_ref`."""
    b = _bounds(offsets_E1)
    dx = dy_RN.new_empty(dy_RN.shape[0], w_ENK.shape[2])
    for e in range(w_ENK.shape[0]):
        dx[b[e] : b[e + 1]] = dy_RN[b[e] : b[e + 1]] @ w_ENK[e]
    return dx


def grouped_mm_dw_ref(dy_RN: torch.Tensor, x_RK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """dw[e] = dy_seg.T @ x_seg over segment e (zeros for an empty segment): the weight gradient.

    Returns:
        dw_ENK [E, N, K] in x's dtype.
    """
    b = _bounds(offsets_E1)
    E = len(b) - 1
    dw = x_RK.new_zeros(E, dy_RN.shape[1], x_RK.shape[1])
    for e in range(E):
        if b[e + 1] > b[e]:
            dw[e] = dy_RN[b[e] : b[e + 1]].t() @ x_RK[b[e] : b[e + 1]]
    return dw


def swiglu_fwd_ref(gu_R2F: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up with gate = gu[:, :F], up = gu[:, F:], computed in float32."""
    g, u = gu_R2F.to(_acc(gu_R2F)).chunk(2, dim=-1)
    return (F.silu(g) * u).to(gu_R2F.dtype)


def swiglu_bwd_ref(gu_R2F: torch.Tensor, grad_h_RF: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`swiglu_fwd_ref` with respect to gu, in gu's dtype."""
    g, u = gu_R2F.to(_acc(gu_R2F)).chunk(2, dim=-1)
    dh = grad_h_RF.to(g.dtype)
    sig = torch.sigmoid(g)
    dg = dh * u * sig * (1 + g * (1 - sig))
    du = dh * g * sig
    return torch.cat([dg, du], dim=-1).to(gu_R2F.dtype)


def gate_up_swiglu_ref(x_RD: torch.Tensor, w_E2FD: torch.Tensor, offsets_E1: torch.Tensor):
    """The expert input projection with its activation: gu = grouped_mm(x, w), h = swiglu(gu).

    Returns:
        (h_RF, gu_R2F): the activation and the pre-activation kept for backward.
    """
    gu = grouped_mm_ref(x_RD, w_E2FD, offsets_E1)
    return swiglu_fwd_ref(gu), gu
