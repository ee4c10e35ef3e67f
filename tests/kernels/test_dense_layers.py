"""The dense layers (lancet_rt.dense): add + RMSNorm and the chunked linear cross-entropy as torch
operators, on both kernel paths (LANCET_KERNELS=triton under the interpreter, and torch), against
the plain formulas with autograd: outputs and every gradient; the loss against transformers'
definition (shifted labels, mean over the whole batch's valid labels, num_items_in_batch), chunk
sizes that leave a short last chunk, a chunk whose labels are all ignored; the bytes saved for
backward; torch.compile(fullgraph=True) through the operators (aot_eager and inductor).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lancet_rt.dense import LinearCrossEntropy, RMSNorm, add_rmsnorm, linear_cross_entropy
from tests.helpers import assert_close


@pytest.fixture(params=["triton", "torch"])
def kernels(request, monkeypatch):
    monkeypatch.setenv("LANCET_KERNELS", request.param)
    return request.param


def _norm_formula(x, r, w, eps):
    s = x if r is None else x + r
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w, s


@pytest.mark.parametrize("residual", [True, False])
def test_add_rmsnorm_layer(gen, kernels, residual):
    x = torch.randn(3, 7, 60, generator=gen, requires_grad=True)
    r = torch.randn(3, 7, 60, generator=gen, requires_grad=True) if residual else None
    w = (torch.randn(60, generator=gen) + 1).requires_grad_(True)
    out = add_rmsnorm(x, r, w, 1e-5)
    y, s = out if residual else (out, None)
    gy = torch.randn(y.shape, generator=gen)
    gs = torch.randn(y.shape, generator=gen)
    torch.autograd.backward([y, s] if residual else [y], [gy, gs] if residual else [gy])
    grads = [x.grad, w.grad] + ([r.grad] if residual else [])
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    rd = r.detach().double().requires_grad_(True) if residual else None
    yd, sd = _norm_formula(xd, rd, wd, 1e-5)
    torch.autograd.backward([yd, sd] if residual else [yd], [gy.double(), gs.double()] if residual else [gy.double()])
    assert_close("y", y, yd)
    if residual:
        assert_close("s", s, sd)
        assert_close("grad residual", grads[2], rd.grad)
    assert_close("grad x", grads[0], xd.grad)
    assert_close("grad weight", grads[1], wd.grad)


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_layer_recomputes_rstd_on_the_kernels(gen, monkeypatch, residual, dtype):
    """The eager layer on the kernels saves no rstd (its backward recomputes it from s): bitwise the
    launchers' outputs and gradients with the stored rstd."""
    from lancet_rt.kernels.norm import add_rmsnorm_bwd, add_rmsnorm_fwd

    monkeypatch.setenv("LANCET_KERNELS", "triton")
    x = torch.randn(3, 7, 60, generator=gen).to(dtype).requires_grad_(True)
    r = torch.randn(3, 7, 60, generator=gen).to(dtype).requires_grad_(True) if residual else None
    w = (torch.randn(60, generator=gen) + 1).to(dtype).requires_grad_(True)
    out = add_rmsnorm(x, r, w, 1e-5)
    y, s = out if residual else (out, None)
    assert y.grad_fn.saved_tensors[1] is None  # (s, rstd, weight): no rstd
    gy = torch.randn(y.shape, generator=gen).to(dtype)
    gs = torch.randn(y.shape, generator=gen).to(dtype)
    torch.autograd.backward([y, s] if residual else [y], [gy, gs] if residual else [gy])
    y_k, s_k, rstd_k = add_rmsnorm_fwd(x.detach(), None if r is None else r.detach(), w.detach(), 1e-5)
    ds_k, dw_k = add_rmsnorm_bwd(gy, gs if residual else None, s_k, rstd_k, w.detach())
    assert torch.equal(y, y_k) and torch.equal(x.grad, ds_k) and torch.equal(w.grad, dw_k)
    if residual:
        assert torch.equal(s, s_k) and torch.equal(r.grad, ds_k)


def test_rmsnorm_module_matches_transformers_formula(gen, kernels):
    norm = RMSNorm(60, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(60, generator=gen))
    x = torch.randn(5, 60, generator=gen)
    expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert_close("y", norm(x), expected)


def _hf_loss(hidden, weight, labels, num_items=None):
    """transformers' ForCausalLMLoss on the head's logits (float32 upcast, shifted labels)."""
    logits = (hidden @ weight.t()).float()
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    red = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100, reduction=red)
    return loss if num_items is None else loss / num_items


@pytest.mark.parametrize("chunk_size", [1, 3, 5, None])
def test_linear_ce_equals_transformers(gen, kernels, chunk_size):
    B, S, D, V = 2, 9, 60, 97
    hidden = torch.randn(B, S, D, generator=gen, requires_grad=True)
    weight = (torch.randn(V, D, generator=gen) * 0.1).requires_grad_(True)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, 1:7] = -100  # with chunk_size 3 and 5 a whole chunk of (shifted) rows is ignored
    labels[1, 3] = -100
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    (loss * 1.7).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    ref = _hf_loss(h2, w2, labels)
    (ref * 1.7).backward()
    assert_close("loss", loss.reshape(1), ref.reshape(1))
    assert_close("grad hidden", hidden.grad, h2.grad)
    assert_close("grad weight", weight.grad, w2.grad)


def test_linear_ce_num_items_and_module(gen, kernels):
    head = torch.nn.Linear(60, 33, bias=False)
    hidden = torch.randn(2, 5, 60, generator=gen, requires_grad=True)
    labels = torch.randint(0, 33, (2, 5), generator=gen)
    loss = LinearCrossEntropy(head, chunk_size=4)(hidden, labels, num_items_in_batch=torch.tensor(11))
    loss.backward()
    h2 = hidden.detach().clone().requires_grad_(True)
    w2 = head.weight.detach().clone().requires_grad_(True)
    ref = _hf_loss(h2, w2, labels, num_items=torch.tensor(11))
    ref.backward()
    assert_close("loss", loss.reshape(1), ref.reshape(1))
    assert_close("grad hidden", hidden.grad, h2.grad)
    assert_close("grad weight", head.weight.grad, w2.grad)
    with torch.no_grad():  # evaluation: the loss only
        assert_close(
            "eval loss",
            LinearCrossEntropy(head)(hidden, labels).reshape(1),
            _hf_loss(hidden, head.weight, labels).reshape(1),
        )


def test_linear_ce_bad_input(gen):
    h, w = torch.randn(2, 5, 8), torch.randn(11, 8)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, torch.randn(11, 7), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, torch.zeros(2, 5, dtype=torch.long), chunk_size=0)


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (each storage once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("fused", [True, False])
def test_saved_bytes_do_not_grow_with_tokens_times_vocab(gen, fused):
    """Growing V by dV adds T x dV x 4 bytes saved by head + loss today (the float32 logits); the
    chunked loss saves its two gradients: the hidden state's [T, D] and the head's [V, D]."""
    T, D, V, dV = 256, 16, 64, 512
    hidden = torch.randn(1, T, D, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (1, T), generator=gen)

    def run(vocab):
        w = torch.randn(vocab, D, generator=gen, requires_grad=True)
        if fused:
            return _saved_bytes(lambda: linear_cross_entropy(hidden, w, labels))
        return _saved_bytes(lambda: _hf_loss(hidden, w, labels))

    growth = run(V + dV) - run(V)
    if fused:
        assert growth == dV * D * 4  # the head's gradient only: no T x dV term
        assert growth < T * dV * 4 / 4
    else:
        assert growth >= T * dV * 4  # the baseline the issue measured


def test_add_rmsnorm_promotes_mixed_dtypes(gen):
    """A bf16 sublayer output and a float32 residual (autocast): summed and normed in float32, as
    ``x + residual`` promotes (the fake implementation's dtypes are the real ones)."""
    x = torch.randn(3, 5, 60, generator=gen).bfloat16()
    r = torch.randn(3, 5, 60, generator=gen)
    w = torch.randn(60, generator=gen)
    y, s = add_rmsnorm(x, r, w, 1e-5)
    assert y.dtype == s.dtype == torch.float32
    s_ref = x.float() + r
    assert_close("s", s, s_ref)
    assert_close("y", y, s_ref * torch.rsqrt(s_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * w)
    compiled = torch.compile(lambda x, r: add_rmsnorm(x, r, w, 1e-5), fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x, r), (y, s)):
        assert_close("compiled", got, want)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(gen, backend):
    norm = RMSNorm(60)
    head = torch.nn.Linear(60, 41, bias=False)
    loss_fn = LinearCrossEntropy(head, chunk_size=4)

    def step(x, r, labels):
        y, s = norm(x, r)
        return loss_fn(y, labels) + s.mean()

    x = torch.randn(2, 5, 60, generator=gen, requires_grad=True)
    r = torch.randn(2, 5, 60, generator=gen)
    labels = torch.randint(0, 41, (2, 5), generator=gen)
    eager = step(x, r, labels)
    eager.backward()
    g_eager = (x.grad.clone(), norm.weight.grad.clone(), head.weight.grad.clone())
    for p in (x, norm.weight, head.weight):
        p.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)(x, r, labels)
    compiled.backward()
    assert_close("loss", compiled.reshape(1), eager.reshape(1))
    for name, a, b in zip(("x", "norm", "head"), (x.grad, norm.weight.grad, head.weight.grad), g_eager):
        assert_close(f"grad {name}", a, b)


def test_block_traces_without_graph_break():
    """The blocks model's decoder block under torch.compile: the fused norms and, without expert parallelism,
    the MoE layer (lancet_rt.moe.library's operators) trace in one graph (tests/moe/test_compile.py compares
    it with eager)."""
    import lancet_rt
    from lancet_rt.models.blocks import Block

    torch._dynamo.reset()
    block = Block(32, 4, lancet_rt.MoE(32, d_ffn=48, num_experts=4, top_k=2))
    explained = torch._dynamo.explain(block)(torch.randn(2, 5, 32))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    norm_only = torch.compile(lambda x, r: block.norm2(block.norm1(x), r), fullgraph=True, backend="aot_eager")
    x, r = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    for got, want in zip(norm_only(x, r), block.norm2(block.norm1(x), r)):
        assert_close("compiled norms", got, want)


@pytest.mark.gpu
def test_linear_ce_gpu_real_size(monkeypatch):
    """GPU lane: the Triton path at a real size (T = 4096, D = 4096, V = 151936, bf16) against
    transformers' loss and gradients computed in float32 from the same bf16 inputs."""
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    T, D, V = 4096, 4096, 151936
    hidden = torch.randn(1, T, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    weight = (torch.randn(V, D, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_(True)
    labels = torch.randint(0, V, (1, T), device="cuda", generator=g)
    labels[0, ::7] = -100
    loss = linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    h32, w32 = hidden.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
    ref = _hf_loss(h32, w32, labels)
    ref.backward()
    assert_close("loss", loss.reshape(1), ref.reshape(1), torch.bfloat16)
    assert_close("grad hidden", hidden.grad, h32.grad, torch.bfloat16)
    assert_close("grad weight", weight.grad, w32.grad, torch.bfloat16)


@pytest.mark.gpu
def test_add_rmsnorm_layer_gpu_real_size(monkeypatch):
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(16384, 4096, device="cuda", generator=g).bfloat16().requires_grad_(True) for _ in range(2))
    w = (torch.randn(4096, device="cuda", generator=g) + 1).bfloat16().requires_grad_(True)
    y, s = add_rmsnorm(x, r, w, 1e-6)
    (y.float().square().mean() + s.float().mean()).backward()
    xd, rd, wd = (t.detach().double().requires_grad_(True) for t in (x, r, w))
    yd, sd = _norm_formula(xd, rd, wd, 1e-6)
    (yd.square().mean() + sd.mean()).backward()
    assert_close("y", y, yd, torch.bfloat16)
    for name, a, b in (("x", x.grad, xd.grad), ("residual", r.grad, rd.grad), ("weight", w.grad, wd.grad)):
        assert_close(f"grad {name}", a, b, torch.bfloat16)
