"""Expert kernels (lancet_rt.kernels.grouped_gemm) against their references (lancet_rt.kernels.reference).

CPU lane: the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on small odd shapes,
with segments of 0, 1 and 17 rows, all rows in one expert, a single expert and block-aligned
segments; fp32, bf16 and fp16. Every output buffer is NaN-filled before the launch, so an unwritten
element fails. bf16/fp16 results are compared with a float64 reference computed from the same
low-precision inputs, with the tolerance row of the result's dtype; with K = 512 their error is also
held to the rounding floor (the float64 result rounded once to the dtype), which a kernel rounding its
accumulator at every K step exceeds. 22 experts with pinned larger tiles, strided views, int64
offsets, TF32 and a guard against host synchronisation in the launchers complete the lane.

GPU lane (``-m gpu``): the same checks at real sizes (E_local = 8, 4096 rows per expert, D = 4096,
F in {2048, 14336}, bf16), balanced and skewed routing.

Note on the interpreter: Triton's interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to
nearest even), so bf16 errors on the CPU lane are about twice the GPU's. The fused h is therefore
checked as ``swiglu(gu)`` of the kernel's own rounded gu (which is its exact contract, see the module
docstring of lancet_rt.kernels._grouped_gemm_kernels), and gu against the float64 GEMM.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from lancet_rt.kernels import _gemm_space as space
from lancet_rt.kernels import grouped_gemm as gg
from lancet_rt.kernels import swiglu
from lancet_rt.kernels.reference import (
    gate_up_swiglu_ref,
    grouped_mm_dw_ref,
    grouped_mm_dx_ref,
    grouped_mm_ref,
    swiglu_bwd_ref,
    swiglu_fwd_ref,
)

from tests.helpers import TOLERANCES, assert_close, interpreter_enabled, nan_like

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (name, rows per expert, K (= D), N (= F)). The interpreter config tiles 16 x 32 x 32, so these
# cover partial M tiles, two N tiles with a ragged edge, and K with (60) and without (64) a K tail.
SEGMENTS = [
    ("mixed", [0, 1, 17, 5, 0, 23], 60, 36),  # empty first, 1 row, 17 rows, an empty in the middle
    ("one_expert", [0, 0, 41, 0], 64, 40),  # every row in one expert, the others empty
    ("single", [33], 60, 36),  # E = 1
    ("aligned", [16, 32, 0, 0], 32, 32),  # block-aligned segments, empties at the end
]
SEG_IDS = [s[0] for s in SEGMENTS]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(gen, *shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def _offsets(counts, dtype=torch.int32) -> torch.Tensor:
    off = torch.zeros(len(counts) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    return off.to(device=DEVICE, dtype=dtype)


def _problem(gen, counts, K, N, dtype):
    """x [R, K] (unit scale), w [E, N, K] scaled 1/sqrt(K) so outputs are O(1), offsets [E + 1]."""
    R, E = sum(counts), len(counts)
    x = _randn(gen, R, K, dtype=dtype)
    w = _randn(gen, E, N, K, dtype=dtype, scale=K**-0.5)
    return x, w, _offsets(counts)


# ------------------------------------------------------------------------------------------------
# Grouped GEMMs: forward, dx, dw
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SEGMENTS, ids=SEG_IDS)
def test_grouped_mm(case, dtype, gen):
    _, counts, K, N = case
    x, w, off = _problem(gen, counts, K, N, dtype)
    expected = grouped_mm_ref(x.double(), w.double(), off)
    y = gg.grouped_mm(x, w, off, out=nan_like(expected.to(dtype)))
    assert y.dtype == dtype
    assert_close("grouped_mm y", y, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SEGMENTS, ids=SEG_IDS)
def test_grouped_mm_dx(case, dtype, gen):
    _, counts, K, N = case
    _, w, off = _problem(gen, counts, K, N, dtype)
    dy = _randn(gen, sum(counts), N, dtype=dtype)
    expected = grouped_mm_dx_ref(dy.double(), w.double(), off)
    dx = gg.grouped_mm_dx(dy, w, off, out=nan_like(expected.to(dtype)))
    assert dx.dtype == dtype
    assert_close("grouped_mm dx", dx, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SEGMENTS, ids=SEG_IDS)
def test_grouped_mm_dw(case, dtype, gen):
    _, counts, K, N = case
    x, _, off = _problem(gen, counts, K, N, dtype)
    dy = _randn(gen, sum(counts), N, dtype=dtype)
    expected = grouped_mm_dw_ref(dy.double(), x.double(), off)
    dw = gg.grouped_mm_dw(dy, x, off, out=nan_like(expected.to(dtype)))
    assert dw.dtype == dtype
    assert_close("grouped_mm dw", dw, expected)
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])), f"dw[{e}] of an empty segment is not zero"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SEGMENTS, ids=SEG_IDS)
def test_grouped_mm_dw_accumulate(case, dtype, gen):
    """accumulate=True: out becomes out + dW bit for bit as PyTorch adds the two in out's dtype (the
    chunks' gradients of one weight summed in their dW launches), with and without row maps, on a
    strided out; the reference within the dtype's tolerance; empty segments leave out as it was."""
    _, counts, K, N = case
    x, _, off = _problem(gen, counts, K, N, dtype)
    R = x.shape[0]
    dy = _randn(gen, R, N, dtype=dtype)
    first = gg.grouped_mm_dw(dy, x, off)
    second_dy, second_x = _randn(gen, R, N, dtype=dtype), _randn(gen, R, K, dtype=dtype)
    second = gg.grouped_mm_dw(second_dy, second_x, off)
    total = gg.grouped_mm_dw(second_dy, second_x, off, out=first.clone(), accumulate=True)
    assert torch.equal(total, first + second)
    expected = grouped_mm_dw_ref(dy.double(), x.double(), off).to(dtype).double()
    expected += grouped_mm_dw_ref(second_dy.double(), second_x.double(), off).to(dtype).double()
    assert_close("accumulated dw", total, expected)
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.equal(total[e], first[e]), f"dw[{e}] of an empty segment changed"
    # through row maps, into a column-major out (a NaN in out stays NaN: every element is read)
    rows = _row_map(gen, R, torch.int32)
    out = first.transpose(1, 2).contiguous().transpose(1, 2)
    out[0, 0, 0] = float("nan")
    mapped = gg.grouped_mm_dw(
        _scattered(second_dy, rows),
        _scattered(second_x, rows),
        off,
        dy_rows=rows,
        x_rows=rows,
        out=out,
        accumulate=True,
    )
    assert mapped is out
    want = first + second
    want[0, 0, 0] = float("nan")
    assert torch.equal(mapped.isnan(), want.isnan()) and torch.equal(mapped.nan_to_num(), want.nan_to_num())


def test_grouped_mm_dw_accumulate_validation(gen):
    x, _, off = _problem(gen, [2, 3], 16, 8, torch.float32)
    dy = _randn(gen, 5, 8)
    with pytest.raises(ValueError, match="accumulate"):
        gg.grouped_mm_dw(dy, x, off, accumulate=True)  # nothing to add to
    with pytest.raises(TypeError, match="accumulate"):
        gg.grouped_mm_dw(dy, x, off, out=torch.zeros(2, 8, 16, device=DEVICE), accumulate=1)
    with pytest.raises(ValueError, match="out"):
        gg.grouped_mm_dw(dy, x, off, out=torch.zeros(2, 8, 16, device=DEVICE, dtype=torch.bfloat16), accumulate=True)


# ------------------------------------------------------------------------------------------------
# Row maps: operands read, outputs written, through a permutation (rows in received order)
# ------------------------------------------------------------------------------------------------
def _row_map(gen, R, dtype):
    """A random permutation of [0, R) (grouped row g <-> received row map[g]) in ``dtype``."""
    return torch.randperm(R, generator=gen).to(device=DEVICE, dtype=dtype)


def _scattered(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Grouped rows ``t`` put in received order: row rows[g] is t[g]."""
    out = torch.empty_like(t)
    out[rows.long()] = t
    return out


# Each segment case, each dtype and each row-map dtype at least once, the mixed case in every dtype
# (the full product repeats the same launches at several times the interpreter's time).
_C = dict(zip(SEG_IDS, SEGMENTS))
ROW_MAP_CASES = [
    (_C["mixed"], torch.float32, torch.int32),
    (_C["mixed"], torch.bfloat16, torch.int64),
    (_C["mixed"], torch.float16, torch.int32),
    (_C["one_expert"], torch.bfloat16, torch.int32),
    (_C["single"], torch.float16, torch.int64),
    (_C["aligned"], torch.float32, torch.int64),
]


@pytest.mark.parametrize(
    "case, dtype, map_dtype", ROW_MAP_CASES, ids=[f"{c[0]}-{d}-{m}".replace("torch.", "") for c, d, m in ROW_MAP_CASES]
)
def test_row_maps(case, dtype, map_dtype, gen):
    """Every launcher's row maps: the reference on the regrouped rows, and bit for bit the launch on
    rows regrouped beforehand (index_select) and regrouped after (outputs NaN-filled first)."""
    _, counts, K, N = case
    x, w, off = _problem(gen, counts, K, N, dtype)
    R = x.shape[0]
    rows = _row_map(gen, R, map_dtype)
    x_in = _scattered(x, rows)  # received order: grouped row g is x_in[rows[g]]
    dy = _randn(gen, R, N, dtype=dtype)
    dy_in = _scattered(dy, rows)
    bias = _randn(gen, len(counts), N, dtype=dtype)

    y = gg.grouped_mm(x_in, w, off, bias, x_rows=rows, out=nan_like(dy))
    assert_close("mapped y", y, grouped_mm_ref(x.double(), w.double(), off, bias.double()))
    assert torch.equal(y, gg.grouped_mm(x, w, off, bias))
    y_in = gg.grouped_mm(x, w, off, bias, out_rows=rows, out=nan_like(y))
    assert torch.equal(y_in, _scattered(gg.grouped_mm(x, w, off, bias), rows))
    both = gg.grouped_mm(x_in, w, off, x_rows=rows, out_rows=rows, out=nan_like(y))
    assert torch.equal(both, _scattered(gg.grouped_mm(x, w, off), rows))

    dx = gg.grouped_mm_dx(dy_in, w, off, dy_rows=rows, out=nan_like(x))
    assert_close("mapped dx", dx, grouped_mm_dx_ref(dy.double(), w.double(), off))
    assert torch.equal(dx, gg.grouped_mm_dx(dy, w, off))
    dx_in = gg.grouped_mm_dx(dy, w, off, out_rows=rows, out=nan_like(x))
    assert torch.equal(dx_in, _scattered(gg.grouped_mm_dx(dy, w, off), rows))

    dw_plain = gg.grouped_mm_dw(dy, x, off)
    assert_close("mapped dw", gg.grouped_mm_dw(dy_in, x_in, off, dy_rows=rows, x_rows=rows), dw_plain.double())
    for kw, a, b in (({"dy_rows": rows}, dy_in, x), ({"x_rows": rows}, dy, x_in)):
        dw = gg.grouped_mm_dw(a, b, off, **kw, out=nan_like(dw_plain))
        assert torch.equal(dw, dw_plain), f"dw with {sorted(kw)}"
    assert torch.equal(gg.grouped_mm_dw(dy_in, x_in, off, dy_rows=rows, x_rows=rows), dw_plain)
    assert_close("mapped dw vs reference", dw_plain, grouped_mm_dw_ref(dy.double(), x.double(), off))

    for interleaved in (False, True):
        w2 = _randn(gen, len(counts), 2 * N, K, dtype=dtype, scale=K**-0.5)
        b2 = _randn(gen, len(counts), 2 * N, dtype=dtype)
        act = dict(activation="swiglu_oai" if interleaved else "swiglu", interleaved=interleaved)
        out = (nan_like(y), nan_like(torch.cat([y, y], 1)))
        h, gu = gg.gate_up_swiglu(x_in, w2, off, b2, x_rows=rows, out=out, **act)
        h0, gu0 = gg.gate_up_swiglu(x, w2, off, b2, **act)
        assert torch.equal(h, h0) and torch.equal(gu, gu0), f"gate_up interleaved={interleaved}"
        assert_close("mapped gate_up gu", gu, grouped_mm_ref(x.double(), w2.double(), off, b2.double()))


# Every segment case with every activation; the dtypes in turn (each dtype with each activation)
ACTS = ["swiglu", "swiglu_oai-interleaved", "swiglu_oai"]
DX_ACT_CASES = [(case, DTYPES[(i + j) % 3], act) for i, case in enumerate(SEGMENTS) for j, act in enumerate(ACTS)]


@pytest.mark.parametrize(
    "case, dtype, act", DX_ACT_CASES, ids=[f"{c[0]}-{d}-{a}".replace("torch.", "") for c, d, a in DX_ACT_CASES]
)
def test_dx_with_the_activation_gradient(case, dtype, act, gen):
    """grouped_mm_dx(gu_R2F=): swiglu_bwd of the dx in the epilogue, bit for bit the two launches
    (dx stored, then swiglu_bwd), also with dy read through a row map; against the references."""
    _, counts, D, F = case
    _, w, off = _problem(gen, counts, F, D, dtype)  # w_EDF [E, D, F]: dH = dy @ w[e]
    R = sum(counts)
    dy = _randn(gen, R, D, dtype=dtype)
    gu = _randn(gen, R, 2 * F, dtype=dtype, scale=3.0)  # past limit = 2 in places: both clamps bite
    kw = dict(activation=act.split("-")[0], interleaved=act.endswith("interleaved"), alpha=1.702, limit=2.0)
    two = swiglu.swiglu_bwd(gu, gg.grouped_mm_dx(dy, w, off), **kw)
    dgu = gg.grouped_mm_dx(dy, w, off, gu_R2F=gu, **kw, out=nan_like(gu))
    assert dgu.shape == gu.shape and dgu.dtype == dtype
    assert torch.equal(dgu, two)
    rows = _row_map(gen, R, torch.int32)
    assert torch.equal(gg.grouped_mm_dx(_scattered(dy, rows), w, off, dy_rows=rows, gu_R2F=gu, **kw), two)
    dh_ref = grouped_mm_dx_ref(dy.double(), w.double(), off).to(dtype)  # rounded as the kernel's dH
    assert_close("fused dgu", dgu, swiglu_bwd_ref(gu.double(), dh_ref.double(), **kw))


def test_row_map_validation(gen):
    x, w, off = _problem(gen, [2, 3], 16, 8, torch.float32)
    rows = _row_map(gen, 5, torch.int64)
    dy, w2 = _randn(gen, 5, 8), _randn(gen, 2, 16, 16)
    with pytest.raises(TypeError, match="x_rows"):
        gg.grouped_mm(x, w, off, x_rows=rows.float())
    with pytest.raises(TypeError, match="x_rows"):
        gg.grouped_mm(x, w, off, x_rows=[4, 3, 2, 1, 0])
    with pytest.raises(ValueError, match="out_rows"):
        gg.grouped_mm(x, w, off, out_rows=rows[:4])
    with pytest.raises(ValueError, match="dy_rows"):
        gg.grouped_mm_dx(dy, w, off, dy_rows=rows[None])
    with pytest.raises(TypeError, match="out_rows"):
        gg.grouped_mm_dx(dy, w, off, out_rows=rows.to(torch.int16))
    with pytest.raises(ValueError, match="dy_rows"):
        gg.grouped_mm_dw(dy, x, off, dy_rows=torch.cat([rows, rows]))
    with pytest.raises(TypeError, match="x_rows"):
        gg.grouped_mm_dw(dy, x, off, x_rows=rows.double())
    with pytest.raises(ValueError, match="x_rows"):
        gg.gate_up_swiglu(x, w2, off, x_rows=rows[:3])
    gu = _randn(gen, 5, 32)  # dx of w [2, 8, 16] is [5, 16]: gu [5, 32]
    with pytest.raises(ValueError, match="gu_R2F"):
        gg.grouped_mm_dx(dy, w, off, gu_R2F=gu[:, :30])
    with pytest.raises(TypeError, match="gu_R2F"):
        gg.grouped_mm_dx(dy, w, off, gu_R2F=gu.double())
    with pytest.raises(ValueError, match="out_rows"):
        gg.grouped_mm_dx(dy, w, off, gu_R2F=gu, out_rows=rows)
    with pytest.raises(ValueError, match="activation"):
        gg.grouped_mm_dx(dy, w, off, gu_R2F=gu, activation="gelu")
    with pytest.raises(ValueError, match="out"):
        gg.grouped_mm_dx(dy, w, off, gu_R2F=gu, out=torch.empty(5, 16, device=DEVICE))


# ------------------------------------------------------------------------------------------------
# Fused gate/up + SwiGLU, and the elementwise SwiGLU kernels
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SEGMENTS, ids=SEG_IDS)
def test_gate_up_swiglu(case, dtype, gen):
    _, counts, D, F = case
    x, w, off = _problem(gen, counts, D, 2 * F, dtype)  # w_E2FD: gate rows, then up rows
    h_ref, gu_ref = gate_up_swiglu_ref(x.double(), w.double(), off)
    out = (nan_like(h_ref.to(dtype)), nan_like(gu_ref.to(dtype)))
    h, gu = gg.gate_up_swiglu(x, w, off, out=out)
    assert h.dtype == gu.dtype == dtype
    assert h.data_ptr() == out[0].data_ptr() and gu.data_ptr() == out[1].data_ptr()
    assert_close("gate_up gu", gu, gu_ref)
    # The epilogue computes h from the rounded gu: exactly swiglu of what backward will see.
    assert_close("gate_up h vs swiglu(gu)", h, swiglu_fwd_ref(gu.double()))
    if dtype == torch.float32:
        assert_close("gate_up h", h, h_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("F", [36, 150])
def test_swiglu_fwd_bwd(F, dtype, gen):
    # R = 45 is ragged in the 16-row tile; F = 36 is one ragged F tile (the CPU F tile is
    # min(64, next_pow2(F))), F = 150 three: 64 + 64 + 22.
    R = 45
    gu = _randn(gen, R, 2 * F, dtype=dtype, scale=2.0)
    dh = _randn(gen, R, F, dtype=dtype)
    h_ref = swiglu_fwd_ref(gu.double())
    h = swiglu.swiglu_fwd(gu, out=nan_like(h_ref.to(dtype)))
    assert_close("swiglu h", h, h_ref)
    dgu_ref = swiglu_bwd_ref(gu.double(), dh.double())
    dgu = swiglu.swiglu_bwd(gu, dh, out=nan_like(dgu_ref.to(dtype)))
    assert dgu.dtype == dtype
    assert_close("swiglu dgu", dgu, dgu_ref)


def test_strided_inputs_and_int64_offsets(gen):
    """Non-contiguous x/dy (column slices), weights as transposed views, int64 offsets, and
    column-major (transposed) output buffers, so that every stride of every kernel is not 1."""
    counts, K, N = [5, 0, 19, 2], 60, 36
    R, E = sum(counts), len(counts)
    off = _offsets(counts, torch.int64)
    x = _randn(gen, R, K + 8)[:, 3 : 3 + K]
    dy = _randn(gen, R, 2 * N)[:, ::2]
    w = _randn(gen, E, K, N, scale=K**-0.5).transpose(1, 2)  # [E, N, K] view, N contiguous
    w2 = _randn(gen, E, K, 2 * N, scale=K**-0.5).transpose(1, 2)  # [E, 2F, D] view, 2F contiguous
    assert not any(t.is_contiguous() for t in (x, dy, w, w2))

    def nan_t(*shape):  # a NaN-filled column-major [.., rows, cols] buffer
        return torch.full(shape[:-2] + shape[:-3:-1], float("nan"), device=DEVICE).transpose(-1, -2)

    y = gg.grouped_mm(x, w, off, out=nan_t(R, N))
    assert_close("strided y", y, grouped_mm_ref(x.double(), w.double(), off))
    dx = gg.grouped_mm_dx(dy, w, off, out=nan_t(R, K))
    assert_close("strided dx", dx, grouped_mm_dx_ref(dy.double(), w.double(), off))
    dw = gg.grouped_mm_dw(dy, x, off, out=nan_t(E, N, K))
    assert_close("strided dw", dw, grouped_mm_dw_ref(dy.double(), x.double(), off))
    h, gu = gg.gate_up_swiglu(x, w2, off, out=(nan_t(R, N), nan_t(R, 2 * N)))
    assert_close("strided gate_up gu", gu, grouped_mm_ref(x.double(), w2.double(), off))
    assert_close("strided gate_up h", h, swiglu_fwd_ref(gu.double()))
    gu_in = _randn(gen, R, 4 * N)[:, : 2 * N]
    dh = _randn(gen, N, R).t()
    assert_close("strided swiglu h", swiglu.swiglu_fwd(gu_in, out=nan_t(R, N)), swiglu_fwd_ref(gu_in.double()))
    assert_close(
        "strided swiglu dgu",
        swiglu.swiglu_bwd(gu_in, dh, out=nan_t(R, 2 * N)),
        swiglu_bwd_ref(gu_in.double(), dh.double()),
    )


def test_tile_bounded_products_switch_to_int64(monkeypatch, gen):
    """The TILE_I64 heuristic: where a tile size times a stride (the bound of the in-tile offset and
    per-step pointer products) reaches 2^31, the kernels form those products in int64. The predicate
    is checked directly (such views take gigabytes); the int64 variants run with the limit lowered."""
    fwd, gate_up, dw = (gg._FWD.values["TILE_I64"], gg._GATE_UP.values["TILE_I64"], gg._DW.values["TILE_I64"])
    assert not fwd({"stride_xk": 1, "stride_wk": 2**25 - 1, "BLOCK_K": 64})
    assert fwd({"stride_xk": 1, "stride_wk": 2**25, "BLOCK_K": 64})
    assert gate_up({"stride_xd": 2**26, "stride_wd": 1, "BLOCK_K": 32})
    assert not gate_up({"stride_xd": 2**26 - 1, "stride_wd": 1, "BLOCK_K": 32})
    assert dw({"stride_dym": 2**24, "stride_xm": 1, "BLOCK_M": 128})
    assert not dw({"stride_dym": 2**24 - 1, "stride_xm": 2**24 - 1, "BLOCK_M": 128})
    monkeypatch.setattr(gg, "_INT32_LIMIT", 1)  # every launch takes the int64 variant
    counts, K, N = [3, 0, 37, 1], 40, 20  # 37 rows: two dW row steps of 32 (and two K steps of 32)
    x, w, off = _problem(gen, counts, K, N, torch.bfloat16)
    dy = _randn(gen, sum(counts), N, dtype=torch.bfloat16)
    y_ref = grouped_mm_ref(x.double(), w.double(), off)
    assert_close("int64 tile y", gg.grouped_mm(x, w, off, out=nan_like(y_ref.to(x.dtype))), y_ref)
    dx_ref = grouped_mm_dx_ref(dy.double(), w.double(), off)
    assert_close("int64 tile dx", gg.grouped_mm_dx(dy, w, off, out=nan_like(dx_ref.to(x.dtype))), dx_ref)
    dw_ref = grouped_mm_dw_ref(dy.double(), x.double(), off)
    assert_close("int64 tile dw", gg.grouped_mm_dw(dy, x, off, out=nan_like(dw_ref.to(x.dtype))), dw_ref)
    w2 = _randn(gen, len(counts), 2 * N, K, dtype=torch.bfloat16, scale=K**-0.5)
    h_ref, gu_ref = gate_up_swiglu_ref(x.double(), w2.double(), off)
    h, gu = gg.gate_up_swiglu(x, w2, off, out=(nan_like(h_ref.to(x.dtype)), nan_like(gu_ref.to(x.dtype))))
    assert_close("int64 tile gu", gu, gu_ref)
    assert_close("int64 tile h", h, swiglu_fwd_ref(gu.double()))


# 22 experts (BLOCK_E = 32 > 16) with segments of 0, 1, 17 and 40 rows, R = 240, K = 40, N = 150.
MANY_COUNTS = [0, 1, 17, 40, 3, 0, 12, 9, 25, 2, 0, 14, 7, 31, 5, 0, 11, 6, 19, 1, 8, 29]
# (dtype, LANCET_GEMM_CONFIG, LANCET_GEMM_CONFIG_DW), None: unpinned. The interpreter's 16 x 32 x 32
# tiles give 36 M-tile slots (25 real tiles: past GROUP_M = 8, the swizzle's later groups), 5 N tiles
# and 2 K steps with a tail; dW in 16 x 64 output tiles gives 10 N tiles (its swizzle's second group
# too; the interpreter's 16 x 32 would double the programs and the time). 64 x 64 x 32 gives 18 M
# tiles, 3 N tiles, dW 64 x 64 tiles over 32-row steps; 32 x 128 x 64 gives 19 M tiles, 2 N tiles, one
# masked K step (K = 40 < 64), dW 32 x 128 tiles (5 N tiles) over 64-row steps.
MANY_RUNS = [
    (torch.float32, None, "16,64,32,4,1"),
    (torch.bfloat16, "64,64,32,4,1", None),
    (torch.float16, "32,128,64,4,1", None),
]


@pytest.mark.parametrize("dtype, config, config_dw", MANY_RUNS, ids=["fp32-interp", "bf16-64x64x32", "fp16-32x128x64"])
def test_many_experts_all_launchers(dtype, config, config_dw, monkeypatch, gen):
    for var, value in ((gg.CONFIG_ENV, config), (gg.CONFIG_ENV + "_DW", config_dw)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    counts, K, N = MANY_COUNTS, 40, 150
    R, E = sum(counts), len(counts)
    assert (R, E) == (240, 22)
    x, w, off = _problem(gen, counts, K, N, dtype)
    dy = _randn(gen, R, N, dtype=dtype)
    y_ref = grouped_mm_ref(x.double(), w.double(), off)
    assert_close("many y", gg.grouped_mm(x, w, off, out=nan_like(y_ref.to(dtype))), y_ref)
    dx_ref = grouped_mm_dx_ref(dy.double(), w.double(), off)
    assert_close("many dx", gg.grouped_mm_dx(dy, w, off, out=nan_like(dx_ref.to(dtype))), dx_ref)
    dw_ref = grouped_mm_dw_ref(dy.double(), x.double(), off)
    dw = gg.grouped_mm_dw(dy, x, off, out=nan_like(dw_ref.to(dtype)))
    assert_close("many dw", dw, dw_ref)
    assert not dw[[e for e, n in enumerate(counts) if n == 0]].any(), "dW of an empty expert is not zero"
    w2 = _randn(gen, E, 2 * N, K, dtype=dtype, scale=K**-0.5)
    h_ref, gu_ref = gate_up_swiglu_ref(x.double(), w2.double(), off)
    h, gu = gg.gate_up_swiglu(x, w2, off, out=(nan_like(h_ref.to(dtype)), nan_like(gu_ref.to(dtype))))
    assert_close("many gu", gu, gu_ref)
    assert_close("many h", h, swiglu_fwd_ref(gu.double()))
    # The tiles the launches used (on CUDA without a pin the autotuner picks them).
    expect = config or (",".join(map(str, gg._INTERPRETER_CONFIG)) if interpreter_enabled() else None)
    if expect is not None:
        assert gg.selected_config("fwd") == gg.selected_config("dx") == gg.selected_config("gate_up") == expect
        assert gg.selected_config("dw") == (config_dw or expect)


def test_allow_tf32(gen):
    """fp32 with allow_tf32=True. TF32 keeps 10 mantissa bits, like fp16: each operand is rounded by
    at most 2^-11 relative, so a sum of products carries about sqrt(2) * 2^-11 / sqrt(3) = 4e-4 relative
    RMS error, and the fp16 row of the tolerance table (2e-3) applies. (Triton's interpreter ignores the
    dot's input precision, so on the CPU lane this checks the plumbing; on CUDA, the TF32 arithmetic.)"""
    assert gg._dot_meta(torch.float32, True)["INPUT_PRECISION"] == "tf32"
    assert gg._dot_meta(torch.bfloat16, True)["INPUT_PRECISION"] == "ieee"
    tol = TOLERANCES[torch.float16]["rel_rms"]
    counts, K, N = [2, 0, 17, 1], 40, 36
    x, w, off = _problem(gen, counts, K, N, torch.float32)
    dy = _randn(gen, sum(counts), N)
    y_ref = grouped_mm_ref(x.double(), w.double(), off)
    y = gg.grouped_mm(x, w, off, out=nan_like(y_ref.float()), allow_tf32=True)
    assert_close("tf32 y", y, y_ref, rel_rms=tol)
    dx_ref = grouped_mm_dx_ref(dy.double(), w.double(), off)
    assert_close(
        "tf32 dx", gg.grouped_mm_dx(dy, w, off, out=nan_like(dx_ref.float()), allow_tf32=True), dx_ref, rel_rms=tol
    )
    dw_ref = grouped_mm_dw_ref(dy.double(), x.double(), off)
    assert_close(
        "tf32 dw", gg.grouped_mm_dw(dy, x, off, out=nan_like(dw_ref.float()), allow_tf32=True), dw_ref, rel_rms=tol
    )
    w2 = _randn(gen, len(counts), 2 * N, K, scale=K**-0.5)
    h_ref, gu_ref = gate_up_swiglu_ref(x.double(), w2.double(), off)
    h, gu = gg.gate_up_swiglu(x, w2, off, out=(nan_like(h_ref.float()), nan_like(gu_ref.float())), allow_tf32=True)
    assert_close("tf32 gu", gu, gu_ref, rel_rms=tol)
    assert_close("tf32 h", h, swiglu_fwd_ref(gu.double()))


# ------------------------------------------------------------------------------------------------
# The rounding floor: with a long reduction the error must be that of rounding the result once
# ------------------------------------------------------------------------------------------------
#: Allowed ratio of a kernel's RMS error to the rounding floor's. Measured on the CPU lane over the
#: cases of test_error_at_rounding_floor and 3 seeds: 1.00 for these kernels (their fp32 sum rounds
#: like the float64 one), while rounding the accumulator to the dtype at every K step gives 2.5-3.1x
#: (fp16, to nearest) and 7.7-9.0x (bf16, which the interpreter truncates).
FLOOR_RATIO = 1.5


def _round_once(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``t`` rounded to ``dtype`` once, as this platform's kernels convert their fp32
    accumulators: to nearest even, except bf16 under the interpreter, which truncates (module docstring)."""
    t32 = t.float()
    if dtype == torch.bfloat16 and interpreter_enabled():
        return (t32.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: low 16 bits are 0
    return t32.to(dtype)


def _floor_check(name: str, actual: torch.Tensor, exact: torch.Tensor) -> float:
    """Assert the RMS error of ``actual`` is at most FLOOR_RATIO x that of ``exact`` rounded once."""
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    err = (actual.double() - exact).pow(2).mean().sqrt().item()
    floor = (_round_once(exact, actual.dtype).double() - exact).pow(2).mean().sqrt().item()
    assert floor > 0, f"{name}: a zero rounding floor cannot bound anything"
    assert err <= FLOOR_RATIO * floor, f"{name}: RMS err {err:.3e} > {FLOOR_RATIO} x the rounding floor {floor:.3e}"
    return err / floor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["fwd", "dx", "dw", "gate_up"])
def test_error_at_rounding_floor(op, dtype, gen):
    """A reduction of 512 (16 interpreter K steps, 8-16 on CUDA) on a few rows per expert."""
    L = 512
    if op == "dw":  # the reduction runs over the rows of a segment: one of 512 rows
        counts = [0, L, 7]
        dy, x = _randn(gen, sum(counts), 16, dtype=dtype), _randn(gen, sum(counts), 24, dtype=dtype)
        off = _offsets(counts)
        exact = grouped_mm_dw_ref(dy.double(), x.double(), off)
        actual = gg.grouped_mm_dw(dy, x, off, out=nan_like(exact.to(dtype)))
    else:
        counts = [3, 0, 5, 2]
        off = _offsets(counts)
        x = _randn(gen, sum(counts), L, dtype=dtype)
        if op == "fwd":
            w = _randn(gen, len(counts), 24, L, dtype=dtype, scale=L**-0.5)
            exact = grouped_mm_ref(x.double(), w.double(), off)
            actual = gg.grouped_mm(x, w, off, out=nan_like(exact.to(dtype)))
        elif op == "dx":  # dx = dy @ w[e] with dy = x: the reduction runs over N = 512
            w = _randn(gen, len(counts), L, 24, dtype=dtype, scale=L**-0.5)
            exact = grouped_mm_dx_ref(x.double(), w.double(), off)
            actual = gg.grouped_mm_dx(x, w, off, out=nan_like(exact.to(dtype)))
        else:
            w = _randn(gen, len(counts), 48, L, dtype=dtype, scale=L**-0.5)
            exact = grouped_mm_ref(x.double(), w.double(), off)
            out = (nan_like(exact[:, :24].to(dtype)), nan_like(exact.to(dtype)))
            actual = gg.gate_up_swiglu(x, w, off, out=out)[1]
    _floor_check(f"{op} {dtype}", actual, exact)


# ------------------------------------------------------------------------------------------------
# No host synchronisation on the launch path
# ------------------------------------------------------------------------------------------------
_HOST_SYNCS = ("item", "tolist", "__int__", "__index__", "__float__", "__bool__")


@contextlib.contextmanager
def _no_host_sync():
    """Within the block, every Tensor -> Python value conversion (the ways a launcher could read
    device data on the host, i.e. synchronise) raises. Triton's interpreter needs none of them: it
    reads tensors through data_ptr() and copies whole storages."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in _HOST_SYNCS}

    def refusal(name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"host synchronisation: Tensor.{name} called on the launch path")

        return refuse

    try:
        for name in _HOST_SYNCS:
            setattr(torch.Tensor, name, refusal(name))
        yield
    finally:
        for name, attr in saved.items():
            if attr is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, attr)


def test_launchers_do_not_sync(gen):
    counts, K, N = [2, 0, 9, 1], 24, 20
    R, E = sum(counts), len(counts)
    x, w, off = _problem(gen, counts, K, N, torch.float32)
    dy, w2, gu_in = _randn(gen, R, N), _randn(gen, E, 2 * N, K), _randn(gen, R, 2 * N)
    launches = [
        ("grouped_mm", lambda: gg.grouped_mm(x, w, off)),
        ("grouped_mm_dx", lambda: gg.grouped_mm_dx(dy, w, off)),
        ("grouped_mm_dw", lambda: gg.grouped_mm_dw(dy, x, off)),
        ("gate_up_swiglu", lambda: gg.gate_up_swiglu(x, w2, off)),
        ("swiglu_fwd", lambda: swiglu.swiglu_fwd(gu_in)),
        ("swiglu_bwd", lambda: swiglu.swiglu_bwd(gu_in, dy)),
    ]
    if DEVICE.type == "cuda":  # the autotuner's first run benchmarks (and syncs) once per key: warm up
        for _, launch in launches:
            launch()
    with _no_host_sync():  # the guard bites: a launcher doing any of this would fail
        for probe in (
            lambda: off[-1].item(),
            lambda: int(off[-1]),
            lambda: bool(off[-1] > 0),
            off.tolist,
            lambda: range(off[-1]),
            lambda: float(x[0, 0]),
        ):
            with pytest.raises(AssertionError, match="host synchronisation"):
                probe()
    results = {}
    for name, launch in launches:
        with _no_host_sync():
            results[name] = launch()
    assert off[-1].item() == R and bool(off[-1]) and int(off[0]) == 0  # restored afterwards
    assert_close("no-sync y", results["grouped_mm"], grouped_mm_ref(x.double(), w.double(), off))
    assert_close("no-sync dw", results["grouped_mm_dw"], grouped_mm_dw_ref(dy.double(), x.double(), off))
    assert_close("no-sync dgu", results["swiglu_bwd"], swiglu_bwd_ref(gu_in.double(), dy.double()))


def test_no_rows(gen):
    """R = 0 with E = 3: empty outputs, and dW writes zeros over a NaN-filled buffer."""
    off = _offsets([0, 0, 0])
    x = _randn(gen, 0, 60)
    w = _randn(gen, 3, 36, 60)
    dy = _randn(gen, 0, 36)
    assert gg.grouped_mm(x, w, off).shape == (0, 36)
    assert gg.grouped_mm_dx(dy, w, off).shape == (0, 60)
    dw = gg.grouped_mm_dw(dy, x, off, out=nan_like(w))
    assert torch.equal(dw, torch.zeros_like(w))
    h, gu = gg.gate_up_swiglu(x, _randn(gen, 3, 72, 60), off)
    assert h.shape == (0, 36) and gu.shape == (0, 72)


def test_references_are_autograd_gradients(gen):
    """The dx/dw/swiglu_bwd references are the autograd gradients of the forward references."""
    counts, K, N = [3, 0, 6, 1], 7, 5
    x, w, off = _problem(gen, counts, K, N, torch.float64)
    x.requires_grad_(True)
    w.requires_grad_(True)
    dy = _randn(gen, sum(counts), N, dtype=torch.float64)
    gx, gw = torch.autograd.grad(grouped_mm_ref(x, w, off), (x, w), dy)
    assert_close("ref dx", grouped_mm_dx_ref(dy, w.detach(), off), gx)
    assert_close("ref dw", grouped_mm_dw_ref(dy, x.detach(), off), gw)
    gu = _randn(gen, 9, 2 * N, dtype=torch.float64).requires_grad_(True)
    dh = _randn(gen, 9, N, dtype=torch.float64)
    (ggu,) = torch.autograd.grad(swiglu_fwd_ref(gu), gu, dh)
    assert_close("ref swiglu_bwd", swiglu_bwd_ref(gu.detach(), dh), ggu)


# ------------------------------------------------------------------------------------------------
# Validation, pinned configs and the CUDA search space (CPU-checkable parts of the tuning code)
# ------------------------------------------------------------------------------------------------
def test_validation(gen):
    x, w, off = _problem(gen, [2, 3], 16, 8, torch.float32)
    with pytest.raises(TypeError, match="x_RK"):
        gg.grouped_mm(x.double(), w, off)
    with pytest.raises(TypeError, match="w_ENK"):
        gg.grouped_mm(x, w.half(), off)
    with pytest.raises(ValueError, match="w_ENK"):
        gg.grouped_mm(x, w[:, :, :8], off)
    with pytest.raises(ValueError, match="offsets_E1"):
        gg.grouped_mm(x, w, off[:2])
    with pytest.raises(TypeError, match="offsets_E1"):
        gg.grouped_mm(x, w, off.float())
    with pytest.raises(ValueError, match="out"):
        gg.grouped_mm(x, w, off, out=torch.empty(5, 9, device=DEVICE))
    with pytest.raises(ValueError, match="dy_RN"):
        gg.grouped_mm_dw(_randn(gen, 4, 8), x, off)
    with pytest.raises(ValueError, match="w_ENK"):
        gg.grouped_mm_dx(_randn(gen, 5, 9), w, off)
    with pytest.raises(ValueError, match="w_E2FD"):
        gg.gate_up_swiglu(x, _randn(gen, 2, 7, 16), off)
    with pytest.raises(ValueError, match="gu_R2F"):
        swiglu.swiglu_fwd(_randn(gen, 5, 7))
    with pytest.raises(ValueError, match="grad_h_RF"):
        swiglu.swiglu_bwd(_randn(gen, 5, 8), _randn(gen, 5, 3))


def test_pinned_config(monkeypatch, gen):
    counts, K, N = [0, 21, 4], 40, 24
    x, w, off = _problem(gen, counts, K, N, torch.float32)
    dy = _randn(gen, sum(counts), N)
    monkeypatch.setenv(gg.CONFIG_ENV, "16,16,16,4,2")
    monkeypatch.setenv(gg.CONFIG_ENV + "_DW", "32,16,16,4,2")  # dW: 32 x 16 output tiles, 16-row steps
    assert space._pinned_config("fwd") == (16, 16, 16, 4, 2)
    assert space._pinned_config("dw") == (32, 16, 16, 4, 2)
    y_ref, dw_ref = grouped_mm_ref(x.double(), w.double(), off), grouped_mm_dw_ref(dy.double(), x.double(), off)
    assert_close("pinned y", gg.grouped_mm(x, w, off, out=nan_like(y_ref.float())), y_ref)
    assert_close("pinned dw", gg.grouped_mm_dw(dy, x, off, out=nan_like(dw_ref.float())), dw_ref)
    assert gg.selected_config("fwd") == "16,16,16,4,2" and gg.selected_config("dw") == "32,16,16,4,2"
    monkeypatch.setenv(gg.CONFIG_ENV, "128,128,64,8")
    with pytest.raises(ValueError, match=gg.CONFIG_ENV):
        gg.grouped_mm(x, w, off)
    monkeypatch.setenv(gg.CONFIG_ENV, "128,100,64,8,3")
    with pytest.raises(ValueError, match="powers of two"):
        space._pinned_config("fwd")


@pytest.mark.parametrize("op", ["fwd", "dx", "gate_up", "dw"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_search_space(op, dtype):
    """At real sizes the pruned space is non-empty and every config fits registers and shared memory."""
    x = torch.empty(1, 1, dtype=dtype)
    smem = 227 * 1024
    for m_bucket in (16, 4096):
        args = dict(x_ptr=x, N=4096, K=14336, F=14336, D=4096, M_BUCKET=m_bucket)
        kept = space._prune_configs(op)(space._gemm_configs(op), args)
        assert kept, f"{op}: every config pruned"
        for cfg in kept:
            rows, cols, red = space._tile_of(op, cfg)
            assert red * x.element_size() == 128
            assert space._acc_regs(op, cfg) <= 128
            assert space._config_fits(op, cfg, elt_bytes=x.element_size(), smem_bytes=smem)
            if op != "dw":
                assert rows <= max(64, m_bucket)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_search_space_of_dx_with_the_activation_gradient(dtype):
    """dx with GLU_GRAD keeps only tiles whose accumulator leaves registers for the epilogue's gate,
    up and gradient tiles (the sm_90 builds of larger ones spilled), and always some."""
    x = torch.empty(1, 1, dtype=dtype)
    for interleaved in (False, True):
        args = dict(x_ptr=x, N=2048, K=4096, M_BUCKET=4096, GLU_GRAD=True, INTERLEAVED=interleaved)
        kept = space._prune_configs("dx")(space._gemm_configs("dx"), args)
        assert kept and all(space._acc_regs("dx", cfg) <= space._GLU_ACC_REGS for cfg in kept)
    plain = space._prune_configs("dx")(space._gemm_configs("dx"), dict(x_ptr=x, N=2048, K=4096, M_BUCKET=4096))
    assert max(space._acc_regs("dx", cfg) for cfg in plain) > space._GLU_ACC_REGS


# ------------------------------------------------------------------------------------------------
# GPU lane: real sizes, bf16
# ------------------------------------------------------------------------------------------------
E_LOCAL, ROWS_PER_EXPERT, D_MODEL = 8, 4096, 4096
ROUTINGS = {
    "balanced": [ROWS_PER_EXPERT] * E_LOCAL,
    # Zipf-like: half the rows in one expert, three experts empty, same total.
    "skewed": [16384, 8192, 4096, 2048, 2048, 0, 0, 0],
}


def _assert_close_sampled(name, actual, expected, dtype, counts=None, rows_per_segment=64):
    """Full NaN check on the device, then the helper on sampled rows: every segment's first and last
    rows plus random ones (the full tensors would take minutes to compare on the host in float64)."""
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    g = torch.Generator().manual_seed(0)
    if counts is None:  # dW: sample rows of each expert's [N, K] slab
        idx = torch.randint(0, actual.shape[1], (rows_per_segment,), generator=g)
        idx = torch.cat([idx, torch.tensor([0, actual.shape[1] - 1])]).to(actual.device)
        assert_close(name, actual[:, idx], expected[:, idx], dtype)
        return
    parts, start = [], 0
    for n in counts:
        if n:
            parts.append(torch.tensor([start, start + n - 1]))
            parts.append(start + torch.randint(0, n, (rows_per_segment,), generator=g))
        start += n
    idx = torch.cat(parts).to(actual.device)
    assert_close(name, actual[idx], expected[idx], dtype)


def _gpu_problem(routing, seed):
    """(counts, R, offsets, randn) with a device generator: bf16 inputs built on the GPU."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    counts = ROUTINGS[routing]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(torch.bfloat16)

    return counts, sum(counts), _offsets(counts), randn


def _nan(*shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)


GPU_CASES = [(F, r) for F in (2048, 14336) for r in ROUTINGS]
GPU_IDS = [f"F{F}-{r}" for F, r in GPU_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("F,routing", GPU_CASES, ids=GPU_IDS)
def test_gpu_gate_up_swiglu(F, routing):
    counts, R, off, randn = _gpu_problem(routing, 1)
    x, w = randn(R, D_MODEL), randn(E_LOCAL, 2 * F, D_MODEL, scale=D_MODEL**-0.5)
    h, gu = gg.gate_up_swiglu(x, w, off, out=(_nan(R, F), _nan(R, 2 * F)))
    h_ref, gu_ref = gate_up_swiglu_ref(x.float(), w.float(), off)
    _assert_close_sampled("gpu gu", gu, gu_ref, torch.bfloat16, counts)
    _assert_close_sampled("gpu h", h, h_ref, torch.bfloat16, counts)


@pytest.mark.gpu
@pytest.mark.parametrize("F,routing", GPU_CASES, ids=GPU_IDS)
def test_gpu_down_fwd_dx(F, routing):
    counts, R, off, randn = _gpu_problem(routing, 2)
    h, w = randn(R, F), randn(E_LOCAL, D_MODEL, F, scale=F**-0.5)
    y = gg.grouped_mm(h, w, off, out=_nan(R, D_MODEL))
    _assert_close_sampled("gpu down y", y, grouped_mm_ref(h.float(), w.float(), off), torch.bfloat16, counts)
    dy = randn(R, D_MODEL)
    dh = gg.grouped_mm_dx(dy, w, off, out=_nan(R, F))
    dh_ref = grouped_mm_dx_ref(dy.float(), w.float(), off)
    _assert_close_sampled("gpu down dx", dh, dh_ref, torch.bfloat16, counts)


@pytest.mark.gpu
@pytest.mark.parametrize("F,routing", GPU_CASES, ids=GPU_IDS)
def test_gpu_gate_up_dx_dw(F, routing):
    counts, R, off, randn = _gpu_problem(routing, 3)
    x, w = randn(R, D_MODEL), randn(E_LOCAL, 2 * F, D_MODEL, scale=D_MODEL**-0.5)
    dgu = randn(R, 2 * F)
    dx = gg.grouped_mm_dx(dgu, w, off, out=_nan(R, D_MODEL))
    dx_ref = grouped_mm_dx_ref(dgu.float(), w.float(), off)
    _assert_close_sampled("gpu gate_up dx", dx, dx_ref, torch.bfloat16, counts)
    del dx, dx_ref
    dw = gg.grouped_mm_dw(dgu, x, off, out=_nan(E_LOCAL, 2 * F, D_MODEL))
    _assert_close_sampled("gpu gate_up dw", dw, grouped_mm_dw_ref(dgu.float(), x.float(), off), torch.bfloat16)
    for e, n in enumerate(counts):
        if n == 0:
            assert not dw[e].any(), f"dw[{e}] of an empty expert is not zero"


@pytest.mark.gpu
@pytest.mark.parametrize("F,routing", GPU_CASES, ids=GPU_IDS)
def test_gpu_down_dw_swiglu(F, routing):
    counts, R, off, randn = _gpu_problem(routing, 4)
    h, dy = randn(R, F), randn(R, D_MODEL)
    dw = gg.grouped_mm_dw(dy, h, off, out=_nan(E_LOCAL, D_MODEL, F))
    _assert_close_sampled("gpu down dw", dw, grouped_mm_dw_ref(dy.float(), h.float(), off), torch.bfloat16)
    gu, dh = randn(R, 2 * F, scale=2.0), randn(R, F)
    h2 = swiglu.swiglu_fwd(gu, out=_nan(R, F))
    _assert_close_sampled("gpu swiglu h", h2, swiglu_fwd_ref(gu.float()), torch.bfloat16, counts)
    dgu = swiglu.swiglu_bwd(gu, dh, out=_nan(R, 2 * F))
    _assert_close_sampled("gpu swiglu dgu", dgu, swiglu_bwd_ref(gu.float(), dh.float()), torch.bfloat16, counts)


@pytest.mark.gpu
@pytest.mark.parametrize("F,routing", GPU_CASES, ids=GPU_IDS)
def test_gpu_row_maps_and_dx_with_the_activation_gradient(F, routing):
    """The experts' backward on received rows: dgu = swiglu_bwd(gu, dy @ w[e]) with dy read through a
    row map, dX written through it, dW reading through it."""
    counts, R, off, randn = _gpu_problem(routing, 5)
    rows = torch.randperm(R, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    w_down, dy_in = randn(E_LOCAL, D_MODEL, F, scale=F**-0.5), randn(R, D_MODEL)
    gu = randn(R, 2 * F, scale=2.0)
    dgu = gg.grouped_mm_dx(dy_in, w_down, off, dy_rows=rows, gu_R2F=gu, out=_nan(R, 2 * F))
    dy = dy_in[rows]
    dh_ref = grouped_mm_dx_ref(dy.float(), w_down.float(), off).to(torch.bfloat16)
    _assert_close_sampled("gpu fused dgu", dgu, swiglu_bwd_ref(gu.float(), dh_ref.float()), torch.bfloat16, counts)
    w_gu = randn(E_LOCAL, 2 * F, D_MODEL, scale=D_MODEL**-0.5)
    dx_in = gg.grouped_mm_dx(dgu, w_gu, off, out_rows=rows, out=_nan(R, D_MODEL))
    dx_ref = grouped_mm_dx_ref(dgu.float(), w_gu.float(), off)
    _assert_close_sampled("gpu mapped dx", dx_in[rows], dx_ref, torch.bfloat16, counts)
    del dx_in, dx_ref
    h = randn(R, F)
    dw = gg.grouped_mm_dw(dy_in, h, off, dy_rows=rows, out=_nan(E_LOCAL, D_MODEL, F))
    _assert_close_sampled("gpu mapped dw", dw, grouped_mm_dw_ref(dy.float(), h.float(), off), torch.bfloat16)
