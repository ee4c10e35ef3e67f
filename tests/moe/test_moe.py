"""The MoE layer against the float64 contract reference, Mixtral parity, and input validation."""

from __future__ import annotations

import copy

import pytest
import torch

import lancet_rt
from tests.contract_ref import moe_contract_ref
from tests.helpers import assert_close

CONFIGS = [
    dict(T=1, D=7, F=5, E=4, K=2, capacity_factor=None, score_fn="softmax", normalize_topk=True),
    dict(T=37, D=9, F=6, E=5, K=5, capacity_factor=1.0, score_fn="sigmoid", normalize_topk=False),
    dict(
        T=64,
        D=12,
        F=8,
        E=8,
        K=2,
        capacity_factor=0.5,
        score_fn="softmax",
        normalize_topk=False,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
    ),
    dict(
        T=33,
        D=11,
        F=4,
        E=6,
        K=1,
        capacity_factor=1.25,
        score_fn="sigmoid",
        normalize_topk=True,
        aux_loss_coef=0.1,
        z_loss_coef=0.01,
    ),
    dict(T=50, D=8, F=10, E=3, K=2, capacity_factor=1.0, score_fn="softmax", normalize_topk=True, aux_loss_coef=0.05),
    dict(T=0, D=6, F=4, E=4, K=2, capacity_factor=1.0, score_fn="softmax", normalize_topk=True),
]


def _ids(c):
    return "T{T}-D{D}-E{E}-K{K}-cf{capacity_factor}-{score_fn}-n{normalize_topk:d}".format(**c)


def build(c, dtype=torch.float32, **extra):
    kw = {k: c[k] for k in ("capacity_factor", "score_fn", "normalize_topk")}
    kw.update({k: c[k] for k in ("aux_loss_coef", "z_loss_coef") if k in c})
    kw.update(extra)
    return lancet_rt.MoE(c["D"], c["F"], c["E"], c["K"], dtype=dtype, **kw)


def reference(moe, x, g, c):
    """Float64 contract outputs and gradients for the layer's weights and input x."""
    params = [
        p.detach().double().requires_grad_(True)
        for p in (moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj)
    ]
    x64 = x.detach().double().reshape(-1, c["D"]).requires_grad_(True)
    y, aux, z, counts, dropped = moe_contract_ref(
        x64,
        *params,
        top_k=c["K"],
        capacity_factor=c["capacity_factor"],
        score_fn=c["score_fn"],
        normalize_topk=c["normalize_topk"],
    )
    loss = (y * g.double().reshape(y.shape)).sum() + c.get("aux_loss_coef", 0) * aux + c.get("z_loss_coef", 0) * z
    grads = torch.autograd.grad(loss, [x64] + params, allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, [x64] + params)]
    return y.reshape(x.shape), aux, z, counts, dropped, grads


def check_layer_against_contract(c, dtype=torch.float32, lead=None):
    torch.manual_seed(hash(_ids(c)) % 2**31)
    moe = build(c, dtype)
    shape = lead if lead is not None else (c["T"],)
    x = torch.randn(*shape, c["D"], dtype=dtype, requires_grad=True)
    g = torch.randn(*shape, c["D"], dtype=dtype)
    y = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.backward(g)
    y_ref, aux, z, counts, dropped, grads = reference(moe, x, g, c)
    assert_close("y", y, y_ref, rel_rms=1e-4 if dtype == torch.float32 else None)
    if c["T"]:
        assert_close("aux_loss", moe.aux_loss.reshape(1), aux.reshape(1), rel_rms=1e-4)
        assert_close("z_loss", moe.z_loss.reshape(1), z.reshape(1), rel_rms=1e-4)
    assert moe.tokens_per_expert.tolist() == counts.tolist()
    assert moe.dropped == dropped
    names = ["x", "router.weight", "experts.gate_up_proj", "experts.down_proj"]
    actual = [x.grad, moe.router.weight.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad]
    for name, a, e in zip(names, actual, grads):
        a = torch.zeros_like(e) if a is None else a
        assert_close(f"grad {name}", a.reshape(e.shape), e, rel_rms=1e-4 if dtype == torch.float32 else None)


@pytest.fixture(params=["torch", "triton"])
def kernels(request, monkeypatch):
    """Both kernel paths: the PyTorch references, and the Triton kernels (interpreter on CPU)."""
    monkeypatch.setenv("LANCET_KERNELS", request.param)
    return request.param


@pytest.mark.parametrize("c", CONFIGS, ids=_ids)
def test_contract_float32(c, kernels):
    check_layer_against_contract(c)


@pytest.mark.parametrize("c", CONFIGS[1:3], ids=_ids)
def test_contract_float64(c, kernels):
    check_layer_against_contract(c, torch.float64)


def test_any_leading_dims(kernels):
    c = dict(CONFIGS[2])
    check_layer_against_contract(c, lead=(2, 4, 8))


def test_triton_path_is_used(monkeypatch):
    from lancet_rt.kernels import cpu_backend, gating, grouped_gemm

    from lancet_rt.ops import get_ops, implementation

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("LANCET_KERNELS", raising=False)
    assert implementation(cpu) == "torch" and implementation(cuda) == "triton"  # the defaults
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    ops = get_ops(cpu)
    assert ops.name == "triton" and ops.reference_families == ()
    assert (
        ops.gating_fwd is gating.gating_fwd and ops.grouped_mm.__wrapped__ is grouped_gemm.grouped_mm
    )  # (+ TF32 switch)
    # float64 layers (gradient checks): only the gating kernels compute in float64.
    ops64 = get_ops(cpu, torch.float64)
    assert ops64.name == "triton" and ops64.reference_families == (
        "permute",
        "grouped_gemm",
        "swiglu",
        "norm",
        "linear_ce",
    )
    assert ops64.gating_fwd is gating.gating_fwd and ops64.grouped_mm is cpu_backend.grouped_mm
    assert get_ops(cpu, torch.bfloat16).grouped_mm is grouped_gemm.grouped_mm
    monkeypatch.setenv("LANCET_KERNELS", "torch")
    assert get_ops(cpu).name == "torch" and implementation(cuda) == "torch"
    monkeypatch.setenv("LANCET_KERNELS", "cuda")
    with pytest.raises(ValueError, match="LANCET_KERNELS"):
        get_ops(cpu)
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="LANCET_KERNELS=triton on device cpu needs CUDA or TRITON_INTERPRET=1"):
        implementation(cpu)


def test_capacity_drops_happen_and_are_counted(kernels):
    c = dict(T=64, D=8, F=4, E=4, K=2, capacity_factor=0.5, score_fn="softmax", normalize_topk=True)
    moe = build(c)
    with torch.no_grad():
        moe.router.weight[0] += 5.0  # crowd expert 0
    x = torch.randn(64, 8).abs()
    moe(x)
    assert moe.dropped > 0
    assert moe.tokens_per_expert.sum().item() == 64 * 2


def test_ties_go_to_lower_expert(kernels):
    moe = lancet_rt.MoE(4, 4, 4, 2)
    with torch.no_grad():
        moe.router.weight.zero_()  # all logits equal: experts 0 and 1 win every token
    moe(torch.randn(10, 4))
    assert moe.tokens_per_expert.tolist() == [10, 10, 0, 0]


def test_aux_gradient_reaches_router_without_user_loss(kernels):
    torch.manual_seed(1)
    a = lancet_rt.MoE(8, 8, 4, 2, aux_loss_coef=0.0)
    b = lancet_rt.MoE(8, 8, 4, 2, aux_loss_coef=1.0)
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 8)
    a(x).sum().backward()
    b(x).sum().backward()
    assert (a.router.weight.grad - b.router.weight.grad).abs().max() > 1e-4
    assert not b.aux_loss.requires_grad


def test_mixtral_parity(kernels):
    pytest.importorskip("transformers")
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=24, intermediate_size=20, num_local_experts=6, num_experts_per_tok=2, router_jitter_noise=0.0
    )
    torch.manual_seed(3)
    hf = MixtralSparseMoeBlock(cfg).float()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe = lancet_rt.MoE(24, 20, 6, 2)
    with torch.no_grad():
        moe.router.weight.copy_(hf.gate.weight)
        moe.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        moe.experts.down_proj.copy_(hf.experts.down_proj)
    x = torch.randn(3, 17, 24)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_hf = hf(x1)
    out_hf = out_hf[0] if isinstance(out_hf, tuple) else out_hf
    out = moe(x2)
    assert_close("y vs Mixtral", out, out_hf)
    g = torch.randn_like(out)
    out_hf.backward(g)
    out.backward(g)
    assert_close("grad x vs Mixtral", x2.grad, x1.grad)
    assert_close("grad router vs Mixtral", moe.router.weight.grad, hf.gate.weight.grad)
    assert_close("grad gate_up vs Mixtral", moe.experts.gate_up_proj.grad, hf.experts.gate_up_proj.grad)
    assert_close("grad down vs Mixtral", moe.experts.down_proj.grad, hf.experts.down_proj.grad)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=5), ValueError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(capacity_factor=0.0), ValueError, "capacity_factor"),
        (dict(capacity_factor=-1.0), ValueError, "capacity_factor"),
        (dict(capacity_factor="1"), TypeError, "capacity_factor"),
        (dict(score_fn="relu"), ValueError, "score_fn"),
        (dict(aux_loss_coef=-1.0), ValueError, "aux_loss_coef"),
        (dict(ep_group=3), TypeError, "ep_group"),
    ],
)
def test_bad_construction(kwargs, exc, words):
    args = dict(d_model=8, d_ffn=8, num_experts=4, top_k=2)
    args.update(kwargs)
    with pytest.raises(exc, match=words):
        lancet_rt.MoE(args.pop("d_model"), args.pop("d_ffn"), args.pop("num_experts"), args.pop("top_k"), **args)


@pytest.mark.parametrize(
    "x, exc, words",
    [
        (torch.randn(4, 7), ValueError, "d_model=8"),
        (torch.randint(0, 3, (4, 8)), TypeError, "floating"),
        (torch.randn(4, 8, dtype=torch.float64), TypeError, "dtype"),
        ([[0.0] * 8], TypeError, "torch.Tensor"),
        (torch.randn(4, 8, device="meta"), ValueError, "device"),
    ],
)
def test_bad_input(x, exc, words):
    moe = lancet_rt.MoE(8, 8, 4, 2)
    with pytest.raises(exc, match=words):
        moe(x)


def test_a_chunk_with_every_assignment_dropped(kernels):
    """A late chunk that finds every expert full keeps no row at all (S = 0 while T > 0): its output
    is zero and its gradients too, on both kernel paths, chunked as unchunked."""
    from torch import nn

    torch.manual_seed(2)
    moe = lancet_rt.MoE(8, 12, 4, 2, capacity_factor=0.5)
    model = nn.Sequential(moe)
    x = torch.randn(6, 5, 8)
    ref = copy.deepcopy(model)
    y_ref = ref(x.clone())
    y_ref.square().sum().backward()
    y = lancet_rt.Overlapped(model, chunks=3)(x.clone())
    y.square().sum().backward()
    assert (y[4:] == 0).all(), "the last chunk should keep nothing (capacity spent by the chunks before)"
    assert_close("y", y, y_ref)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(f"grad {n}", p.grad, q.grad)
