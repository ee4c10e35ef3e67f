"""``lancet_rt.warmup``: compile and tune every kernel shape a step will use, before its first collective.

A cold step compiles and autotunes its Triton kernels as it meets them: on an H100 about 6 keys x
12-14 configs x 5-10 s of compiles, between two collectives, so a peer waits in the next all-to-all
(and a 300 s watchdog can end the step). Worse, the grouped GEMMs' autotune key holds a power-of-two
bucket of the mean rows per expert, and the rows a rank receives depend on the other ranks' routing:
in steady state one rank crosses into a new bucket alone and re-tunes while its peers wait.

:func:`warmup` runs the step once with every expert-parallel group replaced by a local stand-in that
models the same number of ranks (:class:`~lancet_rt.comm.emulated.EmulatedGroup`: no collective
starts), so every kernel of the forward and the backward, at the chunk count the step will use, is
compiled and tuned here; then it launches the grouped GEMMs at every row bucket a step can reach
(up to every token of the whole group routed to one rank's experts). The step leaves no trace: the
gradients are set aside before it (its backward writes fresh ones, never into a ``.grad`` the
caller holds: None, zeros or a partial sum of accumulated microbatches) and put back after; every
buffer (a BatchNorm's statistics and counter, the router's expert bias), each module's train/eval
flag, the layers' statistics and configuration check, an Overlapped's separability check and the
RNG states (CPU and CUDA) are restored; parameters and optimizer state are never written. Row counts never
select a compiled variant (the kernels do not specialise on them), so after this no row count a step
meets compiles or tunes anything. The bucket range is agreed across ranks (one all-gather of the
largest token count, the only collective this function issues), so every rank warms the same keys.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lancet_rt import ops as _ops
from lancet_rt.comm.emulated import EmulatedGroup
from lancet_rt.moe.layer import MoE
from lancet_rt.schedule.overlap import Overlapped

#: Layer attributes a step changes and warm-up restores.
_LAYER_STATE = ("group", "_config_checked", "aux_loss", "z_loss", "tokens_per_expert", "_dropped", "expert_load",
                "shadowed")
#: The grouped GEMMs' autotune buckets of mean rows per expert (kernels.grouped_gemm._m_bucket).
_BUCKETS = tuple(2 ** b for b in range(4, 13))


def warmup(model: nn.Module, *args, chunks: Optional[int] = None, **kwargs) -> dict:
    """Compile and tune the kernels of one training step of ``model`` on inputs like ``args``.

    Call it on every rank before the first step (it issues one all-gather per expert-parallel group).

    Args:
        model: the model, or the :class:`lancet_rt.Overlapped` that runs it (its chunk count is used).
        *args, **kwargs: example inputs of one step (the step's shapes; values need not be real).
        chunks: the chunk count to warm (default: the Overlapped's, if an int; else 1).

    Returns:
        ``dict(layers=, chunks=, buckets=, seconds=)``: what was warmed.
    """
    runner = model
    inner = model.model if isinstance(model, Overlapped) else model
    if chunks is None:
        chunks = model.chunks if isinstance(model, Overlapped) and isinstance(model.chunks, int) else 1
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    layers = [m for m in inner.modules() if isinstance(m, MoE)]
    t0 = time.perf_counter()
    tokens = _agreed_tokens(layers, args, kwargs)
    with _restored(runner, inner, layers, (args, kwargs)):
        for m in layers:
            if m.group is not None:
                m.group = EmulatedGroup(m.ep_size, float("inf"), 0.0, device=_device(args, kwargs))
                m._config_checked = True
        _step(runner, inner, chunks, args, kwargs)
    buckets = _warm_buckets(layers, tokens, _device(args, kwargs))
    return dict(layers=len(layers), chunks=chunks, buckets=buckets, seconds=time.perf_counter() - t0)


def _device(args, kwargs) -> torch.device:
    for v in pytree.tree_leaves((args, kwargs)):
        if isinstance(v, torch.Tensor):
            return v.device
    raise ValueError("warmup needs at least one tensor input (the step's example inputs)")


def _agreed_tokens(layers: list, args, kwargs) -> int:
    """The largest token count of any rank's step: hidden states [..., d_model] count numel / d_model,
    token ids and masks [B, S] their numel."""
    leaves = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not leaves:
        raise ValueError("warmup needs at least one tensor input (the step's example inputs)")
    D = layers[0].d_model if layers else 0
    mine = max(v.numel() // D if v.dim() > 2 and v.shape[-1] == D else v.numel() for v in leaves)
    most = mine
    for group in {id(m.group): m.group for m in layers if m.group is not None}.values():
        most = max(most, int(group.all_gather(torch.tensor([mine], dtype=torch.int64)).max()))
    return most


@contextlib.contextmanager
def _restored(runner, model: nn.Module, layers: list, inputs):
    """Undo what one step changes: gradients, buffers, train/eval flags, the layers' state, the RNG states.

    The gradients of the parameters (and of input leaves that require one) are set aside and the
    step starts from None, so its backward allocates its own instead of adding into the caller's; the
    caller's tensors are put back, untouched. Buffers are copied back in place (their tensors stay the
    ones the caller, an optimizer or a hook holds).
    """
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad]
    grads = {id(t): (t, t.grad) for t in [*model.parameters(), *leaves]}
    buffers = [(m, name, b, b.clone()) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    training = [(m, m.training) for m in model.modules()]
    state = [{k: m.__dict__[k] for k in _LAYER_STATE if k in m.__dict__} for m in layers]
    checked = runner.__dict__.get("_checked")
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None)
    for t, _ in grads.values():
        t.grad = None
    try:
        yield
    finally:
        for t, g in grads.values():
            t.grad = g
        with torch.no_grad():
            for m, name, b, saved in buffers:
                m._buffers[name] = b
                b.copy_(saved)
        for m, flag in training:
            m.training = flag
        for m, saved in zip(layers, state):
            m.__dict__.update(saved)
        if checked is not None:
            runner._checked = checked
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])


def _step(runner, inner, chunks: int, args, kwargs) -> None:
    """One forward and backward, at ``chunks`` chunks when ``runner`` is an Overlapped."""
    if isinstance(runner, Overlapped):
        out = runner.forward_chunked(chunks, args, kwargs)
    else:
        out = inner(*args, **kwargs)
    losses = [t.float().sum() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if losses:
        torch.stack(losses).sum().backward()


def _warm_buckets(layers: list, tokens: int, device: torch.device) -> list:
    """Launch each layer's grouped GEMMs (forward, dX, dW) at every row bucket a step can reach.

    Only on the Triton path (the references tune nothing). A bucket is the mean rows per local
    expert; the most a rank can receive is every token of the group, ``tokens x top_k x W``.
    """
    warmed = []
    for m in layers:
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) \
            else m.experts.gate_up_proj.dtype
        ops = _ops.get_ops(device, dtype)
        if ops.name != "triton" or "grouped_gemm" in ops.reference_families:
            continue
        L = m.num_local_experts
        most = max(1, tokens * m.top_k * m.ep_size // L)
        for b in (b for b in _BUCKETS if b // 2 < most):
            _launch_experts(m, ops, b * L, dtype, device)
            warmed.append((m.trace_name, b))
    return warmed


def _launch_experts(m: MoE, ops, rows: int, dtype, device) -> None:
    """The experts' four grouped GEMMs on ``rows`` zero rows spread evenly over the local experts."""
    e = m.experts
    L, D = m.num_local_experts, m.d_model
    off = torch.arange(L + 1, device=device) * (rows // L)
    w_gu = e.gate_up_proj.detach().to(dtype)
    w_dn = e.down_proj.detach().to(dtype)
    w_E2FD = w_gu.transpose(1, 2) if e.layout == "gpt_oss" else w_gu
    w_EDF = w_dn.transpose(1, 2) if e.layout == "gpt_oss" else w_dn
    b_gu, b_dn = (None if b is None else b.detach().to(dtype) for b in (e.gate_up_proj_bias, e.down_proj_bias))
    x = torch.zeros(rows, D, device=device, dtype=dtype)
    h, gu = ops.gate_up_swiglu(x, w_E2FD, off, b_gu, **e._spec.act())
    y = ops.grouped_mm(h, w_EDF, off, b_dn)
    ops.grouped_mm_dx(y, w_EDF, off)
    ops.grouped_mm_dx(gu, w_E2FD, off)
    if e.layout == "gpt_oss":  # (its dW GEMMs take their operands swapped: lancet_rt.moe.experts)
        ops.grouped_mm_dw(x, gu, off)
        ops.grouped_mm_dw(h, y, off)
    else:
        ops.grouped_mm_dw(gu, x, off)
        ops.grouped_mm_dw(y, h, off)
