"""gating_fwd(row_TK=...): the dispatch rows written by the forward's last launch (the single program, or
the slot programs of the finish launch on the scan path), bitwise those of permute.dispatch_rows and of the reference
dispatch_rows_ref given the call's experts, slots, carried counter and kept rows; the other outputs and
the totals as without it; dropless, dropping and capacity 0, T = 0 / 1 / odd, K = E, grouped selection
with padded lanes; the launcher's checks of ``row_TK``; and the layer's gate on the scan path, fused
against unfused.

CPU lane: the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); every output is poisoned (NaN,
-7777) before the launch so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import gating as gating_mod
from lancet_rt.kernels.gating import GatingTotals, gating_fwd
from lancet_rt.kernels.permute import dispatch_rows
from lancet_rt.kernels.reference import dispatch_rows_ref, gating_fwd_ref

from tests.routing_inputs import DEVICE, _assert_gating_equal, _capacity, _logits, _poison, _poisoned_gating_out

# (T, E, K, router kwargs): odd T, padded lanes (E = 7), K = E, grouped with padded groups (E = 12 in 4
# groups of 3 lanes padded to 4), sigmoid with a bias
CASES = [
    (1, 8, 2, {}),
    (37, 7, 2, {}),
    (45, 5, 5, {}),
    (41, 12, 3, dict(n_group=4, topk_group=2)),
    (33, 6, 2, dict(score_fn="sigmoid", bias=True)),
]
FACTORS = [None, 0.6, 0.0]  # dropless, dropping, capacity 0


def _call_rows(gen, T, E, K, router, factor, dtype=torch.float32):
    """(outputs, rows, kept) of one call with row_TK and kept_E, and of one without (plain), and the inputs."""
    logits = _logits(gen, T, E, dtype=dtype)
    capacity = None if factor is None else (0 if factor == 0.0 else _capacity(T, E, K, factor))
    used = torch.randint(0, 1 + (capacity or 6), (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    kw = {k: v for k, v in router.items() if k != "bias"}
    if router.get("bias"):
        kw["expert_bias"] = (torch.rand(E, generator=gen) - 0.5).to(DEVICE)
    kw["capacity"] = capacity
    rows = _poison(torch.empty(T, K, dtype=torch.int32, device=DEVICE))
    kept = _poison(torch.empty(E, dtype=torch.int32, device=DEVICE))
    got = gating_fwd(logits, K, used, out=_poisoned_gating_out(T, E, K, dtype), kept_E=kept, row_TK=rows, **kw)
    plain = gating_fwd(logits, K, used, out=_poisoned_gating_out(T, E, K, dtype), **kw)
    return logits, used, kw, got, plain, rows, kept


def _assert_rows(got, used, kept, rows, plain):
    for a, b in zip(got, plain):  # (the other outputs: as without row_TK)
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan())
    assert torch.equal(rows, dispatch_rows(got.expert_TK, got.slot_TK, used, kept, out=_poison(rows.clone())))
    assert torch.equal(rows, dispatch_rows_ref(got.expert_TK, got.slot_TK, used, kept))
    assert rows.dtype == torch.int32 and bool((rows >= -1).all())


@pytest.mark.parametrize("path", ["single", "multi"])
@pytest.mark.parametrize("factor", FACTORS, ids=lambda f: f"cf{f}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-K{}-{}".format(*c[:3], "-".join(c[3]) or "plain"))
def test_rows_are_dispatch_rows(gen, monkeypatch, case, factor, path):
    """On both paths the rows are dispatch_rows' (and the reference's), dropless the counts' rows."""
    if path == "multi":
        monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    T, E, K, router = case
    logits, used, kw, got, plain, rows, kept = _call_rows(gen, T, E, K, router, factor)
    _assert_gating_equal(f"gating_fwd[rows,{path}]", got, gating_fwd_ref(logits, K, used, **kw))
    _assert_rows(got, used, kept, rows, plain)
    if factor is None:  # (the gate's dropless rows: dispatch_rows of the counts)
        assert torch.equal(rows, dispatch_rows_ref(got.expert_TK, got.slot_TK, used, got.counts_E))
    if factor == 0.0:
        assert bool((rows == -1).all())


def test_rows_scan_path_many_spans(gen):
    """A call of several spans (T past the single program's bound) with drops, float64, and the totals."""
    T, E, K = 257, 9, 3
    logits, used, kw, got, plain, rows, kept = _call_rows(gen, T, E, K, {}, 0.9, dtype=torch.float64)
    _assert_rows(got, used, kept, rows, plain)
    totals = GatingTotals(
        torch.zeros(E, dtype=torch.int64, device=DEVICE),
        torch.zeros(E, dtype=torch.float64, device=DEVICE),
        torch.zeros((), dtype=torch.float64, device=DEVICE),
    )
    rows2 = _poison(rows.clone())
    gating_fwd(logits, K, used, out=_poisoned_gating_out(T, E, K, torch.float64), totals=totals, row_TK=rows2, **kw)
    assert torch.equal(rows2, rows)
    assert torch.equal(totals.kept_E, kept.long())


def test_rows_zero_tokens():
    """T = 0: an empty row_TK is accepted and nothing is launched."""
    E, K = 7, 2
    rows = torch.empty(0, K, dtype=torch.int32, device=DEVICE)
    out = gating_fwd(torch.empty(0, E, device=DEVICE), K, row_TK=rows)
    assert rows.shape == (0, K) and out.expert_TK.shape == (0, K)


def test_rows_are_validated(gen):
    """A bad ``row_TK`` raises before launching, naming it; nothing is written."""
    T, E, K = 5, 8, 2
    logits = _logits(gen, T, E)
    out = _poisoned_gating_out(T, E, K, logits.dtype)
    bad = [
        (TypeError, "row_TK", torch.zeros(T, K, dtype=torch.int64)),
        (ValueError, "row_TK", torch.zeros(T, K + 1, dtype=torch.int32)),
        (ValueError, "row_TK", torch.zeros(K, T, dtype=torch.int32).t()),
    ]
    for exc, name, rows in bad:
        with pytest.raises(exc, match=name):
            gating_fwd(logits, K, out=out, row_TK=rows.to(DEVICE))
    kept = torch.empty(E, dtype=torch.int32, device=DEVICE)
    for rows in (out.slot_TK, out.expert_TK):
        with pytest.raises(ValueError, match="alias"):
            gating_fwd(logits, K, out=out, row_TK=rows)
    with pytest.raises(ValueError, match="alias"):
        gating_fwd(logits[:2], 4, out=_poisoned_gating_out(2, E, 4, logits.dtype), kept_E=kept, row_TK=kept.view(2, 4))
    assert bool((out.expert_TK == -7777).all())


def test_gate_scan_path_rows_are_the_unfused(gen, monkeypatch):
    """The layer's gate with the chunks on the scan path: the fused rows (and every output) are those of the
    unfused gate (dispatch_rows after the gating), with drops."""
    from lancet_rt.ops import get_ops
    from lancet_rt.routing import functions
    from lancet_rt.routing.functions import BatchRouting, gate

    monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    T, E, K, cuts = 75, 7, 2, [33, 1, 41]
    logits = _logits(gen, T, E)
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    ops = get_ops(DEVICE, torch.float32)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(functions, "_fused_gating", lambda ops, fused=fused: fused)
        state = BatchRouting(E, K, T, 0.6, DEVICE)
        runs.append(
            [
                gate(c, state, ops, score_fn="softmax", normalize_topk=True, aux_coef=0.0, z_coef=0.0)
                for c in torch.split(logits, cuts)
            ]
        )
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert bool((runs[0][-1][2] == -1).any())  # (the last chunk drops)
