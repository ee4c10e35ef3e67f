"""The CPU path's short cuts in the references, each against the general path it replaces (bitwise):
``torch._grouped_mm`` for the grouped GEMMs (one ``mm`` for one segment, against ``torch._grouped_mm``
itself), the one-hot running count for the gating's slots, and the no-drop gathers of the permutation
passes (S = T K rows)."""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import reference as ref
from lancet_rt.kernels import reference_experts as rex


def _bounds(sizes):
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[5, 0, 11, 3], [0, 0, 0], [7]])
def test_grouped_mm_one_launch_equals_the_per_segment_loop(dtype, sizes, monkeypatch):
    g = torch.Generator().manual_seed(0)
    R, N, K = sum(sizes), 24, 16
    x = torch.randn(R, K, generator=g).to(dtype)
    w = torch.randn(len(sizes), N, K, generator=g).to(dtype)
    dy = torch.randn(R, N, generator=g).to(dtype)
    b = _bounds(sizes)
    assert rex._one_launch(x, w.transpose(1, 2)) and rex._one_launch(dy.t(), x)
    fast = (rex.grouped_mm_ref(x, w, b), rex.grouped_mm_dx_ref(dy, w, b), rex.grouped_mm_dw_ref(dy, x, b))
    monkeypatch.setattr(rex, "_HAS_GROUPED_MM", False)
    loop = (rex.grouped_mm_ref(x, w, b), rex.grouped_mm_dx_ref(dy, w, b), rex.grouped_mm_dw_ref(dy, x, b))
    for name, f, l in zip(("y", "dx", "dw"), fast, loop):
        assert torch.equal(f, l), name
    for e, n in enumerate(sizes):
        if n == 0:
            assert not fast[2][e].any(), "an empty segment's dW must be zeros"


def test_grouped_mm_unaligned_operands_take_the_loop():
    x, w = torch.randn(9, 6), torch.randn(2, 5, 6)  # 6 floats = 24 bytes: not a multiple of 16
    assert not rex._one_launch(x, w.transpose(1, 2))
    y = rex.grouped_mm_ref(x, w, [0, 4, 9])
    assert torch.equal(y, torch.cat([x[:4] @ w[0].t(), x[4:] @ w[1].t()]))
    assert not rex._one_launch(x.double(), w.double().transpose(1, 2))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [0, 1, 37])
def test_grouped_mm_one_segment_is_the_gemm_grouped_mm_runs(dtype, R):
    """One local expert: the references run one mm, bitwise ``torch._grouped_mm``'s one group (host
    bounds or an offsets tensor alike: its length says one segment, no value is read)."""
    g = torch.Generator().manual_seed(R)
    N, K = 24, 16
    x = torch.randn(R, K, generator=g).to(dtype)
    w = torch.randn(1, N, K, generator=g).to(dtype)
    dy = torch.randn(R, N, generator=g).to(dtype)
    offs = torch.tensor([R], dtype=torch.int32)
    want = (
        torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
        torch._grouped_mm(dy, w, offs=offs),
        torch._grouped_mm(dy.t(), x, offs=offs),
    )
    for b in ([0, R], torch.tensor([0, R])):
        got = (rex.grouped_mm_ref(x, w, b), rex.grouped_mm_dx_ref(dy, w, b), rex.grouped_mm_dw_ref(dy, x, b))
        for name, a, e in zip(("y", "dx", "dw"), got, want):
            assert a.shape == e.shape and torch.equal(a, e), name


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
