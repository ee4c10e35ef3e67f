"""Overlapped.accumulate where the engine runs the backward on its device thread (CUDA's semantics).

A forward that calls autograd through its MoE layers (a gradient penalty: ``torch.autograd.grad`` of
a loss of the blocks' output with respect to the first block's input) while the previous
microbatch's backward is parked beside it. accumulate first runs the parked backward to its end (it
holds the device thread), then the call runs on the device thread and its all-to-alls' backward
reach ``finish_backward``, which offers the host a turn: it must not, since that call is not the
parked backward (the host waits for the call, the call would wait for the host). The step must end
and equal the same microbatches run sequentially, on the emulated link and on 2 gloo ranks, in both
execution modes (tests/cuda_semantics.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import lancet_rt
from tests import cuda_semantics
from tests.dist import assert_all_ok, run_ranks
from tests.schedule.test_accumulate import D, assert_same_step, ep_model, make_model, microbatches, sequential_reference

STEP_TIMEOUT_S = 120.0


class _GradThroughMoE(torch.nn.Module):
    """Differentiates through its MoE layers inside its forward: the gradient of a loss of the blocks'
    output with respect to the first block's input (``create_graph=False``: a constant) is added to
    the output. ``record`` gets, per call with grad, whether it ran beside a microbatch's backward."""

    def __init__(self, body, record: list):
        super().__init__()
        self.body, self.record = body, record
        self.embed = torch.nn.Linear(D, D)

    def forward(self, x):
        from lancet_rt.runtime import scope

        h = self.embed(x)  # the first block's input
        y = h
        for block in self.body.blocks:
            y = block(y)
        if torch.is_grad_enabled():
            self.record.append(scope.beside_active())
            (g,) = torch.autograd.grad(y.square().sum(), h, retain_graph=True, create_graph=False)
            y = y + 1e-2 * g
        return y

    def moe_layers(self):
        return self.body.moe_layers()


def _step(model, xs, gs, chunks: int, defer_wgrad: bool):
    twin = copy.deepcopy(model)
    ref = sequential_reference(model, xs, gs)
    ov = lancet_rt.Overlapped(twin, chunks=chunks, defer_wgrad=defer_wgrad)
    losses = cuda_semantics.bounded(
        lambda: ov.accumulate(xs, lambda out, i: (out * gs[i]).sum()),
        STEP_TIMEOUT_S,
        "accumulate with autograd through the MoE layers in its forward",
    )
    assert_same_step(ref, twin, losses)
    assert any(twin.record), "some forward's autograd call must have run beside a backward"
    if defer_wgrad:
        assert not ov.wgrad_queue.items


@pytest.mark.parametrize("defer_wgrad", [False, True])
def test_autograd_through_the_moe_layers_from_a_forward_beside_a_parked_backward(execution, defer_wgrad):
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.05, latency_us=200)
    model = _GradThroughMoE(make_model(None, link), [])
    xs, gs = microbatches(3, [6, 5])
    _step(model, xs, gs, 2, defer_wgrad)


def _gloo(rank, world):
    gen = torch.Generator().manual_seed(rank)
    model = _GradThroughMoE(ep_model(None, rank, world), [])
    xs, gs = microbatches(3, [4, 5] if rank else [6, 3], gen)
    _step(model, xs, gs, 2, True)
    return cuda_semantics.active()


def test_autograd_through_the_moe_layers_beside_a_parked_backward_gloo(execution):
    assert assert_all_ok(run_ranks(_gloo, 2, timeout=300)) == [execution != "plain"] * 2
