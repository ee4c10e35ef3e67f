"""``lancet_rt.warmup``: compile and tune every kernel shape a step will use, before its first collective.

A cold step compiles and autotunes its Triton kernels as it meets them: on an H100 a few keys
times a dozen configs, each compile taking seconds (bench/results/HISTORY.md), between two
collectives, so a peer waits in the next all-to-all (and the watchdog, ``LANCET_TIMEOUT_S``, can end
the step). Worse, the grouped GEMMs' autotune key holds a power-of-two bucket of the mean rows per
expert, and the rows a rank receives depend on the other ranks' routing:
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

Without a call, the first step warms itself (:func:`before_step` for :class:`lancet_rt.Overlapped`,
:func:`before_collectives` for a layer run outside one): on the Triton path, for layers with peers
(a process group, not an emulated link), once per layer, compute dtype and grad mode, inside the
step's own autocast and before the layers' first collective. It issues no collective (it warms every
row bucket, 16 to 4096 mean rows per expert, instead of agreeing on a range), and every rank does it
at the same point of the same step, so peers wait only for the spread of one warm-up, not for one
rank's compiles. It is logged on the ``lancet_rt`` logger. An explicit :func:`warmup` marks what it
warmed, and the first step then warms nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
import weakref
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lancet_rt import env as _env
from lancet_rt import ops as _ops
from lancet_rt.comm.emulated import EmulatedGroup
from lancet_rt.moe.experts import expert_rows, kernel_views, triton_gemms, weight_gradients
from lancet_rt.moe.layer import MoE

log = logging.getLogger("lancet_rt")

#: The grouped GEMMs' autotune buckets of mean rows per expert (kernels.grouped_gemm._m_bucket).
_BUCKETS = tuple(2**b for b in range(4, 13))
#: Per layer, the (compute dtype, grad mode) pairs whose kernels a warm-up compiled and tuned.
_warm: "weakref.WeakKeyDictionary[MoE, set]" = weakref.WeakKeyDictionary()


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
    overlapped = _is_overlapped(model)
    inner = model.model if overlapped else model
    if chunks is None:
        chunks = model.chunks if overlapped and isinstance(model.chunks, int) else 1
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    layers = [m for m in inner.modules() if isinstance(m, MoE)]
    device = _device(args, kwargs)
    t0 = time.perf_counter()
    keys = [_key(m, device) for m in layers]  # (before the step: the dtype and grad mode it runs in)
    with _ops.on_device(device):
        tokens = _agreed_tokens(layers, args, kwargs)
        _warm_step(_runner(model, inner, chunks), model, inner, layers, args, kwargs)
        buckets = _warm_buckets(layers, device, tokens)
    for m, key in zip(layers, keys):
        _warm.setdefault(m, set()).add(key)
    return dict(layers=len(layers), chunks=chunks, buckets=buckets, seconds=time.perf_counter() - t0)


def before_step(overlapped, layers: list, args: tuple, kwargs: dict) -> None:
    """What :class:`lancet_rt.Overlapped` runs at the start of every step (a forward, or ``accumulate``),
    before its layers' first collective: :func:`check_connections`, then, on the step that first runs a
    layer cold, the warm-up of the whole model (the first-step warm-up of the module docstring).

    Args:
        overlapped: the :class:`lancet_rt.Overlapped` (run only by the warm-up of a cold first step).
        layers: its MoE layers.
        args, kwargs: the step's inputs (those of its first microbatch under ``accumulate``).
    """
    peers = [m for m in layers if _has_peers(m)]
    device = _first_device(args, kwargs) if peers else None
    if device is None:
        return
    check_connections(device)
    if _ops.implementation(device) != "triton":
        return
    cold = [m for m in peers if _key(m, device) not in _warm.get(m, ())]
    if not cold:
        return
    chunks = overlapped.chunks if isinstance(overlapped.chunks, int) else 1
    _warm_first_step(
        _runner(overlapped, overlapped.model, chunks),
        overlapped,
        overlapped.model,
        device,
        args,
        kwargs,
        f"Overlapped at {chunks} chunk(s)",
    )


def before_collectives(layer: MoE, x: torch.Tensor) -> Optional[Exception]:
    """Installed as :attr:`lancet_rt.MoE.before_collectives`: an expert-parallel layer run outside
    :class:`lancet_rt.Overlapped` warms itself (its own forward and backward on a detached copy of
    ``x``, then its grouped GEMMs at every bucket) on its first forward per compute dtype and grad mode.

    Args:
        layer: the layer, about to issue its first collective of this forward.
        x: its input (only its shape, dtype and device are used).

    Returns:
        None, or the exception the warm-up raised (the layer raises it on every rank, as a rejected input).
    """
    if (
        not _has_peers(layer)
        or _ops.implementation(x.device) != "triton"
        or _key(layer, x.device) in _warm.get(layer, ())
    ):
        return None
    copy = x.detach().requires_grad_(x.requires_grad)
    try:
        _warm_first_step(layer.forward_eager, layer, layer, x.device, (copy,), {}, f"layer {layer.trace_name!r}")
    except Exception as exc:  # handed to the layer, which raises it on every rank
        return exc
    return None


def check_connections(device: torch.device) -> None:
    """On CUDA, ``CUDA_DEVICE_MAX_CONNECTIONS`` as the overlap needs it: unset (CUDA's 8) or >= 2.

    At 1 all streams share one hardware queue in launch order: a side stream's wait (the counts'
    copy, a collective's completion) holds back every kernel launched after it, so the step stays
    correct but nothing is hidden: a RuntimeWarning says so. A value CUDA cannot read is a ValueError.

    Args:
        device: the step's device (nothing is checked off CUDA).
    """
    if device.type != "cuda":
        return
    connections = _env.cuda_device_max_connections()
    if connections == 1:
        warnings.warn(
            f"{_env.CUDA_DEVICE_MAX_CONNECTIONS}=1: every CUDA stream of this process shares one hardware queue, so "
            f"each wait of a side stream (the counts' copy, a collective) blocks all compute launched after it and "
            f"Overlapped hides no communication. Unset {_env.CUDA_DEVICE_MAX_CONNECTIONS} (CUDA's default, 8) for "
            f"lancet-rt ranks; Megatron sets it to 1 for its tensor-parallel overlap, which lancet-rt does not use.",
            RuntimeWarning,
            stacklevel=3,
        )


MoE.before_collectives = before_collectives


def _is_overlapped(obj) -> bool:
    # Overlapped by its interface: schedule.overlap imports this module, not the other way.
    return all(callable(getattr(obj, name, None)) for name in ("forward_chunked", "moe_layers")) and isinstance(
        getattr(obj, "model", None), nn.Module
    )


def _runner(model, inner, chunks: int) -> Callable:
    """The step's forward: the Overlapped's at ``chunks`` chunks, else the model's."""
    if _is_overlapped(model):
        return lambda *a, **k: model.forward_chunked(chunks, a, k)
    return inner


def _has_peers(m: MoE) -> bool:
    """The layer exchanges with other processes (a process group, not a local emulated link)."""
    return m.group is not None and m.ep_size > 1 and not isinstance(m.group, EmulatedGroup)


def _key(m: MoE, device: torch.device) -> tuple:
    """What a warm-up of ``m`` depends on beyond its shapes: the compute dtype (autocast's, else the
    experts') and whether the step runs a backward."""
    dtype = (
        torch.get_autocast_dtype(device.type)
        if torch.is_autocast_enabled(device.type)
        else m.experts.gate_up_proj.dtype
    )
    return dtype, torch.is_grad_enabled()


def _first_device(args, kwargs) -> Optional[torch.device]:
    return next((v.device for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)), None)


def _warm_first_step(run: Callable, runner, inner: nn.Module, device, args, kwargs, what: str) -> None:
    """The first-step warm-up: the step against local stand-ins, then every bucket (none under the
    interpreter, which tunes nothing); no collective. Logged."""
    layers = [m for m in inner.modules() if isinstance(m, MoE)]
    keys = [_key(m, device) for m in layers]
    t0 = time.perf_counter()
    _warm_step(run, runner, inner, layers, args, kwargs)
    buckets = _warm_buckets(layers, device, 0 if _env.triton_interpret() else None)
    for m, key in zip(layers, keys):
        _warm.setdefault(m, set()).add(key)
    dtype, grad = keys[0]
    log.info(
        "lancet_rt: first-step warm-up of %s: %d MoE layer(s), %s%s, %d bucket launch(es), %.1f s "
        "(lancet_rt.warmup before the first step does it ahead)",
        what,
        len(layers),
        dtype,
        " with backward" if grad else " forward only",
        len(buckets),
        time.perf_counter() - t0,
    )


def _warm_step(run: Callable, runner, inner: nn.Module, layers: list, args, kwargs) -> None:
    """One step of ``run`` with every layer's group replaced by a local stand-in; leaves no trace."""
    device = _device(args, kwargs)
    with _restored(runner, inner, layers, (args, kwargs)):
        for m in layers:
            if m.group is not None:
                m.group = EmulatedGroup(m.ep_size, float("inf"), 0.0, device=device)
                m._config_checked = True
        _step(run, args, kwargs)


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
    state = [m.step_state() for m in layers]
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
            m.restore_step_state(saved)
        if checked is not None:
            runner._checked = checked
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])


def _step(run: Callable, args, kwargs) -> None:
    """One forward of ``run`` and, where its outputs need gradients, its backward."""
    out = run(*args, **kwargs)
    losses = [t.float().sum() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if losses:
        torch.stack(losses).sum().backward()


def _warm_buckets(layers: list, device: torch.device, tokens: Optional[int]) -> list:
    """Launch each layer's grouped GEMMs (forward, dX, dW) at every row bucket a step can reach.

    Only on the Triton path (the references tune nothing). A bucket is the mean rows per local
    expert; the most a rank can receive is every token of the group, ``tokens x top_k x W``
    (``tokens`` None: every bucket; 0: none).
    """
    warmed = []
    for m in layers:
        dtype = _key(m, device)[0]
        ops = _ops.get_ops(device, dtype)
        if ops.name != "triton" or "grouped_gemm" in ops.reference_families:
            continue
        L = m.num_local_experts
        if tokens is None:
            most = 2 * _BUCKETS[-1]
        else:
            most = max(1, tokens * m.top_k * m.ep_size // L) if tokens else 0
        for b in (b for b in _BUCKETS if b // 2 < most):
            _launch_experts(m, ops, b * L, dtype, device)
            warmed.append((m.trace_name, b))
    return warmed


def _launch_experts(m: MoE, ops, rows: int, dtype, device) -> None:
    """The experts' grouped GEMMs on ``rows`` zero rows spread evenly over the local experts, as a step
    launches them (:mod:`lancet_rt.moe.experts`' own functions, with the same variants): the forward,
    dH with the activation's gradient in its epilogue, dX, and the two dW (one launch on the Triton
    GEMMs: the dW pair), writing and (the chunks' sum of dW, without biases) adding; with an expert-parallel
    group of several local experts through a row map (received rows, read and written through it)."""
    e = m.experts
    L, D = m.num_local_experts, m.d_model
    off = torch.arange(L + 1, device=device) * (rows // L)
    spec = e._spec
    w_E2FD, w_EDF = kernel_views(e.gate_up_proj.detach().to(dtype), e.down_proj.detach().to(dtype), spec.gpt_oss)
    b_gu, b_dn = (None if b is None else b.detach().to(dtype) for b in (e.gate_up_proj_bias, e.down_proj_bias))
    row_map = torch.arange(rows, device=device) if m.dispatcher.regroups_rows and triton_gemms(ops) else None
    x = torch.zeros(rows, D, device=device, dtype=dtype)
    y, h, gu = expert_rows(ops, spec, x, w_E2FD, w_EDF, off, b_gu, b_dn, row_map)
    dy = {} if row_map is None else dict(dy_rows=row_map)
    dgu = ops.grouped_mm_dx(y, w_EDF, off, gu_R2F=gu, **spec.act(), **dy)
    ops.grouped_mm_dx(dgu, w_E2FD, off, **({} if row_map is None else dict(out_rows=row_map)))
    dw = weight_gradients(ops, spec.gpt_oss, x, h, dgu, y, off, (True, True, False, False), row_map)
    if triton_gemms(ops) and b_gu is None and b_dn is None:  # the chunks after the first add into the sum
        weight_gradients(ops, spec.gpt_oss, x, h, dgu, y, off, (True, True, False, False), row_map, into=dw[:2])
