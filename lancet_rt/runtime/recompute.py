"""Activation checkpointing of regions that hold lancet MoE layers.

``torch.utils.checkpoint`` (non-reentrant) runs a region's forward again in backward to rebuild the
tensors it saved. A lancet MoE layer inside the region cannot simply run again: under
:class:`lancet_rt.Overlapped` its routing depends on the chunks before it (carried capacity, whole-batch
token count), and a rerun on its own would route the chunk as a batch of its own, with other drops.
:func:`checkpoint_context` is the ``context_fn`` that makes the rerun exact: the forward records, for
each MoE call in the region, the routing state it started from (and the deferred-dW queue in force);
the recomputation replays them in the same order. The replayed layer issues the same collectives as
the forward (counts, dispatch, combine), in the same order on every rank, since every rank recomputes
the same regions in the autograd engine's deterministic order; it records no statistics.

Where the state lives: the log being recorded or replayed now is the step context's
(``scope.CHUNK.recording`` / ``scope.CHUNK.replaying``, per chunk: each greenlet has its own); the
log itself, and the deferred-dW queue in force in the region's forward, belong to one checkpointed
region and live in its two context objects, which ``torch.utils.checkpoint`` keeps with the region's
saved tensors: they die with that part of the autograd graph.

A MoE layer recomputed without this context (the reentrant checkpoint, or ``context_fn`` left out)
raises a RuntimeError that says what to pass, instead of routing differently.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils.checkpoint

from lancet_rt.runtime import scope as _scope
from lancet_rt.runtime import wgrad as _wgrad


@dataclass
class Snapshot:
    """Where one MoE call's routing started: the carried state before its chunk's gating."""

    total_tokens: int
    routed_tokens: int
    used_E: torch.Tensor
    kept_E: torch.Tensor


class _Recording:
    def __init__(self, log: list, queues: list):
        self._log, self._queues = log, queues

    def __enter__(self):
        self._queues.append(_wgrad.current())
        self._token = _scope.CHUNK.recording.set(self._log)

    def __exit__(self, *exc):
        _scope.CHUNK.recording.reset(self._token)


class _Replaying:
    def __init__(self, log: list, queues: list):
        self._log, self._queues = log, queues

    def __enter__(self):
        self._token = _scope.CHUNK.replaying.set(deque(self._log))
        # The rerun must take the code paths the forward took (deferred dW or not), so that it saves
        # the same tensors: the queue in force then is in force now.
        self._prev_queue = _wgrad.set_current(self._queues[0] if self._queues else None)

    def __exit__(self, *exc):
        _wgrad.set_current(self._prev_queue)
        _scope.CHUNK.replaying.reset(self._token)


def checkpoint_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` around
    regions holding lancet MoE layers: returns (forward context, recomputation context)."""
    log: list = []
    queues: list = []
    return _Recording(log, queues), _Replaying(log, queues)


def checkpoint(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` (non-reentrant) with :func:`checkpoint_context`.

    Args:
        function: the region to checkpoint, e.g. a decoder layer.
        *args, **kwargs: passed to ``function`` (``use_reentrant`` and ``context_fn`` are set here).
    """
    for name in ("use_reentrant", "context_fn"):
        if name in kwargs:
            raise TypeError(f"lancet_rt.checkpoint sets {name} itself")
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=checkpoint_context, **kwargs
    )


def recording() -> bool:
    """Whether a checkpointed region's forward is recording MoE calls now."""
    return _scope.CHUNK.recording.get() is not None


def record(snapshot: Snapshot) -> None:
    """Called by a MoE layer before its gating: keep its starting state if a region records."""
    log = _scope.CHUNK.recording.get()
    if log is not None:
        log.append(snapshot)


def replayed() -> Optional[Snapshot]:
    """The starting state to replay for the MoE call being recomputed, or None outside a rerun.

    Raises RuntimeError when the call is a recomputation in backward that no context replays.
    """
    pending = _scope.CHUNK.replaying.get()
    if pending is not None:
        if not pending:
            raise RuntimeError(
                "lancet_rt: a checkpointed region called more MoE layers when recomputed "
                "than in its forward; the region must be deterministic"
            )
        return pending.popleft()
    if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            "lancet_rt: a MoE layer is being recomputed in backward (activation checkpointing) without "
            "lancet's replay, which would route its chunk differently. Checkpoint with "
            "torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, "
            "context_fn=lancet_rt.checkpoint_context), or lancet_rt.checkpoint(fn, ...); with Hugging Face "
            "models, lancet_rt.from_hf does this for activation_checkpointing_enable() (use_reentrant=False). "
            "The reentrant checkpoint is not supported around MoE layers."
        )
    return None
