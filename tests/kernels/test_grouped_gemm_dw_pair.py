"""The dW pair (lancet_rt.kernels.grouped_gemm.grouped_mm_dw_pair): two weight gradients over the same row
segments in one launch, bit for bit the two grouped_mm_dw launches (the same tile config), and within the
dtype's tolerance of the reference (grouped_mm_dw_pair_ref).

CPU lane: the Triton interpreter (tests/conftest.py), odd shapes (a non-power-of-two E with empty
segments, N and K with ragged tiles, the two problems of different sizes), NaN-filled outputs, row maps
on each operand, ``accumulate`` into running sums (bf16 rounded to nearest even), and bad arguments
named in the error.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import _gemm_space as space
from lancet_rt.kernels import grouped_gemm as gg
from lancet_rt.kernels.reference import grouped_mm_dw_pair_ref

from tests.helpers import assert_close, nan_like

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (name, rows per expert, (N, K) of problem A, (N, K) of problem B): the interpreter tiles 16 x 32 x 32,
# so each covers ragged output tiles and partial row steps; gate_up's dW and down's in small.
CASES = [
    ("mixed", [0, 1, 17, 5, 0, 23], (36, 60), (60, 18)),  # E = 6, empties first and in the middle
    ("one_expert", [0, 0, 41], (40, 33), (33, 20)),  # E = 3, every row in one expert
    ("single", [19], (7, 45), (45, 7)),  # E = 1
]
IDS = [c[0] for c in CASES]


def _randn(gen, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _offsets(counts) -> torch.Tensor:
    off = torch.zeros(len(counts) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    return off.to(device=DEVICE, dtype=torch.int32)


def _operands(gen, counts, a, b, dtype) -> tuple:
    """(dy, x, dy_b, x_b, offsets) for problems of output shapes a = (N, K) and b = (N_b, K_b)."""
    R = sum(counts)
    return (
        _randn(gen, R, a[0], dtype=dtype),
        _randn(gen, R, a[1], dtype=dtype),
        _randn(gen, R, b[0], dtype=dtype),
        _randn(gen, R, b[1], dtype=dtype),
        _offsets(counts),
    )


def _scattered(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Grouped rows ``t`` put in received order: row rows[g] is t[g]."""
    out = torch.empty_like(t)
    out[rows.long()] = t
    return out


def _same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equal, NaN where NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_pair_is_the_two_launches(case, dtype, gen):
    """Into NaN-filled outputs: both gradients bitwise those of two grouped_mm_dw launches, within the
    tolerance of the float64 reference, zeros for empty segments."""
    _, counts, a, b = case
    dy, x, dy_b, x_b, off = _operands(gen, counts, a, b, dtype)
    ref = grouped_mm_dw_pair_ref(dy.double(), x.double(), dy_b.double(), x_b.double(), off)
    out = tuple(nan_like(r.to(dtype)) for r in ref)
    got = gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    _same("dw", got[0], gg.grouped_mm_dw(dy, x, off))
    _same("dw_b", got[1], gg.grouped_mm_dw(dy_b, x_b, off))
    assert_close("pair dw", got[0], ref[0])
    assert_close("pair dw_b", got[1], ref[1])
    for e, n in enumerate(counts):
        if n == 0:
            assert not got[0][e].any() and not got[1][e].any(), f"dw[{e}] of an empty segment is not zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("accumulate", [(True, True), (True, False), (False, True)], ids=str)
def test_pair_accumulates_through_row_maps(accumulate, dtype, gen):
    """Each problem with its own row map (as the experts' backward reads them: one operand of each in
    received order) and its own ``accumulate``: bitwise the two launches', a running sum rounded to
    nearest even in bf16 (``a + b`` in PyTorch), a NaN in a running sum kept."""
    _, counts, a, b = CASES[0]
    dy, x, dy_b, x_b, off = _operands(gen, counts, a, b, dtype)
    R = x.shape[0]
    rows = torch.randperm(R, generator=gen).to(DEVICE)
    rows32 = rows.to(torch.int32)
    x_r, dy_b_r = _scattered(x, rows), _scattered(dy_b, rows32)  # (gate_up's x, down's dy: in received order)
    sums = (_randn(gen, len(counts), *a, dtype=dtype), _randn(gen, len(counts), *b, dtype=dtype))
    sums[0][1, 2, 3] = float("nan")
    sums = tuple(s if acc else nan_like(s) for s, acc in zip(sums, accumulate))
    into = tuple(s.clone() for s in sums)
    got = gg.grouped_mm_dw_pair(
        dy, x_r, dy_b_r, x_b, off, x_rows=rows, dy_b_rows=rows32, out=into, accumulate=accumulate
    )
    two = (
        gg.grouped_mm_dw(dy, x_r, off, x_rows=rows, out=sums[0].clone(), accumulate=accumulate[0]),
        gg.grouped_mm_dw(dy_b_r, x_b, off, dy_rows=rows32, out=sums[1].clone(), accumulate=accumulate[1]),
    )
    _same("dw", got[0], two[0])
    _same("dw_b", got[1], two[1])
    plain = (gg.grouped_mm_dw(dy, x, off), gg.grouped_mm_dw(dy_b, x_b, off))
    for name, g, s, p, acc in zip(("dw", "dw_b"), got, sums, plain, accumulate):
        _same(name + " as PyTorch adds", g, s + p if acc else p)


def test_pair_of_one_empty_problem(gen):
    """A problem with no output (N = 0) launches only the other's tiles; the other is unchanged."""
    dy, x, _, x_b, off = _operands(gen, [3, 0, 9], (20, 17), (0, 5), torch.float32)
    dy_b = dy[:, :0]
    got = gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, out=(nan_like(torch.empty(3, 20, 17)), None))
    _same("dw", got[0], gg.grouped_mm_dw(dy, x, off))
    assert got[1].shape == (3, 0, 5)
    got = gg.grouped_mm_dw_pair(dy_b, x_b, dy, x, off)
    _same("dw_b", got[1], gg.grouped_mm_dw(dy, x, off))


def test_pair_validation(gen):
    dy, x, dy_b, x_b, off = _operands(gen, [2, 3], (8, 16), (16, 4), torch.float32)
    outs = (torch.zeros(2, 8, 16, device=DEVICE), torch.zeros(2, 16, 4, device=DEVICE))
    with pytest.raises(TypeError, match="out"):
        gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, out=outs[0])
    with pytest.raises(TypeError, match="accumulate"):
        gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, out=outs, accumulate=True)
    with pytest.raises(TypeError, match=r"accumulate\[1\]"):
        gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, out=outs, accumulate=(True, 1))
    with pytest.raises(ValueError, match=r"out\[1\]"):
        gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, out=(outs[0], None), accumulate=(True, True))
    with pytest.raises(ValueError, match=r"out\[0\]"):
        gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, out=(outs[1], outs[0]))
    with pytest.raises(TypeError, match="x_b_RK"):
        gg.grouped_mm_dw_pair(dy, x, dy_b, x_b.double(), off)
    with pytest.raises(ValueError, match="dy_b_RN"):
        gg.grouped_mm_dw_pair(dy, x, dy_b[:4], x_b, off)
    with pytest.raises(ValueError, match="x_b_RK"):
        gg.grouped_mm_dw_pair(dy, x, dy_b[:4], x_b[:4], off)
    with pytest.raises(ValueError, match="dy_b_rows"):
        gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, dy_b_rows=torch.arange(4, device=DEVICE))
    with pytest.raises(TypeError, match="x_rows"):
        gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, x_rows=torch.arange(5.0, device=DEVICE))
    with pytest.raises(ValueError, match="offsets_E1"):
        gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off[None])


def test_pair_is_pinned_by_the_dw_variable(monkeypatch, gen):
    """LANCET_GEMM_CONFIG_DW pins the pair as it pins dW (so the same pin gives the same bits), and the
    pair's launch is dW's latest config."""
    dy, x, dy_b, x_b, off = _operands(gen, [5, 0, 12], (20, 33), (33, 9), torch.float32)
    monkeypatch.setenv("LANCET_GEMM_CONFIG_DW", "16,16,16,4,2")
    got = gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off)
    assert gg.selected_config("dw_pair") == gg.selected_config("dw") == "16,16,16,4,2"
    _same("dw", got[0], gg.grouped_mm_dw(dy, x, off))
    _same("dw_b", got[1], gg.grouped_mm_dw(dy_b, x_b, off))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pair_search_space(dtype):
    """The pair's CUDA configs are dW's for the larger of its two problems whose operand stages fit twice
    in a block's shared memory (one set per problem in the pair's kernel)."""
    x = torch.empty(1, 1, dtype=dtype)
    smem = space._smem_bytes(x.device)

    def tiles(op, args):
        kept = space._prune_configs(op)(space._gemm_configs(op), args)
        return {(*space._tile_of(op, c), c.num_warps, c.num_stages): c for c in kept}

    pair = tiles("dw_pair", dict(x_ptr=x, N=64, K=64, N_B=4096, K_B=2048, M_BUCKET=4096))
    single = tiles("dw", dict(x_ptr=x, N=4096, K=2048, M_BUCKET=4096))
    assert pair and set(pair) <= set(single)
    fits_twice = {
        t for t, c in single.items() if space._smem_fits("dw_pair", c, elt_bytes=x.element_size(), smem_bytes=smem)
    }
    assert set(pair) == fits_twice
    # the GPU lane's bf16 dW pin, 128 x 256 x 64 in 3 stages, fits one dW, not the pair
    lane = space._make_config("dw_pair", 128, 256, 64, 8, 3)
    assert space._smem_fits("dw", lane, elt_bytes=2, smem_bytes=227 * 1024)
    assert not space._smem_fits("dw_pair", lane, elt_bytes=2, smem_bytes=227 * 1024)


def test_a_pair_that_does_not_fit_runs_as_the_two_launches(monkeypatch, gen):
    """Where the pinned config does not fit the pair (CUDA only: _pair_fits), the launcher runs the two
    dW launches instead, with the same results and ``out``/``accumulate`` per problem."""
    dy, x, dy_b, x_b, off = _operands(gen, [4, 9, 0], (20, 33), (33, 9), torch.float32)
    want = gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, out=(None, torch.ones(3, 33, 9)), accumulate=(False, True))
    launched = []
    launch = gg._launch_gemm
    monkeypatch.setattr(gg, "_launch_gemm", lambda op, *a, **k: (launched.append(op), launch(op, *a, **k))[1])
    monkeypatch.setattr(gg, "_pair_fits", lambda x_RK: False)
    sums = torch.ones(3, 33, 9)
    got = gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, out=(None, sums), accumulate=(False, True))
    assert launched == ["dw", "dw"] and got[1] is sums
    _same("dw", got[0], want[0])
    _same("dw_b", got[1], want[1])
