"""The references' hand-written backward passes against autograd through their own forward formulas
(float64): the gating backward (softmax / sigmoid scores, with and without renormalisation, scaled
weights, the score-sum and z-loss statistics) and the K-vectorised permutation backward passes.
The kernels are tested against these references, so the references must be the gradients."""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels.reference import (
    _scores,
    gating_bwd_ref,
    gating_fwd_ref,
    permute_bwd_ref,
    unpermute_bwd_ref,
    unpermute_fwd_ref,
)

from tests.helpers import assert_close


def _autograd_gating(logits, expert_TK, gw, gs, gz, score_fn, normalize_topk, scaling):
    logits = logits.detach().requires_grad_(True)
    s = _scores(logits, score_fn)
    w = torch.gather(s, 1, expert_TK.long())
    if normalize_topk:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)  # (the contract's epsilon)
    total = (w * scaling * gw).sum() if gw is not None else logits.new_zeros(())
    if gs is not None:
        total = total + ((s / (s.sum(dim=-1, keepdim=True) + 1e-20)).sum(dim=0) * gs).sum()
    if gz is not None:
        total = total + (torch.logsumexp(logits, dim=-1) ** 2).sum() * gz
    return torch.autograd.grad(total, logits)[0]


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize_topk", [True, False])
@pytest.mark.parametrize("which", ["w", "s", "z", "all"])
def test_gating_bwd_ref_is_the_gradient(score_fn, normalize_topk, which):
    g = torch.Generator().manual_seed(3)
    T, E, K = 37, 7, 3
    logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 2
    expert = gating_fwd_ref(logits, K, score_fn=score_fn).expert_TK
    gw = torch.randn(T, K, generator=g, dtype=torch.float64) if which in ("w", "all") else None
    gs = torch.randn(E, generator=g, dtype=torch.float64) if which in ("s", "all") else None
    gz = torch.tensor(0.7, dtype=torch.float64) if which in ("z", "all") else None
    kw = dict(score_fn=score_fn, normalize_topk=normalize_topk, scaling=2.5)
    got = gating_bwd_ref(logits, expert, gw, gs, gz, **kw)
    assert_close("gating_bwd_ref", got, _autograd_gating(logits, expert, gw, gs, gz, **kw))


def test_permutation_bwd_refs_are_the_gradients():
    g = torch.Generator().manual_seed(4)
    T, K, D = 11, 3, 5
    row = torch.randperm(T * K, generator=g).view(T, K)
    row[row >= 25] = -1  # dropped assignments
    S = int((row >= 0).sum())
    row[row >= 0] = torch.arange(S)[torch.argsort(row[row >= 0])]  # kept rows: a bijection onto range(S)
    y = torch.randn(S, D, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, generator=g, requires_grad=True)
    gy = torch.randn(T, D, dtype=torch.float64, generator=g)
    src = torch.empty(S, dtype=torch.int32)
    flat = row.reshape(-1)
    src[flat[flat >= 0]] = torch.nonzero(flat >= 0).squeeze(1).to(torch.int32)
    out = unpermute_fwd_ref(y, row, w)
    want_y, want_w = torch.autograd.grad(out, (y, w), gy)
    got_y, got_w = unpermute_bwd_ref(gy, y.detach(), row, w.detach(), src)
    assert_close("grad y", got_y, want_y)
    assert_close("grad w", got_w, want_w)
    # permute: x_SD[s] = x_TD[src[s] // K]; its gradient sums each token's kept rows
    x = torch.randn(T, D, dtype=torch.float64, generator=g, requires_grad=True)
    gs = torch.randn(S, D, dtype=torch.float64, generator=g)
    (want_x,) = torch.autograd.grad(x.index_select(0, src.long() // K), x, gs)
    assert_close("grad x", permute_bwd_ref(gs, row), want_x)
