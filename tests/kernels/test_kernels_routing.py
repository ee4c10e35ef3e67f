"""Gating kernels (lancet_rt.kernels.gating) against their references (lancet_rt.kernels.reference); the
permutation kernels are in test_kernels_permute.py, the shared inputs in routing_inputs.py.

CPU lane: the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on small odd shapes:
T in {0, 1, 63, 257}, D in {60, 100}, E in {2, 7, 8, 64, 256}, K in {1, 2, E}; softmax and sigmoid,
with and without renormalisation, dropless and dropping capacities (capacity 0 included), carried
used capacity, an expert with no tokens, every token on one expert, exact ties, NaN / +inf / all
-inf logit rows; DeepSeek-V3's router variants (selection-only expert bias, group-limited top-k,
scaled weights: against the reference, the naive tests/contract_ref.py and transformers'
DeepseekV3TopkRouter); float32, bfloat16 and float16 rows; small tiles pinned through the config
environment variables, so token tiles, D tiles and scan blocks repeat. Outputs AND gradients are
compared; every output buffer is poisoned before the launch (NaN for floats, or -7777 where NaN is
a legitimate result, and a value no kernel writes for integers, through the launchers' ``out=``),
so an unwritten element fails. Integer outputs must match exactly.

Gating logits are drawn *well separated* (distinct ranks a step apart plus jitter): top-k over scores
is discontinuous, and an exp that differs in the last bit from PyTorch's could otherwise swap two
near-equal experts. Exact ties are tested on purpose, with integer-valued logits.

Interpreter note: Triton's interpreter converts float32 -> bfloat16 by truncation (the GPU rounds to
nearest even), so bf16 results may differ from the reference by one bf16 ulp here; the bf16 row of
the tolerance table covers it.

GPU lane (``-m gpu``): the same checks at real sizes, T = 16384, D = 4096, E in {8, 64, 256},
K in {1, 2, 8}, bf16 rows.
"""

from __future__ import annotations

import pytest
import torch
import triton
from lancet_rt.kernels import gating as gating_mod
from lancet_rt.kernels._common import run_autotuned
from lancet_rt.kernels.gating import gating_bwd, gating_fwd
from lancet_rt.kernels.permute import dispatch_rows, permute_fwd, unpermute_bwd, unpermute_fwd
from lancet_rt.kernels.reference import (
    GatingOutput,
    dispatch_rows_ref,
    gating_bwd_ref,
    gating_fwd_ref,
)

from tests.contract_ref import route_contract_ref
from tests.helpers import assert_close
from tests.routing_inputs import (
    DEVICE,
    GPU_EK,
    GPU_T,
    D,
    _assert_close_nonfinite,
    _assert_gating_equal,
    _capacity,
    _kept_E,
    _logits,
    _poison,
    _poisoned_gating_out,
)

# ----------------------------------------------------------------------------------------------
# Gating: forward and backward against the reference
# ----------------------------------------------------------------------------------------------
# (T, E, K): the fused single-program forward (T <= 63) and the 2-launch scan path (T = 257, 3
# spans under the interpreter), an expert with no tokens (E = 64, T = 63, K = 1), K = E (on both
# paths, with padded lanes at E = 7), E = 7 (padded expert lanes) and E = 2.
GATING_SHAPES = [
    (1, 8, 2),
    (63, 7, 2),
    (63, 64, 1),
    (257, 8, 8),
    (257, 64, 2),
    (63, 256, 8),
    (5, 256, 256),
    (257, 2, 1),
    (257, 256, 2),
    (257, 64, 64),
    (1, 256, 256),
    (63, 7, 7),
]
# (score_fn, normalize_topk, capacity_factor)
GATING_MODES = [
    ("softmax", True, None),
    ("softmax", False, 0.5),
    ("sigmoid", True, 1.0),
    ("sigmoid", False, None),
]


def _check_gating(gen, shape, mode, **variant):
    """gating_fwd and gating_bwd (all three incoming gradients) against the reference; ``variant``:
    the router-variant arguments (expert_bias, n_group, topk_group, scaling). Returns the output."""
    (T, E, K), (score_fn, normalize, factor) = shape, mode
    logits = _logits(gen, T, E)
    capacity = _capacity(T, E, K, factor)
    used = torch.randint(0, 1 + (capacity or 8) // 2, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    kw = dict(capacity=capacity, score_fn=score_fn, normalize_topk=normalize, **variant)
    bwd_kw = dict(score_fn=score_fn, normalize_topk=normalize, scaling=variant.get("scaling", 1.0))

    out = gating_fwd(logits, K, used, out=_poisoned_gating_out(T, E, K, logits.dtype), **kw)
    ref = gating_fwd_ref(logits, K, used, **kw)
    _assert_gating_equal("gating_fwd", out, ref)

    grad_w = torch.randn(T, K, generator=gen).to(DEVICE)
    grad_p = torch.randn(E, generator=gen).to(DEVICE)
    grad_z = torch.randn((), generator=gen).to(DEVICE)
    got = gating_bwd(logits, out.expert_TK, grad_w, grad_p, grad_z, out=_poison(logits), **bwd_kw)
    want = gating_bwd_ref(logits, ref.expert_TK, grad_w, grad_p, grad_z, **bwd_kw)
    assert_close("gating_bwd.grad_logits", got, want, torch.float32)
    return out


@pytest.mark.parametrize("mode", GATING_MODES, ids=lambda m: f"{m[0]}-norm{int(m[1])}-cf{m[2]}")
@pytest.mark.parametrize("shape", GATING_SHAPES, ids=lambda s: "T{}-E{}-K{}".format(*s))
def test_gating_matches_reference(gen, shape, mode):
    _check_gating(gen, shape, mode)


@pytest.mark.parametrize(
    "case",
    [((63, 7, 2), GATING_MODES[1]), ((257, 64, 2), GATING_MODES[2])],
    ids=lambda c: "T{}-E{}-K{}-".format(*c[0]) + "{}-norm{:d}-cf{}".format(*c[1]),
)
def test_gating_pinned_small_tile(gen, monkeypatch, case):
    """A pinned 4-token tile (the interpreter otherwise takes the largest, 32 here): many tiles per
    span, so the per-expert running count is carried across tiles, forward and backward."""
    monkeypatch.setenv(gating_mod._ENV_FWD_CONFIG, "BLOCK_T=4,num_warps=1")
    monkeypatch.setenv(gating_mod._ENV_BWD_CONFIG, "BLOCK_T=4,num_warps=1")
    launched = []

    def spy(tuner, grid, args, meta, env_var):
        # The pin is read from the environment at every launch (nothing cached); record what ran.
        (config,) = tuner.early_config_prune(tuner.configs, dict(zip(tuner.arg_names, args)), **meta)
        launched.append((env_var, config.kwargs["BLOCK_T"], config.num_warps))
        run_autotuned(tuner, grid, args, meta, env_var)

    monkeypatch.setattr(gating_mod, "run_autotuned", spy)
    _check_gating(gen, *case)
    assert sorted(launched) == [(gating_mod._ENV_BWD_CONFIG, 4, 1), (gating_mod._ENV_FWD_CONFIG, 4, 1)]


@pytest.mark.parametrize("path", ["single", "multi"])
def test_gating_capacity_zero(gen, monkeypatch, path):
    """capacity=0 is accepted: every assignment is dropped (slot -1, no dispatch row), while the
    counts and the carried counter still count every assignment."""
    if path == "multi":
        monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    T, E, K = 63, 8, 2
    logits = _logits(gen, T, E)
    used = torch.randint(0, 4, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    out = gating_fwd(logits, K, used, capacity=0, out=_poisoned_gating_out(T, E, K, logits.dtype))
    ref = gating_fwd_ref(logits, K, used, capacity=0)
    _assert_gating_equal(f"gating_fwd[capacity=0,{path}]", out, ref)
    assert bool((out.slot_TK == -1).all())
    assert torch.equal(out.counts_E, torch.bincount(out.expert_TK.flatten().long(), minlength=E).int())
    assert torch.equal(out.used_E, used + out.counts_E)
    kept = _kept_E(out.expert_TK, out.slot_TK, E)
    assert int(kept.sum()) == 0
    row = dispatch_rows(out.expert_TK, out.slot_TK, used, kept, out=_poison(out.slot_TK))
    assert bool((row == -1).all())


# The interpreter evaluates inf - inf and 0 / 0 in numpy, which warns; NaN is the point here.
_NONFINITE_OK = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _nonfinite_logits(gen, T, E, rows):
    """Random logits with special rows: {t: "nan" | "+inf" | "-inf_all" | "-inf_some"}."""
    logits = _logits(gen, T, E)
    for t, kind in rows.items():
        if kind == "nan":
            logits[t, (t + 4) % E] = float("nan")
        elif kind == "+inf":
            logits[t, (t + 2) % E] = float("inf")
        elif kind == "-inf_all":
            logits[t] = float("-inf")
        else:  # some experts masked out, the rest finite: an ordinary row
            logits[t, [t % E, (t + 3) % E]] = float("-inf")
    return logits


def _check_gating_nonfinite(gen, logits, K, used, capacity, score_fn, normalize, **variant):
    """Forward, dispatch rows and backward against the reference, NaN/inf-exact; returns the
    forward output. ``variant``: the router-variant arguments."""
    T, E = logits.shape
    kw = dict(capacity=capacity, score_fn=score_fn, normalize_topk=normalize, **variant)
    bwd_kw = dict(score_fn=score_fn, normalize_topk=normalize, scaling=variant.get("scaling", 1.0))
    out = gating_fwd(logits, K, used, out=_poisoned_gating_out(T, E, K, logits.dtype, nan=False), **kw)
    ref = gating_fwd_ref(logits, K, used, **kw)
    assert bool(((out.expert_TK >= 0) & (out.expert_TK < E)).all()), "expert ids outside [0, E)"
    _assert_gating_equal("gating_fwd[nonfinite]", out, ref, nonfinite=True)

    kept = _kept_E(out.expert_TK, out.slot_TK, E)
    row = dispatch_rows(out.expert_TK, out.slot_TK, used, kept, out=_poison(out.slot_TK))
    assert torch.equal(row, dispatch_rows_ref(ref.expert_TK, ref.slot_TK, used, kept))
    assert torch.equal(row[row >= 0].sort().values, torch.arange(int(kept.sum()), dtype=torch.int32, device=DEVICE))

    grads = (
        torch.randn(T, K, generator=gen).to(DEVICE),
        torch.randn(E, generator=gen).to(DEVICE),
        torch.randn((), generator=gen).to(DEVICE),
    )
    for present in ("w", "wpz"):
        g = [x if name in present else None for name, x in zip("wpz", grads)]
        got = gating_bwd(logits, out.expert_TK, *g, out=_poison(logits, nan=False), **bwd_kw)
        want = gating_bwd_ref(logits, ref.expert_TK, *g, **bwd_kw)
        _assert_close_nonfinite(f"gating_bwd[nonfinite,{present}]", got, want, torch.float32)
    return out


@_NONFINITE_OK
@pytest.mark.parametrize("capacity", [None, 3], ids=["dropless-single", "cap3-multi"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm1", "norm0"])
@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_gating_nonfinite_logits(gen, monkeypatch, score_fn, normalize, capacity):
    """A NaN logit, a +inf logit and an all -inf row among ordinary rows, in both spans. The
    reference (a stable descending sort) ranks a NaN score first and breaks ties to the lower
    index: under softmax such a row is all NaN and takes experts 0..K-1, under sigmoid the NaN
    expert comes first. Every (t, k) gets an expert in [0, E), a weight and a slot, and drops,
    counts, dispatch rows and NaN/inf placement in every output and gradient match."""
    T, E, K = 40, 7, 3
    if capacity is not None:  # 2 spans of 32 tokens: the scan carries the NaN rows' claims
        monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    rows = {0: "nan", 3: "+inf", 6: "-inf_all", 9: "-inf_some", 33: "nan", 35: "+inf", 38: "-inf_all"}
    logits = _nonfinite_logits(gen, T, E, rows)
    used = torch.randint(0, 2, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    out = _check_gating_nonfinite(gen, logits, K, used, capacity, score_fn, normalize)
    # Spelled out: the rows whose scores hold a NaN (NaN logits at experts 4 and 2), their
    # experts, and their weights (all NaN once normalised); ordinary rows stay finite. Under
    # sigmoid an all -inf row scores 0 everywhere (experts 0..K-1): normalised by the sum + 1e-20
    # (the contract), its weights are 0, not 0/0.
    nan_rows = [0, 3, 6, 33, 35, 38] if score_fn == "softmax" else [0, 33]
    if score_fn == "softmax":
        assert torch.equal(out.expert_TK[nan_rows].long(), torch.arange(K).expand(len(nan_rows), K).to(DEVICE))
    else:
        assert int(out.expert_TK[0, 0]) == 4 and int(out.expert_TK[33, 0]) == 2
        assert torch.equal(out.expert_TK[[6, 38]].long(), torch.arange(K).expand(2, K).to(DEVICE))
        assert torch.equal(out.weight_TK[[6, 38]], torch.zeros(2, K, device=DEVICE))
    if normalize:
        assert bool(out.weight_TK[nan_rows].isnan().all())
    assert not bool(out.weight_TK[[1, 9, 20, 39]].isnan().any())


@_NONFINITE_OK
@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_gating_infinite_logits_statistics(gen, score_fn):
    """Without a NaN logit, a +inf logit or an all -inf row gives logsumexp = +inf / -inf (as
    torch.logsumexp), so zsq_sum is +inf, not NaN; sigmoid's +inf row is ordinary (score 1)."""
    T, E, K = 9, 7, 2
    logits = _nonfinite_logits(gen, T, E, {2: "+inf", 5: "-inf_all", 7: "-inf_some"})
    used = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    out = _check_gating_nonfinite(gen, logits, K, used, 4, score_fn, True)
    assert float(out.zsq_sum) == float("inf")
    if score_fn == "sigmoid":
        assert int(out.expert_TK[2, 0]) == 4 and float(out.weight_TK[2, 0]) > 0.5


@pytest.mark.parametrize("present", ["w", "p", "z", "wp", "none"])
@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_gating_bwd_optional_grads(gen, score_fn, present):
    T, E, K = 63, 7, 2
    logits = _logits(gen, T, E)
    expert = gating_fwd_ref(logits, K, score_fn=score_fn).expert_TK
    grads = [
        torch.randn(T, K, generator=gen).to(DEVICE) if "w" in present else None,
        torch.randn(E, generator=gen).to(DEVICE) if "p" in present else None,
        torch.randn((), generator=gen).to(DEVICE) if "z" in present else None,
    ]
    got = gating_bwd(logits, expert, *grads, score_fn=score_fn, out=_poison(logits))
    want = gating_bwd_ref(logits, expert, *grads, score_fn=score_fn)
    assert_close(f"gating_bwd[{present}]", got, want, torch.float32)


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_gating_float64(gen, score_fn):
    """float64 logits are computed in float64 (forward statistics and the backward)."""
    T, E, K = 63, 7, 3
    logits = _logits(gen, T, E, dtype=torch.float64)
    capacity = _capacity(T, E, K, 0.75)
    out = gating_fwd(logits, K, capacity=capacity, score_fn=score_fn, out=_poisoned_gating_out(T, E, K, logits.dtype))
    ref = gating_fwd_ref(logits, K, capacity=capacity, score_fn=score_fn)
    _assert_gating_equal("gating_fwd[float64]", out, ref)
    grads = (
        torch.randn(T, K, generator=gen, dtype=torch.float64).to(DEVICE),
        torch.randn(E, generator=gen, dtype=torch.float64).to(DEVICE),
        torch.randn((), generator=gen, dtype=torch.float64).to(DEVICE),
    )
    got = gating_bwd(logits, out.expert_TK, *grads, score_fn=score_fn, out=_poison(logits))
    assert_close("gating_bwd[float64]", got, gating_bwd_ref(logits, ref.expert_TK, *grads, score_fn=score_fn))


def test_gating_bwd_expanded_grads(gen):
    """Autograd hands over expanded (stride-0) gradients, e.g. from ``weight_TK.sum()``."""
    T, E, K = 63, 8, 2
    logits = _logits(gen, T, E)
    expert = gating_fwd_ref(logits, K).expert_TK
    grad_w = torch.ones((), device=DEVICE).expand(T, K)
    grad_p = torch.full((1,), 0.3, device=DEVICE).expand(E)
    got = gating_bwd(logits, expert, grad_w, grad_p, None, normalize_topk=False, out=_poison(logits))
    want = gating_bwd_ref(logits, expert, grad_w, grad_p, None, normalize_topk=False)
    assert_close("gating_bwd[expanded]", got, want, torch.float32)


@pytest.mark.parametrize("path", ["single", "multi", "multi-blocks"])
@pytest.mark.parametrize("shape", [(63, 8, 2), (257, 7, 7), (40, 64, 8)], ids=lambda s: "T{}-E{}-K{}".format(*s))
def test_gating_paths(gen, monkeypatch, shape, path):
    """The fused single-program forward (many tiles in one span) and the 2-launch scan (many
    spans); "multi-blocks" shrinks the spans and the scan's step to 2 spans, so the scan walks
    several blocks and carries the per-expert slot offsets (and the float sums) from block to block."""
    T, E, K = shape
    if path == "single":
        monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 1 << 30)
        monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_ELEMENTS", 1 << 40)
    else:
        monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    if path == "multi-blocks":
        monkeypatch.setattr(gating_mod, "_SPAN_MIN", 8)
        monkeypatch.setattr(gating_mod, "_PROGRAMS_PER_SM", 16)
        monkeypatch.setattr(gating_mod, "_SCAN_BLOCK_B", 2)
        span = gating_mod._plan_span(T, triton.next_power_of_2(E), DEVICE)
        assert triton.cdiv(T, span) > 2 * gating_mod._SCAN_BLOCK_B, "expected 3+ scan blocks"
    logits = _logits(gen, T, E)
    capacity = _capacity(T, E, K, 0.75)
    used = torch.randint(0, 4, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    out = gating_fwd(logits, K, used, capacity=capacity, out=_poisoned_gating_out(T, E, K, logits.dtype))
    _assert_gating_equal(f"gating_fwd[{path}]", out, gating_fwd_ref(logits, K, used, capacity=capacity))
    again = gating_fwd(logits, K, used, capacity=capacity)  # freshly allocated, bit-identical
    for field, a, b in zip(GatingOutput._fields, out, again):
        assert torch.equal(a, b), f"gating_fwd[{path}].{field} differs between two runs"


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E", [8, 256])
def test_gating_ties_pick_lower_index(gen, score_fn, E):
    T, K = 63, 4
    logits = torch.randint(0, 3, (T, E), generator=gen).float().to(DEVICE)  # many exact ties
    out = gating_fwd(logits, K, score_fn=score_fn, capacity=5, out=_poisoned_gating_out(T, E, K, logits.dtype))
    ref = gating_fwd_ref(logits, K, score_fn=score_fn, capacity=5)
    _assert_gating_equal("gating_fwd[ties]", out, ref)
    # Spelled out: among equal scores, the chosen experts ascend.
    s = torch.gather(logits, 1, out.expert_TK.long())
    same = s[:, 1:] == s[:, :-1]
    assert bool((out.expert_TK[:, 1:] > out.expert_TK[:, :-1])[same].all())


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_gating_skewed(gen, score_fn):
    """Every token's top choice is one expert (huge logit), another expert gets none; drops."""
    T, E, K = 257, 8, 2
    logits = _logits(gen, T, E)
    logits[:, 5] += 50.0
    logits[:, 2] -= 50.0
    capacity = _capacity(T, E, K, 1.0)
    out = gating_fwd(logits, K, capacity=capacity, score_fn=score_fn, out=_poisoned_gating_out(T, E, K, logits.dtype))
    ref = gating_fwd_ref(logits, K, capacity=capacity, score_fn=score_fn)
    _assert_gating_equal("gating_fwd[skewed]", out, ref)
    assert int(out.counts_E[5]) == T and int(out.counts_E[2]) == 0
    assert int((out.slot_TK[:, 0] >= 0).sum()) == capacity  # expert 5 dropped past the capacity
    grad_w = torch.randn(T, K, generator=gen).to(DEVICE)
    got = gating_bwd(logits, out.expert_TK, grad_w, None, None, score_fn=score_fn, out=_poison(logits))
    want = gating_bwd_ref(logits, ref.expert_TK, grad_w, None, None, score_fn=score_fn)
    assert_close("gating_bwd[skewed]", got, want, torch.float32)


def test_gating_zero_tokens(gen):
    E, K = 8, 2
    logits = torch.empty(0, E, device=DEVICE)
    used = torch.randint(0, 9, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    out = gating_fwd(logits, K, used, capacity=3, out=_poisoned_gating_out(0, E, K, logits.dtype))
    _assert_gating_equal("gating_fwd[T=0]", out, gating_fwd_ref(logits, K, used, capacity=3))
    grad = gating_bwd(
        logits,
        out.expert_TK,
        torch.empty(0, K, device=DEVICE),
        torch.ones(E, device=DEVICE),
        torch.ones((), device=DEVICE),
    )
    assert grad.shape == (0, E)
    assert dispatch_rows(out.expert_TK, out.slot_TK, used, torch.zeros_like(used)).shape == (0, K)


@pytest.mark.parametrize(
    "case",
    [(257, 8, 2, 0.6, "softmax"), (200, 7, 7, 0.8, "sigmoid"), (130, 64, 1, 1.5, "softmax")],
    ids=lambda c: "T{}-E{}-K{}-cf{}-{}".format(*c),
)
def test_gating_carried_capacity_chunks(gen, case):
    """Gating chunk by chunk with used_E carried equals one call: slots, drops, counts, weights,
    statistics, and the dispatch rows agree."""
    T, E, K, factor, score_fn = case
    logits = _logits(gen, T, E)
    capacity = _capacity(T, E, K, factor)
    whole = gating_fwd(logits, K, capacity=capacity, score_fn=score_fn, out=_poisoned_gating_out(T, E, K, logits.dtype))
    _assert_gating_equal("gating_fwd[whole]", whole, gating_fwd_ref(logits, K, capacity=capacity, score_fn=score_fn))
    zeros = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    for n_chunks in (1, 2, 3, 4):
        cuts = sorted(torch.randperm(T - 1, generator=gen)[: n_chunks - 1].add(1).tolist())
        bounds = [0, *cuts, T]
        used = zeros
        parts, score_sum, zsq = [], torch.zeros_like(whole.score_sum_E), torch.zeros_like(whole.zsq_sum)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            g = gating_fwd(
                logits[lo:hi],
                K,
                used,
                capacity=capacity,
                score_fn=score_fn,
                out=_poisoned_gating_out(hi - lo, E, K, logits.dtype),
            )
            kept = _kept_E(g.expert_TK, g.slot_TK, E)
            rows = dispatch_rows(g.expert_TK, g.slot_TK, used, kept, out=_poison(g.slot_TK))
            assert torch.equal(rows, dispatch_rows_ref(g.expert_TK, g.slot_TK, used, kept))
            parts.append(g)
            score_sum += g.score_sum_E
            zsq += g.zsq_sum
            used = g.used_E
        cat = lambda i: torch.cat([p[i] for p in parts])
        tag = f"chunks={bounds}"
        assert torch.equal(cat(0), whole.expert_TK), tag
        assert torch.equal(cat(2), whole.slot_TK), tag
        assert torch.equal(torch.stack([p.counts_E for p in parts]).sum(0).int(), whole.counts_E), tag
        assert torch.equal(used, whole.used_E), tag
        assert_close(f"weight_TK[{tag}]", cat(1), whole.weight_TK)
        assert_close(f"score_sum_E[{tag}]", score_sum, whole.score_sum_E)
        assert_close(f"zsq_sum[{tag}]", zsq, whole.zsq_sum)


# ----------------------------------------------------------------------------------------------
# Router variants: expert bias, group-limited top-k, scaled weights (DeepSeek-V3)
# ----------------------------------------------------------------------------------------------
def _tier_bias(gen, E):
    """A selection bias of 0, 3 or 6 per expert. Scores lie in [0, 1], so ``scores + bias`` keeps
    _logits' well-separated order within a tier, and different tiers (and group sums of two
    scores, which differ by < 2 within a tier sum) never come near each other: no near-ties."""
    return (torch.randint(0, 3, (E,), generator=gen) * 3.0).to(DEVICE)


# (id, (T, E, K), (score_fn, normalize_topk, capacity_factor), variant without the bias, biased, path)
VARIANT_CASES = [
    ("bias", (63, 8, 2), ("softmax", True, 0.75), dict(), True, "single"),
    # 4 groups of 3 experts: lanes padded to 4 per group
    ("groups", (63, 12, 3), ("sigmoid", False, None), dict(n_group=4, topk_group=2), False, "single"),
    # DeepSeek-V3 scaled down (E=256, K=8, 8 groups, 4 kept -> E=16, K=4, 4 groups, 2 kept)
    ("deepseek", (63, 16, 4), ("sigmoid", True, 1.0), dict(n_group=4, topk_group=2, scaling=2.5), True, "single"),
    (
        "deepseek-softmax-spans",
        (63, 16, 4),
        ("softmax", False, 0.5),
        dict(n_group=4, topk_group=2, scaling=2.827),
        True,
        "multi",
    ),
    # groups of one expert (group score = the selection score), one token
    ("T1-groups-of-1", (1, 6, 2), ("sigmoid", True, None), dict(n_group=6, topk_group=3, scaling=0.5), True, "single"),
    # 3 groups of 5: a padded group (4 group lanes) and 8 lanes per group
    ("padded-groups-spans", (63, 15, 4), ("sigmoid", True, 1.0), dict(n_group=3, topk_group=2), True, "multi"),
    # K = topk_group * E / n_group: every expert of the kept groups is chosen
    ("K-all-kept", (63, 8, 4), ("softmax", True, 0.75), dict(n_group=4, topk_group=2, scaling=1.5), True, "single"),
]


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: c[0])
def test_gating_variants_match_reference(gen, monkeypatch, case):
    """Biased and group-limited selection, scaled weights: every forward output (NaN-poisoned)
    and the logits' gradient against the reference, on the fused single program and the scan."""
    _, shape, mode, variant, biased, path = case
    if path == "multi":
        monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)  # T = 63: two spans of 32
    if biased:
        variant = dict(variant, expert_bias=_tier_bias(gen, shape[1]))
    out = _check_gating(gen, shape, mode, **variant)
    # Spelled out: every token's experts lie in at most topk_group groups.
    group_size, topk_group = shape[1] // variant.get("n_group", 1), variant.get("topk_group", 1)
    assert all(len(set(row)) <= topk_group for row in (out.expert_TK.long() // group_size).tolist())


def test_gating_variants_defaults_are_plain_routing(gen):
    """A zero bias and n_group groups all kept take the biased/grouped code path and must give
    plain routing: same experts, slots and counts, weights equal up to summation order; NaN
    and infinite logits included (a NaN score still ranks first)."""
    T, E, K = 40, 8, 3
    logits = _nonfinite_logits(gen, T, E, {0: "nan", 3: "+inf", 6: "-inf_all", 9: "-inf_some"})
    zeros = torch.zeros(E, device=DEVICE)
    for score_fn in ("softmax", "sigmoid"):
        plain = gating_fwd(logits, K, capacity=9, score_fn=score_fn)
        for variant in (dict(expert_bias=zeros), dict(n_group=4, topk_group=4), dict(n_group=1, topk_group=1)):
            got = gating_fwd(logits, K, capacity=9, score_fn=score_fn, **variant)
            _assert_gating_equal(f"gating_fwd[{score_fn},{sorted(variant)}]", got, plain, nonfinite=True)


def test_gating_variants_carried_capacity(gen):
    """DeepSeek-shaped routing in two chunks with used_E carried equals one call."""
    T, E, K = 63, 16, 4
    logits = _logits(gen, T, E)
    kw = dict(
        capacity=_capacity(T, E, K, 1.0),
        score_fn="sigmoid",
        expert_bias=_tier_bias(gen, E),
        n_group=4,
        topk_group=2,
        scaling=2.5,
    )
    whole = gating_fwd(logits, K, **kw)
    _assert_gating_equal("gating_fwd[whole]", whole, gating_fwd_ref(logits, K, **kw))
    first = gating_fwd(logits[:20], K, **kw)
    second = gating_fwd(logits[20:], K, first.used_E, out=_poisoned_gating_out(T - 20, E, K, logits.dtype), **kw)
    for i in (0, 2):  # experts, slots (drops included)
        assert torch.equal(torch.cat([first[i], second[i]]), whole[i]), GatingOutput._fields[i]
    assert torch.equal(second.used_E, whole.used_E)
    assert torch.equal(first.counts_E + second.counts_E, whole.counts_E)
    assert_close("weight_TK[chunks]", torch.cat([first.weight_TK, second.weight_TK]), whole.weight_TK)
    assert_close("score_sum_E[chunks]", first.score_sum_E + second.score_sum_E, whole.score_sum_E)
    assert bool((whole.slot_TK == -1).any()), "expected drops at capacity factor 1.0"


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_gating_variants_ties(gen, score_fn):
    """Exact ties everywhere: integer logits and a bias repeating per group give equal selection
    scores and equal group scores. Groups tie to the lower group, experts to the lower index,
    against the reference and the naive contract."""
    T, E, K, n_group, topk_group = 63, 16, 4, 4, 2
    logits = torch.randint(0, 3, (T, E), generator=gen).float().to(DEVICE)
    logits[0] = 1.0  # one token: every score equal
    bias = torch.tensor([0.0, 3.0, 0.0, 3.0] * 4, device=DEVICE)
    kw = dict(capacity=5, score_fn=score_fn, expert_bias=bias, n_group=n_group, topk_group=topk_group)
    out = gating_fwd(logits, K, out=_poisoned_gating_out(T, E, K, logits.dtype), **kw)
    _assert_gating_equal("gating_fwd[ties]", out, gating_fwd_ref(logits, K, **kw))
    # Token 0: all four groups score 2 * (3 + s): groups 0 and 1 are kept; its biased experts first.
    assert out.expert_TK[0].tolist() == [1, 3, 5, 7]
    _, chosen, _, slots, _ = route_contract_ref(logits.double(), top_k=K, **kw)
    assert out.expert_TK.tolist() == chosen and out.slot_TK.tolist() == slots


@_NONFINITE_OK
@pytest.mark.parametrize("case", ["bias-K=E-softmax", "groups-sigmoid"])
def test_gating_variants_nonfinite(gen, monkeypatch, case):
    """NaN / +inf / all -inf logit rows with a non-finite bias, on two spans. Experts: a NaN
    selection score ranks first (its weight stays the finite score), then +inf, and an allowed
    -inf expert comes before every expert of the groups left out. Groups: a NaN group score (a NaN
    score, or a top two of +inf and -inf) ranks first, before +inf, ties to the lower group."""
    monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)  # T = 40: two spans of 32
    rows = {0: "nan", 3: "+inf", 6: "-inf_all", 9: "-inf_some", 33: "nan", 35: "+inf"}
    inf, nan = float("inf"), float("nan")
    if case == "bias-K=E-softmax":
        T, E, K, score_fn, variant = 40, 7, 7, "softmax", dict(scaling=2.0)
        bias = torch.tensor([0.1, nan, 0.0, 0.2, -inf, inf, 0.3], device=DEVICE)
    else:  # groups (0, 1) score +inf, (6, 7) NaN; one group kept
        T, E, K, score_fn, variant = 40, 8, 2, "sigmoid", dict(n_group=4, topk_group=1)
        bias = torch.tensor([inf, 0.0, 0.1, 0.2, 0.3, 0.0, inf, -inf], device=DEVICE)
    logits = _nonfinite_logits(gen, T, E, rows)
    used = torch.randint(0, 2, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    out = _check_gating_nonfinite(gen, logits, K, used, 3, score_fn, True, expert_bias=bias, **variant)
    if case == "bias-K=E-softmax":  # ordinary rows: NaN-biased 1, +inf-biased 5, ..., -inf-biased 4 last
        assert out.expert_TK[1, :2].tolist() == [1, 5] and int(out.expert_TK[1, -1]) == 4
        assert not bool(out.weight_TK[[1, 9, 20]].isnan().any())
    else:  # ordinary rows keep group 3 (+inf then -inf); NaN logits at 4 / 5 make group 2 the first NaN group
        assert out.expert_TK[[1, 9, 20]].tolist() == [[6, 7]] * 3
        assert out.expert_TK[[0, 33]].tolist() == [[4, 5], [5, 4]]


def test_gating_variants_match_deepseek_v3_router(gen):
    """Against transformers' DeepseekV3TopkRouter (sigmoid, e_score_correction_bias, groups,
    renormalised and scaled weights) on random inputs without ties: the same expert sets and
    weights (it picks with topk(sorted=False), so both sides are compared sorted by expert)."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    T, D, E, K, n_group, topk_group, scaling = 37, 24, 32, 6, 8, 3, 2.5
    config = DeepseekV3Config(
        hidden_size=D,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=scaling,
        norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, D, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.3)
        logits, hf_weight, hf_expert = router(torch.randn(T, D, generator=gen))
    bias = router.e_score_correction_bias.to(DEVICE)
    kw = dict(score_fn="sigmoid", expert_bias=bias, n_group=n_group, topk_group=topk_group, scaling=scaling)
    hf_expert, order = hf_expert.sort(dim=1)
    hf_weight = hf_weight.gather(1, order)
    for name, fn in (("gating_fwd_ref", gating_fwd_ref), ("gating_fwd", gating_fwd)):
        g = fn(logits.to(DEVICE), K, **kw)
        expert, order = g.expert_TK.long().sort(dim=1)
        assert torch.equal(expert.cpu(), hf_expert), f"{name}: expert sets differ from DeepseekV3TopkRouter"
        assert_close(f"{name}.weight_TK vs DeepseekV3TopkRouter", g.weight_TK.gather(1, order), hf_weight)


@pytest.mark.parametrize(
    "case",
    [
        dict(
            T=50,
            E=12,
            K=3,
            capacity=9,
            score_fn="sigmoid",
            normalize_topk=True,
            n_group=3,
            topk_group=2,
            scaling=2.5,
            bias=True,
        ),
        dict(
            T=50,
            E=12,
            K=4,
            capacity=None,
            score_fn="softmax",
            normalize_topk=False,
            n_group=6,
            topk_group=2,
            scaling=1.0,
            bias=False,
        ),
        dict(
            T=50,
            E=9,
            K=2,
            capacity=7,
            score_fn="softmax",
            normalize_topk=True,
            n_group=1,
            topk_group=None,
            scaling=0.7,
            bias=True,
        ),
    ],
    ids=["deepseek", "groups-softmax", "bias-only"],
)
def test_gating_ref_matches_naive_contract(gen, case):
    """The vectorised reference against tests/contract_ref.py's loops (float64): experts, slots,
    counts and weights, with random (untied) biases and groups."""
    c = dict(case)
    T, E, K, biased = c.pop("T"), c.pop("E"), c.pop("K"), c.pop("bias")
    logits = torch.randn(T, E, generator=gen, dtype=torch.float64).to(DEVICE)
    bias = torch.randn(E, generator=gen, dtype=torch.float64).to(DEVICE) * 0.2 if biased else None
    g = gating_fwd_ref(logits, K, expert_bias=bias, **c)
    _, chosen, weights, slots, used = route_contract_ref(logits, top_k=K, expert_bias=bias, **c)
    assert g.expert_TK.tolist() == chosen and g.slot_TK.tolist() == slots
    assert g.counts_E.tolist() == used
    assert_close("weight_TK vs contract", g.weight_TK, torch.stack(weights))


def test_gate_passes_router_variants(gen):
    """lancet_rt.routing.functions.gate over two chunks: weights are those of one whole-batch call with the
    variants, the logits' gradient includes the scaling, and the bias gets no gradient."""
    from lancet_rt.ops import get_ops
    from lancet_rt.routing.functions import BatchRouting, gate

    T, E, K = 30, 16, 4
    logits = _logits(gen, T, E).requires_grad_(True)
    bias = _tier_bias(gen, E).requires_grad_(True)
    variant = dict(expert_bias=bias, n_group=4, topk_group=2, scaling=2.5)
    state = BatchRouting(E, K, T, 1.0, DEVICE)
    parts = [
        gate(
            chunk, state, get_ops(DEVICE), score_fn="sigmoid", normalize_topk=True, aux_coef=0.0, z_coef=0.0, **variant
        )
        for chunk in torch.split(logits, [11, 19])
    ]
    weight, expert = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    ref = gating_fwd_ref(logits.detach(), K, capacity=state.capacity, score_fn="sigmoid", **variant)
    assert torch.equal(expert, ref.expert_TK) and torch.equal(state.used_E, ref.used_E)
    assert_close("gate.weight_TK", weight, ref.weight_TK)
    grad_w = torch.randn(T, K, generator=gen).to(DEVICE)
    weight.backward(grad_w)
    want = gating_bwd_ref(logits.detach(), ref.expert_TK, grad_w, None, None, score_fn="sigmoid", scaling=2.5)
    assert_close("gate: grad of logits", logits.grad, want)
    assert bias.grad is None


def test_router_variant_arguments_are_validated():
    """Each bad router-variant argument raises before launching, naming it, in the Triton launchers
    and the references alike."""
    logits = torch.randn(4, 8)
    expert = torch.zeros(4, 2, dtype=torch.int32)
    bad = [
        (TypeError, "expert_bias", dict(expert_bias=[0.0] * 8)),
        (TypeError, "expert_bias", dict(expert_bias=torch.zeros(8, dtype=torch.int32))),
        (ValueError, "expert_bias", dict(expert_bias=torch.zeros(7))),
        (ValueError, "expert_bias", dict(expert_bias=torch.zeros(8, device="meta"))),
        (ValueError, "n_group", dict(n_group=3)),
        (ValueError, "n_group", dict(n_group=0)),
        (ValueError, "n_group", dict(n_group=True)),
        (ValueError, "topk_group", dict(n_group=4, topk_group=5)),
        (ValueError, "topk_group", dict(n_group=4, topk_group=0)),
        (ValueError, "top_k=3", dict(n_group=4, topk_group=1, top_k=3)),
        (ValueError, "scaling", dict(scaling=0.0)),
        (ValueError, "scaling", dict(scaling=float("nan"))),
        (ValueError, "scaling", dict(scaling=float("inf"))),
        (TypeError, "scaling", dict(scaling="2")),
    ]
    for fn in (gating_fwd, gating_fwd_ref):
        for exc, name, kw in bad:
            kw = dict(kw)
            with pytest.raises(exc, match=name):
                fn(logits, kw.pop("top_k", 2), **kw)
    with pytest.raises(ValueError, match="scaling"):
        gating_fwd(logits, 2, scaling=1e39)  # beyond float32: the kernel takes float32 halves
    for fn in (gating_bwd, gating_bwd_ref):
        with pytest.raises(ValueError, match="scaling"):
            fn(logits, expert, torch.ones(4, 2), None, None, scaling=-1.0)
        with pytest.raises(TypeError, match="scaling"):
            fn(logits, expert, torch.ones(4, 2), None, None, scaling=None)


# ----------------------------------------------------------------------------------------------
# Validation and config spaces (no kernels launched)
# ----------------------------------------------------------------------------------------------
def test_launchers_validate_arguments():
    logits = torch.randn(4, 8)
    with pytest.raises(TypeError, match="logits_TE"):
        gating_fwd(logits.half(), 2)
    with pytest.raises(ValueError, match="top_k"):
        gating_fwd(logits, 9)
    with pytest.raises(ValueError, match="score_fn"):
        gating_fwd(logits, 2, score_fn="relu")
    with pytest.raises(ValueError, match="capacity"):
        gating_fwd(logits, 2, capacity=-1)
    with pytest.raises(ValueError, match="used_E"):
        gating_fwd(logits, 2, torch.zeros(7, dtype=torch.int32))
    with pytest.raises(ValueError, match="out.slot_TK"):
        bad = _poisoned_gating_out(4, 8, 2, torch.float32)._replace(slot_TK=torch.empty(4, 3, dtype=torch.int32))
        gating_fwd(logits, 2, out=bad)
    with pytest.raises(ValueError, match="expert_TK"):
        gating_bwd(logits, torch.zeros(3, 2, dtype=torch.int32), None, None, None)
    with pytest.raises(ValueError, match="grad_weight_TK"):
        gating_bwd(logits, torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 3), None, None)
    with pytest.raises(ValueError, match="kept_E"):
        dispatch_rows(
            torch.zeros(4, 2, dtype=torch.int32),
            torch.zeros(4, 2, dtype=torch.int32),
            torch.zeros(8, dtype=torch.int32),
            torch.zeros(7, dtype=torch.int32),
        )
    x = torch.randn(4, D)
    row = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="row_TK"):
        permute_fwd(x, row.float(), 8)
    with pytest.raises(ValueError, match="num_rows"):
        permute_fwd(x, row, 9)
    with pytest.raises(ValueError, match="weight_TK"):
        unpermute_fwd(x, row, torch.ones(4, 3))
    with pytest.raises(ValueError, match="src_S"):
        unpermute_bwd(x, x, row, torch.ones(4, 2), torch.zeros(3, dtype=torch.int32))


def test_config_spaces(monkeypatch):
    """Every shape keeps at least one config (timed on CUDA), and a pin overrides the space."""
    import triton
    from lancet_rt.kernels import _gating_kernels, _permute_kernels
    from lancet_rt.kernels import permute as permute_mod

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CUDA view of the space; nothing is launched
    prune = _gating_kernels._token_tile_prune(gating_mod._ENV_FWD_CONFIG)
    for E in (1, 2, 7, 8, 64, 256, 1024):
        kept = prune(_gating_kernels._token_tile_configs(), {"E": E, "K": 1}, BLOCK_E=triton.next_power_of_2(E))
        assert kept and all(c.kwargs["BLOCK_T"] * triton.next_power_of_2(E) <= 16 * 32 * c.num_warps for c in kept)
    prune = _permute_kernels._row_tile_prune(permute_mod._ENV_PERMUTE_FWD_CONFIG)
    for d in (1, 60, 128, 4096, 7168):
        kept = prune(_permute_kernels._row_tile_configs(), {"D": d, "K": 2})
        assert kept and all(c.kwargs["BLOCK_D"] <= max(64, triton.next_power_of_2(d)) for c in kept)
    monkeypatch.setenv(permute_mod._ENV_PERMUTE_FWD_CONFIG, "BLOCK_T=2,BLOCK_D=1024,num_warps=4")
    (pinned,) = prune(_permute_kernels._row_tile_configs(), {"D": 4096, "K": 2})
    assert pinned.kwargs == {"BLOCK_T": 2, "BLOCK_D": 1024} and pinned.num_warps == 4


# ----------------------------------------------------------------------------------------------
# GPU lane: real sizes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
@pytest.mark.parametrize("EK", GPU_EK, ids=lambda ek: "E{}-K{}".format(*ek))
def test_gpu_gating(gen, EK, score_fn):
    E, K = EK
    logits = _logits(gen, GPU_T, E)
    capacity = _capacity(GPU_T, E, K, 1.25)
    used = torch.randint(0, 64, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    kw = dict(capacity=capacity, score_fn=score_fn)
    out = gating_fwd(logits, K, used, out=_poisoned_gating_out(GPU_T, E, K, logits.dtype), **kw)
    ref = gating_fwd_ref(logits, K, used, **kw)
    _assert_gating_equal("gpu gating_fwd", out, ref)
    again = gating_fwd(logits, K, used, **kw)
    for field, a, b in zip(GatingOutput._fields, out, again):
        assert torch.equal(a, b), f"gpu gating_fwd.{field} not deterministic"
    grads = (
        torch.randn(GPU_T, K, generator=gen).to(DEVICE),
        torch.randn(E, generator=gen).to(DEVICE),
        torch.randn((), generator=gen).to(DEVICE),
    )
    assert_close(
        "gpu gating_bwd",
        gating_bwd(logits, out.expert_TK, *grads, score_fn=score_fn, out=_poison(logits)),
        gating_bwd_ref(logits, ref.expert_TK, *grads, score_fn=score_fn),
        torch.float32,
    )


@pytest.mark.gpu
def test_gpu_gating_carried_capacity(gen):
    E, K = 64, 2
    logits = _logits(gen, GPU_T, E)
    capacity = _capacity(GPU_T, E, K, 1.0)
    whole = gating_fwd(logits, K, capacity=capacity)
    used = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    slots = []
    for chunk in torch.split(logits, [5000, 3, 7000, GPU_T - 12003]):
        g = gating_fwd(chunk, K, used, capacity=capacity)
        slots.append(g.slot_TK)
        used = g.used_E
    assert torch.equal(torch.cat(slots), whole.slot_TK) and torch.equal(used, whole.used_E)


@pytest.mark.gpu
def test_gpu_gating_deepseek_v3(gen):
    """DeepSeek-V3's router at real size (E=256, K=8, 8 groups, 4 kept, bias, scaling 2.5). Against
    the reference in float64 (at 16384 random tokens, float32 group sums would tie within an ulp
    somewhere); in float32, chunked with used_E carried equals one call, run to run identical."""
    E, K = 256, 8
    kw = dict(
        capacity=_capacity(GPU_T, E, K, 1.25),
        score_fn="sigmoid",
        n_group=8,
        topk_group=4,
        scaling=2.5,
        expert_bias=(torch.randn(E, generator=gen) * 0.05).to(DEVICE),
    )
    logits = (torch.randn(GPU_T, E, generator=gen, dtype=torch.float64) * 2).to(DEVICE)
    out = gating_fwd(logits, K, out=_poisoned_gating_out(GPU_T, E, K, logits.dtype), **kw)
    ref = gating_fwd_ref(logits, K, **kw)
    _assert_gating_equal("gpu gating_fwd[deepseek-v3, float64]", out, ref)
    grads = (
        torch.randn(GPU_T, K, generator=gen, dtype=torch.float64).to(DEVICE),
        torch.randn(E, generator=gen, dtype=torch.float64).to(DEVICE),
        torch.randn((), generator=gen, dtype=torch.float64).to(DEVICE),
    )
    assert_close(
        "gpu gating_bwd[deepseek-v3, float64]",
        gating_bwd(logits, out.expert_TK, *grads, score_fn="sigmoid", scaling=2.5, out=_poison(logits)),
        gating_bwd_ref(logits, ref.expert_TK, *grads, score_fn="sigmoid", scaling=2.5),
    )
    logits = logits.float()
    whole = gating_fwd(logits, K, **kw)
    again = gating_fwd(logits, K, **kw)
    for field, a, b in zip(GatingOutput._fields, whole, again):
        assert torch.equal(a, b), f"gpu gating_fwd[deepseek-v3].{field} not deterministic"
    used, parts = torch.zeros(E, dtype=torch.int32, device=DEVICE), []
    for chunk in torch.split(logits, [5000, 3, GPU_T - 5003]):
        parts.append(gating_fwd(chunk, K, used, **kw))
        used = parts[-1].used_E
    for i in (0, 2):
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i]), GatingOutput._fields[i]
    assert torch.equal(used, whole.used_E)
