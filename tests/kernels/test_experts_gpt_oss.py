"""GPT-OSS's experts: per-expert biases, the clamped activation "swiglu_oai" and the interleaved
gate/up layout, in the expert kernels (lancet_rt.kernels.grouped_gemm, lancet_rt.kernels.swiglu) against
their references (lancet_rt.kernels.reference), the references against torch autograd and transformers' own
activation, and ``lancet_rt.Experts(layout="gpt_oss")`` against transformers' ``GptOssExperts``.

CPU lane: the kernels run under TRITON_INTERPRET=1 (tests/conftest.py). Segments with an empty
expert, all rows in one expert, D = 60 (a K tail in the 32-wide interpreter tile) and F = 36 (a ragged
F tile); every output NaN-filled before the launch; gate/up values spread over the clamp limit, and
values exactly at and one bf16 step around it, where the clamps' gradients switch on and off.
GPU lane (``-m gpu``): GPT-OSS's sizes (D = F = 2880), bf16.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import grouped_gemm as gg
from lancet_rt.kernels import swiglu
from lancet_rt.kernels.reference import (
    gate_up_swiglu_ref,
    grouped_mm_dw_ref,
    grouped_mm_dx_ref,
    grouped_mm_ref,
    segment_sum_ref,
    swiglu_bwd_ref,
    swiglu_fwd_ref,
)
from lancet_rt.kernels.segment_sum import segment_sum

from lancet_rt.moe.experts import Experts
from lancet_rt.ops import get_ops
from tests.helpers import assert_close, nan_like
from tests.kernels.test_kernels_experts import (
    DEVICE,
    DTYPES,
    _assert_close_sampled,
    _gpu_problem,
    _nan,
    _no_host_sync,
    _offsets,
    _randn,
)

ALPHA, LIMIT = 1.702, 7.0
# (name, rows per expert, D, F): an empty first expert, 1 and 17 rows, an empty one in the middle; and
# every row in one expert. D = 60 has a K tail, F = 36 a ragged F tile (interpreter tiles: 16 x 32 x 32).
SEGMENTS = [("mixed", [0, 1, 17, 5, 0, 23], 60, 36), ("one_expert", [0, 0, 41, 0], 64, 40)]
# Kernel keyword arguments of each variant: GPT-OSS's, and the other combinations of its three parts.
VARIANTS = {
    "gpt_oss": dict(activation="swiglu_oai", interleaved=True, bias=True),
    "bias_oai": dict(activation="swiglu_oai", interleaved=False, bias=True),
    "interleaved": dict(activation="swiglu", interleaved=True, bias=False),
}


def _act(variant: str) -> dict:
    v = VARIANTS[variant]
    return dict(activation=v["activation"], interleaved=v["interleaved"], alpha=ALPHA, limit=LIMIT)


def _gate_up_weight(gen, E, D, F, dtype, interleaved, scale):
    """[E, 2F, D] weights as the experts pass them: GPT-OSS's [E, D, 2F] parameter transposed (a view),
    or the lancet parameter itself."""
    if interleaved:
        return _randn(gen, E, D, 2 * F, dtype=dtype, scale=scale).transpose(1, 2)
    return _randn(gen, E, 2 * F, D, dtype=dtype, scale=scale)


def _split(gu, interleaved):
    return (gu[:, 0::2], gu[:, 1::2]) if interleaved else gu.chunk(2, dim=-1)


# ------------------------------------------------------------------------------------------------
# Kernels against their references
# ------------------------------------------------------------------------------------------------
GATE_UP_CASES = (
    [("gpt_oss", SEGMENTS[0], dt) for dt in DTYPES]
    + [("gpt_oss", SEGMENTS[1], torch.bfloat16)]
    + [(v, SEGMENTS[0], torch.float32) for v in ("bias_oai", "interleaved")]
)


@pytest.mark.parametrize(
    "variant, case, dtype", GATE_UP_CASES, ids=[f"{v}-{c[0]}-{str(d)[6:]}" for v, c, d in GATE_UP_CASES]
)
def test_gate_up_variants(variant, case, dtype, gen):
    _, counts, D, F = case
    E, act = len(counts), _act(variant)
    x = _randn(gen, sum(counts), D, dtype=dtype)
    # Pre-activations of standard deviation ~4.5: about 1 in 8 beyond the clamp limit of 7.
    w = _gate_up_weight(gen, E, D, F, dtype, act["interleaved"], scale=4 / D**0.5)
    b = _randn(gen, E, 2 * F, dtype=dtype, scale=2.0) if VARIANTS[variant]["bias"] else None
    off = _offsets(counts)
    h_ref, gu_ref = gate_up_swiglu_ref(x.double(), w.double(), off, None if b is None else b.double(), **act)
    out = (nan_like(h_ref.to(dtype)), nan_like(gu_ref.to(dtype)))
    h, gu = gg.gate_up_swiglu(x, w, off, b, out=out, **act)
    assert h.data_ptr() == out[0].data_ptr() and gu.data_ptr() == out[1].data_ptr()
    assert_close(f"{variant} gu", gu, gu_ref)
    assert_close(f"{variant} h vs act(gu)", h, swiglu_fwd_ref(gu.double(), **act))
    if dtype == torch.float32:
        assert_close(f"{variant} h", h, h_ref)
    gate, up = _split(gu_ref, act["interleaved"])
    assert (gate > LIMIT).any() and (up.abs() > LIMIT).any(), "the clamps were not exercised"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_mm_bias(dtype, gen):
    """The down projection of GPT-OSS: its [E, F, D] parameter as the [E, D, F] view, plus a bias."""
    _, counts, D, F = SEGMENTS[0]
    E, R = len(counts), sum(counts)
    h = _randn(gen, R, F, dtype=dtype)
    w = _randn(gen, E, F, D, dtype=dtype, scale=F**-0.5).transpose(1, 2)
    b = _randn(gen, E, D, dtype=dtype)
    off = _offsets(counts)
    y_ref = grouped_mm_ref(h.double(), w.double(), off, b.double())
    y = gg.grouped_mm(h, w, off, b, out=nan_like(y_ref.to(dtype)))
    assert_close("bias y", y, y_ref)


SEGMENT_SUM_CASES = [(SEGMENTS[0], dt) for dt in DTYPES] + [(SEGMENTS[1], torch.float32)]


@pytest.mark.parametrize("case, dtype", SEGMENT_SUM_CASES, ids=[f"{c[0]}-{str(d)[6:]}" for c, d in SEGMENT_SUM_CASES])
def test_segment_sum(case, dtype, gen):
    """Bias gradients: per-expert sums of the output gradient's rows; zeros for an empty expert."""
    _, counts, D, F = case
    g = _randn(gen, sum(counts), 2 * F + 8, dtype=dtype)[:, 3 : 3 + 2 * F]  # strided rows
    off = _offsets(counts)
    expected = segment_sum_ref(g.double(), off)
    s = segment_sum(g, off, out=nan_like(expected.to(dtype)))
    assert s.dtype == dtype
    assert_close("segment_sum", s, expected)
    for e, n in enumerate(counts):
        if n == 0:
            assert not s[e].any(), f"s[{e}] of an empty segment is not zero"
    assert torch.equal(s, segment_sum(g, off)), "not the same bits run to run"


def _boundary_gu(gen, R, F, dtype, interleaved):
    """[R, 2F] pre-activations of scale 6 whose first row holds, in its first 8 columns, the gate values
    limit - 1 step, limit, limit + 1 step, -limit and the up values -limit - 1 step, -limit, limit,
    limit + 1 step (1 step = 2^-5, one bf16 ulp at 7), exactly representable in every dtype."""
    gu = _randn(gen, R, 2 * F, dtype=torch.float32, scale=6.0)
    gate, up = _split(gu, interleaved)
    step = 2.0**-5
    gate[0, :4] = torch.tensor([LIMIT - step, LIMIT, LIMIT + step, -LIMIT])
    up[0, :4] = torch.tensor([-LIMIT - step, -LIMIT, LIMIT, LIMIT + step])
    return gu.to(dtype)


SWIGLU_CASES = [("gpt_oss", dt) for dt in DTYPES] + [("bias_oai", torch.float32), ("interleaved", torch.float32)]


@pytest.mark.parametrize("variant, dtype", SWIGLU_CASES, ids=[f"{v}-{str(d)[6:]}" for v, d in SWIGLU_CASES])
def test_swiglu_variants(variant, dtype, gen):
    """swiglu_fwd / swiglu_bwd (the experts' backward) per activation and column order, with values at
    the clamp limit: the gradient passes where torch.clamp's does (bounds included), else it is 0."""
    R, F = 21, 36
    act = _act(variant)
    gu = _boundary_gu(gen, R, F, dtype, act["interleaved"])
    dh = _randn(gen, R, F, dtype=dtype)
    h_ref = swiglu_fwd_ref(gu.double(), **act)
    assert_close(f"{variant} h", swiglu.swiglu_fwd(gu, out=nan_like(h_ref.to(dtype)), **act), h_ref)
    dgu_ref = swiglu_bwd_ref(gu.double(), dh.double(), **act)
    dgu = swiglu.swiglu_bwd(gu, dh, out=nan_like(dgu_ref.to(dtype)), **act)
    assert_close(f"{variant} dgu", dgu, dgu_ref)
    if act["activation"] == "swiglu_oai":  # element by element at the boundary values
        dgate, dup = _split(dgu, act["interleaved"])
        assert dgate[0, 0] != 0 and dgate[0, 1] != 0 and dgate[0, 2] == 0 and dgate[0, 3] != 0, dgate[0, :4]
        assert dup[0, 0] == 0 and dup[0, 1] != 0 and dup[0, 2] != 0 and dup[0, 3] == 0, dup[0, :4]
        gate, up = _split(gu, act["interleaved"])
        assert not dgate[gate > LIMIT].any() and not dup[up.abs() > LIMIT].any(), "a clamped value has a gradient"


def test_edge_cases(gen):
    """No rows; an empty reduction (K = 0 / D = 0) with a bias: the output is the bias (and its activation)."""
    off0 = _offsets([0, 0, 0])
    s = segment_sum(_randn(gen, 0, 20), off0, out=torch.full((3, 20), float("nan"), device=DEVICE))
    assert torch.equal(s, torch.zeros_like(s))
    counts = [2, 0, 3]
    off, R = _offsets(counts), sum(counts)
    x = _randn(gen, R, 0)
    b = _randn(gen, 3, 10)
    y = gg.grouped_mm(x, _randn(gen, 3, 10, 0), off, b, out=torch.full((R, 10), float("nan"), device=DEVICE))
    assert torch.equal(y, torch.repeat_interleave(b, torch.tensor(counts, device=DEVICE), dim=0))
    b2 = _randn(gen, 3, 20, scale=6.0)
    w2 = _randn(gen, 3, 0, 20).transpose(1, 2)
    out = (torch.full((R, 10), float("nan"), device=DEVICE), torch.full((R, 20), float("nan"), device=DEVICE))
    h, gu = gg.gate_up_swiglu(x, w2, off, b2, out=out, **_act("gpt_oss"))
    h_ref, gu_ref = gate_up_swiglu_ref(x.double(), w2.double(), off, b2.double(), **_act("gpt_oss"))
    assert_close("D = 0 gu", gu, gu_ref)
    assert_close("D = 0 h", h, h_ref)


def test_launchers_do_not_sync(gen):
    counts = [2, 0, 9, 1]
    R, E, D, F = sum(counts), len(counts), 24, 10
    off = _offsets(counts)
    x, w = _randn(gen, R, D), _randn(gen, E, D, 2 * F).transpose(1, 2)
    b, gu, dh = _randn(gen, E, 2 * F), _randn(gen, R, 2 * F, scale=6.0), _randn(gen, R, F)
    w_down, b_down = _randn(gen, E, F, D).transpose(1, 2), _randn(gen, E, D)
    launches = [
        lambda: gg.gate_up_swiglu(x, w, off, b, **_act("gpt_oss")),
        lambda: gg.grouped_mm(dh, w_down, off, b_down),
        lambda: segment_sum(gu, off),
        lambda: swiglu.swiglu_fwd(gu, **_act("gpt_oss")),
        lambda: swiglu.swiglu_bwd(gu, dh, **_act("gpt_oss")),
    ]
    if DEVICE.type == "cuda":  # the autotuner's first run benchmarks (and syncs) once per key: warm up
        for launch in launches:
            launch()
    for launch in launches:
        with _no_host_sync():
            launch()


def test_validation(gen):
    off = _offsets([2, 3])
    x, w = _randn(gen, 5, 16), _randn(gen, 2, 8, 16)
    with pytest.raises(ValueError, match="bias_E2F"):
        gg.gate_up_swiglu(x, w, off, _randn(gen, 2, 7))
    with pytest.raises(TypeError, match="bias_E2F"):
        gg.gate_up_swiglu(x, w, off, _randn(gen, 2, 8).half())
    with pytest.raises(ValueError, match="bias_EN"):
        gg.grouped_mm(x, w, off, _randn(gen, 3, 8))
    with pytest.raises(ValueError, match="activation"):
        gg.gate_up_swiglu(x, w, off, activation="gelu")
    with pytest.raises(ValueError, match="limit"):
        swiglu.swiglu_bwd(_randn(gen, 5, 8), _randn(gen, 5, 4), activation="swiglu_oai", limit=0.0)
    with pytest.raises(TypeError, match="alpha"):
        swiglu.swiglu_fwd(_randn(gen, 5, 8), activation="swiglu_oai", alpha="1.7")
    with pytest.raises(ValueError, match="offsets_E1"):
        segment_sum(_randn(gen, 5, 8), off[:1].reshape(1, 1))
    with pytest.raises(TypeError, match="g_RN"):
        segment_sum(_randn(gen, 5, 8).double(), off)
    with pytest.raises(ValueError, match="layout"):
        Experts(2, 8, 4, layout="mixtral")
    with pytest.raises(ValueError, match="activation"):
        Experts(2, 8, 4, activation="relu")
    with pytest.raises(ValueError, match="limit"):
        Experts(2, 8, 4, layout="gpt_oss", limit=-1.0)


def test_interleaved_search_space():
    """The interleaved gate_up keeps at most 64 accumulator registers in fp32 even with TF32 (128
    spilled 220-240 bytes per thread in sm_90 builds) and at 4 warps in bf16 (128 sat at 253-255
    registers); with 8 warps bf16 keeps its 128-register tiles, and the gate-first layout all of them."""
    from lancet_rt.kernels import _gemm_space as space

    def kept(dtype, interleaved):
        args = dict(x_ptr=torch.empty(1, 1, dtype=dtype), F=2880, D=2880, M_BUCKET=4096, INPUT_PRECISION="tf32")
        configs = space._prune_configs("gate_up")(space._gemm_configs("gate_up"), args, INTERLEAVED=interleaved)
        assert configs
        return {(space._acc_regs("gate_up", c), c.num_warps) for c in configs}

    assert max(kept(torch.float32, True))[0] == 64 and max(kept(torch.float32, False))[0] == 128
    assert (128, 8) in kept(torch.bfloat16, True) and (128, 4) not in kept(torch.bfloat16, True)
    assert (128, 4) in kept(torch.bfloat16, False)


# ------------------------------------------------------------------------------------------------
# The references: torch autograd of the same formulas, and transformers' own activation
# ------------------------------------------------------------------------------------------------
def test_references_are_autograd_gradients(gen):
    """float64: swiglu_bwd_ref ("swiglu_oai", both column orders, values at the limit) is the autograd
    gradient of swiglu_fwd_ref; the interleaved "swiglu_oai" is transformers' GptOssExperts._apply_gate,
    forward and gradient; segment_sum_ref is the gradient of grouped_mm_ref's bias."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    R, F = 9, 8
    for interleaved in (False, True):
        act = dict(activation="swiglu_oai", interleaved=interleaved, alpha=ALPHA, limit=LIMIT)
        gu = _boundary_gu(gen, R, F, torch.float64, interleaved).requires_grad_(True)
        dh = _randn(gen, R, F, dtype=torch.float64)
        (ggu,) = torch.autograd.grad(swiglu_fwd_ref(gu, **act), gu, dh)
        assert torch.equal(swiglu_bwd_ref(gu.detach(), dh, **act) == 0, ggu == 0), "clamp masks differ"
        assert_close(f"ref swiglu_oai bwd interleaved={interleaved}", swiglu_bwd_ref(gu.detach(), dh, **act), ggu)
    hf = GptOssExperts(
        GptOssConfig(hidden_size=4, intermediate_size=F, num_local_experts=1, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    )
    if hasattr(hf, "_apply_gate"):  # transformers >= 5 (4.x inlines it; the module test covers both)
        h_hf = hf._apply_gate(gu)
        (ggu_hf,) = torch.autograd.grad(h_hf, gu, dh)
        assert_close("ref swiglu_oai vs transformers", swiglu_fwd_ref(gu.detach(), **act), h_hf)
        assert_close("ref swiglu_oai bwd vs transformers", swiglu_bwd_ref(gu.detach(), dh, **act), ggu_hf)
    counts = [3, 0, 6, 1]
    x = _randn(gen, sum(counts), 7, dtype=torch.float64)
    w = _randn(gen, 4, 5, 7, dtype=torch.float64)
    b = _randn(gen, 4, 5, dtype=torch.float64).requires_grad_(True)
    off = _offsets(counts)
    dy = _randn(gen, sum(counts), 5, dtype=torch.float64)
    (gb,) = torch.autograd.grad(grouped_mm_ref(x, w, off, b), b, dy)
    assert_close("ref bias grad", segment_sum_ref(dy, off), gb)


# ------------------------------------------------------------------------------------------------
# lancet_rt.Experts against transformers' GptOssExperts
# ------------------------------------------------------------------------------------------------
T_TOKENS, D_MODEL, D_FFN, N_EXPERTS = 13, 60, 20, 4  # D with a K tail, F below one 32-wide tile


def _gpt_oss_pair(gen):
    """transformers' GptOssExperts with random weights (pre-activations of scale ~4, so the clamps
    act) and biases, and lancet's Experts holding its state_dict."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(
        hidden_size=D_MODEL,
        intermediate_size=D_FFN,
        num_local_experts=N_EXPERTS,
        num_experts_per_tok=2,
        swiglu_alpha=ALPHA,
        swiglu_limit=LIMIT,
    )
    cfg._experts_implementation = "eager"
    hf = GptOssExperts(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = {"gate_up_proj": 4 / D_MODEL**0.5, "down_proj": D_FFN**-0.5}.get(name, 1.0)
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    ours = Experts.from_gpt_oss_config(cfg)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def _routing(gen, routing):
    """router_indices [T, K] and the top-k weights [T, K]."""
    T, E = T_TOKENS, N_EXPERTS
    if routing == "one_expert":
        return torch.full((T, 1), 2, dtype=torch.long), torch.ones(T, 1)
    # K = 2 over experts 0..2 only: expert 3 gets no rows.
    idx = torch.stack([torch.randperm(E - 1, generator=gen)[:2] for _ in range(T)])
    return idx, torch.softmax(torch.randn(T, 2, generator=gen), dim=-1)


def _run_transformers(hf, x, idx, weights):
    """GptOssExperts' forward: transformers 5 takes the top-k weights [T, K]; 4.x a [T, E] matrix
    (the top-k weights scattered to their experts) and returns [T, 1, D]."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        weights = torch.zeros(idx.shape[0], hf.num_experts, dtype=weights.dtype).scatter(1, idx, weights)
    return hf(x, idx, weights).reshape(x.shape)


def _run_lancet(experts, x, idx, weights):
    """GptOssExperts' routing emulated: lancet's experts on each expert's rows (grouped by expert, in
    token order), combined with the same weights."""
    T, K = idx.shape
    E = experts.num_local_experts
    order = torch.argsort(idx.reshape(-1), stable=True)
    token = order // K
    off = torch.zeros(E + 1, dtype=torch.int32)
    off[1:] = torch.cumsum(torch.bincount(idx.reshape(-1), minlength=E), 0)
    y_R = experts(x.index_select(0, token), off, get_ops(x.device, x.dtype))
    w_R = weights.reshape(-1)[order]
    return torch.zeros_like(x).index_add(0, token, y_R * w_R[:, None])


# The kernels' own one_expert case runs in test_gate_up_variants; in the interpreter a module step costs ~2 s.
MODULE_CASES = [("torch", "mixed"), ("torch", "one_expert"), ("triton", "mixed")]


@pytest.mark.parametrize("kernels, routing", MODULE_CASES, ids=[f"{k}-{r}" for k, r in MODULE_CASES])
def test_experts_match_transformers_gpt_oss(kernels, routing, monkeypatch, gen):
    """Outputs, the input gradient and every parameter gradient equal GptOssExperts' at float32
    (rel RMS 1e-5), on the references and on the kernels, with an expert that gets no rows."""
    monkeypatch.setenv("LANCET_KERNELS", kernels)
    hf, ours = _gpt_oss_pair(gen)
    x = torch.randn(T_TOKENS, D_MODEL, generator=gen)
    idx, weights = _routing(gen, routing)
    g = torch.randn(T_TOKENS, D_MODEL, generator=gen)
    x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_hf = _run_transformers(hf, x_hf, idx, weights)
    y_hf.backward(g)
    y = _run_lancet(ours, x_ours, idx, weights)
    y.backward(g)
    assert_close("y", y, y_hf)
    assert_close("dx", x_ours.grad, x_hf.grad)
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad.shape == hf_grads[name].shape
        assert_close(f"d{name}", p.grad, hf_grads[name].grad)


def test_ops_serve_the_new_ops_float64_on_references(monkeypatch, gen):
    """The kernel selection: segment_sum on both paths; float64 layers under LANCET_KERNELS=triton run
    the grouped GEMM and SwiGLU families' PyTorch path (the CPU backend), and match GptOssExperts in float64."""
    from lancet_rt.kernels import cpu_backend, reference

    monkeypatch.setenv("LANCET_KERNELS", "triton")
    cpu = torch.device("cpu")
    assert get_ops(cpu, torch.float32).segment_sum is segment_sum
    assert get_ops(cpu, torch.float64).segment_sum is reference.segment_sum_ref
    assert get_ops(cpu, torch.float64).gate_up_swiglu is cpu_backend.gate_up_swiglu
    hf, ours = _gpt_oss_pair(gen)
    hf.double()
    ours.double()
    x = torch.randn(T_TOKENS, D_MODEL, generator=gen, dtype=torch.float64)
    idx, weights = _routing(gen, "mixed")
    x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    _run_transformers(hf, x_hf, idx, weights.double()).sum().backward()
    y = _run_lancet(ours, x_ours, idx, weights.double())
    y.sum().backward()
    assert y.dtype == torch.float64
    assert_close("float64 dx", x_ours.grad, x_hf.grad)
    assert_close("float64 ddown_proj_bias", ours.down_proj_bias.grad, hf.down_proj_bias.grad)
    monkeypatch.setenv("LANCET_KERNELS", "torch")
    assert get_ops(cpu, torch.float32).segment_sum is reference.segment_sum_ref


def test_lancet_layout_with_bias_and_oai_equals_gpt_oss(monkeypatch, gen):
    """The other layout with the same parts: ``Experts(layout="lancet", bias=True,
    activation="swiglu_oai")`` holding GPT-OSS's weights re-laid out (gate rows first, untransposed)
    computes the same outputs and the same gradients, re-laid out. On the references: the kernels of
    this variant are test_gate_up_variants' "bias_oai"; here the module's parameter plumbing."""
    _, gpt = _gpt_oss_pair(gen)
    lan = Experts(N_EXPERTS, D_MODEL, D_FFN, layout="lancet", bias=True, activation="swiglu_oai")

    def relaid(gate_up, gate_up_bias, down):  # gpt_oss -> lancet
        return (
            torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2),
            torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1),
            down.transpose(1, 2),
        )

    with torch.no_grad():
        for dst, src in zip(
            (lan.gate_up_proj, lan.gate_up_proj_bias, lan.down_proj),
            relaid(gpt.gate_up_proj, gpt.gate_up_proj_bias, gpt.down_proj),
        ):
            dst.copy_(src)
        lan.down_proj_bias.copy_(gpt.down_proj_bias)
    idx, weights = _routing(gen, "mixed")
    x, g = torch.randn(T_TOKENS, D_MODEL, generator=gen), torch.randn(T_TOKENS, D_MODEL, generator=gen)
    monkeypatch.setenv("LANCET_KERNELS", "torch")
    ys = []
    for m in (gpt, lan):
        y = _run_lancet(m, x, idx, weights)
        y.backward(g)
        ys.append(y)
    assert_close("lancet layout y", ys[1], ys[0])
    for name, got, want in zip(
        ("gate_up_proj", "gate_up_proj_bias", "down_proj"),
        (lan.gate_up_proj.grad, lan.gate_up_proj_bias.grad, lan.down_proj.grad),
        relaid(gpt.gate_up_proj.grad, gpt.gate_up_proj_bias.grad, gpt.down_proj.grad),
    ):
        assert_close(f"lancet layout d{name}", got, want)
    assert_close("lancet layout ddown_proj_bias", lan.down_proj_bias.grad, gpt.down_proj_bias.grad)


def test_default_experts_unchanged():
    """The default layer is today's: two parameters, lancet layout, plain SwiGLU."""
    ex = Experts(3, 8, 5)
    assert [(n, tuple(p.shape)) for n, p in ex.named_parameters()] == [
        ("gate_up_proj", (3, 10, 8)),
        ("down_proj", (3, 8, 5)),
    ]
    assert ex.gate_up_proj_bias is None and ex.down_proj_bias is None
    assert repr(ex) == "Experts(num_local_experts=3, d_model=8, d_ffn=5)"
    gpt = Experts(3, 8, 5, layout="gpt_oss")
    assert [(n, tuple(p.shape)) for n, p in gpt.named_parameters()] == [
        ("gate_up_proj", (3, 8, 10)),
        ("gate_up_proj_bias", (3, 10)),
        ("down_proj", (3, 5, 8)),
        ("down_proj_bias", (3, 8)),
    ]
    assert "activation='swiglu_oai'" in repr(gpt)


# ------------------------------------------------------------------------------------------------
# GPU lane: GPT-OSS's sizes, bf16
# ------------------------------------------------------------------------------------------------
GPT_OSS_D = GPT_OSS_F = 2880


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_gpu_gpt_oss_experts(routing):
    """Every kernel of the GPT-OSS experts' forward and backward at D = F = 2880, against the
    references in fp32 from the same bf16 inputs."""
    counts, R, off, randn = _gpu_problem(routing, 5)
    D, F, E = GPT_OSS_D, GPT_OSS_F, len(counts)
    act = _act("gpt_oss")
    x = randn(R, D)
    w_gu = randn(E, D, 2 * F, scale=4 / D**0.5).transpose(1, 2)  # GPT-OSS's [E, D, 2F] as [E, 2F, D]
    b_gu, b_down = randn(E, 2 * F), randn(E, D)
    w_down = randn(E, F, D, scale=F**-0.5).transpose(1, 2)
    h, gu = gg.gate_up_swiglu(x, w_gu, off, b_gu, out=(_nan(R, F), _nan(R, 2 * F)), **act)
    h_ref, gu_ref = gate_up_swiglu_ref(x.float(), w_gu.float(), off, b_gu.float(), **act)
    _assert_close_sampled("gpu gpt_oss gu", gu, gu_ref, torch.bfloat16, counts)
    _assert_close_sampled("gpu gpt_oss h", h, swiglu_fwd_ref(gu.float(), **act), torch.bfloat16, counts)
    del h_ref, gu_ref
    y = gg.grouped_mm(h, w_down, off, b_down, out=_nan(R, D))
    _assert_close_sampled(
        "gpu gpt_oss y", y, grouped_mm_ref(h.float(), w_down.float(), off, b_down.float()), torch.bfloat16, counts
    )
    dy = randn(R, D)
    dh = gg.grouped_mm_dx(dy, w_down, off, out=_nan(R, F))
    dgu = swiglu.swiglu_bwd(gu, dh, out=_nan(R, 2 * F), **act)
    _assert_close_sampled("gpu gpt_oss dgu", dgu, swiglu_bwd_ref(gu.float(), dh.float(), **act), torch.bfloat16, counts)
    dx = gg.grouped_mm_dx(dgu, w_gu, off, out=_nan(R, D))
    _assert_close_sampled(
        "gpu gpt_oss dx", dx, grouped_mm_dx_ref(dgu.float(), w_gu.float(), off), torch.bfloat16, counts
    )
    del dx
    dw = gg.grouped_mm_dw(x, dgu, off, out=_nan(E, D, 2 * F))  # the parameter's own [E, D, 2F] layout
    _assert_close_sampled("gpu gpt_oss dW gate_up", dw, grouped_mm_dw_ref(x.float(), dgu.float(), off), torch.bfloat16)
    del dw
    for name, grad, n in (("gate_up", dgu, 2 * F), ("down", dy, D)):
        db = segment_sum(grad, off, out=_nan(E, n))
        assert_close(f"gpu gpt_oss dbias {name}", db, segment_sum_ref(grad.float(), off))
