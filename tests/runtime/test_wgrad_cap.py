"""Deferred dW holds at most ``max_deferred_bytes`` (its items' operands), prices its items in the
dtype they run in, and still gives the gradients of the run without deferral."""

from __future__ import annotations

import math

import pytest
import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from lancet_rt.runtime import wgrad
from tests.helpers import assert_close


def _model():
    link = lancet_rt.EmulatedGroup(2, 0.05, 0.0)  # a slow link: wide windows, items wait in them
    torch.manual_seed(0)
    return MoEBlocks(2, 32, 4, dict(d_ffn=48, num_experts=4, top_k=2, ep_group=link))


def _grads(runner, model, x):
    model.zero_grad(set_to_none=True)
    runner(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cap", ["auto", "small", "zero", "inf"])
def test_deferred_bytes_never_exceed_the_cap(cap, monkeypatch):
    model = _model()
    x = torch.randn(4, 12, 32, generator=torch.Generator().manual_seed(1))
    want = _grads(lancet_rt.Overlapped(model, chunks=2), model, x)
    sizes = []
    push = wgrad.WGradQueue.push
    monkeypatch.setattr(
        wgrad.WGradQueue,
        "push",
        lambda self, *a, **k: sizes.append(a[4] if len(a) > 4 else k["nbytes"]) or push(self, *a, **k),
    )
    bound = {"auto": None, "small": 6000, "zero": 0, "inf": math.inf}[cap]
    runner = lancet_rt.Overlapped(model, chunks=2, defer_wgrad=True, max_deferred_bytes=bound)
    q = runner.wgrad_queue
    for _step in range(2):
        got = _grads(runner, model, x)
        for n, g in want.items():
            assert_close(n, got[n], g)
        assert q.held_bytes == 0 and not q.items  # everything delivered
        limit = {"auto": wgrad.AUTO_CAP_ITEMS * max(sizes), "inf": math.inf}.get(cap, bound)
        assert 0 < max(sizes) and q.peak_held_bytes <= limit, (q.peak_held_bytes, limit)
        if cap in ("small", "zero"):
            assert q.forced > 0  # the bound made items run early
            assert sum(sizes) > bound  # (so it was a real bound)
        if cap == "zero":
            assert q.peak_held_bytes == 0 and q.flushed == 0 and q.ran_in_windows == 0
        if cap == "inf":
            assert q.forced == 0
        sizes.clear()


def test_items_are_priced_in_the_dtype_they_run_in(monkeypatch):
    """Under autocast with float32 parameters, the items' GEMMs run in bfloat16: that is their dtype
    (on CUDA the rate they are priced at is timed in it; the parameter's float32 is 10x slower)."""
    model = _model()
    runner = lancet_rt.Overlapped(model, chunks=2, defer_wgrad=True)
    dtypes = []
    push = wgrad.WGradQueue.push
    monkeypatch.setattr(
        wgrad.WGradQueue,
        "push",
        lambda self, *a, **k: dtypes.append(a[5] if len(a) > 5 else k["dtype"]) or push(self, *a, **k),
    )
    x = torch.randn(4, 12, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = runner(x)
    y.float().square().mean().backward()
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("bad", [-1, "1GB", True, float("nan")])
def test_bad_cap_is_refused(bad):
    with pytest.raises(ValueError, match="max_deferred_bytes"):
        lancet_rt.Overlapped(_model(), chunks=2, defer_wgrad=True, max_deferred_bytes=bad)
