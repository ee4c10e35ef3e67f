"""An independent float64 implementation of docs/design.md's routing contract, written for tests.

Deliberately naive (Python loops for top-k, groups and capacity) and sharing no code with
kernels/ or lancet_rt/, so the layer is checked against the contract, not against itself.
Finite logits only: NaN ordering is the vectorised reference's business.
"""

from __future__ import annotations

import math

import torch


def route_contract_ref(
    logits_TE,
    *,
    top_k,
    capacity=None,
    score_fn="softmax",
    normalize_topk=True,
    expert_bias=None,
    n_group=1,
    topk_group=None,
    scaling=1.0,
):
    """The routing of one whole batch, token by token.

    Selection: experts ranked by score + expert_bias (ties to the lower index); with n_group > 1
    only the experts of the topk_group groups with the highest group score (sum of the group's
    best min(2, E / n_group) selection scores; ties to the lower group) can be chosen. Weights:
    the chosen experts' unbiased scores, divided by their sum + 1e-20 if normalize_topk, times scaling.

    Returns:
        (scores [T, E], chosen: list of T lists of K experts, best first, weights: list of T
        tensors [K] (differentiable), slots: list of T lists of K slots or -1, used: list of E
        counts before dropping).
    """
    T, E = logits_TE.shape
    scores = torch.softmax(logits_TE, -1) if score_fn == "softmax" else torch.sigmoid(logits_TE)
    bias = [0.0] * E if expert_bias is None else [float(b) for b in expert_bias]
    topk_group = n_group if topk_group is None else topk_group
    size = E // n_group
    s = scores.detach().tolist()
    chosen, weights = [], []
    for t in range(T):
        sel = [s[t][e] + bias[e] for e in range(E)]
        group_score = []
        for g in range(n_group):
            members = sorted((sel[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            group_score.append(sum(members[: min(2, size)]))
        kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        candidates = [e for e in range(E) if e // size in kept]
        experts = sorted(candidates, key=lambda e: (-sel[e], e))[:top_k]
        w = scores[t, experts]
        if normalize_topk:
            w = w / (w.sum() + 1e-20)  # (the contract's epsilon: all-zero scores give 0)
        chosen.append(experts)
        weights.append(w * scaling)
    used = [0] * E
    slots = []
    for t in range(T):
        row = []
        for e in chosen[t]:
            row.append(used[e] if capacity is None or used[e] < capacity else -1)
            used[e] += 1
        slots.append(row)
    return scores, chosen, weights, slots, used


def moe_contract_ref(
    x_TD,
    router_w_ED,
    gate_up_E2FD,
    down_EDF,
    *,
    top_k,
    capacity_factor=None,
    score_fn="softmax",
    normalize_topk=True,
    expert_bias=None,
    n_group=1,
    topk_group=None,
    scaling=1.0,
):
    """Returns (y_TD, aux_loss, z_loss, counts_E, dropped), differentiable in every tensor input."""
    T, D = x_TD.shape
    E = router_w_ED.shape[0]
    logits = x_TD @ router_w_ED.t()
    C = None if capacity_factor is None else math.ceil(capacity_factor * T * top_k / E)
    scores, chosen, weights, slots, used = route_contract_ref(
        logits,
        top_k=top_k,
        capacity=C,
        score_fn=score_fn,
        normalize_topk=normalize_topk,
        expert_bias=expert_bias,
        n_group=n_group,
        topk_group=topk_group,
        scaling=scaling,
    )
    kept = [(t, k, e) for t in range(T) for k, e in enumerate(chosen[t]) if slots[t][k] >= 0]
    y = torch.zeros_like(x_TD)
    F = gate_up_E2FD.shape[1] // 2
    rows = []
    for t, k, e in kept:
        gu = gate_up_E2FD[e] @ x_TD[t]
        h = torch.nn.functional.silu(gu[:F]) * gu[F:]
        rows.append((t, weights[t][k] * (down_EDF[e] @ h)))
    if rows:
        idx = torch.tensor([t for t, _ in rows])
        y = y.index_add(0, idx, torch.stack([v for _, v in rows]))
    counts = torch.tensor(used, dtype=torch.float64)
    if T:
        f = counts / (T * top_k)
        P = (scores / (scores.sum(-1, keepdim=True) + 1e-20)).mean(0)
        aux = E * (f * P).sum()
        z = (torch.logsumexp(logits, -1) ** 2).mean()
    else:
        aux = z = x_TD.sum() * 0
    return y, aux, z, counts.long(), sum(used) - len(kept)
