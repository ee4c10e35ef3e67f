"""Deferred weight gradients: dX now, dW later, inside the backward all-to-alls' windows.

(Filled in by the overlap runtime; with no queue active, nothing is deferred.)
"""
from __future__ import annotations

_active = None


def defer(params, needs, compute, *, flops: int = 0) -> bool:
    """Queue ``compute()`` (returning one gradient per param) if a queue is active."""
    if _active is None:
        return False
    _active.push(params, needs, compute, flops)
    return True


def drain_during(work) -> None:
    """Run deferred weight-gradient work while ``work`` (a collective) is in flight."""
    if _active is not None:
        _active.drain_during(work)
