"""The local experts: SwiGLU FFNs in the Hugging Face layout, computed as grouped GEMMs.

``gate_up_proj [E_local, 2F, D]`` (gate rows first) and ``down_proj [E_local, D, F]``; expert e
computes ``down(silu(gate x) * up x)``. One launch per projection covers all local experts'
variable-size row segments; the weight gradients are separate launches the overlap runtime may
defer into the backward all-to-alls.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import scope as _scope, trace as _trace, wgrad


class _ExpertsFn(torch.autograd.Function):
    """Rows in the received (rank-major) order in and out; expert-major inside for the GEMMs."""

    @staticmethod
    def forward(ctx, x_in, gate_up_E2FD, down_EDF, offsets_E1, ops, to_expert, to_rank, link, probe, params):
        x_RD = x_in if to_expert is None else x_in.index_select(0, to_expert)
        h_RF, gu_R2F = ops.gate_up_swiglu(x_RD, gate_up_E2FD, offsets_E1)
        y_RD = ops.grouped_mm(h_RF, down_EDF, offsets_E1)
        ctx.perms, ctx.link = (to_expert, to_rank), link
        ctx.save_for_backward(x_RD, gu_R2F, h_RF, gate_up_E2FD, down_EDF, offsets_E1)
        ctx.ops = ops
        # Deferring (a dW queue is active), the weights come detached and dW reaches ``params`` (the
        # Parameters) through the queue; ``probe`` tells backward whether the engine accumulates.
        ctx.params, ctx.probe = params, probe
        ctx.wgrad = wgrad.current() if params is not None else None
        ctx.chunk = _scope.current().chunk if _scope.current() is not None else None
        return y_RD if to_rank is None else y_RD.index_select(0, to_rank)

    @staticmethod
    def backward(ctx, dy_out):
        with _trace.span("experts bwd", chunk=ctx.chunk):
            return _ExpertsFn._backward(ctx, dy_out)

    @staticmethod
    def _backward(ctx, dy_out):
        x_RD, gu_R2F, h_RF, gate_up_E2FD, down_EDF, offsets_E1 = ctx.saved_tensors
        ops = ctx.ops
        to_expert, to_rank = ctx.perms
        dy_RD = dy_out.contiguous() if to_expert is None else dy_out.index_select(0, to_expert)
        dh_RF = ops.grouped_mm_dx(dy_RD, down_EDF, offsets_E1)
        dgu_R2F = ops.swiglu_bwd(gu_R2F, dh_RF)
        dx_RD = ops.grouped_mm_dx(dgu_R2F, gate_up_E2FD, offsets_E1)
        dx_in = dx_RD if to_rank is None else dx_RD.index_select(0, to_rank)
        if ctx.link is not None:
            ctx.link.issue(dx_in)  # the dispatch's backward all-to-all starts now
        none = (None,) * 7

        def weight_grads():
            return (ops.grouped_mm_dw(dgu_R2F, x_RD, offsets_E1),
                    ops.grouped_mm_dw(dy_RD, h_RF, offsets_E1))

        if ctx.wgrad is not None:
            needs = tuple(p.requires_grad for p in ctx.params)
            if any(needs) and wgrad.accumulating(ctx.probe):
                flops = 3 * x_RD.shape[0] * gu_R2F.shape[1] * x_RD.shape[1]  # 2RD(2F) + 2RDF
                ctx.wgrad.push(ctx.params, needs, weight_grads, flops)
            return (dx_in, None, None) + none
        needs = ctx.needs_input_grad[1:3]
        if not any(needs):
            return (dx_in, None, None) + none
        dgu, ddown = weight_grads()
        return (dx_in, dgu if needs[0] else None, ddown if needs[1] else None) + none


def _as(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in the rows' dtype: under autocast, float32 weights meet bfloat16 rows as
    ``nn.Linear`` does (a differentiable cast, so float32 parameters get float32 gradients)."""
    return w if w.dtype == dtype else w.to(dtype)


class Experts(nn.Module):
    """``E_local`` SwiGLU experts in the Hugging Face layout.

    Args:
        num_local_experts: E_local.
        d_model: D.
        d_ffn: F.
        init_std: standard deviation of the normal initialisation.

    Attributes:
        gate_up_proj: [E_local, 2F, D], gate rows first.
        down_proj: [E_local, D, F].
    """

    def __init__(self, num_local_experts: int, d_model: int, d_ffn: int, *, init_std: float = 0.02,
                 device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.num_local_experts, self.d_model, self.d_ffn = num_local_experts, d_model, d_ffn
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * d_ffn, d_model, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, d_model, d_ffn, **factory))
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=self.init_std)
        nn.init.normal_(self.down_proj, std=self.init_std / math.sqrt(2))

    def forward(self, x_RD: torch.Tensor, offsets_E1: torch.Tensor, ops, *, to_expert=None, to_rank=None,
                link=None) -> torch.Tensor:
        """Apply expert e to rows offsets[e]:offsets[e+1] of ``x_RD`` [R, D]; returns y_RD.

        Args:
            x_RD: [R, D] rows grouped by local expert, or in received order with ``to_expert``.
            offsets_E1: [E_local + 1] segment bounds (in expert-major order).
            ops: the kernel namespace (:func:`lancet_rt.ops.get_ops`).
            to_expert, to_rank: optional row permutations received -> expert-major and back.
            link: the dispatch all-to-all that produced ``x_RD``; its backward is issued from here.
        """
        q = wgrad.current()
        if q is not None and torch.is_grad_enabled():
            return _ExpertsFn.apply(x_RD, _as(self.gate_up_proj.detach(), x_RD.dtype), _as(self.down_proj.detach(), x_RD.dtype),
                                    offsets_E1, ops, to_expert, to_rank, link, q.probe, (self.gate_up_proj, self.down_proj))
        return _ExpertsFn.apply(x_RD, _as(self.gate_up_proj, x_RD.dtype), _as(self.down_proj, x_RD.dtype), offsets_E1, ops,
                                to_expert, to_rank, link, None, None)

    def extra_repr(self) -> str:
        return f"num_local_experts={self.num_local_experts}, d_model={self.d_model}, d_ffn={self.d_ffn}"
