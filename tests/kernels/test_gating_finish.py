"""gating_fwd's scan path (a call of several spans) in two launches: the spans, then the finish launch whose
sums programs reduce the span counts and sums (counts_E, used_E, score_sum_E, zsq_sum, kept_E, the totals)
and whose slot programs make each span's first slots from the raw span counts themselves and fix the
slots up (and write the dispatch rows). Against the reference and dispatch_rows: capacity dropping across
spans, a carried used_E, kept_E, the totals, row_TK, with and without the rows (a slot program's pass then
stops at its first span), several slot programs with spans straddling their boundaries and their steps,
K = 1 and K = 8, E not a power of two and E = 128, float32 and float64; the launch count; the launcher's
check that ``used_E`` shares no memory with what the finish launch writes.

CPU lane: the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); every output is poisoned (NaN,
-7777) before the launch so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch
import triton
from lancet_rt.kernels import gating as gating_mod
from lancet_rt.kernels.gating import GatingTotals, gating_fwd
from lancet_rt.kernels.reference import dispatch_rows_ref, gating_fwd_ref

from bench.host import LaunchCounter
from tests.routing_inputs import (
    DEVICE,
    _assert_gating_equal,
    _capacity,
    _kept_E,
    _logits,
    _poison,
    _poisoned_gating_out,
)

# (T, E, K) (spans as the launcher plans them on the CPU lane): several slot programs (T * K > 1024) whose
# boundaries fall inside a span, K = 1 and K = 8, E not a power of two, E = 128
CASES = [
    (700, 7, 3),  # spans of 256 tokens (768 assignments) straddling the programs' 1024
    (1100, 5, 1),  # K = 1: spans of 512, two in a slot program's step
    (300, 128, 8),  # E = 128, K = 8: spans of 128 (1024 assignments: the boundaries meet)
    (333, 12, 6),  # spans of 128 (768 assignments) straddling, the last span short
    (45, 9, 2),  # one slot program, two spans
]
FACTORS = [None, 0.8, 0.0]  # dropless, dropping across spans, capacity 0


def _geometry(T, E, K):
    """(spans, span * K, slot programs, steps per slot program) the launcher picks for this call."""
    span = gating_mod._plan_span(T, triton.next_power_of_2(E), torch.device(DEVICE))
    steps = gating_mod._slot_steps(T * K, span)
    return triton.cdiv(T, span), span * K, triton.cdiv(T * K, gating_mod._FLAT_BLOCK * steps), steps


def _run(gen, T, E, K, factor, dtype, rows: bool):
    logits = _logits(gen, T, E, dtype=dtype)
    capacity = None if factor is None else (0 if factor == 0.0 else _capacity(T, E, K, factor))
    used = torch.randint(0, 1 + (capacity or 6), (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    before = GatingTotals(
        torch.randint(0, 50, (E,), generator=gen, dtype=torch.int64).to(DEVICE),
        (torch.rand(E, generator=gen, dtype=torch.float64) * 7).to(dtype).to(DEVICE),
        (torch.rand((), generator=gen, dtype=torch.float64) * 30).to(dtype).to(DEVICE),
    )
    totals = GatingTotals(*(t.clone() for t in before))
    kept = _poison(torch.empty(E, dtype=torch.int32, device=DEVICE))
    row_TK = _poison(torch.empty(T, K, dtype=torch.int32, device=DEVICE)) if rows else None
    out = _poisoned_gating_out(T, E, K, dtype)
    got = gating_fwd(logits, K, used, capacity=capacity, out=out, kept_E=kept, totals=totals, row_TK=row_TK)
    ref = gating_fwd_ref(logits, K, used, capacity=capacity)
    return logits, used, capacity, got, ref, kept, row_TK, before, totals


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "no-rows"])
@pytest.mark.parametrize("factor", FACTORS, ids=lambda f: f"cf{f}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-K{}".format(*c))
def test_finish_matches_the_reference(gen, monkeypatch, case, factor, rows):
    monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    T, E, K = case
    n_spans, span_k, programs, _ = _geometry(T, E, K)
    assert n_spans >= 2
    logits, used, capacity, got, ref, kept, row_TK, before, totals = _run(gen, T, E, K, factor, torch.float32, rows)
    _assert_gating_equal("gating_fwd[finish]", got, ref)
    want_kept = _kept_E(ref.expert_TK, ref.slot_TK, E)
    assert torch.equal(kept, want_kept)
    assert torch.equal(totals.kept_E, before.kept_E + want_kept.long())
    assert torch.equal(totals.score_sum_E, before.score_sum_E + got.score_sum_E)
    assert torch.equal(totals.zsq_sum, before.zsq_sum + got.zsq_sum)
    if rows:
        assert torch.equal(row_TK, dispatch_rows_ref(ref.expert_TK, ref.slot_TK, used, want_kept))
    if factor == 0.8:  # an expert keeps rows in the first span and drops some in a later one
        span = span_k // K
        kept_first = set(ref.expert_TK[:span][ref.slot_TK[:span] >= 0].tolist())
        dropped_later = set(ref.expert_TK[span:][ref.slot_TK[span:] == -1].tolist())
        assert kept_first & dropped_later


def test_the_cases_straddle_the_slot_programs():
    """What the cases above claim: several slot programs, some boundaries inside a span."""
    geo = {case: _geometry(*case) for case in CASES}
    assert all(g[2] > 1 for case, g in geo.items() if case[0] * case[2] > 1024)
    assert any((gating_mod._FLAT_BLOCK * g[3]) % g[1] for g in geo.values() if g[2] > 1)


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "no-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", [(257, 7, 7), (200, 128, 8), (413, 9, 1)], ids=lambda c: "T{}-E{}-K{}".format(*c))
def test_finish_many_steps_and_spans(gen, monkeypatch, case, dtype, rows):
    """Tiny steps (8 assignments) and spans (8 to 32 tokens): a slot program walks several steps, a span
    several steps and programs; the sums programs and the slot programs' pass walk several blocks of spans."""
    monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    monkeypatch.setattr(gating_mod, "_SPAN_MIN", 8)
    monkeypatch.setattr(gating_mod, "_PROGRAMS_PER_SM", 16)
    monkeypatch.setattr(gating_mod, "_FLAT_BLOCK", 8)
    monkeypatch.setattr(gating_mod, "_SCAN_BLOCK_B", 4)
    monkeypatch.setattr(gating_mod, "_SLOT_PASS_ELEMENTS", 64)
    T, E, K = case
    n_spans, span_k, programs, steps = _geometry(T, E, K)
    assert n_spans > 2 * gating_mod._SCAN_BLOCK_B and programs > 1 and steps > 1
    logits, used, capacity, got, ref, kept, row_TK, before, totals = _run(gen, T, E, K, 0.9, dtype, rows)
    _assert_gating_equal("gating_fwd[finish, steps]", got, ref)
    assert torch.equal(kept, _kept_E(ref.expert_TK, ref.slot_TK, E))
    if rows:
        assert torch.equal(row_TK, dispatch_rows_ref(ref.expert_TK, ref.slot_TK, used, kept))


def test_scan_path_is_two_launches(gen, monkeypatch):
    monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    T, E, K = 300, 8, 2
    logits = _logits(gen, T, E)
    totals = GatingTotals(
        torch.zeros(E, dtype=torch.int64, device=DEVICE),
        torch.zeros(E, device=DEVICE),
        torch.zeros((), device=DEVICE),
    )
    rows = torch.empty(T, K, dtype=torch.int32, device=DEVICE)
    kept = torch.empty(E, dtype=torch.int32, device=DEVICE)
    with LaunchCounter() as launches:
        gating_fwd(logits, K, capacity=70, kept_E=kept, totals=totals, row_TK=rows, scratch={})
    assert launches.count == 2


def test_used_E_must_not_alias_what_the_call_writes(gen):
    """The finish launch's slot programs read ``used_E`` while its sums programs write: ``used_E`` may share
    no memory with ``out``, ``kept_E``, the totals or ``row_TK``; nothing is written then."""
    T, E, K = 5, 8, 2
    logits = _logits(gen, T, E)
    out = _poisoned_gating_out(T, E, K, logits.dtype)
    kept = _poison(torch.empty(E, dtype=torch.int32, device=DEVICE))
    rows = _poison(torch.empty(T, K, dtype=torch.int32, device=DEVICE))
    for used in (out.counts_E, out.used_E, kept, rows.view(-1)[:E]):
        with pytest.raises(ValueError, match="used_E"):
            gating_fwd(logits, K, used.zero_(), out=out, kept_E=kept, row_TK=rows)
        used.copy_(_poison(used))
    assert bool((out.expert_TK == -7777).all())
