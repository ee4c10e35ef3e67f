"""The MoE layer's compute as torch custom operators, so ``torch.compile(fullgraph=True)`` traces the layer.

Outside :class:`lancet_rt.Overlapped` and without expert parallelism, a compiled ``MoE.forward`` runs
:func:`forward` (``torch.compiler.is_compiling()``); eager calls never come here (the dispatcher of a
custom op costs host time per call). The operators (namespace ``lancet``) wrap the kernel namespace
of :func:`lancet_rt.ops.get_ops` and the gating stage :func:`lancet_rt.routing.functions.gate`, each
with a fake implementation and an autograd formula:

=====================  =====================================================================
moe_gate               logits_TE -> weight_TK, expert_TK, row_TK, kept_E, used_E, score_sum_E,
                       zsq_sum (router scores, top-k, capacity slots, dispatch rows, aux statistics)
moe_gate_bwd           grad of the logits (weights, plus the aux and z losses' gradients)
moe_permute(_bwd)      x_TD -> x_SD [T*K, D], src_S [T*K]: rows grouped by expert
moe_experts(_bwd)      grouped GEMMs + SwiGLU over the rows of each expert segment
moe_unpermute(_bwd)    y_SD -> y_TD, the weighted sum over K
=====================  =====================================================================

The data-dependent size, the S kept rows, stays inside the operators: their [S, ...] tensors are
buffers of T*K rows (every assignment kept: exactly S when dropless), the rows past S zero. With a
capacity factor the operators read S on the host (as eager MoE.forward reads it once per chunk).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lancet_rt import ops as _ops
from lancet_rt.moe.dispatch.base import Chunk, Dispatcher, Exchanged
from lancet_rt.moe.dispatch.common import Route
from lancet_rt.moe.experts import _Spec, expert_rows, kernel_views, triton_gemms, weight_gradients
from lancet_rt.routing.functions import BatchRouting, gate
from lancet_rt.runtime import scope as _scope
from lancet_rt.runtime import wgrad

Tensor = torch.Tensor


def _pad(t: Tensor, rows: int, value: float = 0) -> Tensor:
    """``t`` with rows appended up to ``rows`` (filled with ``value``), or ``t`` itself when full."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0],) + tuple(t.shape[1:]), value)])


# ------------------------------------------------------------------------------------- gating
@torch.library.custom_op("lancet::moe_gate", mutates_args=())
def _moe_gate(
    logits_TE: Tensor,
    expert_bias: Optional[Tensor],
    top_k: int,
    capacity_factor: Optional[float],
    score_fn: str,
    normalize_topk: bool,
    n_group: int,
    topk_group: Optional[int],
    scaling: float,
    aux_coef: float,
    z_coef: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    T, E = logits_TE.shape
    state = BatchRouting(E, top_k, T, capacity_factor, logits_TE.device)
    ops = _ops.get_ops(logits_TE.device, logits_TE.dtype)
    weight_TK, expert_TK, row_TK, kept_E = gate(
        logits_TE,
        state,
        ops,
        score_fn=score_fn,
        normalize_topk=normalize_topk,
        aux_coef=aux_coef,
        z_coef=z_coef,
        expert_bias=expert_bias,
        n_group=n_group,
        topk_group=topk_group,
        scaling=scaling,
    )
    # (the layer's kept_E is int32; the operator keeps its int64 signature)
    return weight_TK, expert_TK, row_TK, kept_E.long(), state.used_E, state.score_sum_E, state.zsq_sum


@_moe_gate.register_fake
def _(
    logits_TE,
    expert_bias,
    top_k,
    capacity_factor,
    score_fn,
    normalize_topk,
    n_group,
    topk_group,
    scaling,
    aux_coef,
    z_coef,
):
    T, E = logits_TE.shape
    i32 = dict(dtype=torch.int32)
    return (
        logits_TE.new_empty(T, top_k),
        logits_TE.new_empty(T, top_k, **i32),
        logits_TE.new_empty(T, top_k, **i32),
        logits_TE.new_empty(E, dtype=torch.int64),
        logits_TE.new_empty(E, **i32),
        logits_TE.new_empty(E),
        logits_TE.new_empty(()),
    )


@torch.library.custom_op("lancet::moe_gate_bwd", mutates_args=())
def _moe_gate_bwd(
    logits_TE: Tensor,
    expert_TK: Tensor,
    grad_weight_TK: Optional[Tensor],
    used_E: Tensor,
    aux_coef: float,
    z_coef: float,
    score_fn: str,
    normalize_topk: bool,
    scaling: float,
) -> Tensor:
    # _Gate.backward's formula for one unchunked batch (T = the logits' rows)
    T, E = logits_TE.shape
    K = expert_TK.shape[1]
    grad_score_sum = grad_zsq = None
    if aux_coef > 0:
        grad_score_sum = (aux_coef * E / max(T, 1)) * (used_E.to(logits_TE.dtype) / (max(T, 1) * K))
    if z_coef > 0:
        grad_zsq = torch.full((), z_coef / max(T, 1), dtype=logits_TE.dtype, device=logits_TE.device)
    ops = _ops.get_ops(logits_TE.device, logits_TE.dtype)
    grad = ops.gating_bwd(
        logits_TE,
        expert_TK,
        grad_weight_TK,
        grad_score_sum,
        grad_zsq,
        score_fn=score_fn,
        normalize_topk=normalize_topk,
        scaling=scaling,
    )
    return grad


@_moe_gate_bwd.register_fake
def _(logits_TE, expert_TK, grad_weight_TK, used_E, aux_coef, z_coef, score_fn, normalize_topk, scaling):
    return torch.empty_like(logits_TE)


def _gate_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1], output[4])
    ctx.args = (inputs[9], inputs[10], inputs[4], inputs[5], inputs[8])  # aux, z, score_fn, normalize, scaling


def _gate_backward(ctx, grad_weight_TK, *_):
    logits_TE, expert_TK, used_E = ctx.saved_tensors
    grad = None if grad_weight_TK is None else grad_weight_TK.contiguous()
    return (_moe_gate_bwd(logits_TE, expert_TK, grad, used_E, *ctx.args),) + (None,) * 10


_moe_gate.register_autograd(_gate_backward, setup_context=_gate_setup)


# ------------------------------------------------------------------------------------- permute
@torch.library.custom_op("lancet::moe_permute", mutates_args=())
def _moe_permute(x_TD: Tensor, row_TK: Tensor, kept_E: Tensor, padded: bool) -> tuple[Tensor, Tensor]:
    T, K = row_TK.shape
    S = int(kept_E.sum()) if padded else T * K  # (dropless: every assignment is kept)
    x_SD, src_S = _ops.get_ops(x_TD.device, x_TD.dtype).permute_fwd(x_TD, row_TK, S)
    return _pad(x_SD, T * K), _pad(src_S, T * K, -1)


@_moe_permute.register_fake
def _(x_TD, row_TK, kept_E, padded):
    R = row_TK.shape[0] * row_TK.shape[1]
    return x_TD.new_empty(R, x_TD.shape[1]), x_TD.new_empty(R, dtype=torch.int32)


@torch.library.custom_op("lancet::moe_permute_bwd", mutates_args=())
def _moe_permute_bwd(grad_x_SD: Tensor, row_TK: Tensor, padded: bool) -> Tensor:
    # (the kept rows only, as the kernels' contract has them: a padded buffer's rows are never read)
    if padded:
        grad_x_SD = grad_x_SD[: int((row_TK >= 0).sum())]
    return _ops.get_ops(grad_x_SD.device, grad_x_SD.dtype).permute_bwd(grad_x_SD.contiguous(), row_TK)


@_moe_permute_bwd.register_fake
def _(grad_x_SD, row_TK, padded):
    return grad_x_SD.new_empty(row_TK.shape[0], grad_x_SD.shape[1])


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.padded = inputs[3]


def _permute_backward(ctx, grad_x_SD, _grad_src):
    (row_TK,) = ctx.saved_tensors
    return _moe_permute_bwd(grad_x_SD, row_TK, ctx.padded), None, None, None


_moe_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


# ------------------------------------------------------------------------------------- unpermute
@torch.library.custom_op("lancet::moe_unpermute", mutates_args=())
def _moe_unpermute(y_SD: Tensor, row_TK: Tensor, weight_TK: Tensor, src_S: Tensor, padded: bool) -> Tensor:
    # (the kept rows only, as the kernels' contract has them: a padded buffer's rows are never read)
    if padded:
        y_SD = y_SD[: int((src_S >= 0).sum())]
    return _ops.get_ops(y_SD.device, y_SD.dtype).unpermute_fwd(y_SD, row_TK, weight_TK)


@_moe_unpermute.register_fake
def _(y_SD, row_TK, weight_TK, src_S, padded):
    return y_SD.new_empty(row_TK.shape[0], y_SD.shape[1])


@torch.library.custom_op("lancet::moe_unpermute_bwd", mutates_args=())
def _moe_unpermute_bwd(
    grad_y_TD: Tensor, y_SD: Tensor, row_TK: Tensor, weight_TK: Tensor, src_S: Tensor, padded: bool
) -> tuple[Tensor, Tensor]:
    R = y_SD.shape[0]
    S = int((src_S >= 0).sum()) if padded else R  # the kept rows (src -1 marks the padding)
    ops = _ops.get_ops(y_SD.device, y_SD.dtype)
    grad_y_SD, grad_w_TK = ops.unpermute_bwd(grad_y_TD.contiguous(), y_SD[:S], row_TK, weight_TK, src_S[:S])
    return _pad(grad_y_SD, R), grad_w_TK


@_moe_unpermute_bwd.register_fake
def _(grad_y_TD, y_SD, row_TK, weight_TK, src_S, padded):
    acc = torch.float64 if weight_TK.dtype == torch.float64 else torch.float32
    return torch.empty_like(y_SD), weight_TK.new_empty(weight_TK.shape, dtype=acc)


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.padded = inputs[4]


def _unpermute_backward(ctx, grad_y_TD):
    y_SD, row_TK, weight_TK, src_S = ctx.saved_tensors
    grad_y_SD, grad_w_TK = _moe_unpermute_bwd(grad_y_TD, y_SD, row_TK, weight_TK, src_S, ctx.padded)
    return grad_y_SD, None, grad_w_TK.to(weight_TK.dtype), None, None


_moe_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# ------------------------------------------------------------------------------------- experts
def _expert_args(x_RD, offsets_E1, w_gate_up, w_down, padded, gpt_oss):
    """(ops, S, segments, w_E2FD, w_EDF): the kernels' namespace, the kept rows, the segment bounds (host
    ints for the references, which read them anyway) and the kernels' weight views (_ExpertsFn's)."""
    ops = _ops.get_ops(x_RD.device, x_RD.dtype)
    bounds = offsets_E1.tolist() if padded or getattr(ops, "host_offsets", False) else None
    S = bounds[-1] if padded else x_RD.shape[0]
    segments = bounds if bounds is not None and getattr(ops, "host_offsets", False) else offsets_E1
    return (ops, S, segments) + kernel_views(w_gate_up, w_down, gpt_oss)


@torch.library.custom_op("lancet::moe_experts", mutates_args=())
def _moe_experts(
    x_RD: Tensor,
    offsets_E1: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    b_gate_up: Optional[Tensor],
    b_down: Optional[Tensor],
    activation: str,
    alpha: float,
    limit: float,
    gpt_oss: bool,
    padded: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    ops, S, segments, w_E2FD, w_EDF = _expert_args(x_RD, offsets_E1, w_gate_up, w_down, padded, gpt_oss)
    spec = _Spec(activation, alpha, limit, gpt_oss)
    y_RD, h_RF, gu_R2F = expert_rows(ops, spec, x_RD[:S], w_E2FD, w_EDF, segments, b_gate_up, b_down)
    R = x_RD.shape[0]
    return _pad(y_RD, R), _pad(gu_R2F, R), _pad(h_RF, R)


@_moe_experts.register_fake
def _(x_RD, offsets_E1, w_gate_up, w_down, b_gate_up, b_down, activation, alpha, limit, gpt_oss, padded):
    R, D = x_RD.shape
    F2 = w_gate_up.shape[2] if gpt_oss else w_gate_up.shape[1]
    return x_RD.new_empty(R, D), x_RD.new_empty(R, F2), x_RD.new_empty(R, F2 // 2)


@torch.library.custom_op("lancet::moe_experts_bwd", mutates_args=())
def _moe_experts_bwd(
    dy_RD: Tensor,
    x_RD: Tensor,
    gu_R2F: Tensor,
    h_RF: Tensor,
    offsets_E1: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str,
    alpha: float,
    limit: float,
    gpt_oss: bool,
    padded: bool,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # _ExpertsFn._backward's formulas (the weight gradients: the same function); a gradient not needed is an
    # empty tensor
    ops, S, seg, w_E2FD, w_EDF = _expert_args(x_RD, offsets_E1, w_gate_up, w_down, padded, gpt_oss)
    R = x_RD.shape[0]
    dy_RD, x_RD, gu_R2F, h_RF = dy_RD[:S].contiguous(), x_RD[:S], gu_R2F[:S], h_RF[:S]
    act = _Spec(activation, alpha, limit, gpt_oss).act()
    if triton_gemms(ops):  # the activation's gradient in the dH GEMM's epilogue (as _ExpertsFn)
        dgu_R2F = ops.grouped_mm_dx(dy_RD, w_EDF, seg, gu_R2F=gu_R2F, **act)
    else:
        dgu_R2F = ops.swiglu_bwd(gu_R2F, ops.grouped_mm_dx(dy_RD, w_EDF, seg), **act)
    dx_RD = _pad(ops.grouped_mm_dx(dgu_R2F, w_E2FD, seg), R)
    grads = weight_gradients(ops, gpt_oss, x_RD, h_RF, dgu_R2F, dy_RD, seg, needs)
    return (dx_RD,) + tuple(dy_RD.new_empty(0) if g is None else g for g in grads)


@_moe_experts_bwd.register_fake
def _(dy_RD, x_RD, gu_R2F, h_RF, offsets_E1, w_gate_up, w_down, activation, alpha, limit, gpt_oss, padded, needs):
    E = w_gate_up.shape[0]
    shapes = (w_gate_up.shape, w_down.shape, (E, gu_R2F.shape[1]), (E, dy_RD.shape[1]))
    return (torch.empty_like(x_RD),) + tuple(x_RD.new_empty(s if need else (0,)) for s, need in zip(shapes, needs))


def _experts_setup(ctx, inputs, output):
    x_RD, offsets_E1, w_gate_up, w_down = inputs[:4]
    ctx.save_for_backward(x_RD, output[1], output[2], offsets_E1, w_gate_up, w_down)
    ctx.args = inputs[6:]  # activation, alpha, limit, gpt_oss, padded


def _experts_backward(ctx, dy_RD, _grad_gu, _grad_h):
    x_RD, gu_R2F, h_RF, offsets_E1, w_gate_up, w_down = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[2:6])
    grads = _moe_experts_bwd(dy_RD, x_RD, gu_R2F, h_RF, offsets_E1, w_gate_up, w_down, *ctx.args, needs)
    dx_RD, rest = grads[0], tuple(g if need else None for g, need in zip(grads[1:], needs))
    return (dx_RD, None) + rest + (None,) * 5


_moe_experts.register_autograd(_experts_backward, setup_context=_experts_setup)


# ------------------------------------------------------------------------------------- the layer
def traceable(moe) -> bool:
    """Whether ``moe``'s forward can run as these operators now: no expert parallelism, no overlap scope,
    no deferred weight gradients (those need the eager runtime: collectives, chunk switches, queues)."""
    return moe.group is None and _scope.current() is None and wgrad.current() is None


class Compiled(Dispatcher):
    """The stages after the routing as these operators (no group, no overlap scope): the permute, the experts
    and the unpermute of the whole batch; the shared experts are the base class's stage."""

    name = "compiled"

    def run(self, c: Chunk) -> Exchanged:
        moe, r = self.moe, c.route
        padded = moe.capacity_factor is not None
        x_SD, src_S = _moe_permute(c.x_TD.to(c.dtype), r.row_TK, r.kept_E, padded)
        offsets_E1 = F.pad(torch.cumsum(r.kept_E, 0), (1, 0))
        experts = self.routed_experts
        spec = experts._spec
        weights = (experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_bias, experts.down_proj_bias)
        weights = tuple(None if w is None else w.to(c.dtype) for w in weights)  # (as nn.Linear under autocast)
        y_SD, _, _ = _moe_experts(
            x_SD, offsets_E1, *weights, spec.activation, spec.alpha, spec.limit, spec.gpt_oss, padded
        )
        return Exchanged(y_SD, src_S, None, self.shared(c.x_TD))

    def unpermute(self, c: Chunk, ex: Exchanged) -> Tensor:
        r = c.route
        return _moe_unpermute(ex.y_SD, r.row_TK, r.weight_TK, ex.src_S, self.moe.capacity_factor is not None)


def forward(moe, x: Tensor) -> Tensor:
    """``MoE.forward`` of an unchunked batch without expert parallelism, as lancet custom operators.

    The same kernels on the same inputs as the eager layer (equal outputs and gradients), the same
    statistics recorded (``aux_loss``, ``z_loss``, ``tokens_per_expert``, ``dropped``, ``expert_load``),
    the same orchestration after the routing (``MoE.after_route`` with :class:`Compiled`).
    """
    error = moe._input_error(x)
    if error is not None:
        raise error
    x_TD = x.reshape(-1, moe.d_model)
    c = Chunk(x_TD, moe._compute_dtype(x_TD), None, None)
    c.route = _route(moe, x_TD)
    return moe.after_route(Compiled(moe, moe.experts, moe.shared_experts, moe.shared_expert_gate), c, x)


def _route(moe, x_TD: Tensor) -> Route:
    """The router and the gating operator over the whole batch; records the layer's statistics."""
    router = moe.router
    expert_bias = router.e_score_correction_bias if moe.expert_bias else None
    topk_group = moe.topk_group if moe.n_group > 1 else None
    weight_TK, _expert_TK, row_TK, kept_E, used_E, score_sum_E, zsq_sum = _moe_gate(
        router(x_TD),
        expert_bias,
        moe.top_k,
        moe.capacity_factor,
        moe.score_fn,
        moe.normalize_topk,
        moe.n_group,
        topk_group,
        moe.routed_scaling_factor,
        moe.aux_loss_coef,
        moe.z_loss_coef,
    )
    _record_stats(moe, x_TD.shape[0], used_E, kept_E, score_sum_E, zsq_sum)
    return Route(weight_TK, row_TK, kept_E)


def _record_stats(moe, T: int, used_E: Tensor, kept_E: Tensor, score_sum_E: Tensor, zsq_sum: Tensor) -> None:
    state = BatchRouting(moe.num_experts, moe.top_k, T, moe.capacity_factor, used_E.device)
    state.used_E, state.kept_E, state.score_sum_E, state.zsq_sum = used_E, kept_E, score_sum_E, zsq_sum
    state.routed_tokens = T
    moe._record_stats(state)
