"""gating_fwd(scratch=...): the scan path's per-span buffers kept in a caller's dict and reused by the next
calls of the same shapes (a batch's chunks allocate them once): every output and the totals bitwise as
without it and the reference's, with the kept buffers poisoned between calls (each call writes all it
reads), odd T and chunks of several sizes, float64; the single program leaves the dict alone; a bad
``scratch`` raises naming it.

CPU lane: the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); every output is poisoned (NaN,
-7777) before the launch so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import gating as gating_mod
from lancet_rt.kernels.gating import GatingTotals, gating_fwd
from lancet_rt.kernels.reference import gating_fwd_ref

from tests.routing_inputs import DEVICE, _assert_gating_equal, _capacity, _logits, _poison, _poisoned_gating_out


def _totals(E, dtype):
    return GatingTotals(
        torch.zeros(E, dtype=torch.int64, device=DEVICE),
        torch.zeros(E, dtype=dtype, device=DEVICE),
        torch.zeros((), dtype=dtype, device=DEVICE),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("factor", [None, 0.7], ids=lambda f: f"cf{f}")
def test_scratch_reused_by_the_chunks_gives_the_same_bits(gen, monkeypatch, factor, dtype):
    monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)  # spans of 32 tokens: the scan path
    E, K, cuts = 9, 3, [65, 65, 33, 1]  # (two chunks of one shape, then others: the dict's buffers replaced)
    logits = _logits(gen, sum(cuts), E, dtype=dtype)
    capacity = None if factor is None else _capacity(sum(cuts), E, K, factor)
    scratch: dict = {}
    used_a = used_b = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    tot_a, tot_b = _totals(E, dtype), _totals(E, dtype)
    start, kept_before = 0, None
    for T in cuts:
        x = logits[start : start + T]
        start += T
        rows = _poison(torch.empty(T, K, dtype=torch.int32, device=DEVICE))
        rows_b = _poison(rows.clone())
        kw = dict(capacity=capacity)
        got = gating_fwd(
            x, K, used_a, out=_poisoned_gating_out(T, E, K, dtype), totals=tot_a, row_TK=rows, scratch=scratch, **kw
        )
        plain = gating_fwd(x, K, used_b, out=_poisoned_gating_out(T, E, K, dtype), totals=tot_b, row_TK=rows_b, **kw)
        for a, b in zip(got, plain):
            assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan())
        assert torch.equal(rows, rows_b)
        _assert_gating_equal("gating_fwd[scratch]", got, gating_fwd_ref(x, K, used_a, **kw))
        kept = scratch["spans"]
        if T == 65 and kept_before is not None:
            assert all(a is b for a, b in zip(kept, kept_before))  # the second chunk of a shape reuses them
        kept_before = kept
        for t in kept:  # the next call of this shape writes everything it reads
            t.copy_(_poison(t))
        used_a, used_b = got.used_E, plain.used_E
    for a, b in zip(tot_a, tot_b):
        assert torch.equal(a, b)


def test_scratch_single_program_leaves_it_alone(gen):
    T, E, K = 37, 7, 2
    logits, scratch = _logits(gen, T, E), {}
    got = gating_fwd(logits, K, out=_poisoned_gating_out(T, E, K, logits.dtype), scratch=scratch)
    _assert_gating_equal("gating_fwd[single, scratch]", got, gating_fwd_ref(logits, K))
    assert scratch == {}


def test_scratch_entries_of_other_shapes_are_replaced(gen, monkeypatch):
    monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    T, E, K = 70, 6, 2
    logits = _logits(gen, T, E)
    stale = (torch.zeros(3, E, dtype=torch.int32), torch.zeros(3, E), torch.zeros(3, dtype=torch.float64))
    scratch = {"spans": stale}
    got = gating_fwd(logits, K, out=_poisoned_gating_out(T, E, K, logits.dtype), scratch=scratch)
    _assert_gating_equal("gating_fwd[stale scratch]", got, gating_fwd_ref(logits, K))
    assert [tuple(t.shape) for t in scratch["spans"]] == [(3, E), (3, E), (3,)]
    assert scratch["spans"][2].dtype == torch.float32 and scratch["spans"][0] is not stale[0]


def test_scratch_is_validated(gen):
    T, E, K = 5, 8, 2
    logits = _logits(gen, T, E)
    out = _poisoned_gating_out(T, E, K, logits.dtype)
    for bad in ([], (torch.zeros(1),), "spans"):
        with pytest.raises(TypeError, match="scratch"):
            gating_fwd(logits, K, out=out, scratch=bad)
    assert bool((out.expert_TK == -7777).all())
