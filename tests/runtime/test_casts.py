"""Weight casts once per chunked forward (lancet_rt.runtime.casts): under autocast with float32
parameters, a 4-chunk step saves no more for backward than the unchunked step (each chunk used to
save its own bfloat16 copy of the expert and deferred-linear weights), and its gradients are those of
the unchunked step."""

from __future__ import annotations

import copy

import pytest
import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from lancet_rt.runtime import casts
from lancet_rt.runtime import scope as _scope
from tests.helpers import assert_close


def _saved_bytes(fn, exclude: set) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs, ``exclude``'s left out."""
    seen: set = set()

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen.add((s.data_ptr(), s.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(n for _, n in seen), out


def _model(E=8, D=64, F=256):
    link = lancet_rt.EmulatedGroup(2, float("inf"), 0.0)
    torch.manual_seed(0)
    return MoEBlocks(2, D, 4, dict(d_ffn=F, num_experts=E, top_k=2, ep_group=link, aux_loss_coef=0.0))


@pytest.mark.parametrize("defer_wgrad", [False, True])
def test_autocast_chunks_save_one_weight_copy(defer_wgrad):
    model = _model()
    x = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    expert_copy = sum(p.numel() * 2 for n, p in model.named_parameters() if "experts" in n)  # bf16 bytes
    saved, grads = {}, {}
    for n in (1, 4):
        m = copy.deepcopy(model)
        runner = lancet_rt.Overlapped(m, chunks=n, defer_wgrad=defer_wgrad)
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return runner(x)

        saved[n], y = _saved_bytes(step, params)
        y.float().square().mean().backward()
        grads[n] = {k: p.grad for k, p in m.named_parameters()}
    # Each extra chunk's own copy of the experts' weights would add 3 copies: far over the bound.
    assert 3 * expert_copy > 0.10 * saved[1]
    assert saved[4] <= 1.10 * saved[1], f"4 chunks save {saved[4] / saved[1]:.2f}x the unchunked step"
    for k, g in grads[1].items():
        assert g is not None and grads[4][k] is not None, k
        assert g.dtype == torch.float32 and grads[4][k].dtype == torch.float32, k
        assert_close(k, grads[4][k], g, torch.bfloat16)


def test_compute_copy_is_shared_inside_a_scope_and_fresh_after_an_update():
    w = torch.randn(4, 4, requires_grad=True)
    assert casts.compute_copy(w, torch.float32) is not w  # detached, never the parameter
    a, b = casts.compute_copy(w, torch.bfloat16), casts.compute_copy(w, torch.bfloat16)
    assert a is not b  # no scope: a copy per call
    prev = _scope.current()
    _scope.set_current(_scope.ChunkScope([2, 2], switch=lambda: None))
    try:
        a, b = casts.compute_copy(w, torch.bfloat16), casts.compute_copy(w, torch.bfloat16)
        assert a is b and a.dtype == torch.bfloat16 and not a.requires_grad
        with torch.no_grad():
            w.add_(1.0)  # an update bumps the version
        c = casts.compute_copy(w, torch.bfloat16)
        assert c is not a and torch.equal(c, w.detach().to(torch.bfloat16))
    finally:
        _scope.set_current(prev)


def test_compute_copy_in_the_weights_dtype_is_one_detached_alias_per_scope():
    """A weight already in the compute dtype: its detached alias (same storage, no copy), made once
    inside a scope and shared by the chunks; fresh after an in-place update; never the parameter."""
    w = torch.randn(4, 4, requires_grad=True)
    a, b = casts.compute_copy(w, torch.float32), casts.compute_copy(w, torch.float32)
    assert a is not b and a is not w  # no scope: an alias per call
    prev = _scope.current()
    _scope.set_current(_scope.ChunkScope([2, 2], switch=lambda: None))
    try:
        a, b = casts.compute_copy(w, torch.float32), casts.compute_copy(w, torch.float32)
        assert a is b and a is not w and not a.requires_grad and a.grad_fn is None
        assert a.data_ptr() == w.data_ptr() and a.dtype == torch.float32
        with torch.no_grad():
            w.add_(1.0)  # an update bumps the version (shared with the alias)
        c = casts.compute_copy(w, torch.float32)
        assert c is not a and c is not w and torch.equal(c, w.detach())
        assert casts.compute_copy(w, torch.bfloat16) is not c  # another dtype: its own entry
    finally:
        _scope.set_current(prev)
