"""FSDP2 beside expert parallelism: experts sharded over dp, everything else over dp x ep.

torchtitan's recipe on a ``("dp", "ep")`` mesh: each :class:`lancet_rt.Experts` module becomes an
FSDP2 unit over ``mesh["dp"]`` whose reduce-scatter divides by dp x ep (it sums over dp the
gradients of experts that already hold their ep group's tokens), the rest of the model one unit (or
one per block) over the dp x ep ranks, averaged. Both are then the gradients of the global mean loss.

The divide: on NCCL FSDP2 runs it inside the reduce-scatter (``PREMUL_SUM``, or ``AVG``); gloo has
neither, so on gloo the units reduce with ``SUM`` and divide after
(``set_force_sum_reduction_for_comms``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lancet_rt.moe.experts import Experts
from lancet_rt.parallel import fsdp_comm
from lancet_rt.parallel import mesh as _mesh
from lancet_rt.parallel import supported as _supported
from lancet_rt.runtime import wgrad


def _unit_meshes(mesh):
    """(experts' mesh, their shard size, the rest's mesh, its shard size): over dp and over dp x ep,
    or with HSDP over (dp_replicate, dp) and (dp_replicate, dp x ep)."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh.ndim == 2:
        flat = DeviceMesh.from_group(_mesh.flat_group(mesh), mesh.device_type, mesh_dim_names=("dp_ep",))
        return mesh["dp"], mesh.size(0), flat, mesh.size()
    dense = _mesh.derived_mesh(mesh, (0, 1, 2), ("dp_replicate", "dp_ep"))
    return mesh["dp_replicate", "dp"], mesh.size(1), dense, dense.size(1)


class _FlushDeferred(torch.autograd.Function):
    """Identity on an FSDP2 unit's inputs, placed inside FSDP2's own input hook: in backward the
    engine runs it just before the unit's post-backward (FSDP2's reduce-scatter), and it flushes the
    deferred dW queued so far into the parameters' accumulators, so the unit reduces whole
    gradients. When no input takes a gradient (the first block's), a probe leaf keeps it in the
    graph: FSDP2 would reduce that unit in its final callback, which an inner unit's output hook
    may queue ahead of any flush (the cost: that input's gradient is computed)."""

    @staticmethod
    def forward(ctx, queue, probe, *xs):
        ctx.queue = queue
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.queue.flush()
        return (None, None) + grads


_probe = None


def _flush_before_reduce(module, args, kwargs):

    global _probe
    queue = wgrad.current()
    if queue is None or not torch.is_grad_enabled():
        return None
    flat = list(args) + list(kwargs.values())
    at = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    probe = None
    if not at:
        at = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        if not at:  # token ids only (a root): _flush_first_at_the_end flushes before FSDP2's final callback
            return None
        if _probe is None:
            _probe = torch.zeros((), requires_grad=True)
        probe = _probe
    out = _FlushDeferred.apply(queue, probe, *(flat[i] for i in at))
    for i, y in zip(at, out):
        flat[i] = y
    n = len(args)
    return tuple(flat[:n]), dict(zip(kwargs, flat[n:]))


def _flush_first_at_the_end(module, args, output):
    """On the root, before FSDP2's post-forward: a hook on the outputs queues the flush when backward
    reaches them, ahead of FSDP2's final callback (which reduces the units whose inputs took no
    gradient) as long as no inner unit hooked the same tensor first (a root computing its loss
    itself, as transformers' models do; otherwise _FlushDeferred's probe covers the unit)."""
    from torch.utils._pytree import tree_leaves

    queue = wgrad.current()
    if queue is None or not torch.is_grad_enabled():
        return None
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(queue.flush))
    return None


def fully_shard(model: nn.Module, mesh, *, blocks: Optional[Sequence[nn.Module]] = None, **fsdp_kwargs) -> nn.Module:
    """Apply FSDP2 to ``model`` over a ``("dp", "ep")`` mesh, its MoE layers expert-parallel over "ep".

    Every :class:`lancet_rt.Experts` module is sharded over ``mesh["dp"]`` (dim 0: the local experts),
    with a gradient divide factor of dp x ep; each of ``blocks`` (optional: the transformer blocks,
    for per-block all-gathers) and then ``model`` itself over the dp x ep ranks. After ``backward()``
    the sharded gradients are those of the mean loss over the global batch. ``Overlapped(chunks=N)``
    runs on the result, with deferred dW (``defer_wgrad=True``: each unit flushes the dW queued so far
    just before FSDP2 reduce-scatters it, so dW fills the all-to-all windows inside a unit, not
    across units), and ``Overlapped.accumulate(..., interleave=False)``; ``accumulate(interleave=True)``
    is refused when called, on every rank before any collective.

    Every MoE layer's group must be ``mesh["ep"]``'s (the same global ranks in the same order:
    ValueError otherwise, before anything is sharded). FSDP2's all-gathers and reduce-scatters run
    through the process groups' monitors (:mod:`lancet_rt.parallel.fsdp_comm`): bounded by
    ``LANCET_TIMEOUT_S``, and an exception in one rank's forward is a PeerError naming it on every
    peer instead of a wait in FSDP2's collective; the groups are unusable afterwards.

    Args:
        model: the model, its MoE layers built with ``ep_group=mesh["ep"].get_group()``.
        mesh: a DeviceMesh with dimensions ``("dp", "ep")``, or ``("dp_replicate", "dp", "ep")`` for
            HSDP: experts replicated over dp_replicate and sharded over dp, the rest replicated over
            dp_replicate and sharded over dp x ep.
        blocks: submodules to make units of their own (over dp x ep), in order.
        fsdp_kwargs: passed to ``torch.distributed.fsdp.fully_shard`` for every unit (not ``mesh``).

    Returns:
        ``model`` (now an ``FSDPModule``), as ``torch.distributed.fsdp.fully_shard`` returns it.
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _mesh.check_mesh(mesh)
    _supported.check_layers(model, "lancet_rt.parallel.fully_shard", shards=True)
    if "mesh" in fsdp_kwargs:
        raise ValueError("fully_shard: pass the ('dp', 'ep') mesh as the mesh argument, not in fsdp_kwargs")
    _mesh.check_expert_groups(model, mesh)  # by membership, before anything is sharded
    lay = _mesh.layout(mesh)
    gloo = dist.get_backend(lay.dense_group) != "nccl"
    expert_mesh, expert_shards, dense_mesh, dense_shards = _unit_meshes(mesh)
    units = []  # (unit, its shard group's size)
    for m in model.modules():
        if isinstance(m, Experts):
            torch_fully_shard(m, mesh=expert_mesh, **fsdp_kwargs)
            m.set_gradient_divide_factor(float(lay.divisor))
            units.append((m, expert_shards))
    for b in blocks or ():
        units.append((torch_fully_shard(b, mesh=dense_mesh, **fsdp_kwargs), dense_shards))
    units.append((torch_fully_shard(model, mesh=dense_mesh, **fsdp_kwargs), dense_shards))
    if gloo:  # gloo has no PREMUL_SUM or AVG: SUM, then FSDP2 divides
        for u, size in units:
            # Not on one rank: FSDP2 (torch 2.13) then divides by the factor in its copy AND after it.
            u.set_force_sum_reduction_for_comms(size > 1)
    for u, _ in units:  # after FSDP2's input hook (it prepends its own): see _FlushDeferred
        u.register_forward_pre_hook(_flush_before_reduce, with_kwargs=True)
    model.register_forward_hook(_flush_first_at_the_end, prepend=True)
    # FSDP2's collectives through the groups' monitors; a forward that raises tells the peers (fsdp_comm)
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    groups = fsdp_comm.install([(u, names[id(u)]) for u, _ in units], [expert_mesh, dense_mesh])
    model.register_forward_hook(fsdp_comm.break_on_forward_error(groups), always_call=True)
    # Read by Overlapped.accumulate: FSDP2 reshards a unit in its post-backward while the next
    # microbatch's forward (on another thread) uses it.
    model.lancet_interleave_refused = (
        "lancet_rt.parallel.fully_shard (FSDP2) cannot run one microbatch's forward beside the previous one's "
        "backward; use accumulate(..., interleave=False), or replicate / GradientSync"
    )
    return model
