"""The routing references' short cuts, each against the general path it replaces (bitwise): the one-hot
running count for the gating's slots, and the no-drop gathers of the permutation passes (S = T K rows).
(The experts' CPU short cuts are in their backend: tests/kernels/test_cpu_backend.py.)"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import reference as ref


@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (13, 5, 2), (40, 8, 3)])
def test_slots_one_hot_count_equals_the_sort(T, E, K, monkeypatch):
    g = torch.Generator().manual_seed(T)
    flat_e = torch.randint(0, E, (T * K,), generator=g)
    used = torch.randint(0, 9, (E,), generator=g, dtype=torch.int32)
    one_hot = ref._slots(flat_e, used)
    monkeypatch.setattr(ref, "_ONE_HOT_CELLS", 0)
    sort = ref._slots(flat_e, used)
    for a, b in zip(one_hot, sort):
        assert a.dtype == b.dtype == torch.int32
        assert torch.equal(a, b)


def test_permutation_without_drops_equals_the_masked_gathers():
    """S = T K: the short cut; the same chunk with one extra dropped assignment: the masked path."""
    g = torch.Generator().manual_seed(3)
    T, K, D = 7, 2, 5
    row = torch.randperm(T * K, generator=g).to(torch.int32).view(T, K)
    y, w, gy = torch.randn(T * K, D, generator=g), torch.rand(T, K, generator=g), torch.randn(T, D, generator=g)
    src = torch.empty(T * K, dtype=torch.int32)
    src[row.view(-1).long()] = torch.arange(T * K, dtype=torch.int32)
    fast = (ref.unpermute_fwd_ref(y, row, w), *ref.unpermute_bwd_ref(gy, y, row, w, src), ref.permute_bwd_ref(y, row))
    y_pad = torch.cat([y, torch.full((1, D), float("nan"))])  # S = T K + 1: the general path (row T K unused)
    slow = (
        ref.unpermute_fwd_ref(y_pad, row, w),
        *ref.unpermute_bwd_ref(gy, y_pad, row, w, src),
        ref.permute_bwd_ref(y_pad, row),
    )
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[2], slow[2]) and torch.equal(fast[3], slow[3])
    assert torch.equal(fast[1], slow[1][: T * K])


@pytest.mark.parametrize("dropped", [0, 3])
def test_unpermute_weight_gradient_is_the_gathered_rows_formula(dropped):
    """The weights' gradient, dot(y row, its token's gradient), computed over the rows in dispatch
    order and gathered to [T, K]: bitwise the written-out gather of y's rows to [T, K, D] (zero where
    dropped)."""
    g = torch.Generator().manual_seed(dropped)
    T, K, D = 9, 3, 40
    perm = torch.randperm(T * K, generator=g)
    row = torch.empty(T * K, dtype=torch.int32)
    row[perm] = torch.arange(T * K, dtype=torch.int32)
    row[perm[T * K - dropped :]] = -1  # the last rows' assignments dropped
    row = row.view(T, K)
    S = T * K - dropped
    y, w, gy = torch.randn(S, D, generator=g), torch.rand(T, K, generator=g), torch.randn(T, D, generator=g)
    src = torch.empty(S, dtype=torch.int32)
    kept = row.view(-1) >= 0
    src[row.view(-1)[kept].long()] = torch.arange(T * K, dtype=torch.int32)[kept]
    _, grad_w = ref.unpermute_bwd_ref(gy, y, row, w, src)
    rows = y[row.clamp(min=0).long()]  # [T, K, D]
    want = torch.where(row >= 0, (rows * gy.unsqueeze(1)).sum(dim=2), 0.0)
    assert torch.equal(grad_w, want)
