"""The experts' CPU backend (lancet_rt.kernels.cpu_backend) against the references
(lancet_rt.kernels.reference_experts), as the Triton kernels are held to them.

Each function on small odd shapes with segments of 0, 1 and 17 rows, all rows in one expert, a single
expert and block-aligned segments; fp32, bf16 and fp16; its ``out=``, ``work=`` and ``halves`` forms;
float32 results bitwise the float32 reference's, 16-bit ones within the dtype's tolerance of the
float64 reference from the same inputs. Then the experts' output and every gradient through the
backend (the layer's CPU path) against autograd through the references, both layouts, F on and off
the vector step. Last, the short cuts against what they stand for: ``torch._grouped_mm`` against
the per-segment loop, one segment against ``torch._grouped_mm``'s one group.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import cpu_backend as cb
from lancet_rt.kernels import reference_experts as ref
from lancet_rt.kernels.cpu_backend import GateUp

import lancet_rt
from lancet_rt import ops as ops_mod
from tests.helpers import assert_close, nan_like

SEGMENTS = [
    ("mixed", [0, 1, 17, 5, 0, 23], 60, 36),  # empty first, 1 row, 17 rows, an empty in the middle
    ("one_expert", [0, 0, 41, 0], 64, 40),  # every row in one expert, the others empty
    ("single", [33], 60, 36),  # E = 1
    ("aligned", [16, 32, 0, 0], 32, 64),  # F a multiple of the vector step: gate and up as halves
]
SEG_IDS = [s[0] for s in SEGMENTS]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bounds(counts) -> list:
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
    return out


def _randn(gen, *shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _check(name, got, fn, *args, **kwargs):
    """``got`` against ``fn`` (a reference) of ``args``: float32 bitwise, 16-bit within tolerance
    of the float64 reference of the same inputs."""
    f64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    expected = fn(*f64, **kwargs)
    if isinstance(got, tuple):
        for i, (g, e) in enumerate(zip(got, expected)):
            _check_one(f"{name}[{i}]", g, e, fn, args, kwargs, i)
    else:
        _check_one(name, got, expected, fn, args, kwargs, None)


def _check_one(name, got, expected, fn, args, kwargs, i):
    assert got.shape == expected.shape and not torch.isnan(got).any(), name
    if got.dtype == torch.float32:
        want = fn(*args, **kwargs)
        assert torch.equal(got, want if i is None else want[i]), name
    else:
        assert_close(name, got, expected)


def _joined(gu):
    return torch.cat(list(gu), dim=1) if isinstance(gu, GateUp) else gu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SEGMENTS, ids=SEG_IDS)
def test_grouped_gemms(case, dtype, gen):
    _, counts, K, N = case
    R, E, b = sum(counts), len(counts), _bounds(counts)
    x, dy = _randn(gen, R, K, dtype=dtype), _randn(gen, R, N, dtype=dtype)
    w = _randn(gen, E, N, K, dtype=dtype, scale=K**-0.5)
    bias = _randn(gen, E, N, dtype=dtype)
    bounds = cb.HostBounds(b)
    for off in (bounds, torch.tensor(b)):
        _check("y", cb.grouped_mm(x, w, off), ref.grouped_mm_ref, x, w, off)
        _check("y+b", cb.grouped_mm(x, w, off, bias), ref.grouped_mm_ref, x, w, off, bias)
        _check("dx", cb.grouped_mm_dx(dy, w, off), ref.grouped_mm_dx_ref, dy, w, off)
        _check("dw", cb.grouped_mm_dw(dy, x, off), ref.grouped_mm_dw_ref, dy, x, off)
    # into caller memory: the output buffer, the 16-bit weight copy's buffer
    out, work = nan_like(torch.empty(R, K, dtype=dtype)), torch.full((w.numel(),), float("nan"), dtype=dtype)
    assert cb.grouped_mm_dx(dy, w, bounds, out=out, work=work) is out
    _check("dx out=", out, ref.grouped_mm_dx_ref, dy, w, bounds)
    # strided views (GPT-OSS's transposed weights; a transposed dy)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)
    _check("y strided w", cb.grouped_mm(x, wt, bounds), ref.grouped_mm_ref, x, wt, bounds)
    _check("dx strided w", cb.grouped_mm_dx(dy, wt, bounds), ref.grouped_mm_dx_ref, dy, wt, bounds)
    _check("dw swapped", cb.grouped_mm_dw(x, dy, bounds), ref.grouped_mm_dw_ref, x, dy, bounds)
    dw = cb.grouped_mm_dw(dy, x, bounds)
    for e, n in enumerate(counts):
        if n == 0:
            assert not dw[e].any(), "an empty segment's dW must be zeros"


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)  # (float16 takes bfloat16's paths: test_grouped_gemms)
@pytest.mark.parametrize("case", SEGMENTS, ids=SEG_IDS)
@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai", "interleaved"])
def test_gate_up_swiglu_and_its_gradient(case, dtype, act, gen):
    """The forward with and without halves, the activation's gradient in every form the layer asks
    for: joined or as halves, into ``out=`` buffers, with a ``work=`` copy of a 16-bit gu."""
    _, counts, D, F = case
    R, E, b = sum(counts), len(counts), cb.HostBounds(_bounds(counts))
    kw = dict(activation="swiglu" if act == "swiglu" else "swiglu_oai", interleaved=act == "interleaved")
    if kw["activation"] == "swiglu_oai":
        kw.update(alpha=1.5, limit=0.75)  # (a limit inside the values' range: both sides of the clamps)
    x, dh = _randn(gen, R, D, dtype=dtype), _randn(gen, R, F, dtype=dtype)
    w = _randn(gen, E, 2 * F, D, dtype=dtype, scale=D**-0.5)
    bias = _randn(gen, E, 2 * F, dtype=dtype, scale=0.1)
    for bb in (None, bias):
        _check("gate_up", cb.gate_up_swiglu(x, w, b, bb, **kw), ref.gate_up_swiglu_ref, x, w, b, bb, **kw)
        h, gu = cb.gate_up_swiglu(x, w, b, bb, halves=True, **kw)
        _check("gate_up halves", (h, _joined(gu)), ref.gate_up_swiglu_ref, x, w, b, bb, **kw)
    h, gu = cb.gate_up_swiglu(x, w, b, halves=True, **kw)
    gu_joined = ref.grouped_mm_ref(x, w, b)
    _check("swiglu_fwd", cb.swiglu_fwd(gu_joined, **kw), ref.swiglu_fwd_ref, gu_joined, **kw)
    _check("swiglu_fwd halves", cb.swiglu_fwd(gu, **kw), ref.swiglu_fwd_ref, gu_joined, **kw)
    split = isinstance(gu, GateUp)
    assert split == (act != "interleaved" and F % cb._VECTOR_STEP == 0)
    for as_halves in (False, True):
        got = cb.swiglu_bwd(gu, dh, halves=as_halves, **kw)
        _check(f"swiglu_bwd halves={as_halves}", _joined(got), ref.swiglu_bwd_ref, gu_joined, dh, **kw)
        joined_out = as_halves and act != "interleaved"
        out = GateUp(*nan_like(torch.empty(2, R, F, dtype=dtype))) if joined_out else nan_like(gu_joined)
        work = torch.full((2, R, F) if split else (R, 2 * F), float("nan"))
        work = GateUp(*work) if split else work
        got = cb.swiglu_bwd(gu, dh, halves=as_halves, out=out, work=work, **kw)
        assert all(o is g for o, g in zip(GateUp.tensors(out), GateUp.tensors(got)))
        _check(f"swiglu_bwd out= halves={as_halves}", _joined(got), ref.swiglu_bwd_ref, gu_joined, dh, **kw)


def test_segment_sum_is_the_reference():
    """Nothing to gain on the CPU: the layer's CPU path sums the segments by the reference."""
    assert ops_mod.get_ops(torch.device("cpu")).segment_sum is ref.segment_sum_ref


def _experts_by_reference(experts, x, b):
    """The experts' forward by the references, differentiated by autograd."""
    spec = experts._spec
    gpt = spec.gpt_oss
    w_gu = experts.gate_up_proj.transpose(1, 2) if gpt else experts.gate_up_proj
    w_down = experts.down_proj.transpose(1, 2) if gpt else experts.down_proj
    h, _ = ref.gate_up_swiglu_ref(x, w_gu, b, experts.gate_up_proj_bias, **spec.act())
    return ref.grouped_mm_ref(h, w_down, b, experts.down_proj_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["lancet", "gpt_oss"])
@pytest.mark.parametrize("F", [40, 64])
@pytest.mark.parametrize("x_grad", [True, False], ids=["dx", "no-dx"])
def test_experts_output_and_every_gradient(dtype, layout, F, x_grad, monkeypatch):
    """The experts on the CPU path (the backend, its backward formulas, scratch memory for every
    size) against autograd through the references in float64 from the same parameters and rows."""
    monkeypatch.setattr(cb.Workspace, "MIN_BYTES", 0)
    torch.manual_seed(0)
    counts, D = [0, 1, 17, 5, 0, 23], 48
    experts = lancet_rt.Experts(len(counts), D, F, layout=layout, bias=layout == "gpt_oss", dtype=dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    b = _bounds(counts)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), D, generator=gen).to(dtype).requires_grad_(x_grad)
    dy = torch.randn(sum(counts), D, generator=gen).to(dtype)
    y = experts(x, None, ops_mod.get_ops(x.device, dtype), bounds=cb.HostBounds(b))
    y.backward(dy)
    twin = lancet_rt.Experts(len(counts), D, F, layout=layout, bias=layout == "gpt_oss", dtype=torch.float64)
    twin.load_state_dict(experts.state_dict())
    x64 = x.detach().double().requires_grad_(x_grad)
    y64 = _experts_by_reference(twin, x64, b)
    y64.backward(dy.double())
    assert_close("y", y, y64)
    if x_grad:
        assert_close("dx", x.grad, x64.grad)
    else:
        assert x.grad is None
    for (name, p), p64 in zip(experts.named_parameters(), twin.parameters()):
        assert_close(f"d{name}", p.grad, p64.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[5, 0, 11, 3], [0, 0, 0], [7]])
def test_grouped_mm_one_launch_equals_the_per_segment_loop(dtype, sizes, monkeypatch):
    g = torch.Generator().manual_seed(0)
    R, N, K = sum(sizes), 24, 16
    x = torch.randn(R, K, generator=g).to(dtype)
    w = torch.randn(len(sizes), N, K, generator=g).to(dtype)
    dy = torch.randn(R, N, generator=g).to(dtype)
    b = _bounds(sizes)
    assert cb._one_launch(x, w.transpose(1, 2)) and cb._one_launch(dy.t(), x)
    fast = (cb.grouped_mm(x, w, b), cb.grouped_mm_dx(dy, w, b), cb.grouped_mm_dw(dy, x, b))
    monkeypatch.setattr(cb, "_HAS_GROUPED_MM", False)
    loop = (cb.grouped_mm(x, w, b), cb.grouped_mm_dx(dy, w, b), cb.grouped_mm_dw(dy, x, b))
    for name, f, l in zip(("y", "dx", "dw"), fast, loop):
        assert torch.equal(f, l), name
    for e, n in enumerate(sizes):
        if n == 0:
            assert not fast[2][e].any(), "an empty segment's dW must be zeros"


def test_grouped_mm_unaligned_operands_take_the_loop():
    x, w = torch.randn(9, 6), torch.randn(2, 5, 6)  # 6 floats = 24 bytes: not a multiple of 16
    assert not cb._one_launch(x, w.transpose(1, 2))
    y = cb.grouped_mm(x, w, [0, 4, 9])
    assert torch.equal(y, torch.cat([x[:4] @ w[0].t(), x[4:] @ w[1].t()]))
    assert not cb._one_launch(x.double(), w.double().transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [0, 1, 37])
def test_grouped_mm_one_segment_is_the_gemm_grouped_mm_runs(dtype, R):
    """One local expert: one mm, bitwise ``torch._grouped_mm``'s one group (host bounds or an offsets
    tensor alike: its length says one segment, no value is read)."""
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
        got = (cb.grouped_mm(x, w, b), cb.grouped_mm_dx(dy, w, b), cb.grouped_mm_dw(dy, x, b))
        for name, a, e in zip(("y", "dx", "dw"), got, want):
            assert a.shape == e.shape and torch.equal(a, e), name


def test_differentiated_directly_the_backend_is_the_reference():
    """Autograd recording (tests, float64 checks): each function runs its reference's ops, so its
    gradients are autograd's through the reference."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 64, 8, generator=g, requires_grad=True)
    b = [0, 10, 10, 30]
    for fn, want in ((cb.gate_up_swiglu, ref.gate_up_swiglu_ref),):
        got = fn(x, w, b, halves=True)
        exp = want(x, w, b)
        assert all(torch.equal(a, e) for a, e in zip(got, exp))
        gx, gw = torch.autograd.grad(got[0].sum(), (x, w))
        ex, ew = torch.autograd.grad(exp[0].sum(), (x, w))
        assert torch.equal(gx, ex) and torch.equal(gw, ew)
