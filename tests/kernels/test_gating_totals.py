"""gating_fwd(kept_E=..., totals=...): the call's kept rows per expert, and the batch's running sums (kept
rows, score_sum_E, zsq_sum) added in place, by the last launch, against the ops a caller makes after a
call without them (bitwise: the same float additions in the same order), on the single-program and the
scan path, dropless, dropping and capacity 0, float32 and float64, T = 0; the launcher's checks of
``kept_E`` and ``totals``; and the layer's gate (lancet_rt.routing.functions) on the Triton path against
the reference path, chunk by chunk.

CPU lane: the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); every output and total is
poisoned before the launch so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import gating as gating_mod
from lancet_rt.kernels.gating import GatingTotals, gating_fwd
from lancet_rt.kernels.reference import gating_fwd_ref

from tests.routing_inputs import DEVICE, _assert_gating_equal, _capacity, _kept_E, _logits, _poisoned_gating_out


def _totals(gen, E, dtype) -> GatingTotals:
    """Running sums as after some earlier chunks: random, not zeros."""
    kept = torch.randint(0, 50, (E,), generator=gen, dtype=torch.int64)
    score = torch.rand(E, generator=gen, dtype=torch.float64) * 7
    zsq = torch.rand((), generator=gen, dtype=torch.float64) * 30
    return GatingTotals(kept.to(DEVICE), score.to(dtype).to(DEVICE), zsq.to(dtype).to(DEVICE))


def _clone(totals: GatingTotals) -> GatingTotals:
    return GatingTotals(*(t.clone() for t in totals))


# (T, E, K): the fused single program (T <= 128) and the scan path (T = 257, 3 spans here), padded lanes (E = 7)
SHAPES = [(1, 8, 2), (63, 7, 2), (257, 8, 8), (257, 64, 2), (63, 7, 7)]
MODES = [("softmax", None), ("sigmoid", 0.5), ("softmax", 1.0), ("sigmoid", 0.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]}-cf{m[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-K{}".format(*s))
def test_totals_add_the_call(gen, shape, mode, dtype):
    """The outputs are those of a call without totals (and the reference's); each total gains what the
    caller's additions would give it, bit for bit."""
    (T, E, K), (score_fn, factor) = shape, mode
    logits = _logits(gen, T, E, dtype=dtype)
    capacity = None if factor is None else (0 if factor == 0.0 else _capacity(T, E, K, factor))
    used = torch.randint(0, 1 + (capacity or 8), (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    kw = dict(capacity=capacity, score_fn=score_fn)
    before = _totals(gen, E, dtype)
    totals = _clone(before)

    plain = gating_fwd(logits, K, used, out=_poisoned_gating_out(T, E, K, dtype), **kw)
    kept_out = torch.full((E,), -7777, dtype=torch.int32, device=DEVICE)
    got = gating_fwd(logits, K, used, out=_poisoned_gating_out(T, E, K, dtype), kept_E=kept_out, totals=totals, **kw)
    _assert_gating_equal("gating_fwd[totals]", got, gating_fwd_ref(logits, K, used, **kw))
    for a, b in zip(got, plain):
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan())

    C = plain.counts_E if capacity is None else (capacity - used.long()).clamp(min=0)
    kept = torch.minimum(plain.counts_E.long(), C.long())
    assert torch.equal(kept_out, kept.int())
    assert torch.equal(kept_out, _kept_E(got.expert_TK, got.slot_TK, E))
    assert torch.equal(totals.kept_E, before.kept_E + kept)
    assert torch.equal(totals.score_sum_E, before.score_sum_E + plain.score_sum_E)
    assert torch.equal(totals.zsq_sum, before.zsq_sum + plain.zsq_sum)


@pytest.mark.parametrize("path", ["single", "multi"])
def test_totals_scan_path_forced(gen, monkeypatch, path):
    """A small call forced onto the scan path adds the same totals as the single program."""
    if path == "multi":
        monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    T, E, K = 45, 8, 2
    logits = _logits(gen, T, E)
    used = torch.randint(0, 9, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    before = _totals(gen, E, torch.float32)
    totals = _clone(before)
    got = gating_fwd(logits, K, used, capacity=14, out=_poisoned_gating_out(T, E, K, logits.dtype), totals=totals)
    ref = gating_fwd_ref(logits, K, used, capacity=14)
    _assert_gating_equal(f"gating_fwd[totals,{path}]", got, ref)
    kept = torch.minimum(got.counts_E.long(), (14 - used.long()).clamp(min=0))
    alone = torch.full((E,), -7777, dtype=torch.int32, device=DEVICE)  # kept_E without totals
    gating_fwd(logits, K, used, capacity=14, out=_poisoned_gating_out(T, E, K, logits.dtype), kept_E=alone)
    assert torch.equal(alone, kept.int())
    assert torch.equal(totals.kept_E, before.kept_E + kept)
    assert torch.equal(totals.score_sum_E, before.score_sum_E + got.score_sum_E)
    assert torch.equal(totals.zsq_sum, before.zsq_sum + got.zsq_sum)


def test_totals_zero_tokens(gen):
    """T = 0 keeps no row and adds zero sums, as the caller's additions would."""
    E, K = 7, 2
    logits = torch.empty(0, E, device=DEVICE)
    before = _totals(gen, E, torch.float32)
    totals = _clone(before)
    kept = torch.full((E,), -7777, dtype=torch.int32, device=DEVICE)
    gating_fwd(logits, K, out=_poisoned_gating_out(0, E, K, logits.dtype), kept_E=kept, totals=tuple(totals))
    assert all(torch.equal(a, b) for a, b in zip(totals, before))
    assert bool((kept == 0).all())


def test_totals_are_validated(gen):
    """A bad ``totals`` raises before launching, naming it; nothing is written."""
    T, E, K = 5, 8, 2
    logits = _logits(gen, T, E)
    good = _totals(gen, E, torch.float32)
    bad = [
        (TypeError, "totals", [good.kept_E, good.score_sum_E, good.zsq_sum]),
        (TypeError, "totals", good[:2]),
        (TypeError, "totals.kept_E", good._replace(kept_E=good.kept_E.int())),
        (ValueError, "totals.kept_E", good._replace(kept_E=good.kept_E[:7])),
        (TypeError, "totals.score_sum_E", good._replace(score_sum_E=good.score_sum_E.double())),
        (ValueError, "totals.score_sum_E", good._replace(score_sum_E=torch.zeros(2 * E, device=DEVICE)[::2])),
        (ValueError, "totals.zsq_sum", good._replace(zsq_sum=good.zsq_sum.view(1))),
        (ValueError, "alias", good._replace(zsq_sum=good.score_sum_E[0])),
    ]
    for exc, name, totals in bad:
        with pytest.raises(exc, match=name):
            gating_fwd(logits, K, totals=totals)
    out = _poisoned_gating_out(T, E, K, logits.dtype)
    with pytest.raises(ValueError, match="alias"):
        gating_fwd(logits, K, out=out, totals=good._replace(score_sum_E=out.score_sum_E))
    with pytest.raises(ValueError, match="alias"):
        gating_fwd(logits, K, out=out, kept_E=out.counts_E)
    for exc, kept in [(TypeError, good.kept_E), (ValueError, torch.zeros(E + 1, dtype=torch.int32))]:
        with pytest.raises(exc, match="kept_E"):
            gating_fwd(logits, K, kept_E=kept.to(DEVICE))
    assert bool((out.expert_TK == -7777).all())


@pytest.mark.parametrize("capacity_factor", [None, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_gate_triton_path_matches_reference_path(gen, monkeypatch, capacity_factor, dtype):
    """routing.functions.gate chunk by chunk on the Triton ops (buffers and sums in the kernel) gives
    what it gives on the reference ops: every chunk's outputs, the carried state, the logits' gradient."""
    from lancet_rt.ops import get_ops
    from lancet_rt.routing.functions import BatchRouting, gate

    T, E, K, cuts = 41, 8, 2, [10, 10, 14, 7]
    logits = _logits(gen, T, E, dtype=dtype)
    results = []
    for kernels in ("triton", "torch"):
        monkeypatch.setenv("LANCET_KERNELS", kernels)
        ops = get_ops(DEVICE, dtype)
        assert ops.name == kernels
        x = logits.clone().requires_grad_(True)
        state = BatchRouting(E, K, T, capacity_factor, DEVICE)
        parts = [
            gate(c, state, ops, score_fn="softmax", normalize_topk=True, aux_coef=0.01, z_coef=0.001)
            for c in torch.split(x, cuts)
        ]
        loss = sum((p[0] * torch.arange(1.0, K + 1, dtype=dtype, device=DEVICE)).sum() for p in parts)
        loss.backward()
        results.append((parts, state, x.grad))
    (got, s1, g1), (want, s2, g2) = results
    for a, b in zip(got, want):
        assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
        torch.testing.assert_close(a[0], b[0])
    assert torch.equal(s1.used_E, s2.used_E) and torch.equal(s1.kept_E, s2.kept_E)
    assert s1.score_sum_E.dtype == s2.score_sum_E.dtype == dtype
    torch.testing.assert_close(s1.score_sum_E, s2.score_sum_E)
    torch.testing.assert_close(s1.zsq_sum, s2.zsq_sum)
    torch.testing.assert_close(g1, g2)


def test_gate_triton_path_state_is_the_unfused_sums(gen, monkeypatch):
    """On the Triton ops the state's sums are bitwise those of the unfused additions (the gate run again
    with the fusion switched off), and the chunks' outputs are the same tensors' values."""
    from lancet_rt.ops import get_ops
    from lancet_rt.routing import functions
    from lancet_rt.routing.functions import BatchRouting, gate

    T, E, K, cuts = 37, 7, 2, [9, 9, 9, 10]
    logits = _logits(gen, T, E)
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    ops = get_ops(DEVICE, torch.float32)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(functions, "_fused_gating", lambda ops, fused=fused: fused)
        state = BatchRouting(E, K, T, 0.8, DEVICE)
        parts = [
            gate(c, state, ops, score_fn="sigmoid", normalize_topk=True, aux_coef=0.0, z_coef=0.0)
            for c in torch.split(logits, cuts)
        ]
        runs.append((parts, state))
    (p1, s1), (p2, s2) = runs
    for a, b in zip(p1, p2):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for name in ("used_E", "kept_E", "score_sum_E", "zsq_sum"):
        assert torch.equal(getattr(s1, name), getattr(s2, name)), name


def test_autotuner_restores_the_totals():
    """On CUDA the forward is autotuned: its timing runs add to the totals too, so the tuner restores them
    (the GPU twin below checks the sums after a first, tuned call)."""
    tuner = gating_mod._gating_fwd_kernel
    assert {"tot_kept_ptr", "tot_score_ptr", "tot_zsq_ptr"} <= set(tuner.restore_value)


@pytest.mark.gpu
def test_gpu_totals_after_tuning(gen):
    """A single-program call on a key no other test tunes (E = 24, K = 3): the timing runs of its
    first call leave the totals as one call's additions make them."""
    T, E, K = 96, 24, 3
    logits = _logits(gen, T, E)
    used = torch.randint(0, 8, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    before = _totals(gen, E, torch.float32)
    totals = _clone(before)
    kept = torch.full((E,), -7777, dtype=torch.int32, device=DEVICE)
    got = gating_fwd(logits, K, used, capacity=20, kept_E=kept, totals=totals)
    plain = gating_fwd(logits, K, used, capacity=20)
    _assert_gating_equal("gpu gating_fwd[totals]", got, gating_fwd_ref(logits, K, used, capacity=20))
    want = torch.minimum(plain.counts_E.long(), (20 - used.long()).clamp(min=0))
    assert torch.equal(kept, want.int())
    assert torch.equal(totals.kept_E, before.kept_E + want)
    assert torch.equal(totals.score_sum_E, before.score_sum_E + plain.score_sum_E)
    assert torch.equal(totals.zsq_sum, before.zsq_sum + plain.zsq_sum)
