"""Inputs and checks shared by the routing-kernel tests (test_kernels_routing.py: gating;
test_kernels_permute.py: dispatch_rows, permute, unpermute; the seeded ``gen`` fixture is in
conftest.py): well-separated
logits, poisoned output buffers, realistic row maps from the reference gating, and the GPU lane's
real sizes."""

from __future__ import annotations

import math

import torch
from lancet_rt.kernels.reference import GatingOutput, dispatch_rows_ref, gating_fwd_ref

from tests.helpers import assert_close, nan_like

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_INT_POISON = -7777  # no kernel writes this: slots/rows are >= -1, experts and counts >= 0
# Where NaN is a legitimate result (non-finite logits), NaN cannot mark an unwritten element:
# float outputs are filled with this instead, which no kernel computes there.
_FLOAT_POISON = -7777.0


def _logits(gen, T, E, *, dtype=torch.float32):
    """Random logits whose values in a row are >= 0.6 * step apart: no near-ties (module docstring)."""
    step = 0.05 * min(1.0, 64 / E)  # keeps |logits| moderate, so sigmoid scores stay apart in fp32
    ranks = torch.argsort(torch.rand(T, E, generator=gen), dim=1).float()
    jitter = torch.rand(T, E, generator=gen) * 0.4
    shift = torch.randn(T, 1, generator=gen)
    return (shift + (ranks + jitter) * step).to(DEVICE, dtype)


def _poison(t: torch.Tensor, *, nan: bool = True) -> torch.Tensor:
    if not t.dtype.is_floating_point:
        return torch.full_like(t, _INT_POISON)
    return nan_like(t) if nan else torch.full_like(t, _FLOAT_POISON)


def _poisoned_gating_out(T, E, K, dtype, *, nan: bool = True) -> GatingOutput:
    shapes = [(T, K), (T, K), (T, K), (E,), (E,), (E,), ()]
    dtypes = [torch.int32, dtype, torch.int32, torch.int32, torch.int32, dtype, dtype]
    return GatingOutput(*(_poison(torch.empty(s, dtype=d, device=DEVICE), nan=nan) for s, d in zip(shapes, dtypes)))


def _capacity(T, E, K, factor):
    return None if factor is None else math.ceil(factor * T * K / E)


def _kept_E(expert_TK, slot_TK, E):
    return torch.bincount(expert_TK[slot_TK >= 0].long(), minlength=E).to(torch.int32)


def _assert_close_nonfinite(name, got: torch.Tensor, want: torch.Tensor, dtype=None):
    """NaN and +-inf exactly where the reference has them, the finite rest within the dtype's
    tolerance (:func:`assert_close`, which itself fails on any NaN)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), (
        f"{name}: NaN at {nan_got.nonzero().tolist()}, reference at {nan_want.nonzero().tolist()}"
    )
    inf_want = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf_want) and torch.equal(got[inf_want], want[inf_want]), (
        f"{name}: infinities {got[torch.isinf(got)].tolist()} != reference's {want[inf_want].tolist()}"
    )
    finite = ~(nan_want | inf_want)
    assert_close(name, got[finite], want[finite], dtype or got.dtype)


def _assert_gating_equal(name, got: GatingOutput, ref: GatingOutput, *, nonfinite: bool = False):
    for field, a, b in zip(GatingOutput._fields, got, ref):
        if a.dtype.is_floating_point:
            (_assert_close_nonfinite if nonfinite else assert_close)(f"{name}.{field}", a, b, a.dtype)
        else:
            assert a.dtype == b.dtype, f"{name}.{field}: dtype {a.dtype} != {b.dtype}"
            assert torch.equal(a, b), f"{name}.{field}: {(a != b).sum().item()} of {a.numel()} differ"


def _routing(gen, T, E, K, capacity_factor, *, logits=None, capacity=None, used=None):
    """A realistic row_TK (with drops when capacity_factor or capacity is set) from the reference
    gating of ``logits`` (default: random) with ``used`` (default: zeros) carried."""
    logits = _logits(gen, T, E) if logits is None else logits
    capacity = _capacity(T, E, K, capacity_factor) if capacity is None else capacity
    used = torch.zeros(E, dtype=torch.int32, device=DEVICE) if used is None else used
    g = gating_fwd_ref(logits, K, used, capacity=capacity)
    kept = _kept_E(g.expert_TK, g.slot_TK, E)
    row_TK = dispatch_rows_ref(g.expert_TK, g.slot_TK, used, kept)
    return row_TK, int(kept.sum()), g.weight_TK


# The GPU lane's real sizes
GPU_T, GPU_D = 16384, 4096
GPU_EK = [(E, K) for E in (8, 64, 256) for K in (1, 2, 8)]
D = 60  # the permutation tests' row width (odd against every D tile)
