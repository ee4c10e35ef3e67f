"""DDP-style data parallelism beside expert parallelism: every backward reduces, from gradient hooks.

``torch.nn.parallel.DistributedDataParallel`` cannot hold expert parallelism with public API: its
constructor broadcasts every parameter from rank 0 (one ep rank's experts would overwrite the
others') and it averages every gradient over one group. :func:`replicate` does what DDP does with
the right group per parameter: dense parameters broadcast and averaged over dp x ep, experts over dp
only (never across ep ranks), each expert gradient scaled by 1 / ep as it arrives so that the
result is the gradient of the global mean loss, accumulation across backwards included.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lancet_rt.moe.experts import Experts
from lancet_rt.parallel import mesh as _mesh
from lancet_rt.parallel import supported as _supported
from lancet_rt.parallel.sync import GradientSync, _abort_step, expert_parameters
from lancet_rt.runtime import scope as _scope


class Replicated(GradientSync):
    """The reducer :func:`replicate` installs (``model.lancet_replicated``): a :class:`GradientSync`
    that is active in every backward and averages, so that gradients accumulated over several
    backwards stay right. Its buckets are issued in index order per communicator, whatever the dW
    timing; it finishes in an autograd-engine callback queued behind deferred dW's flush. A backward
    that raised before that finish (and was caught) is found by state, whatever thread ran its hooks
    (on CUDA the engine's device thread): by the next forward that does not run beside it, or by the
    next backward once its graph task is gone; the step is then aborted and the peers told."""

    def __init__(self, model: nn.Module, mesh, bucket_mb: float):
        super().__init__(model, mesh, bucket_mb=bucket_mb)
        self._in_backward = False
        self._graph_task: Optional[weakref.ref] = None  # alive while the backward's graph task is
        ep = self._lay.ep
        self._scaled = []  # experts are scaled on arrival instead (accumulation-safe)
        if ep > 1:
            for p in expert_parameters(model):
                if p.requires_grad:
                    self._handles.append(p.register_hook(lambda g: g / ep))
        self._handles.append(model.register_forward_pre_hook(self._before_forward))

    def _divisor(self, expert: bool) -> int:
        return self._lay.expert_group.size() if expert else self._lay.divisor

    def _ready(self, p: torch.Tensor) -> None:
        if self._in_backward and self._graph_task() is None:
            self._abandon()  # the backward it began ended (raised) before its finish; this is another
        if not self._in_backward:
            self._in_backward = True
            self._start()
            # Queued now, it runs after the callbacks already queued in this backward (deferred dW's
            # flush among them); it queues the finish behind any queued meanwhile. The engine holds it
            # as long as the graph task lives, which a backward that raised does not outlive.
            end = _GraphTaskEnd(self._queue_finish)
            self._graph_task = weakref.ref(end)
            torch.autograd.Variable._execution_engine.queue_callback(end)
            del end  # (a traceback through this frame would keep it alive)
        super()._ready(p)

    def _queue_finish(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._active = self._in_backward = False
        self._finish()

    def _before_forward(self, module, args) -> None:
        # A backward begun and not finished by the time a forward starts raised before its finish,
        # whichever thread ran it (on CUDA the engine's device thread runs the hooks, not this one).
        # Not so for a forward that a backward runs (recomputation: inside a graph task), nor beside
        # one that Overlapped.accumulate parks mid-way on purpose (the forward's scope says so).
        if self._in_backward and torch._C._current_graph_task_id() == -1 and not _scope.beside_active():
            self._abandon()

    def _abandon(self) -> None:
        _abort_step(self._buckets, RuntimeError("a backward raised before its gradient sync finished"))
        self._active = self._in_backward = False


class _GraphTaskEnd:
    """The engine callback that starts the reducer's finish; a weak reference to it tells whether the
    graph task that holds it still exists."""

    def __init__(self, then):
        self.then = then

    def __call__(self) -> None:
        self.then()


@torch.no_grad()
def _broadcast(model: nn.Module, lay: _mesh.Layout) -> None:
    """Dense parameters and buffers from the first rank of dp x ep, experts from the first of dp."""

    expert_tensors = {
        id(t) for m in model.modules() if isinstance(m, Experts) for t in list(m.parameters()) + list(m.buffers())
    }
    for t in list(model.parameters()) + list(model.buffers()):
        expert = id(t) in expert_tensors
        group = lay.expert_group if expert else lay.dense_group
        if expert and group is None:
            continue
        # Through the group's monitor: bounded, a lost peer named; on gloo a header all-gather before
        # each broadcast (once, in replicate) turns a model that differs across ranks into CollectiveMismatch.
        mon, n = _mesh.monitor(group), t.numel()
        mon.issue(
            f"replicate broadcast ({'experts' if expert else 'dense'})",
            lambda: dist.broadcast(t.data, group=group, group_src=0, async_op=True),
            (t.dtype, [n] * mon.size, [n] * mon.size),
        ).wait()


def replicate(model: nn.Module, mesh, *, bucket_mb: float = 25.0) -> nn.Module:
    """Data parallelism (DDP-style) over a ``("dp", "ep")`` mesh whose "ep" group is the MoE layers'.

    Broadcasts the dense parameters and buffers from the mesh's first rank and each expert from the
    first rank of its dp group (experts are never copied across ep ranks), then, in every backward,
    averages dense gradients over dp x ep and expert gradients over dp (each scaled by 1 / ep as it
    arrives): the gradients of the mean loss over the global batch, as one process on the whole
    batch would have them, with deferred dW (``Overlapped(defer_wgrad=True)``) and gradient
    accumulation too. Buckets of up to ``bucket_mb`` are all-reduced during backward in index order
    (the same on every rank).

    Args:
        model: the model, its MoE layers built with ``ep_group=mesh["ep"].get_group()``.
        mesh: a DeviceMesh with dimensions ``("dp", "ep")``.
        bucket_mb: bucket size in MB.

    Returns:
        ``model``, with the reducer at ``model.lancet_replicated`` (:class:`Replicated`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _mesh.check_mesh(mesh)
    _supported.check_layers(model, "lancet_rt.parallel.replicate")
    if getattr(model, "lancet_replicated", None) is not None:
        raise ValueError("model is already replicated (lancet_rt.parallel.replicate)")
    _mesh.check_expert_groups(model, mesh)  # by membership, before anything is broadcast
    lay = _mesh.layout(mesh)
    _broadcast(model, lay)
    reducer = Replicated(model, mesh, bucket_mb)
    try:  # its backwards start inside the autograd engine, no place to wait for the peers: checked once, here
        reducer._check_plan()
    except BaseException:
        reducer.remove()
        raise
    model.lancet_replicated = reducer
    return model
