"""The shared harness of the mesh tests: one model on a (dp, ep) mesh against one process on the global batch.

Every rank builds the reference (all experts, the same initial weights) and runs it on the global
batch; its own model holds the reference's dense weights and its ep rank's slice of the experts and
runs its own rows. After each of TWO optimizer steps the local loss, every gradient and every
parameter must equal the reference's (float32 rel RMS <= 1e-5, tests.helpers.assert_close).
"""

from __future__ import annotations

import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from lancet_rt.parallel import expert_parameters
from tests.helpers import assert_close

D, E, ROWS, SEQ = 8, 8, 2, 3  # ROWS per rank


def make_blocks(ep_group=None, z_loss_coef=0.01):
    torch.manual_seed(0)
    # Dropless and no aux loss: both depend on the local batch, so no (dp, ep) run could equal the
    # global one with them. The z-loss is a mean over tokens and stays (but not under accumulate,
    # where it is per microbatch and its gradient is not scaled by the loss's 1 / M).
    return MoEBlocks(2, D, 2, dict(d_ffn=6, num_experts=E, top_k=2, z_loss_coef=z_loss_coef, ep_group=ep_group))


def load_from_reference(model, ref, ep_rank: int) -> None:
    """``model``'s parameters := the reference's (its experts: this ep rank's slice)."""
    experts = {id(p) for p in expert_parameters(model)}
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            src = ref_params[n]
            if id(p) in experts:
                src = src[ep_rank * p.shape[0] : (ep_rank + 1) * p.shape[0]]
            p.copy_(src)


def global_batch(step: int, world: int):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world * ROWS, SEQ, D, generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def blocks_loss(run, x, g):
    """The mean over rows of a per-row loss (the global mean is the mean of equal ranks' means)."""
    return (run(x) * g).flatten(1).sum(1).mean()


def local(t, rank: int, rows: int = ROWS):
    return t[rank * rows : (rank + 1) * rows]


def reference_steps(ref, world: int, steps: int = 2, batch_fn=None, loss_fn=blocks_loss):
    """Per step: (each rank's loss on its rows, gradients, parameters after the step), one process
    with all experts on the global batch ``batch_fn(step, world)`` (a tuple of [world*rows, ...])."""
    batch_fn = batch_fn or global_batch
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    out = []
    for step in range(steps):
        inputs = batch_fn(step, world)
        opt.zero_grad(set_to_none=True)
        rows = inputs[0].shape[0] // world
        with torch.no_grad():
            losses = [loss_fn(ref, *(local(t, r, rows) for t in inputs)) for r in range(world)]
        loss_fn(ref, *inputs).backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        out.append((losses, grads, {n: p.detach().clone() for n, p in ref.named_parameters()}))
    return out


def compare(model, expected, rank: int, ep_rank: int, loss, what: str, *, grads=None, params=None) -> None:
    """The local loss, gradients (``grads``: name -> tensor, default ``.grad``) and parameters equal
    the reference's (experts: this ep rank's slice)."""
    losses, ref_grads, ref_params = expected
    assert_close(f"{what} loss", loss.detach().reshape(1), losses[rank].reshape(1))
    experts = {id(p) for p in expert_parameters(model)}
    named = list(model.named_parameters())
    assert {n for n, _ in named} == set(ref_grads), what
    for n, p in named:
        got_g = grads[n] if grads is not None else p.grad
        got_p = params[n] if params is not None else p.detach()
        ref_g, ref_p = ref_grads[n], ref_params[n]
        if id(p) in experts:
            k = got_p.shape[0]
            ref_g, ref_p = ref_g[ep_rank * k : (ep_rank + 1) * k], ref_p[ep_rank * k : (ep_rank + 1) * k]
        assert got_g is not None, f"{what}: grad of {n} is None"
        assert_close(f"{what} grad {n}", got_g, ref_g)
        assert_close(f"{what} param {n}", got_p, ref_p)


def runner(model, chunks: int, defer_wgrad: bool):
    if chunks == 1 and not defer_wgrad:
        return model
    return lancet_rt.Overlapped(model, chunks=chunks, defer_wgrad=defer_wgrad)


CELLS = [(1, False), (1, True), (2, False), (2, True)]  # (chunks, defer_wgrad)


def full(model):
    """(gradients, parameters) of an FSDP2 model as whole tensors (a collective: every rank calls it)."""
    grads = {n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()}
    return grads, {n: p.detach().full_tensor() for n, p in model.named_parameters()}
