"""An independent float64 implementation of DESIGN.md's routing contract, written for tests.

Deliberately naive (Python loops for top-k and capacity) and sharing no code with kernels/ or
lancet_rt/, so the layer is checked against the contract, not against itself.
"""
from __future__ import annotations

import math

import torch


def moe_contract_ref(x_TD, router_w_ED, gate_up_E2FD, down_EDF, *, top_k, capacity_factor=None,
                     score_fn="softmax", normalize_topk=True):
    """Returns (y_TD, aux_loss, z_loss, counts_E, dropped), differentiable in every tensor input."""
    T, D = x_TD.shape
    E = router_w_ED.shape[0]
    logits = x_TD @ router_w_ED.t()
    scores = torch.softmax(logits, -1) if score_fn == "softmax" else torch.sigmoid(logits)
    s = scores.detach().tolist()
    chosen = [sorted(range(E), key=lambda e: (-s[t][e], e))[:top_k] for t in range(T)]
    C = None if capacity_factor is None else math.ceil(capacity_factor * T * top_k / E)
    used = [0] * E
    kept = []
    for t in range(T):
        for k, e in enumerate(chosen[t]):
            if C is None or used[e] < C:
                kept.append((t, k, e))
            used[e] += 1
    y = torch.zeros_like(x_TD)
    F = gate_up_E2FD.shape[1] // 2
    rows = []
    for t, k, e in kept:
        w = scores[t, chosen[t]]
        if normalize_topk:
            w = w / w.sum()
        gu = gate_up_E2FD[e] @ x_TD[t]
        h = torch.nn.functional.silu(gu[:F]) * gu[F:]
        rows.append((t, w[k] * (down_EDF[e] @ h)))
    if rows:
        idx = torch.tensor([t for t, _ in rows])
        y = y.index_add(0, idx, torch.stack([v for _, v in rows]))
    counts = torch.tensor(used, dtype=torch.float64)
    if T:
        f = counts / (T * top_k)
        P = (scores / scores.sum(-1, keepdim=True)).mean(0)
        aux = E * (f * P).sum()
        z = (torch.logsumexp(logits, -1) ** 2).mean()
    else:
        aux = z = x_TD.sum() * 0
    return y, aux, z, counts.long(), sum(used) - len(kept)
