"""Expert kernels (kernels/grouped_gemm.py) against their references (kernels/reference.py).

CPU lane: the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on small odd shapes,
with segments of 0, 1 and 17 rows, all rows in one expert, a single expert and block-aligned
segments; fp32, bf16 and fp16. Every output buffer is NaN-filled before the launch, so an unwritten
element fails. bf16/fp16 results are compared with a float64 reference computed from the same
low-precision inputs, with the tolerance row of the result's dtype.

GPU lane (``-m gpu``): the same checks at real sizes (E_local = 8, 4096 rows per expert, D = 4096,
F in {2048, 14336}, bf16), balanced and skewed routing.

Note on the interpreter: Triton's interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to
nearest even), so bf16 errors on the CPU lane are about twice the GPU's. The fused h is therefore
checked as ``swiglu(gu)`` of the kernel's own rounded gu (which is its exact contract, see the module
docstring of kernels.grouped_gemm), and gu against the float64 GEMM.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from kernels import _gemm_space as space
from kernels import grouped_gemm as gg
from kernels import swiglu
from kernels.reference import (
    gate_up_swiglu_ref,
    grouped_mm_dw_ref,
    grouped_mm_dx_ref,
    grouped_mm_ref,
    swiglu_bwd_ref,
    swiglu_fwd_ref,
)
from tests.helpers import assert_close, nan_like

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
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's id: fresh inputs per test, reproducible per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


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
def test_swiglu_fwd_bwd(dtype, gen):
    R, F = 45, 36  # ragged in both directions of the 16 x 32 interpreter tile
    gu = _randn(gen, R, 2 * F, dtype=dtype, scale=2.0)
    dh = _randn(gen, R, F, dtype=dtype)
    h_ref = swiglu_fwd_ref(gu.double())
    h = swiglu.swiglu_fwd(gu, out=nan_like(h_ref.to(dtype)))
    assert_close("swiglu h", h, h_ref)
    dgu_ref = swiglu_bwd_ref(gu.double(), dh.double())
    dgu = swiglu.swiglu_bwd(gu, dh, out=nan_like(dgu_ref.to(dtype)))
    assert dgu.dtype == dtype
    assert_close("swiglu dgu", dgu, dgu_ref)


def test_fp16_all_launchers(gen):
    counts, K, N = [3, 0, 17, 1], 60, 36
    x, w, off = _problem(gen, counts, K, N, torch.float16)
    dy = _randn(gen, sum(counts), N, dtype=torch.float16)
    assert_close("fp16 y", gg.grouped_mm(x, w, off), grouped_mm_ref(x.double(), w.double(), off))
    assert_close("fp16 dx", gg.grouped_mm_dx(dy, w, off), grouped_mm_dx_ref(dy.double(), w.double(), off))
    assert_close("fp16 dw", gg.grouped_mm_dw(dy, x, off), grouped_mm_dw_ref(dy.double(), x.double(), off))
    w2 = _randn(gen, len(counts), 2 * N, K, dtype=torch.float16, scale=K**-0.5)
    h, gu = gg.gate_up_swiglu(x, w2, off)
    assert_close("fp16 gu", gu, grouped_mm_ref(x.double(), w2.double(), off))
    assert_close("fp16 h", h, swiglu_fwd_ref(gu.double()))
    gu_in = _randn(gen, sum(counts), 2 * N, dtype=torch.float16)
    assert_close("fp16 swiglu dgu", swiglu.swiglu_bwd(gu_in, dy), swiglu_bwd_ref(gu_in.double(), dy.double()))


def test_strided_inputs_and_int64_offsets(gen):
    """Non-contiguous x/dy (column slices), weights as transposed views, int64 offsets."""
    counts, K, N = [5, 0, 19, 2], 60, 36
    R, E = sum(counts), len(counts)
    off = _offsets(counts, torch.int64)
    x = _randn(gen, R, K + 8)[:, 3 : 3 + K]
    dy = _randn(gen, R, 2 * N)[:, ::2]
    w = _randn(gen, E, K, N, scale=K**-0.5).transpose(1, 2)  # [E, N, K] view, N contiguous
    assert not x.is_contiguous() and not dy.is_contiguous() and not w.is_contiguous()
    assert_close("strided y", gg.grouped_mm(x, w, off), grouped_mm_ref(x.double(), w.double(), off))
    assert_close("strided dx", gg.grouped_mm_dx(dy, w, off), grouped_mm_dx_ref(dy.double(), w.double(), off))
    assert_close("strided dw", gg.grouped_mm_dw(dy, x, off), grouped_mm_dw_ref(dy.double(), x.double(), off))
    gu = _randn(gen, R, 4 * N)[:, : 2 * N]
    assert_close("strided swiglu", swiglu.swiglu_fwd(gu), swiglu_fwd_ref(gu.double()))


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
    assert_close("pinned y", gg.grouped_mm(x, w, off), grouped_mm_ref(x.double(), w.double(), off))
    assert_close("pinned dw", gg.grouped_mm_dw(dy, x, off), grouped_mm_dw_ref(dy.double(), x.double(), off))
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
