"""Sigmoid scores that underflow to 0: the renormalised weights (and the aux statistics' per-token
normalisation) divide by ``sum + 1e-20`` (docs/design.md, routing contract), as transformers'
DeepSeek-V3 router and torchtitan do, so a token whose chosen scores are all 0 (float32 logits below
about -104) gets weights 0, not 0/0 = NaN, and its gradients are finite. And the epsilon changes no
ordinary float32 result: ``s + 1e-20 == s`` in float32 for every ``s >= 2**-42`` (checked here on
the arithmetic itself and on the reference, bitwise).

Kernels under TRITON_INTERPRET=1 against the reference: every output poisoned with NaN before the
launch, the single-program forward and the 2-launch scan, float32 and float64, plain and DeepSeek-V3
routing (bias, groups, scaling); then the layer on both kernel paths.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import gating as gating_mod
from lancet_rt.kernels.gating import gating_bwd, gating_fwd
from lancet_rt.kernels.reference import _scores, gating_bwd_ref, gating_fwd_ref

import lancet_rt
from tests.helpers import assert_close
from tests.routing_inputs import DEVICE, _assert_gating_equal, _logits, _poison, _poisoned_gating_out

pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered in exp:RuntimeWarning"
)  # (the interpreter's sigmoid)

NORM_EPS = 1e-20  # the contract's epsilon (kernels.reference.NORM_EPS), written out: the test states the contract
#: Logits whose sigmoid is exactly 0: below about -104 in float32, -745 in float64.
UNDERFLOW = {torch.float32: -130.0, torch.float64: -800.0}
ROWS = (0, 5, 40, 62)  # underflowed tokens, in both spans of the multi-program forward


def _underflow_logits(gen, T, E, dtype):
    logits = _logits(gen, T, E, dtype=dtype)
    for t in ROWS:
        logits[t] = UNDERFLOW[dtype] - 20 * torch.rand(E, generator=gen).to(DEVICE, dtype)
    logits[7, : E // 2] = UNDERFLOW[dtype]  # some experts underflow, not the chosen ones: an ordinary token
    assert float(torch.sigmoid(logits[list(ROWS)]).max()) == 0.0
    return logits


def test_eps_leaves_ordinary_float32_sums_bitwise_unchanged():
    """The arithmetic the contract relies on: in float32, ``s + 1e-20 == s`` for every sum ``s >=
    2**-42`` (about 2.3e-13: chosen sigmoid scores of logits above about -29), and not below."""
    eps = torch.tensor(NORM_EPS, dtype=torch.float32)
    s = torch.cat(
        [
            torch.logspace(-42, 127, 20000, base=2.0, dtype=torch.float64).float(),
            torch.tensor([2.0**-42, 1.0, 1.0 - 2**-24, 8.0], dtype=torch.float32),
        ]
    )
    assert torch.equal(s + eps, s)
    assert float(torch.tensor(2.0**-43) + eps) != 2.0**-43  # the bound is tight


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_reference_is_bitwise_the_plain_division_on_ordinary_float32(gen, score_fn):
    """Weights, aux statistics and the logits' gradient of the reference equal, bit for bit, the
    formulas without the epsilon (``w / w.sum()``), on ordinary float32 logits."""
    T, E, K = 257, 16, 4
    logits = _logits(gen, T, E)
    out = gating_fwd_ref(logits, K, score_fn=score_fn)
    s = _scores(logits, score_fn)
    w = s.gather(1, out.expert_TK.long())
    assert torch.equal(out.weight_TK, w / w.sum(-1, keepdim=True))
    if score_fn == "sigmoid":
        assert torch.equal(out.score_sum_E, (s / s.sum(-1, keepdim=True)).sum(0))
    gw, gp = torch.randn(T, K, generator=gen).to(DEVICE), torch.randn(E, generator=gen).to(DEVICE)
    got = gating_bwd_ref(logits, out.expert_TK, gw, gp, None, score_fn=score_fn)
    G = w.sum(-1, keepdim=True)
    gs = torch.zeros_like(s).scatter_add(1, out.expert_TK.long(), (gw - (gw * w).sum(-1, keepdim=True) / G) / G)
    if score_fn == "sigmoid":
        Z = s.sum(-1, keepdim=True)
        want = ((gp - (s * gp).sum(-1, keepdim=True) / Z) / Z + gs) * s * (1 - s)
    else:
        want = torch._softmax_backward_data(gp.expand_as(s) + gs, s, -1, s.dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_reference_underflow_gives_zero_weights_and_finite_gradients(gen, dtype):
    T, E, K = 63, 8, 2
    logits = _underflow_logits(gen, T, E, dtype)
    out = gating_fwd_ref(logits, K, score_fn="sigmoid")
    assert torch.equal(out.weight_TK[list(ROWS)], torch.zeros(len(ROWS), K, dtype=dtype, device=DEVICE))
    others = [t for t in range(T) if t not in ROWS]
    assert_close(
        "weights of ordinary tokens sum to 1",
        out.weight_TK[others].sum(-1),
        torch.ones(len(others), dtype=dtype, device=DEVICE),
    )
    assert bool(out.score_sum_E.isfinite().all())
    # the hand-written backward is the gradient of the contract's formula (float64, autograd)
    x = logits.double().requires_grad_(True)
    s = torch.sigmoid(x)
    w = s.gather(1, out.expert_TK.long())
    gw, gp = torch.randn(T, K, generator=gen, dtype=torch.float64), torch.randn(E, generator=gen, dtype=torch.float64)
    total = (w / (w.sum(-1, keepdim=True) + NORM_EPS) * gw).sum() + (
        (s / (s.sum(-1, keepdim=True) + NORM_EPS)).sum(0) * gp
    ).sum()
    (want,) = torch.autograd.grad(total, x)
    got = gating_bwd_ref(logits, out.expert_TK, gw.to(dtype), gp.to(dtype), None, score_fn="sigmoid")
    assert bool(got.isfinite().all())
    assert torch.equal(got[list(ROWS)], torch.zeros(len(ROWS), E, dtype=dtype, device=DEVICE))
    assert_close("gating_bwd_ref vs autograd", got, want.to(dtype), dtype)


VARIANTS = {
    "plain": {},
    "deepseek": dict(n_group=4, topk_group=2, scaling=2.5, expert_bias=True),
}


@pytest.mark.parametrize("path", ["single", "multi"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_kernels_underflow_match_the_reference(gen, monkeypatch, path, variant, dtype):
    """Forward (NaN-poisoned outputs) and backward (all three incoming gradients) against the reference."""
    T, E, K = 63, 8, 2
    if path == "multi":
        monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)  # two spans of 32
    logits = _underflow_logits(gen, T, E, dtype)
    kw = dict(VARIANTS[variant])
    if kw.pop("expert_bias", False):
        kw["expert_bias"] = (torch.randn(E, generator=gen) * 0.1).to(DEVICE)
    used = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    out = gating_fwd(logits, K, used, capacity=20, score_fn="sigmoid", out=_poisoned_gating_out(T, E, K, dtype), **kw)
    ref = gating_fwd_ref(logits, K, used, capacity=20, score_fn="sigmoid", **kw)
    _assert_gating_equal("gating_fwd[underflow]", out, ref)  # (fails on any NaN)
    assert torch.equal(out.weight_TK[list(ROWS)], torch.zeros(len(ROWS), K, dtype=dtype, device=DEVICE))
    grads = (
        torch.randn(T, K, generator=gen).to(DEVICE, dtype),
        torch.randn(E, generator=gen).to(DEVICE, dtype),
        torch.randn((), generator=gen).to(DEVICE, dtype),
    )
    bwd_kw = dict(score_fn="sigmoid", scaling=kw.get("scaling", 1.0))
    got = gating_bwd(logits, out.expert_TK, *grads, out=_poison(logits), **bwd_kw)
    want = gating_bwd_ref(logits, ref.expert_TK, *grads, **bwd_kw)
    assert_close("gating_bwd[underflow]", got, want, dtype)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_layer_with_underflowed_scores_is_finite(gen, monkeypatch, kernels):
    """The layer (DeepSeek-V3 style: sigmoid, renormalised) on tokens whose router logits are all
    below -104: output and every gradient finite, those tokens' routed output 0."""
    monkeypatch.setenv("LANCET_KERNELS", kernels)
    D, E = 8, 4
    torch.manual_seed(0)
    moe = lancet_rt.MoE(D, 6, E, 2, score_fn="sigmoid", normalize_topk=True, aux_loss_coef=0.01)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(E, D, generator=gen).abs() * 0.1 - 20.0)  # every weight about -20
    x = torch.randn(10, D, generator=gen)
    x[:4] = 1.0 + torch.rand(4, D, generator=gen)  # logits below -150: every score 0
    x = x.requires_grad_(True)
    with torch.no_grad():
        assert float(torch.sigmoid(moe.router(x[:4])).max()) == 0.0
    y = moe(x)
    y.square().sum().backward()
    assert bool(y.isfinite().all()) and torch.equal(y[:4].detach(), torch.zeros(4, D))
    assert bool(x.grad.isfinite().all())
    for name, p in moe.named_parameters():
        assert bool(p.grad.isfinite().all()), f"{name}.grad is not finite"
    assert bool(moe.aux_loss.isfinite())
