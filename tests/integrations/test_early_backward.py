"""The early backward (lancet_rt.schedule.early_backward) with something besides the fused loss consuming
the last hidden state, or a tensor between it and the last combine: a forward hook on the final norm
adding a regulariser, ``hidden_states[-1]`` in the loss, a hook on the last decoder layer, tied
embeddings. The duals are issued from the forward, the backward finds the other gradient and sends
them again: every gradient equals that of ``early_backward=False`` bit for bit, in one process (an
emulated 2-rank link; the backward also on another thread, as CUDA runs it) and over 2 gloo ranks
(there also against transformers). Without a second consumer nothing is sent twice.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

pytest.importorskip("transformers")

import lancet_rt
from lancet_rt.comm import faults
from lancet_rt.comm import group as comm
from lancet_rt.models.hf_models import batch, build
from lancet_rt.schedule import early_backward
from tests.helpers import assert_close

REG = 1e-3


def _consumer(model, kind):
    """Install a second consumer of ``kind`` on ``model``; returns ``extra(out)``: the term it adds to
    the loss (a sum over rows, so chunking it changes nothing)."""
    regs = []

    def keep(_m, _inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        regs.append(out.pow(2).sum())

    if kind in ("norm_hook", "tied"):
        model.model.norm.register_forward_hook(keep)
    elif kind == "layer_hook":  # a tensor in the middle of the path: the last decoder layer's output
        model.model.layers[-1].register_forward_hook(keep)

    def extra(out):
        if kind == "hidden_states":
            return REG * out.hidden_states[-1].pow(2).sum()
        total = REG * sum(regs)
        regs.clear()
        return total

    return extra


def _kwargs(kind):
    return {"output_hidden_states": True} if kind == "hidden_states" else {}


def _build(family, kind):
    return build(family, tie_word_embeddings=True) if kind == "tied" else build(family)


class _Counts:
    """Duals issued from the forward, duals withdrawn by the backward, and every issue."""

    def __init__(self, monkeypatch):
        self.withdrawn, self.issued = 0, []
        withdraw, issue = getattr(comm.BackwardLink, "withdraw_early", None), comm.BackwardLink.issue

        def counted_withdraw(link):
            self.withdrawn += 1
            return withdraw(link)

        def counted_issue(link, grad):
            self.issued.append(link)
            return issue(link, grad)

        monkeypatch.setattr(comm.BackwardLink, "withdraw_early", counted_withdraw, raising=False)
        monkeypatch.setattr(comm.BackwardLink, "issue", counted_issue)


def _step(model, ids, mask, labels, kind, thread=False, factor=3.0):
    """One step with the consumer's term added, the loss scaled by ``factor`` (3: not a power of two,
    the dual sent from the forward then differs from the backward's by a rounding); returns (loss,
    {name: grad}, duals issued from the forward)."""
    extra = _consumer(model, kind)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **_kwargs(kind))
    group = lancet_rt.integrations.hf.moe_layers(model)[0].group
    from_forward = faults.backward_state(group).duals if group is not None else 0
    loss = factor * out.loss + extra(out)
    if thread:  # the backward's nodes and hooks on a thread other than the forward's
        errors = []
        t = threading.Thread(target=lambda: _backward(loss, errors))
        t.start()
        t.join(timeout=300)
        assert not t.is_alive() and not errors, errors
    else:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, from_forward


def _backward(loss, errors):
    try:
        loss.backward()
    except BaseException as exc:  # reported by the test
        errors.append(exc)


@pytest.mark.parametrize(
    "family,kind,thread",
    [
        ("mixtral", "norm_hook", False),
        ("mixtral", "hidden_states", False),
        ("qwen3_moe", "layer_hook", False),
        ("deepseek_v3", "tied", False),
        ("qwen2_moe", "norm_hook", True),
    ],
)
def test_a_second_consumer_gets_the_gradients_of_the_backward_issuing_the_duals(family, kind, thread, monkeypatch):
    """Each chunk issues its dual from the forward; the backward finds the other gradient on the path,
    withdraws that dual and sends the one it computed: the step equals early_backward=False bit for bit."""
    hf = _build(family, kind)
    ids, mask, labels = batch(hf.config.vocab_size, 5, 9)
    runs = {}
    for early in (True, False):
        counts = _Counts(monkeypatch)
        lm = lancet_rt.from_hf(
            copy.deepcopy(hf), lancet_rt.EmulatedGroup(world_size=2), chunks=3, fused_loss=True, early_backward=early
        )
        runs[early] = _step(lm, ids, mask, labels, kind, thread) + (counts,)
        monkeypatch.undo()
    (loss, grads, from_forward, counts), (loss_b, grads_b, _, counts_b) = runs[True], runs[False]
    assert torch.equal(loss, loss_b)
    differ = [n for n in grads if not torch.equal(grads[n], grads_b[n])]
    assert not differ, f"{family} {kind}: {len(differ)} of {len(grads)} gradients differ, e.g. {differ[:3]}"
    assert from_forward == 3, "the duals were not issued from the forward"
    assert counts.withdrawn == 3 and len(counts.issued) == len(counts_b.issued) + 3


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_without_a_second_consumer_nothing_is_sent_twice(family, monkeypatch):
    """The plain step keeps its duals from the forward: none withdrawn, each link issued once, and
    the hooks gone from the graph after the backward."""
    hf = build(family)
    ids, mask, labels = batch(hf.config.vocab_size, 5, 9)
    counts = _Counts(monkeypatch)
    watches = []
    issue = early_backward.issue_from_forward

    def watched(hidden, term, scale):
        done = issue(hidden, term, scale)
        watches.append(scale.watch)
        return done

    monkeypatch.setattr(early_backward, "issue_from_forward", watched)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), lancet_rt.EmulatedGroup(world_size=2), chunks=3, fused_loss=True)
    _, _, from_forward = _step(lm, ids, mask, labels, "none")
    assert from_forward == 3 and counts.withdrawn == 0
    assert len(counts.issued) == len(set(map(id, counts.issued)))
    assert len(watches) == 3 and all(w is not None and not w.joined and w._handles is None for w in watches)


def test_a_path_one_tensor_feeds_twice_is_not_watched():
    """Two path gradients into one node's input would be added by the engine, so the check could not
    tell a third apart: such a path declines the early dual (the backward issues it)."""

    class _Net(torch.autograd.Function):  # stands in for the combine's all-to-all node
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    x = torch.randn(4, 3, requires_grad=True)
    y = _Net.apply(x)
    chain = (y * 2).tanh().sum()
    nodes, edges = early_backward._path(chain.grad_fn, y.grad_fn)
    assert len(nodes) == 3 and nodes[0] is chain.grad_fn
    assert any(j == -1 for es in edges.values() for _, (j, _) in es)
    assert early_backward._path((y * y).sum().grad_fn, y.grad_fn) is None  # y feeds the product twice
    z = y * 2
    assert early_backward._path((z + z.exp()).sum().grad_fn, y.grad_fn) is None


def _over_gloo(rank, world, cases):
    """Each rank its own batch, chunks=2, a second consumer: early on equals early off bit for bit,
    and transformers with the same consumer (dense gradients of this rank's loss, expert rows of all
    ranks' losses)."""
    import torch.distributed as dist

    results = []
    for family, kind in cases:
        hf = _build(family, kind)
        batches = [batch(hf.config.vocab_size, 3 + r, 7, seed=10 + r) for r in range(world)]
        want, ref = {}, copy.deepcopy(hf)
        extra = _consumer(ref, kind)
        for own in (True, False):  # transformers: this rank's loss (dense), every rank's (experts)
            ref.zero_grad(set_to_none=True)
            total = 0
            for b in batches[rank : rank + 1] if own else batches:
                out = ref(input_ids=b[0], attention_mask=b[1], labels=b[2], **_kwargs(kind))
                total = total + 3 * out.loss + extra(out)
            total.backward()
            want.update({n: p.grad.clone() for n, p in ref.named_parameters() if (".experts." in n) != own})
        steps, L = [], 0
        for early in (True, False):
            lm = lancet_rt.from_hf(copy.deepcopy(hf), dist.group.WORLD, chunks=2, fused_loss=True, early_backward=early)
            L = lancet_rt.integrations.hf.moe_layers(lm)[0].num_local_experts
            steps.append(_step(lm, *batches[rank], kind))
        (loss, grads, from_forward), (loss_b, grads_b, _) = steps
        same = torch.equal(loss, loss_b) and all(torch.equal(grads[n], grads_b[n]) for n in grads)
        for n, g in grads_b.items():
            ref = want[n][rank * L : (rank + 1) * L] if ".experts." in n else want[n]
            assert_close(f"{family} {kind} rank {rank} grad {n}", g, ref)
        results.append((family, kind, from_forward, same))
    return results


def test_a_second_consumer_over_gloo():
    from tests.dist import assert_all_ok, run_ranks

    cases = [("mixtral", "norm_hook"), ("mixtral", "hidden_states"), ("qwen3_moe", "tied")]
    for rank_results in assert_all_ok(run_ranks(_over_gloo, 2, cases, timeout=420)):
        assert [r[:2] for r in rank_results] == cases
        for family, kind, from_forward, same in rank_results:
            assert same, f"{family} {kind}: the step differs with early_backward"
            assert from_forward == 2, (family, kind, from_forward)


def _empty_chunks(rank, world):
    """Rank 0 runs 4 rows, rank 1 2 (its chunks 2 and 3 empty, a stand-in row each) in 4 chunks: every
    rank issues every chunk's dual from the forward, in the same order, and the step equals the one
    without the early backward."""
    import torch.distributed as dist

    hf = build("mixtral")
    ids, mask, labels = batch(hf.config.vocab_size, 4 - 2 * rank, 7, seed=10 + rank)
    steps = []
    for early in (True, False):
        lm = lancet_rt.from_hf(copy.deepcopy(hf), dist.group.WORLD, chunks=4, fused_loss=True, early_backward=early)
        steps.append(_step(lm, ids, mask, labels, "none", factor=2.0))
    (loss, grads, from_forward), (loss_b, grads_b, _) = steps
    return from_forward, torch.equal(loss, loss_b) and all(torch.equal(grads[n], grads_b[n]) for n in grads)


def test_empty_chunks_on_one_rank_issue_their_duals_alike():
    """A chunk empty on one rank only (fewer rows than chunks there) issued no dual from the forward
    on that rank while the others did: the ranks' collectives differed (CollectiveMismatch)."""
    from tests.dist import assert_all_ok, run_ranks

    for from_forward, same in assert_all_ok(run_ranks(_empty_chunks, 2, timeout=300)):
        assert same and from_forward == 4, (from_forward, same)
