"""Hugging Face MoE models under lancet-rt (``lancet_rt.from_hf``) against transformers itself.

Tiny random models built from config objects (lancet_rt/models/hf_models.py, no downloads). Every check is
transformers' own forward as the reference: logits, loss (with the model's load-balancing loss)
and every parameter gradient at float32 rel RMS <= 1e-5, unchunked, chunked (2, 3) with and without
deferred dW, with activation checkpointing, with expert parallelism over gloo ranks.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

pytest.importorskip("transformers")

import lancet_rt
from lancet_rt.models.hf_models import FAMILIES, batch, build
from tests.dist import assert_all_ok, run_ranks
from tests.helpers import TOLERANCES, assert_close

SCHEDULES = [(1, False), (2, False), (2, True), (3, False), (3, True)]


def _step(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out


def _assert_same(name, lm, out_l, hf, out_r, rows=None):
    assert_close(f"{name} logits", out_l.logits, out_r.logits)
    assert_close(f"{name} loss", out_l.loss.reshape(1), out_r.loss.reshape(1))
    if getattr(out_r, "aux_loss", None) is not None:  # (DeepSeek-V3 and GLM-4.5 have none: bias balancing)
        assert_close(f"{name} aux_loss", out_l.aux_loss.reshape(1), out_r.aux_loss.reshape(1))
    ref = dict(hf.named_parameters())
    for n, p in lm.named_parameters():
        expected = ref[n].grad
        if rows is not None and ".experts." in n:
            expected = expected[rows]
        assert p.grad is not None, f"{name}: no gradient for {n}"
        assert_close(f"{name} grad {n}", p.grad, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_equals_transformers(family):
    hf = build(family)
    ids, mask, labels = batch(hf.config.vocab_size, 5, 9)
    out_r = _step(hf, ids, mask, labels)
    for chunks, defer in SCHEDULES:
        lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=chunks, defer_wgrad=defer)
        out_l = _step(lm, ids, mask, labels)
        _assert_same(f"{family} chunks={chunks} defer={defer}", lm, out_l, hf, out_r)
    # The patched model is the same object, with the same parameter names and router logits.
    assert [n for n, _ in lm.named_parameters()] == [n for n, _ in hf.named_parameters()]
    assert lm.state_dict().keys() == hf.state_dict().keys()
    if getattr(out_r, "router_logits", None) is not None:
        assert len(out_l.router_logits) == len(lancet_rt.integrations.hf.moe_layers(lm))
        assert all(t.dtype == torch.float32 and t.shape[0] == 5 * 9 for t in out_l.router_logits)


def test_activation_checkpointing_replays_routing():
    """Decoder layers checkpointed inside Overlapped: exact, dropless and with capacity (the replay
    must carry capacity across chunks, or the recomputed chunk would drop other tokens)."""
    hf = build("qwen2_moe")
    ids, mask, labels = batch(hf.config.vocab_size, 5, 9)
    out_r = _step(hf, ids, mask, labels)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=3, defer_wgrad=True)
    lm.activation_checkpointing_enable()
    _assert_same("checkpointed", lm, _step(lm, ids, mask, labels), hf, out_r)

    dropping = lancet_rt.from_hf(copy.deepcopy(hf), capacity_factor=0.5)
    ref = _step(dropping, ids, mask, labels)
    assert sum(m.dropped for m in lancet_rt.integrations.hf.moe_layers(dropping)) > 0
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=3, capacity_factor=0.5)
    lm.activation_checkpointing_enable()
    _assert_same("checkpointed with drops", lm, _step(lm, ids, mask, labels), dropping, ref)

    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=2)
    lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant=False"):
        lm(input_ids=ids, attention_mask=mask, labels=labels)


def test_checkpoint_without_replay_is_refused():
    moe = lancet_rt.MoE(8, 16, 4, 2)
    x = torch.randn(6, 8, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="context_fn=lancet_rt.checkpoint_context"):
        y.sum().backward()
    y = lancet_rt.checkpoint(moe, x)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_compile_around_moe_layers():
    """torch.compile of the decoder layers of an overlapped model: the MoE layers stay eager (a graph
    break: collectives, host syncs and chunk switches are not traced), the rest compiles."""
    hf = build("mixtral")
    ids, mask, labels = batch(hf.config.vocab_size, 4, 8)
    out_r = _step(hf, ids, mask, labels)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=2)
    for layer in lm.model.layers:
        layer.compile(backend="aot_eager")
    _assert_same("compiled layers", lm, _step(lm, ids, mask, labels), hf, out_r)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_compiled_layers_trace_the_moe_layers_unchunked(family, monkeypatch):
    """Unchunked, without expert parallelism, compiled decoder layers trace the MoE layers as lancet custom
    operators (lancet_rt.moe.library) and equal transformers. (fullgraph=True stops in transformers' own
    output-capturing hook, which calls ContextVar.get, not in lancet's code.)"""
    from lancet_rt.moe import library

    traced = []
    forward = library.forward
    monkeypatch.setattr(library, "forward", lambda moe, x: traced.append(moe) or forward(moe, x))
    torch._dynamo.reset()
    hf = build(family)
    ids, mask, labels = batch(hf.config.vocab_size, 4, 8)
    out_r = _step(hf, ids, mask, labels)
    lm = lancet_rt.from_hf(copy.deepcopy(hf))
    for layer in lm.model.layers:
        layer.compile(backend="aot_eager")
    _assert_same(f"{family} compiled layers", lm, _step(lm, ids, mask, labels), hf, out_r)
    assert len(traced) >= len(lm.model.layers)


def test_autocast_bf16_with_float32_parameters():
    """The router stays float32 (the same choices as float32), the experts run in bfloat16, the
    output has the input's dtype and float32 parameters get float32 gradients."""
    torch.manual_seed(0)
    moe = lancet_rt.MoE(32, 48, 8, 2, capacity_factor=1.0)
    twin = copy.deepcopy(moe)
    x = torch.randn(3, 21, 32)
    g = torch.randn(3, 21, 32)
    x32, x16 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y32 = moe(x32)
    y32.backward(g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = twin(x16)
    assert y16.dtype == torch.float32
    y16.backward(g)
    assert torch.equal(twin.tokens_per_expert, moe.tokens_per_expert) and twin.dropped == moe.dropped
    assert_close("y under autocast", y16, y32, torch.bfloat16)
    assert_close("grad x under autocast", x16.grad, x32.grad, torch.bfloat16)
    for (n, p16), (_, p32) in zip(twin.named_parameters(), moe.named_parameters()):
        assert p16.grad.dtype == torch.float32, n
        assert_close(f"grad {n} under autocast", p16.grad, p32.grad, torch.bfloat16)
    # bfloat16 rows in (as from a bf16 linear) are accepted under autocast only.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert twin(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="autocast"):
        twin(x.bfloat16())


def test_hf_model_trains_under_autocast():
    hf = build("qwen2_moe")
    ids, mask, labels = batch(hf.config.vocab_size, 4, 8)
    out_r = _step(hf, ids, mask, labels)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=2, defer_wgrad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lm(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert abs(out.loss.item() - out_r.loss.item()) <= 2 * TOLERANCES[torch.bfloat16]["rel_rms"] * out_r.loss.item()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lm.parameters())


def test_lm_head_runs_per_chunk_when_every_position_is_wanted():
    """Training (labels, logits_to_keep=0): each chunk ends with its rows of the logits, so the head
    hides other chunks' all-to-alls; the model's own lm_head call gets them whole. With
    logits_to_keep=1 (generation) the head runs once, on the model's slice."""
    hf = build("mixtral")
    ids, mask, labels = batch(hf.config.vocab_size, 5, 9)
    want = hf(input_ids=ids, attention_mask=mask, labels=labels)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=2)
    seen = []
    lm.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape[:2])))
    out = lm(input_ids=ids, attention_mask=mask, labels=labels)
    assert seen == [(3, 9), (2, 9), (5, 9)]  # chunk 0, chunk 1, then the model's call, served whole
    assert_close("logits", out.logits, want.logits)
    assert_close("loss", out.loss.reshape(1), want.loss.reshape(1))
    seen.clear()
    last = lm(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    assert seen == [(5, 1)]
    assert_close("last logits", last, hf(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits)
    assert lm.model.forward.stash is None  # nothing outlives the call
    # The patched forwards keep the model's signatures (HF's Trainer keeps dataset columns by them,
    # generate() validates its kwargs by them), and greedy generation is transformers'.
    for patched, own in ((lm.forward, hf.forward), (lm.model.forward, hf.model.forward)):
        assert inspect.signature(patched) == inspect.signature(own)
    assert torch.equal(
        lm.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False),
        hf.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False),
    )
    # Converted again unchunked, the model's and the head's own forwards are back.
    lancet_rt.from_hf(lm, chunks=1)
    assert "forward" not in lm.__dict__ and "forward" not in lm.lm_head.__dict__
    assert_close("unchunked logits", lm(input_ids=ids, attention_mask=mask).logits, want.logits)


def test_shared_experts_run_while_the_dispatch_travels():
    link = lancet_rt.EmulatedGroup(world_size=2, bandwidth_gbps=0.01, latency_us=2000)
    shared = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16))
    moe = lancet_rt.MoE(
        16, 24, 4, 2, ep_group=link, shared_experts=shared, shared_expert_gate=torch.nn.Linear(16, 1, bias=False)
    )
    x = torch.randn(40, 16)
    with lancet_rt.tracing() as tr:
        y = moe(x)
    spans = {e["name"]: e for e in tr.events() if e.get("ph") == "X"}
    dispatch, shared_span, experts = spans["dispatch"], spans["shared experts"], spans["experts"]
    assert dispatch["ts"] <= shared_span["ts"] and shared_span["ts"] + shared_span["dur"] <= experts["ts"]
    plain = lancet_rt.MoE(16, 24, 4, 2, ep_group=link)
    plain.load_state_dict({k: v for k, v in moe.state_dict().items() if not k.startswith("shared")})
    expected = plain(x) + torch.sigmoid(moe.shared_expert_gate(x)) * shared(x)
    assert_close("shared + routed", y, expected)


def test_update_expert_bias_moves_towards_balance():
    moe = lancet_rt.MoE(8, 16, 4, 2, score_fn="sigmoid", expert_bias=True)
    with torch.no_grad():
        moe.router.weight[0] += 2.0  # expert 0 overloaded
    moe.train()
    moe(torch.randn(30, 8))
    moe(torch.randn(30, 8))
    load = moe.expert_load.clone()
    assert load.sum() == 2 * 30 * 2
    lancet_rt.update_expert_bias(moe, rate=0.01)
    expected = 0.01 * torch.sign(load.double().mean() - load.double())
    assert torch.equal(moe.router.e_score_correction_bias, expected.float())
    assert moe.expert_load is None
    with pytest.raises(ValueError, match="rate"):
        lancet_rt.update_expert_bias(moe, rate=0.0)


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        lancet_rt.from_hf("mixtral")
    hf = build("mixtral")
    with pytest.raises(ValueError, match="chunks"):
        lancet_rt.from_hf(hf, chunks=0)
    with pytest.raises(TypeError, match="defer_wgrad"):
        lancet_rt.from_hf(hf, chunks=2, defer_wgrad="yes")
    assert all(type(m).__name__ != "MoE" for m in hf.modules())  # refused before anything was patched
    with pytest.raises(ValueError, match="router_jitter_noise"):
        lancet_rt.from_hf(build("mixtral", router_jitter_noise=0.1))
    import transformers as tf

    dense = tf.LlamaForCausalLM(
        tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(ValueError, match="no MoE block"):
        lancet_rt.from_hf(dense)
    moe = lancet_rt.from_hf(hf)
    with pytest.raises(ValueError, match="converted already"):
        lancet_rt.from_hf(moe, capacity_factor=1.0)
    with pytest.raises(ValueError, match="divisible"):
        lancet_rt.from_hf(build("mixtral"), lancet_rt.EmulatedGroup(world_size=3))
    sharded = lancet_rt.from_hf(build("mixtral"), lancet_rt.EmulatedGroup(world_size=2))
    with pytest.raises(ValueError, match="lancet_rt.save_hf"):
        sharded.save_pretrained("never-written")


def expert_parallel_reference(family, rank, world):
    """(transformers model, every rank's batch, this rank's output) for expert parallelism over
    ``world`` ranks, each with its own batch (3 + rank rows). The model's gradients are the
    reference: dense ones of this rank's loss; the expert rows this rank holds get every rank's
    tokens, so theirs (all rows here) are of the sum of all ranks' losses."""
    hf = build(family)
    batches = [batch(hf.config.vocab_size, 3 + r, 7, seed=10 + r) for r in range(world)]
    own = _step(hf, *batches[rank])
    dense = {n: p.grad.clone() for n, p in hf.named_parameters()}
    hf.zero_grad()
    sum(hf(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss for b in batches).backward()
    for n, p in hf.named_parameters():
        if ".experts." not in n:
            p.grad = dense[n]
    return hf, batches, own


def _expert_parallel(rank, world, families):
    """Every rank converts the same full model (EP over the gloo world) and runs its own batch,
    against :func:`expert_parallel_reference`."""
    import torch.distributed as dist

    torch.manual_seed(0)
    checked = []
    for family in families:
        hf, batches, own = expert_parallel_reference(family, rank, world)
        for chunks, defer in ((1, False), (2, True)):
            lm = lancet_rt.from_hf(copy.deepcopy(hf), dist.group.WORLD, chunks=chunks, defer_wgrad=defer)
            if family == "qwen2_moe":
                lm.activation_checkpointing_enable()
            layer = lancet_rt.integrations.hf.moe_layers(lm)[0]
            L = layer.num_local_experts
            out = _step(lm, *batches[rank])
            _assert_same(
                f"{family} EP rank {rank} chunks={chunks}", lm, out, hf, own, rows=slice(rank * L, (rank + 1) * L)
            )
            checked.append((family, chunks, L))
    return checked


def _gloo_checks(rank, world, families):
    """One spawn for the distributed checks: expert parallelism per family, then the bias update."""
    return _expert_parallel(rank, world, families), _bias_update(rank, world)


def test_expert_parallel_over_gloo():
    """Weights sharded from one full state dict over 2 gloo ranks, each rank with its own batch;
    and update_expert_bias summing the loads over the ranks."""
    families = list(FAMILIES)  # every supported family, in one spawn
    (checked, (l0, b0)), (_, (l1, b1)) = assert_all_ok(run_ranks(_gloo_checks, 2, families, timeout=240))
    assert [c[0] for c in checked] == [f for f in families for _ in range(2)]
    assert all(c[2] == 4 for c in checked)  # 8 experts over 2 ranks
    l0, l1, b0, b1 = (torch.tensor(v) for v in (l0, l1, b0, b1))
    total = (l0 + l1).double()
    assert torch.equal(b0, b1)
    assert torch.equal(b0, (0.5 * torch.sign(total.mean() - total)).float())


def _bias_update(rank, world):
    import torch.distributed as dist

    torch.manual_seed(0)
    moe = lancet_rt.MoE(8, 16, 4, 2, score_fn="sigmoid", expert_bias=True, ep_group=dist.group.WORLD)
    moe.train()
    torch.manual_seed(rank + 1)
    moe(torch.randn(10 + 7 * rank, 8))
    local = moe.expert_load.clone()
    lancet_rt.update_expert_bias(moe, rate=0.5, group=dist.group.WORLD)
    # Plain lists: a tensor crosses the result queue through shared memory, gone once the rank exits.
    return local.tolist(), moe.router.e_score_correction_bias.tolist()


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_on_the_triton_kernels(family, monkeypatch):
    """DeepSeek-V3's router (selection bias, groups, scaling) through the Triton gating kernels, and
    GPT-OSS's experts (interleaved gate/up, biases, clamped SwiGLU) through the grouped GEMMs (the
    interpreter on CPU), chunked with deferred dW, against transformers."""
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    hf = build(family)
    ids, mask, labels = batch(hf.config.vocab_size, 3, 7)
    out_r = _step(hf, ids, mask, labels)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=2, defer_wgrad=True)
    _assert_same(f"{family} triton", lm, _step(lm, ids, mask, labels), hf, out_r)
