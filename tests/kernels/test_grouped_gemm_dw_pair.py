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


def _launches(monkeypatch) -> list:
    """The grouped GEMM ops launched from now on (the launcher's ``_launch_gemm`` spied on)."""
    launched: list = []
    launch = gg._launch_gemm
    monkeypatch.setattr(gg, "_launch_gemm", lambda op, *a, **k: (launched.append(op), launch(op, *a, **k))[1])
    return launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["lancet", "gpt_oss"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_pair_accumulates_through_row_maps(accumulate, layout, dtype, monkeypatch, gen):
    """One launch with one row map per problem, the mapped operand chosen per problem at run time (the
    lancet layout maps A's x and B's dy, GPT-OSS's A's dy and B's x), into running sums or NaN-filled
    outputs: bitwise the two launches', a running sum rounded to nearest even in bf16 (``a + b`` in
    PyTorch), a NaN in a running sum kept."""
    _, counts, a, b = CASES[0]
    dy, x, dy_b, x_b, off = _operands(gen, counts, a, b, dtype)
    rows = torch.randperm(x.shape[0], generator=gen).to(DEVICE)
    if layout == "lancet":  # (the mapped operands in received order)
        x, dy_b = _scattered(x, rows), _scattered(dy_b, rows)
        maps = (dict(x_rows=rows), dict(dy_rows=rows))
        pair_maps = dict(x_rows=rows, dy_b_rows=rows)
    else:
        dy, x_b = _scattered(dy, rows), _scattered(x_b, rows)
        maps = (dict(dy_rows=rows), dict(x_rows=rows))
        pair_maps = dict(dy_rows=rows, x_b_rows=rows)
    sums = (_randn(gen, len(counts), *a, dtype=dtype), _randn(gen, len(counts), *b, dtype=dtype))
    sums[0][1, 2, 3] = float("nan")
    sums = sums if accumulate else tuple(nan_like(s) for s in sums)
    into = tuple(s.clone() for s in sums)
    launched = _launches(monkeypatch)
    got = gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, **pair_maps, out=into, accumulate=(accumulate,) * 2)
    assert launched == ["dw_pair"] and got[0] is into[0] and got[1] is into[1]
    two = (
        gg.grouped_mm_dw(dy, x, off, **maps[0], out=sums[0].clone(), accumulate=accumulate),
        gg.grouped_mm_dw(dy_b, x_b, off, **maps[1], out=sums[1].clone(), accumulate=accumulate),
    )
    _same("dw", got[0], two[0])
    _same("dw_b", got[1], two[1])
    plain = (gg.grouped_mm_dw(dy, x, off, **maps[0]), gg.grouped_mm_dw(dy_b, x_b, off, **maps[1]))
    for name, g, s, p in zip(("dw", "dw_b"), got, sums, plain):
        _same(name + " as PyTorch adds", g, s + p if accumulate else p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pair_with_one_problem_mapped(dtype, monkeypatch, gen):
    """A row map on one problem only (the other reads its grouped rows), odd sizes, E = 6 with empty
    segments, one launch: bitwise the two launches'."""
    _, counts, a, b = CASES[0]
    dy, x, dy_b, x_b, off = _operands(gen, counts, a, b, dtype)
    rows = torch.randperm(x.shape[0], generator=gen).to(device=DEVICE, dtype=torch.int32)
    for kw, single in (
        (dict(dy_b_rows=rows), (dict(), dict(dy_rows=rows))),
        (dict(x_rows=rows), (dict(x_rows=rows), {})),
    ):
        launched = _launches(monkeypatch)
        got = gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, **kw)
        assert launched == ["dw_pair"]
        _same("dw", got[0], gg.grouped_mm_dw(dy, x, off, **single[0]))
        _same("dw_b", got[1], gg.grouped_mm_dw(dy_b, x_b, off, **single[1]))


@pytest.mark.parametrize(
    "case",
    [
        ("accumulate (True, False)", dict(accumulate=(True, False))),
        ("accumulate (False, True)", dict(accumulate=(False, True))),
        ("both of A's operands mapped", dict(x_rows="rows", dy_rows="rows")),
        ("the maps' dtypes differ", dict(x_rows="rows", dy_b_rows="rows32")),
    ],
    ids=lambda c: c[0],
)
def test_what_one_launch_cannot_take_runs_as_the_two_launches(case, monkeypatch, gen):
    """The pair's kernel takes one ``accumulate``, at most one row map per problem and one dtype for
    the maps; otherwise the launcher runs the two dW launches, with their results and ``out`` per problem."""
    _, kw = case
    dy, x, dy_b, x_b, off = _operands(gen, [4, 9, 0], (20, 33), (33, 9), torch.bfloat16)
    rows = torch.randperm(x.shape[0], generator=gen).to(DEVICE)
    kw = {
        k: {"rows": rows, "rows32": rows.to(torch.int32)}.get(v, v) if isinstance(v, str) else v for k, v in kw.items()
    }
    acc = kw.pop("accumulate", (False, False))
    sums = (
        torch.ones(3, 20, 33, dtype=torch.bfloat16, device=DEVICE),
        torch.ones(3, 33, 9, dtype=torch.bfloat16, device=DEVICE),
    )
    into = tuple(s.clone() for s in sums)
    launched = _launches(monkeypatch)
    got = gg.grouped_mm_dw_pair(dy, x, dy_b, x_b, off, **kw, out=into, accumulate=acc)
    assert launched == ["dw", "dw"] and got[0] is into[0] and got[1] is into[1]
    del launched[:]
    maps = (
        {k: v for k, v in kw.items() if "_b_" not in k},
        {k.replace("_b_", "_"): v for k, v in kw.items() if "_b_" in k},
    )
    _same("dw", got[0], gg.grouped_mm_dw(dy, x, off, **maps[0], out=sums[0].clone(), accumulate=acc[0]))
    _same("dw_b", got[1], gg.grouped_mm_dw(dy_b, x_b, off, **maps[1], out=sums[1].clone(), accumulate=acc[1]))


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
    """The pair's CUDA configs are dW's for the larger of its two problems (its kernel runs one tile
    loop: one dW's shared memory), its default dW's default."""
    x = torch.empty(1, 1, dtype=dtype)

    def tiles(op, args):
        kept = space._prune_configs(op)(space._gemm_configs(op), args)
        return [(*space._tile_of(op, c), c.num_warps, c.num_stages) for c in kept]

    pair = tiles("dw_pair", dict(x_ptr=x, N=64, K=64, N_B=4096, K_B=2048, M_BUCKET=4096))
    assert pair and pair == tiles("dw", dict(x_ptr=x, N=4096, K=2048, M_BUCKET=4096))
    if dtype == torch.bfloat16:  # the GPU lane's bf16 dW pin, 128 x 256 x 64 in 3 stages
        assert pair[0] == (128, 256, 64, 8, 3)
