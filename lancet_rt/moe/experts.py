"""The local experts: gated FFNs in a Hugging Face layout, computed as grouped GEMMs.

Two parameter layouts, each under its Hugging Face names and shapes (so a state_dict loads as is):

* ``layout="lancet"`` (Mixtral, Qwen-MoE, DeepSeek-MoE): ``gate_up_proj [E_local, 2F, D]`` (gate rows
  first), ``down_proj [E_local, D, F]``; expert e computes ``down(silu(gate x) * up x)``.
* ``layout="gpt_oss"`` (``transformers``' ``GptOssExperts``): ``gate_up_proj [E_local, D, 2F]`` with gate
  and up interleaved along 2F (gate columns 0, 2, ..., up 1, 3, ...), ``gate_up_proj_bias [E_local, 2F]``
  (interleaved likewise), ``down_proj [E_local, F, D]``, ``down_proj_bias [E_local, D]``, and the
  clamped activation "swiglu_oai".

The kernels see both layouts as strided views, never copies: GPT-OSS's weights are the transposes of
``[E, 2F, D]`` and ``[E, D, F]``; its interleaved gate/up rows are read by the fused gate_up kernel as
one contiguous tile per step (``interleaved=True``), and the pre-activation it saves for backward keeps
that column order, so dX is an ordinary grouped GEMM over the same view and dW comes out in the
parameter's own layout (``grouped_mm_dw(x, dgu)`` is ``[E, D, 2F]``). One launch per projection covers
all local experts' variable-size row segments; the weight and bias gradients (grouped dW GEMMs and
per-expert segment sums) are separate launches the overlap runtime may defer into the backward
all-to-alls.

Rows arrive in the dispatch's received (rank-major) order and leave in it; the GEMMs walk them
expert-major. The CPU backend regroups them with ``index_select`` both ways; the Triton kernels read and
write through the permutation instead (their row maps: ``x_rows``, ``dy_rows``, ``out_rows``), so the
regrouping costs no copy and no op, with the same results bit for bit: the forward saves the received
rows, and backward's GEMMs (the deferred dW ones too) read them and the received dY through the map.
There too the activation's gradient is computed in the dH GEMM's epilogue (``grouped_mm_dx(...,
gu_R2F=)``), bit for bit the SwiGLU backward kernel's, so dH is never stored.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import nn

from lancet_rt import trace as _trace
from lancet_rt.kernels.cpu_backend import NO_WORKSPACE, GateUp, Workspace
from lancet_rt.kernels.reference import ACTIVATIONS
from lancet_rt.runtime import casts, wgrad
from lancet_rt.runtime import scope as _scope

#: Parameter layouts (module docstring).
LAYOUTS = ("lancet", "gpt_oss")


class _Spec(NamedTuple):
    """How the experts call the kernels: the activation's arguments and whether the parameters are
    stored transposed ([E, D, 2F] / [E, F, D], GPT-OSS) with interleaved gate/up."""

    activation: str
    alpha: float
    limit: float
    gpt_oss: bool

    def act(self) -> dict:
        return dict(activation=self.activation, interleaved=self.gpt_oss, alpha=self.alpha, limit=self.limit)


def kernel_views(w_gate_up: torch.Tensor, w_down: torch.Tensor, gpt_oss: bool) -> tuple:
    """(w_E2FD, w_EDF): the kernels' [E, 2F, D] and [E, D, F] views of the weights (GPT-OSS's are their
    transposes)."""
    return (w_gate_up.transpose(1, 2) if gpt_oss else w_gate_up), (w_down.transpose(1, 2) if gpt_oss else w_down)


def triton_gemms(ops) -> bool:
    """Whether ``ops``' grouped GEMMs are the Triton kernels (not the CPU backend, not a family fallen
    back to its references): they take row maps and fuse the activation's gradient into dH's GEMM."""
    return getattr(ops, "name", None) == "triton" and not getattr(ops, "host_offsets", True)


def row_maps(ops, to_expert) -> bool:
    """Whether rows in received order (``to_expert``) reach the GEMMs through their row maps, with no
    regrouping op (:func:`triton_gemms`)."""
    return to_expert is not None and triton_gemms(ops)


def expert_rows(ops, spec: _Spec, x_RD, w_E2FD, w_EDF, segments, b_gate_up, b_down, rows=None, **halves) -> tuple:
    """(y_RD, h_RF, gu_R2F): the experts' forward over rows grouped by expert (``segments``): the fused
    gate_up GEMM and SwiGLU, then the down GEMM; ``h_RF`` and ``gu_R2F`` are what backward needs.
    With ``rows`` (the kernels' row map, :func:`row_maps`) x and y are in received order, grouped
    row g being received row ``rows[g]``; h and gu are grouped."""
    if rows is None:
        h_RF, gu_R2F = ops.gate_up_swiglu(x_RD, w_E2FD, segments, b_gate_up, **spec.act(), **halves)
        return ops.grouped_mm(h_RF, w_EDF, segments, b_down), h_RF, gu_R2F
    h_RF, gu_R2F = ops.gate_up_swiglu(x_RD, w_E2FD, segments, b_gate_up, x_rows=rows, **spec.act())
    return ops.grouped_mm(h_RF, w_EDF, segments, b_down, out_rows=rows), h_RF, gu_R2F


def weight_gradients(
    ops, gpt_oss: bool, x_RD, h_RF, dgu_R2F, dy_RD, offsets_E1, needs, rows=None, into=(None, None)
) -> tuple:
    """Gradients of (gate_up, down, gate_up_bias, down_bias), each None where ``needs`` says no. In the
    GPT-OSS layout the dW GEMMs take their operands swapped, so they write the parameters' own
    [E, D, 2F] and [E, F, D] layouts. With ``rows`` (a row map, :func:`expert_rows`) ``x_RD`` and
    ``dy_RD`` are in received order and the dW GEMMs read them through it. ``into``: for gate_up's and
    down's dW, a tensor in x's dtype that the dW GEMM adds its gradient to (and returns), or None
    (Triton GEMMs only: :func:`triton_gemms`). On the Triton GEMMs both dW, where both are needed, are
    one launch (``grouped_mm_dw_pair``, the same bits as the two), deferred or not."""
    # (dy, x) of each dW GEMM, and which of them is read through the row map (x_RD and dy_RD are)
    if gpt_oss:
        gu_args, gu_mapped, down_args, down_mapped = (x_RD, dgu_R2F), "dy", (h_RF, dy_RD), "x"
    else:
        gu_args, gu_mapped, down_args, down_mapped = (dgu_R2F, x_RD), "x", (dy_RD, h_RF), "dy"
    if needs[0] and needs[1] and triton_gemms(ops):  # both in one launch (the host's cost per chunk)
        maps = {} if rows is None else {f"{gu_mapped}_rows": rows, f"{down_mapped}_b_rows": rows}
        accumulate = tuple(t is not None for t in into)
        dgate_up, ddown = ops.grouped_mm_dw_pair(
            *gu_args, *down_args, offsets_E1, **maps, out=tuple(into), accumulate=accumulate
        )
    else:
        gu_to, down_to = ({} if t is None else dict(out=t, accumulate=True) for t in into)
        gu_rows, down_rows = ({} if rows is None else {f"{m}_rows": rows} for m in (gu_mapped, down_mapped))
        dgate_up = ops.grouped_mm_dw(*gu_args, offsets_E1, **gu_rows, **gu_to) if needs[0] else None
        ddown = ops.grouped_mm_dw(*down_args, offsets_E1, **down_rows, **down_to) if needs[1] else None
    dgate_up_bias = ops.segment_sum(dgu_R2F, offsets_E1) if needs[2] else None
    if needs[3] and rows is not None:  # (the segment sums take grouped rows)
        dy_RD = dy_RD.index_select(0, rows)
    ddown_bias = ops.segment_sum(dy_RD, offsets_E1) if needs[3] else None
    return dgate_up, ddown, dgate_up_bias, ddown_bias


def dw_sum_site(ops, tensors: tuple, dtype: torch.dtype) -> Optional[_scope.ChunkSite]:
    """The site at which the chunks of a chunked forward sum their gradients of gate_up and down in
    their dW GEMMs (:meth:`lancet_rt.runtime.scope.ChunkSite.sum_gradients`), so the autograd engine
    gets one gradient per weight, not one per chunk to add; None where each chunk returns its own:
    outside a chunked forward or in a recomputation, without grad, off the Triton GEMMs (which add
    into a sum: :func:`triton_gemms`), with biases, or where the gradients' dtype is not the GEMMs'
    (autocast's float32 weights of bfloat16 rows: their dW are converted before the engine adds).
    ``tensors``: (gate_up, down, gate_up_bias, down_bias), the Parameters; ``dtype``: the rows'."""
    gate_up, down, b_gate_up, b_down = tensors
    if not torch.is_grad_enabled() or not triton_gemms(ops) or b_gate_up is not None or b_down is not None:
        return None
    if gate_up.dtype != dtype or down.dtype != dtype:
        return None
    return _scope.chunk_site(("experts dW", id(gate_up)))


class _ExpertsFn(torch.autograd.Function):
    """Rows in the received (rank-major) order in and out; expert-major inside for the GEMMs."""

    @staticmethod
    def forward(
        ctx,
        x_in,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        weights,
        offsets_E1,
        bounds,
        ops,
        spec,
        to_expert,
        to_rank,
        link,
        probe,
        params,
        dw_site=None,
    ):
        # gate_up .. down_bias: what autograd differentiates (the Parameters; None when deferring);
        # ``weights``: the same four in the rows' dtype, detached, for the GEMMs (under autocast one
        # copy per chunked forward, shared by the chunks: lancet_rt.runtime.casts).
        w_gate_up, w_down, b_gate_up, b_down = weights
        # With the kernels' row maps x_RD stays in received order (saved so: backward reads it through
        # the map); else it is regrouped here.
        rows = to_expert if row_maps(ops, to_expert) else None
        x_RD = x_in if to_expert is None or rows is not None else x_in.index_select(0, to_expert)
        # The CPU backend loops over host bounds: given those, it reads nothing.
        ctx.bounds = bounds if bounds is not None and getattr(ops, "host_offsets", False) else None
        segments = offsets_E1 if ctx.bounds is None else ctx.bounds
        w_E2FD, w_EDF = kernel_views(w_gate_up, w_down, spec.gpt_oss)
        # (the CPU backend: gate and up as contiguous halves, for the activation's passes; GateUp)
        halves = dict(halves=True) if getattr(ops, "gate_up_halves", False) else {}
        y_RD, h_RF, gu_R2F = expert_rows(ops, spec, x_RD, w_E2FD, w_EDF, segments, b_gate_up, b_down, rows, **halves)
        ctx.perms, ctx.rows, ctx.link, ctx.spec = (to_expert, to_rank), rows, link, spec
        ctx.save_for_backward(
            x_RD, h_RF, w_gate_up, w_down, offsets_E1, *(gu_R2F if isinstance(gu_R2F, GateUp) else (gu_R2F,))
        )
        ctx.has_bias = (b_gate_up is not None, b_down is not None)
        # The gradients' dtypes: the parameters' (float32 under autocast), as a differentiable cast gives.
        ctx.grad_dtypes = tuple(None if w is None else w.dtype for w in (gate_up, down, gate_up_bias, down_bias))
        ctx.ops = ops
        # Deferring (a dW queue is active), the gradients reach ``params`` (the Parameters) through
        # the queue; ``probe`` tells backward whether the engine accumulates.
        ctx.params, ctx.probe = params, probe
        ctx.wgrad = wgrad.current() if params is not None else None
        ctx.chunk = _scope.current().chunk if _scope.current() is not None else None
        # The chunks' dW of each weight summed in their dW GEMMs (dw_sum_site), through this site.
        ctx.dw_site = dw_site
        if dw_site is not None:
            dw_site.join_sum(ctx.chunk, ctx)
        return y_RD if to_rank is None or rows is not None else y_RD.index_select(0, to_rank)

    @staticmethod
    def backward(ctx, dy_out):
        with _trace.span("experts bwd", chunk=ctx.chunk):
            return _ExpertsFn._backward(ctx, dy_out)

    @staticmethod
    def _backward(ctx, dy_out):
        """The input-gradient chain now; the weight gradients now, or queued when deferring."""
        saved = _Saved.load(ctx)
        deferral = _Deferral.of(ctx)
        memory = NO_WORKSPACE
        if getattr(ctx.ops, "host_offsets", False) and dy_out.device.type == "cpu":
            memory = Workspace.for_backward(saved.h_RF, saved.gu_R2F)  # (the CPU backend's scratch)
        dy_RD, dgu_R2F, dx_in = _input_grads(ctx, saved, dy_out, memory, deferral.active)
        none = (None,) * 11
        if ctx.wgrad is None:
            needs = ctx.needs_input_grad[1:5]
            if ctx.dw_site is None:
                grads = _param_grads(ctx, saved, dy_RD, dgu_R2F, needs)
            else:  # the weights' gradients summed over the chunks: the last chunk's backward returns them
                summed = ctx.dw_site.sum_gradients(
                    ctx.chunk, lambda into: _param_grads(ctx, saved, dy_RD, dgu_R2F, needs, into)[:2]
                )
                grads = (None, None, None, None) if summed is None else (*summed, None, None)
            return (dx_in, *(None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.grad_dtypes))) + none
        if deferral.active:
            deferral.push(ctx, saved, dy_RD, dgu_R2F)
        return (dx_in, None, None, None, None) + none


class _Saved(NamedTuple):
    """What the experts' backward reads: the forward's saved tensors, the kernels' weight views
    ([E, 2F, D] and [E, D, F]), the segment bounds (host ints where the forward had them) and the row
    map (``rows``: x_RD is then in received order, read through it; else None)."""

    x_RD: torch.Tensor
    h_RF: torch.Tensor
    gu_R2F: object  # [R, 2F], or its halves as a GateUp (the CPU backend)
    w_E2FD: torch.Tensor
    w_EDF: torch.Tensor
    offsets_E1: object
    rows: Optional[torch.Tensor]

    @staticmethod
    def load(ctx) -> "_Saved":
        x_RD, h_RF, gate_up, down, offsets_E1, *pre = ctx.saved_tensors
        gu_R2F = GateUp(*pre) if len(pre) == 2 else pre[0]
        bounds = offsets_E1 if ctx.bounds is None else ctx.bounds
        return _Saved(x_RD, h_RF, gu_R2F, *kernel_views(gate_up, down, ctx.spec.gpt_oss), bounds, ctx.rows)


class _Deferral(NamedTuple):
    """Whether the weight gradients go to the dW queue (``active``), and which: ``present``, the
    parameters the module has in (gate_up, down, gate_up_bias, down_bias) order, ``needs`` those
    whose gradient is wanted."""

    active: bool
    present: tuple = ()
    needs: tuple = ()

    @staticmethod
    def of(ctx) -> "_Deferral":
        if ctx.wgrad is None:
            return _Deferral(False)
        present = (True, True) + ctx.has_bias
        it = iter(p.requires_grad for p in ctx.params)  # (ctx.params: the Parameters the module has)
        needs = tuple(next(it) if has else False for has in present)
        return _Deferral(any(needs) and wgrad.accumulating(ctx.probe), present, needs)

    def push(self, ctx, saved: _Saved, dy_RD, dgu_R2F) -> None:
        """Queue the weight gradients; they reach the Parameters when the queue runs them."""
        x_RD, h_RF = saved.x_RD, saved.h_RF
        flops = 3 * x_RD.shape[0] * saved.gu_R2F.shape[1] * x_RD.shape[1]  # 2RD(2F) + 2RDF

        summing = triton_gemms(ctx.ops)

        def weight_grads(sums=(None, None)):
            # The queue's running sums of gate_up's and down's dW (the earlier chunks'): the dW GEMMs
            # add into those in x's dtype (not into a float32 sum of bfloat16 gradients, autocast's).
            into = tuple(None if t is None or t.dtype != x_RD.dtype else t for t in sums[:2])
            grads = _param_grads(ctx, saved, dy_RD, dgu_R2F, self.needs, into)
            return tuple(g for g, has in zip(grads, self.present) if has)

        needs = tuple(n for n, has in zip(self.needs, self.present) if has)
        held = wgrad.held_bytes(x_RD, *GateUp.tensors(dgu_R2F), h_RF, dy_RD)
        ctx.wgrad.push(ctx.params, needs, weight_grads, flops, held, x_RD.dtype, sums=summing)


def _input_grads(ctx, saved: _Saved, dy_out, memory: Workspace, deferring: bool) -> tuple:
    """The input-gradient chain dY -> dH -> dgu -> dX: (dy_RD, dgu_R2F), kept for the weight gradients
    (dy_RD in expert order, or with a row map the received dY, read through it), and dX in received
    order (None without an input gradient), whose dispatch backward all-to-all is issued here.
    ``memory``: where the temporaries go (the CPU backend's scratch: never a tensor a deferred dW holds
    or one that leaves the call)."""
    ops, act, (to_expert, to_rank), rows = ctx.ops, ctx.spec.act(), ctx.perms, saved.rows
    R, F2 = saved.gu_R2F.shape
    if rows is not None:
        dy_RD, dh_scratch = dy_out, dict(dy_rows=rows)  # (the kernels read dY through the row map)
    elif to_expert is None:
        dy_RD, dh_scratch = dy_out.contiguous(), {}
    else:
        dy_scratch = {} if deferring else memory.out("dy", (R, dy_out.shape[1]))
        dy_RD, dh_scratch = torch.index_select(dy_out, 0, to_expert, **dy_scratch), {}
    if triton_gemms(ops):  # dH -> dgu in the dH GEMM's epilogue: one launch, no dH buffer
        dgu_R2F = ops.grouped_mm_dx(dy_RD, saved.w_EDF, saved.offsets_E1, gu_R2F=saved.gu_R2F, **act, **dh_scratch)
    else:
        dh_scratch.update({**memory.out("dh", (R, F2 // 2)), **memory.along("along_dh", saved.w_EDF)})
        dh_RF = ops.grouped_mm_dx(dy_RD, saved.w_EDF, saved.offsets_E1, **dh_scratch)
        # Without dX, and without a gate/up bias, the CPU backend's dgu may be contiguous halves too
        # (GateUp): its passes and the dW GEMMs then stream (the fused dX GEMM reads one [R, 2F]).
        halves = isinstance(saved.gu_R2F, GateUp) and not ctx.needs_input_grad[0] and not ctx.has_bias[0]
        dgu_R2F = ops.swiglu_bwd(saved.gu_R2F, dh_RF, **act, **memory.swiglu_bwd(saved.gu_R2F, halves, deferring))
        del dh_RF
    if not ctx.needs_input_grad[0]:
        # (the rows came from tokens that need no gradient, e.g. a first layer's input: no dX GEMM
        # and no dual all-to-all, whose forward then recorded no backward to wait for it)
        return dy_RD, dgu_R2F, None
    dx_scratch = {**memory.along("along_dx", saved.w_E2FD)}
    if rows is not None:
        dx_scratch.update(out_rows=rows)  # (dX written in received order)
    elif to_rank is not None:
        dx_scratch.update(memory.out("dx", (R, saved.x_RD.shape[1])))
    dx_RD = ops.grouped_mm_dx(dgu_R2F, saved.w_E2FD, saved.offsets_E1, **dx_scratch)
    dx_in = dx_RD if to_rank is None or rows is not None else dx_RD.index_select(0, to_rank)
    if ctx.link is not None:
        ctx.link.issue(dx_in)  # the dispatch's backward all-to-all starts now
    return dy_RD, dgu_R2F, dx_in


def _param_grads(ctx, saved: _Saved, dy_RD, dgu_R2F, needs, into=(None, None)) -> tuple:
    """Gradients of (gate_up, down, gate_up_bias, down_bias), each None where not needed; gate_up's and
    down's added into ``into``'s tensors where given (:func:`weight_gradients`)."""
    x_RD, h_RF, offsets_E1 = saved.x_RD, saved.h_RF, saved.offsets_E1
    return weight_gradients(
        ctx.ops, ctx.spec.gpt_oss, x_RD, h_RF, dgu_R2F, dy_RD, offsets_E1, needs, saved.rows, into or (None, None)
    )


class Experts(nn.Module):
    """``E_local`` gated experts in a Hugging Face layout (module docstring).

    Args:
        num_local_experts: E_local.
        d_model: D.
        d_ffn: F.
        activation: "swiglu" (silu(gate) * up) or "swiglu_oai" (GPT-OSS: with g = min(gate, limit) and
            u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g)). None: the layout's own
            ("swiglu" for "lancet", "swiglu_oai" for "gpt_oss").
        bias: biases on both projections (added in the GEMM epilogues). None: the layout's own
            (False for "lancet", True for "gpt_oss").
        alpha, limit: the "swiglu_oai" constants (GPT-OSS's config ``swiglu_alpha``, ``swiglu_limit``).
        layout: "lancet" or "gpt_oss": the parameters' names, shapes and gate/up order.
        init_std: standard deviation of the weights' normal initialisation (biases start at zero).

    Attributes (shapes for "lancet" / "gpt_oss"):
        gate_up_proj: [E_local, 2F, D] gate rows first / [E_local, D, 2F] gate and up interleaved.
        down_proj: [E_local, D, F] / [E_local, F, D].
        gate_up_proj_bias: [E_local, 2F] in gate_up_proj's gate/up order, or None without bias.
        down_proj_bias: [E_local, D], or None without bias.
    """

    def __init__(
        self,
        num_local_experts: int,
        d_model: int,
        d_ffn: int,
        *,
        activation: Optional[str] = None,
        bias: Optional[bool] = None,
        alpha: float = 1.702,
        limit: float = 7.0,
        layout: str = "lancet",
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, value in (("num_local_experts", num_local_experts), ("d_model", d_model), ("d_ffn", d_ffn)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        gpt_oss = layout == "gpt_oss"
        activation = ("swiglu_oai" if gpt_oss else "swiglu") if activation is None else activation
        bias = gpt_oss if bias is None else bias
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool or None, got {type(bias).__name__}")
        for name, value in (("alpha", alpha), ("limit", limit)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite float, got {value!r}")
        if not limit > 0:
            raise ValueError(f"limit must be > 0, got {limit}")
        factory = dict(device=device, dtype=dtype)
        E, D, F = num_local_experts, d_model, d_ffn
        self.num_local_experts, self.d_model, self.d_ffn = E, D, F
        self.layout, self.activation, self.alpha, self.limit = layout, activation, float(alpha), float(limit)
        self._spec = _Spec(activation, float(alpha), float(limit), gpt_oss)
        self.gate_up_proj = nn.Parameter(torch.empty(*((E, D, 2 * F) if gpt_oss else (E, 2 * F, D)), **factory))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * F, **factory)) if bias else None
        self.down_proj = nn.Parameter(torch.empty(*((E, F, D) if gpt_oss else (E, D, F)), **factory))
        self.down_proj_bias = nn.Parameter(torch.empty(E, D, **factory)) if bias else None
        self.init_std = init_std
        self.reset_parameters()

    @classmethod
    def from_gpt_oss_config(
        cls, config, *, num_local_experts: Optional[int] = None, device=None, dtype=None
    ) -> "Experts":
        """GPT-OSS's experts from a ``transformers`` ``GptOssConfig`` (read: ``hidden_size``,
        ``intermediate_size``, ``num_local_experts``, ``swiglu_alpha``, ``swiglu_limit``,
        ``initializer_range``); ``num_local_experts`` overrides the config's (expert parallelism)."""
        return cls(
            config.num_local_experts if num_local_experts is None else num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            layout="gpt_oss",
            alpha=config.swiglu_alpha,
            limit=config.swiglu_limit,
            init_std=getattr(config, "initializer_range", 0.02),
            device=device,
            dtype=dtype,
        )

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=self.init_std)
        nn.init.normal_(self.down_proj, std=self.init_std / math.sqrt(2))
        for b in (self.gate_up_proj_bias, self.down_proj_bias):
            if b is not None:
                nn.init.zeros_(b)

    def _params(self) -> tuple:
        """The Parameters in the order the autograd Function returns their gradients."""
        return tuple(
            p for p in (self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias) if p is not None
        )

    def forward(
        self, x_RD: torch.Tensor, offsets_E1: torch.Tensor, ops, *, to_expert=None, to_rank=None, link=None, bounds=None
    ) -> torch.Tensor:
        """Apply expert e to rows offsets[e]:offsets[e+1] of ``x_RD`` [R, D]; returns y_RD.

        Args:
            x_RD: [R, D] rows grouped by local expert, or in received order with ``to_expert``.
            offsets_E1: [E_local + 1] segment bounds (in expert-major order); None where ``ops`` take
                host bounds (the CPU backend) and ``bounds`` holds them.
            ops: the kernel namespace (:func:`lancet_rt.ops.get_ops`).
            to_expert, to_rank: optional row permutations received -> expert-major and back.
            link: the dispatch all-to-all that produced ``x_RD``; its backward is issued from here.
            bounds: ``offsets_E1`` as host ints, when known (the CPU backend then reads nothing).
        """
        if offsets_E1 is None and (bounds is None or not getattr(ops, "host_offsets", False)):
            raise ValueError("offsets_E1 may be None only with bounds and ops that take host bounds")
        tensors = (self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias)
        # Under autocast, float32 weights meet bfloat16 rows as in ``nn.Linear``: computed in the rows'
        # dtype, float32 gradients; one copy per chunked forward whatever the chunk count.
        weights = tuple(None if t is None else casts.compute_copy(t, x_RD.dtype) for t in tensors)
        q = wgrad.current()
        if q is not None and torch.is_grad_enabled():
            return _ExpertsFn.apply(
                x_RD,
                None,
                None,
                None,
                None,
                weights,
                offsets_E1,
                bounds,
                ops,
                self._spec,
                to_expert,
                to_rank,
                link,
                q.probe,
                self._params(),
            )
        site = dw_sum_site(ops, tensors, x_RD.dtype)
        return _ExpertsFn.apply(
            x_RD, *tensors, weights, offsets_E1, bounds, ops, self._spec, to_expert, to_rank, link, None, None, site
        )

    def extra_repr(self) -> str:
        text = f"num_local_experts={self.num_local_experts}, d_model={self.d_model}, d_ffn={self.d_ffn}"
        if self.layout != "lancet" or self.activation != "swiglu" or self.gate_up_proj_bias is not None:
            text += (
                f", layout={self.layout!r}, activation={self.activation!r}, bias={self.gate_up_proj_bias is not None}"
            )
            if self.activation == "swiglu_oai":
                text += f", alpha={self.alpha}, limit={self.limit}"
        return text
