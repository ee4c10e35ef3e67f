"""Shared test utilities: one comparison helper and one tolerance table."""

from __future__ import annotations

import os

import torch

# Relative RMS error allowed per dtype of the result under test, against a reference computed in
# float64 (or in a wider dtype). ``floor`` is the RMS below which a reference counts as zero, so an
# all-zero gradient is compared absolutely. One table, no per-test magic.
TOLERANCES = {
    torch.float64: dict(rel_rms=1e-10, floor=1e-12),
    torch.float32: dict(rel_rms=1e-5, floor=1e-7),
    torch.bfloat16: dict(rel_rms=1e-2, floor=1e-3),
    torch.float16: dict(rel_rms=2e-3, floor=1e-4),
}


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype=None, *, rel_rms=None):
    """Compare ``actual`` with ``expected``: relative RMS error within the tolerance of ``dtype``.

    Reports name, max abs error and relative RMS error. Fails on a shape mismatch and on any NaN in
    ``actual``. ``dtype`` (default ``actual.dtype``) picks the row of :data:`TOLERANCES`.
    """
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    tol = TOLERANCES[dtype or actual.dtype]
    rel_rms = tol["rel_rms"] if rel_rms is None else rel_rms
    if actual.numel() == 0:
        return
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    diff = a - e
    max_abs = diff.abs().max().item()
    rms = diff.pow(2).mean().sqrt().item()
    ref_rms = e.pow(2).mean().sqrt().item()
    rel = rms / max(ref_rms, tol["floor"])
    assert rel <= rel_rms, (
        f"{name}: rel RMS err {rel:.3e} > {rel_rms:.1e} (max abs err {max_abs:.3e}, ref RMS {ref_rms:.3e})"
    )


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer filled with NaN (or -1 for integers) so unwritten elements fail."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, -1)


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def run_and_grad(model, runner, inputs: tuple, kwargs: dict, g):
    """Run ``runner`` on ``inputs`` and backward ``g``; returns the output, the input's and the parameters'
    gradients, and each MoE layer's aux loss, z-loss and drop count."""
    x = inputs[0].clone().requires_grad_(True)
    y = runner(x, *inputs[1:], **kwargs)
    y.backward(g)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads, [(m.aux_loss, m.z_loss, m.dropped) for m in model.moe_layers()]


def assert_same_run(ref, got, what=""):
    """``run_and_grad``'s results equal, term by term."""
    assert_close(f"{what}y", got[0], ref[0])
    assert_close(f"{what}grad x", got[1], ref[1])
    assert ref[2].keys() == got[2].keys()
    for n in ref[2]:
        assert_close(f"{what}grad {n}", got[2][n], ref[2][n])
    for (a0, z0, d0), (a1, z1, d1) in zip(ref[3], got[3]):
        assert_close(f"{what}aux", a1.reshape(1), a0.reshape(1))
        assert_close(f"{what}z", z1.reshape(1), z0.reshape(1))
        assert d0 == d1, (d0, d1)
