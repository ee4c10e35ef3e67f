"""torch.compile(fullgraph=True) of a decoder block with the MoE layer (lancet_rt.moe.library's custom ops):
equal to eager, outputs and every gradient, dropless and with a capacity factor; opcheck of each operator;
the one graph break left with expert parallelism; eager calls never go through the operators."""

from __future__ import annotations

import pytest
import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from lancet_rt.moe import library
from tests.helpers import assert_close, assert_same_run, run_and_grad

MOE = dict(d_ffn=24, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001)


def _model(seed: int, **moe):
    torch.manual_seed(seed)
    return MoEBlocks(1, 16, 2, dict(MOE, **moe))


def _compare(model, backend, gen):
    x = torch.randn(2, 7, 16, generator=gen)
    g = torch.randn(2, 7, 16, generator=gen)
    ref = run_and_grad(model, model, (x,), {}, g)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = run_and_grad(model, compiled, (x,), {}, g)
    assert_same_run(ref, got)
    return ref


@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "cf0.75"])
def test_block_fullgraph_aot_eager(gen, capacity_factor):
    ref = _compare(_model(0, capacity_factor=capacity_factor), "aot_eager", gen)
    assert (ref[3][0][2] > 0) == (capacity_factor is not None)  # the capacity case drops assignments


def test_block_fullgraph_router_options_gpt_oss_experts(gen):
    """Expert bias, group-limited top-k, scaling, sigmoid scores, a shared expert with its gate, and
    GPT-OSS's experts (transposed interleaved weights, biases, clamped SwiGLU)."""
    torch.manual_seed(1)
    experts = lancet_rt.Experts(4, 16, 24, layout="gpt_oss")
    with torch.no_grad():
        for b in (experts.gate_up_proj_bias, experts.down_proj_bias):
            b.normal_()
    shared = torch.nn.Linear(16, 16, bias=False)
    model = _model(
        1,
        score_fn="sigmoid",
        expert_bias=True,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        capacity_factor=1.0,
        experts=experts,
        shared_experts=shared,
        shared_expert_gate=torch.nn.Linear(16, 1, bias=False),
    )
    with torch.no_grad():
        model.blocks[0].moe.router.e_score_correction_bias.normal_()
    _compare(model, "aot_eager", gen)


@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "cf0.75"])
def test_block_fullgraph_on_the_triton_kernels(gen, monkeypatch, capacity_factor):
    """The operators on the Triton kernels (the interpreter on CPU): device offsets, padded row buffers."""
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    _compare(_model(6, capacity_factor=capacity_factor), "aot_eager", gen)


@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "cf0.75"])
def test_block_fullgraph_inductor(gen, capacity_factor):
    _compare(_model(2, capacity_factor=capacity_factor), "inductor", gen)


def test_expert_parallel_breaks_once_at_the_eager_layer():
    """With a group the layer needs collectives and host-read split sizes: one named graph break."""
    torch._dynamo.reset()
    model = _model(3, ep_group=lancet_rt.EmulatedGroup(2))
    explained = torch._dynamo.explain(model)(torch.randn(2, 5, 16))
    assert explained.graph_break_count == 1
    assert "forward_eager" in str(explained.break_reasons[0].reason)


def test_eager_calls_do_not_use_the_operators(monkeypatch):
    model = _model(4)

    def fail(*args):
        raise AssertionError("eager forward went through lancet_rt.moe.library")

    monkeypatch.setattr(library, "forward", fail)
    model(torch.randn(2, 3, 16)).sum().backward()


def _op_cases(gen):
    """(op, args) of each operator on one small routed batch (capacity 1.0: some rows dropped, padded)."""
    T, D, E, K, F = 9, 6, 4, 2, 5
    logits = torch.randn(T, E, generator=gen, requires_grad=True)
    args = (None, K, 0.75, "softmax", True, 1, None, 1.0, 0.01, 0.001)
    weight, expert, row, kept, used, _, _ = library._moe_gate(logits.detach(), *args)
    _, _, row_all, kept_all, _, _, _ = library._moe_gate(logits.detach(), None, K, None, *args[3:])  # dropless
    x = torch.randn(T, D, generator=gen, requires_grad=True)
    x_SD, src = library._moe_permute(x.detach(), row, kept, True)
    offsets = torch.nn.functional.pad(torch.cumsum(kept, 0), (1, 0))
    w_gu = torch.randn(E, 2 * F, D, generator=gen, requires_grad=True)
    w_dn = torch.randn(E, D, F, generator=gen, requires_grad=True)
    y_SD = torch.randn(T * K, D, generator=gen, requires_grad=True)
    w = weight.detach().requires_grad_(True)
    _, gu, h = library._moe_experts(
        x_SD, offsets, w_gu.detach(), w_dn.detach(), None, None, "swiglu", 1.702, 7.0, False, True
    )
    dy = torch.randn(T * K, D, generator=gen)
    # GPT-OSS's layout: [E, D, 2F] interleaved and [E, F, D], with biases
    w_gu_t = torch.randn(E, D, 2 * F, generator=gen, requires_grad=True)
    w_dn_t = torch.randn(E, F, D, generator=gen, requires_grad=True)
    b_gu, b_dn = (torch.randn(E, n, generator=gen, requires_grad=True) for n in (2 * F, D))
    _, gu_t, h_t = library._moe_experts(
        x_SD,
        offsets,
        w_gu_t.detach(),
        w_dn_t.detach(),
        b_gu.detach(),
        b_dn.detach(),
        "swiglu_oai",
        1.702,
        7.0,
        True,
        True,
    )
    return [
        (library._moe_gate, (logits,) + args),
        (
            library._moe_gate_bwd,
            (logits.detach(), expert, torch.randn(T, K, generator=gen), used, 0.01, 0.001, "softmax", True, 1.0),
        ),
        (library._moe_permute, (x, row, kept, True)),
        (library._moe_permute, (x, row_all, kept_all, False)),
        (library._moe_permute_bwd, (dy, row, True)),
        (library._moe_permute_bwd, (dy, row_all, False)),
        (
            library._moe_experts,
            (x_SD.detach().requires_grad_(True), offsets, w_gu, w_dn, None, None, "swiglu", 1.702, 7.0, False, True),
        ),
        (
            library._moe_experts_bwd,
            (
                dy,
                x_SD,
                gu,
                h,
                offsets,
                w_gu.detach(),
                w_dn.detach(),
                "swiglu",
                1.702,
                7.0,
                False,
                True,
                [True, True, False, False],
            ),
        ),
        (
            library._moe_experts,
            (
                x_SD.detach().requires_grad_(True),
                offsets,
                w_gu_t,
                w_dn_t,
                b_gu,
                b_dn,
                "swiglu_oai",
                1.702,
                7.0,
                True,
                True,
            ),
        ),
        (
            library._moe_experts_bwd,
            (
                dy,
                x_SD,
                gu_t,
                h_t,
                offsets,
                w_gu_t.detach(),
                w_dn_t.detach(),
                "swiglu_oai",
                1.702,
                7.0,
                True,
                True,
                [True, True, True, True],
            ),
        ),
        (library._moe_unpermute, (y_SD, row, w, src, True)),
        (library._moe_unpermute_bwd, (torch.randn(T, D, generator=gen), y_SD.detach(), row, w.detach(), src, True)),
    ]


def test_padding_rows_are_never_read(gen):
    """With a capacity factor the operators' [S, ...] buffers have T*K rows, the rows past S padding.
    NaN there changes nothing: the references get the kept rows only, as the kernels' contract has
    it (a reference given the whole buffer read its last row for every dropped assignment)."""
    from lancet_rt.kernels import reference as ref

    T, D, E, K = 9, 6, 4, 2
    logits = torch.randn(T, E, generator=gen)
    weight, _, row, kept, _, _, _ = library._moe_gate(logits, None, K, 0.75, "softmax", True, 1, None, 1.0, 0.01, 0.001)
    S = int(kept.sum())
    assert 0 < S < T * K  # some assignments dropped: there is padding
    y_SD = torch.full((T * K, D), float("nan"))
    y_SD[:S] = torch.randn(S, D, generator=gen)
    _, src = library._moe_permute(torch.randn(T, D, generator=gen), row, kept, True)
    y_TD = library._moe_unpermute(y_SD, row, weight, src, True)
    assert torch.equal(y_TD, ref.unpermute_fwd_ref(y_SD[:S], row, weight))
    grad_x = library._moe_permute_bwd(y_SD, row, True)
    assert torch.equal(grad_x, ref.permute_bwd_ref(y_SD[:S], row))
    assert torch.isfinite(y_TD).all() and torch.isfinite(grad_x).all()


def test_opcheck(gen):
    for op, args in _op_cases(gen):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("ep", [False, True], ids=["scope", "ep2"])
def test_overlapped_compiled_model_equals_eager(gen, ep):
    """Overlapped(torch.compile(model)): the compiled regions end where MoE.forward_eager begins and resume
    after it (the layer, its waits and chunk switches run eager); the result equals eager Overlapped, also
    when the model was first traced outside the overlap scope (the scope is guarded)."""
    torch.manual_seed(5)
    group = lancet_rt.EmulatedGroup(2) if ep else None
    model = MoEBlocks(2, 16, 2, dict(MOE, capacity_factor=0.75, ep_group=group))
    x, g = torch.randn(4, 7, 16, generator=gen), torch.randn(4, 7, 16, generator=gen)
    ref = run_and_grad(model, lancet_rt.Overlapped(model, chunks=2), (x,), {}, g)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(x)  # traced outside the scope first
    model.zero_grad(set_to_none=True)
    assert_same_run(ref, run_and_grad(model, lancet_rt.Overlapped(compiled, chunks=2), (x,), {}, g))


def test_block_fullgraph_under_autocast(gen):
    """bf16 autocast with float32 parameters: the bf16 attention output meets the float32 residual in the fused
    norm (promoted, so the fake and real dtypes agree). Outputs equal eager; gradients to bf16 tolerance
    (torch's aot_eager computes the backward of autocast-disabled float32 regions, such as the router's, in bf16,
    in plain PyTorch models too)."""
    model = _model(7, capacity_factor=1.0)
    x, g = torch.randn(2, 7, 16, generator=gen), torch.randn(2, 7, 16, generator=gen)

    def under_autocast(m):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(x)

        return run

    ref = run_and_grad(model, under_autocast(model), (x,), {}, g)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    got = run_and_grad(model, under_autocast(torch.compile(model, fullgraph=True, backend="aot_eager")), (x,), {}, g)
    assert_close("y", got[0], ref[0])
    for n in ref[2]:
        assert_close(f"grad {n}", got[2][n], ref[2][n], torch.bfloat16)
