"""from_hf with lancet's dense layers (lancet_rt.integrations.hf_dense): every RMSNorm on lancet's
kernel, and with ``fused_loss=True`` the chunked linear cross-entropy per chunk; against transformers
itself (loss, aux loss and every parameter gradient at float32 rel RMS <= 1e-5; logits where returned),
for every supported family, chunks 1/2/3 with and without deferred dW; the bytes saved for backward
as the vocabulary grows; transformers' behaviour where the fused loss does not apply.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import lancet_rt
from lancet_rt.integrations import hf_dense
from lancet_rt.models.hf_models import FAMILIES, batch, build
from tests.helpers import assert_close

SCHEDULES = [(1, False), (2, False), (2, True), (3, False), (3, True)]


def _step(model, ids, mask, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kw)
    out.loss.backward()
    return out


def _assert_same(name, lm, out_l, hf, out_r):
    assert out_l.logits is None, f"{name}: the fused loss formed logits"
    assert_close(f"{name} loss", out_l.loss.reshape(1), out_r.loss.reshape(1))
    if getattr(out_r, "aux_loss", None) is not None:
        assert_close(f"{name} aux_loss", out_l.aux_loss.reshape(1), out_r.aux_loss.reshape(1))
    ref = dict(hf.named_parameters())
    for n, p in lm.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {n}"
        assert_close(f"{name} grad {n}", p.grad, ref[n].grad)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_loss_equals_transformers(family):
    hf = build(family)
    ids, mask, labels = batch(hf.config.vocab_size, 5, 9)
    labels[2, :] = -100  # a row without loss: with chunks=3 a chunk of only ignored labels
    out_r = _step(hf, ids, mask, labels)
    for chunks, defer in SCHEDULES:
        lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=chunks, defer_wgrad=defer, fused_loss=True)
        assert all(type(m).__name__.startswith("Lancet") for m in lm.modules() if type(m).__name__.endswith("RMSNorm"))
        _assert_same(f"{family} chunks={chunks} defer={defer}", lm, _step(lm, ids, mask, labels), hf, out_r)
        # Where the fused loss does not apply (no labels, evaluation), the logits are transformers'.
        with torch.no_grad():
            assert_close(
                "logits", lm(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
            )


def test_chunks_run_the_whole_batchs_inner_loss_chunks(monkeypatch):
    """Cut into chunks, the fused loss steps through the vocabulary GEMMs in the rows the unchunked
    batch would (sized from the whole batch's tokens, not from a chunk's)."""
    from lancet_rt import dense

    hf = build("mixtral")
    ids, mask, labels = batch(hf.config.vocab_size, 6, 9)
    seen, inner = [], dense._linear_ce_chunks

    def spy(hidden, weight, labels, divisor, ignore_index, chunk, *args, **kwargs):
        seen.append(chunk)
        return inner(hidden, weight, labels, divisor, ignore_index, chunk, *args, **kwargs)

    monkeypatch.setattr(dense, "_linear_ce_chunks", spy)
    want = dense._default_chunk(ids.numel(), hf.config.hidden_size, hf.config.vocab_size)
    assert want != dense._default_chunk(ids.numel() // 3, hf.config.hidden_size, hf.config.vocab_size)
    for chunks in (1, 3):
        seen.clear()
        lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=chunks, fused_loss=True)
        _step(lm, ids, mask, labels)
        assert seen == [want] * chunks, (chunks, seen)


def test_rmsnorms_alone_and_eval_with_labels():
    hf = build("qwen3_moe")
    ids, mask, labels = batch(hf.config.vocab_size, 4, 7)
    out_r = _step(hf, ids, mask, labels)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=2)  # fused_loss off: transformers' loss and logits
    out_l = _step(lm, ids, mask, labels)
    assert_close("logits", out_l.logits, out_r.logits)
    assert_close("loss", out_l.loss.reshape(1), out_r.loss.reshape(1))
    lm = lancet_rt.from_hf(lm, chunks=2, fused_loss=True).eval()
    with torch.no_grad():
        out = lm(input_ids=ids, attention_mask=mask, labels=labels)  # evaluation: logits and loss as transformers'
        want = hf.eval()(input_ids=ids, attention_mask=mask, labels=labels)
    assert_close("eval logits", out.logits, want.logits)
    assert_close("eval loss", out.loss.reshape(1), want.loss.reshape(1))
    with pytest.raises(TypeError, match="fused_loss"):
        lancet_rt.from_hf(lm, fused_loss=1)


def _saved_bytes(model, ids, mask, labels) -> int:
    seen, kept = {}, []
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
            kept.append(t)  # alive to the end: a freed storage's address, reused by a later one, hid one of the two
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask, labels=labels)
    return sum(seen.values())


@pytest.mark.parametrize("fused", [True, False])
def test_saved_bytes_as_the_vocabulary_grows(fused):
    """Tiny Mixtral, chunks=2, T = 8 x 32 tokens: growing V by dV adds T x dV x 4 bytes saved for
    backward today (the float32 logits); with the fused loss only the head's gradient, D x dV x 4."""
    V, dV = 96, 512
    ids, mask, labels = batch(V, 8, 32)
    T, sizes = ids.numel(), []
    for vocab in (V, V + dV):
        hf = build("mixtral", vocab_size=vocab)
        lm = lancet_rt.from_hf(hf, chunks=2, fused_loss=fused)
        sizes.append(_saved_bytes(lm, ids, mask, labels))
    growth, D = sizes[1] - sizes[0], hf.config.hidden_size
    if fused:
        assert growth == D * dV * 4
        assert growth < T * dV * 4 / 4
    else:
        assert growth >= T * dV * 4


def test_loss_mode_declines():
    hf = build("mixtral")
    ids, mask, labels = batch(hf.config.vocab_size, 3, 6)
    lm = lancet_rt.from_hf(hf, fused_loss=True)
    head = lm.get_output_embeddings()
    for kwargs in (
        dict(labels=labels, logits_to_keep=1),
        dict(),
        dict(labels=labels, return_dict=False),
        dict(labels=labels, shift_labels=labels),
    ):
        assert hf_dense.loss_mode_for(lm, head, (), dict(kwargs))[0] is None
    assert hf_dense.loss_mode_for(lm, head, (), dict(labels=labels))[0] is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_residual_add_fused_into_the_post_attention_norm(family, monkeypatch):
    """Every decoder layer fuses its residual add into the post-attention RMSNorm (one lancet add_rmsnorm with a
    residual per layer and forward); the logits equal transformers' (test_hf.py compares loss and gradients)."""
    hf = build(family)
    ids, mask, _ = batch(hf.config.vocab_size, 3, 6)
    lm = lancet_rt.from_hf(copy.deepcopy(hf))
    layers = lm.model.layers
    assert all(type(layer).__name__ == "Lancet" + type(hf.model.layers[0]).__name__ for layer in layers)
    calls = []

    def counting(x, residual, weight, eps=1e-6):
        calls.append(residual is not None)
        return hf_dense_add_rmsnorm(x, residual, weight, eps)

    hf_dense_add_rmsnorm = hf_dense.add_rmsnorm
    monkeypatch.setattr(hf_dense, "add_rmsnorm", counting)
    with torch.no_grad():
        assert_close(
            "logits", lm(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
        )
    assert sum(calls) == len(layers)


def test_decoder_layer_of_another_shape_stays_unfused():
    """A decoder layer whose forward is not the pre-norm pattern (here: a scaled residual) keeps its own forward."""
    hf = build("mixtral")
    base = type(hf.model.layers[0])

    class ScaledResidualLayer(base):
        def forward(
            self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, cache=None, **kwargs
        ):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                **kwargs,
            )
            hidden_states = residual + 0.5 * hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    for layer in hf.model.layers:
        layer.__class__ = ScaledResidualLayer
    assert hf_dense.fuse_residual_adds(hf) == 0
    assert all(type(layer) is ScaledResidualLayer for layer in hf.model.layers)
    assert hf_dense._pre_norm_layer(base) is False and hf_dense._pre_norm_layer(ScaledResidualLayer) is None


# ------------------------------------------------------------ the backward's first all-to-all, from the forward
def _early_step(model, ids, mask, labels, monkeypatch, factor=2.0, **kw):
    """One step whose loss is scaled by ``factor``; returns (output, duals issued from the forward,
    every BackwardLink issued)."""
    from lancet_rt.comm import group as comm
    from lancet_rt.runtime import scope

    issued, inner = [], comm.BackwardLink.issue

    def issue(link, grad):
        pending = scope.PROCESS.dual_from_forward  # (the dual a partial backward issues from the forward)
        issued.append((link, pending is not None and pending[0] is link))
        return inner(link, grad)

    monkeypatch.setattr(comm.BackwardLink, "issue", issue)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kw)
    early = sum(e for _, e in issued)
    (out.loss * factor).backward()
    return out, early, issued


def _same_step(name, a, b):
    (out_a, model_a), (out_b, model_b) = a, b
    assert torch.equal(out_a.loss, out_b.loss), name
    grads_b = dict(model_b.named_parameters())
    for n, p in model_a.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {n}"
        assert torch.equal(p.grad, grads_b[n].grad), f"{name}: gradient of {n} differs"


@pytest.mark.parametrize("family", FAMILIES)
def test_early_backward_issues_each_chunks_dual_in_the_forward_exactly(family, monkeypatch):
    """Expert-parallel (an emulated 2-rank link), chunked (3, or 2 deferring dW), fused loss: each
    chunk issues its last combine's backward all-to-all from the forward, the backward issues it no
    second time, and the loss and every gradient equal those with it off bit for bit (the loss
    scaled by 2: the dual's result takes the loss gradient's factor)."""
    hf = build(family)
    ids, mask, labels = batch(hf.config.vocab_size, 5, 9)
    labels[2, :] = -100  # a chunk of only ignored labels
    for chunks, defer in ((3, False), (2, True)):
        runs = {}
        for early in (True, False):
            lm = lancet_rt.from_hf(
                copy.deepcopy(hf),
                lancet_rt.EmulatedGroup(world_size=2),
                chunks=chunks,
                defer_wgrad=defer,
                fused_loss=True,
                early_backward=early,
            )
            out, from_forward, issued = _early_step(lm, ids, mask, labels, monkeypatch)
            monkeypatch.undo()
            links = [link for link, _ in issued]
            assert len(links) == len(set(map(id, links))), "a dual was issued twice"
            assert all(link.early is None and link.scaled_by is None for link in links)
            assert from_forward == (chunks if early else 0)
            runs[early] = (out, lm)
        _same_step(f"{family} chunks={chunks} defer={defer}", runs[True], runs[False])


def test_early_backward_declines_where_it_would_not_be_exact(monkeypatch):
    """Gradient checkpointing or early_backward=False: the backward issues every dual, and the step is
    the same. Hidden states or attentions returned (unused in the loss) keep the duals from the forward
    (tests/integrations/test_early_backward.py: used in the loss)."""
    hf = build("qwen3_moe")
    ids, mask, labels = batch(hf.config.vocab_size, 4, 7)
    ref = lancet_rt.from_hf(
        copy.deepcopy(hf), lancet_rt.EmulatedGroup(world_size=2), chunks=2, fused_loss=True, early_backward=False
    )
    want = _early_step(ref, ids, mask, labels, monkeypatch)[0]
    monkeypatch.undo()
    for kw in ({"output_hidden_states": True}, {"output_attentions": True}, {"checkpointing": True}):
        lm = lancet_rt.from_hf(copy.deepcopy(hf), lancet_rt.EmulatedGroup(world_size=2), chunks=2, fused_loss=True)
        checkpointing = kw.pop("checkpointing", False)
        if checkpointing:
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        out, from_forward, _ = _early_step(lm, ids, mask, labels, monkeypatch, **kw)
        monkeypatch.undo()
        assert from_forward == (0 if checkpointing else 2), kw
        _same_step(str(kw), (out, lm), (want, ref))
    with pytest.raises(TypeError, match="early_backward"):
        lancet_rt.from_hf(build("mixtral"), fused_loss=True, early_backward=1)


def test_early_duals_keep_the_backward_closed():
    """A dual issued from the forward counts as the step's (a backward that raises later is still
    found incomplete) without opening the backward; the step's backward closes it."""
    from lancet_rt.comm import faults
    from lancet_rt.schedule.early_backward import GradScale

    hf = build("mixtral")
    ids, mask, labels = batch(hf.config.vocab_size, 4, 7)
    link = lancet_rt.EmulatedGroup(world_size=2)
    lm = lancet_rt.from_hf(hf, link, chunks=2, fused_loss=True)
    out = lm(input_ids=ids, attention_mask=mask, labels=labels)
    st = faults.backward_state(link)
    assert st.duals == 2 and not st.backward_open and st.links > st.duals
    out.loss.backward()
    assert st.duals == 0 and st.links == 0 and not st.backward_open
    with pytest.raises(RuntimeError, match="early_backward=False"):
        GradScale().factor()


def _early_over_gloo(rank, world, families):
    """Each rank its own batch (3 + rank rows), chunks=2, fused loss, duals issued from the forward over
    real collectives: equal to the step that issues them in the backward bit for bit, and to
    transformers (dense gradients of this rank's loss; the expert rows this rank holds get every
    rank's tokens, so theirs are of the sum of all ranks' losses)."""
    import torch.distributed as dist

    from tests.integrations.test_hf import expert_parallel_reference

    results = []
    for family in families:
        hf, batches, want = expert_parallel_reference(family, rank, world)
        steps, counts = [], []
        for early in (True, False):
            lm = lancet_rt.from_hf(copy.deepcopy(hf), dist.group.WORLD, chunks=2, fused_loss=True, early_backward=early)
            layer = lancet_rt.integrations.hf.moe_layers(lm)[0]
            lm.zero_grad(set_to_none=True)
            out = lm(input_ids=batches[rank][0], attention_mask=batches[rank][1], labels=batches[rank][2])
            counts.append(lancet_rt.comm.faults.backward_state(layer.group).duals)
            out.loss.backward()
            steps.append((out, {n: p.grad for n, p in lm.named_parameters()}))
        (out, grads), (out_b, grads_b) = steps
        same = torch.equal(out.loss, out_b.loss) and all(torch.equal(grads[n], grads_b[n]) for n in grads)
        assert_close(f"{family} loss", out.loss.reshape(1), want.loss.reshape(1))
        L = layer.num_local_experts
        for n, g in grads.items():
            ref = hf.get_parameter(n).grad
            ref = ref[rank * L : (rank + 1) * L] if ".experts." in n else ref
            assert_close(f"{family} rank {rank} grad {n}", g, ref)
        results.append((family, counts, same))
    return results


def test_early_backward_over_gloo():
    from tests.dist import assert_all_ok, run_ranks

    families = ["mixtral", "deepseek_v3"]
    for rank_results in assert_all_ok(run_ranks(_early_over_gloo, 2, families, timeout=240)):
        assert [r[0] for r in rank_results] == families
        for family, counts, same in rank_results:
            assert counts == [2, 0], (family, counts)  # one dual per chunk issued from the forward
            assert same, f"{family}: the step differs with early_backward"
