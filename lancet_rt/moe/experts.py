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
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple, Optional

import torch
from torch import nn

from lancet_rt import trace as _trace
from lancet_rt.kernels.reference import ACTIVATIONS
from lancet_rt.kernels.reference_experts import GateUp
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


class _Scratch(threading.local):
    """Memory the experts' backward reuses from step to step on the reference (CPU) path: the [R, F]
    gradient of h, the [R, 2F] gradient of gu and, with expert parallelism, dY after and dX before
    their permutations, each a view of one flat buffer per role, dtype and device, grown to the largest
    chunk seen.

    Allocated afresh each step (40-65 MB at the benchmark's size), these were returned to the OS by
    glibc on free and faulted in again page by page, 6-12k minor page faults and 10-20 ms of system
    time per step (issue 38). A buffer is handed out only for a tensor that dies inside the same
    backward call: never one a deferred dW holds or one that leaves the call, and there is no
    switch to other work between its write and its last read (``link.issue`` starts a collective of
    a fresh tensor and returns). Per thread: ``Overlapped.accumulate`` runs a backward on a helper
    thread. CUDA keeps its caching allocator and the kernels' own buffers: no scratch there.
    """

    #: Below this size of dgu the backward allocates as before: its temporaries are then at most a
    #: few hundred pages even when faulted in again (none under 128 KiB, glibc's initial mmap
    #: threshold), while the per-segment ``mm`` into a scratch buffer costs ATen ops per chunk (issue
    #: 20's count, bench.host: +3.5 per extra chunk at its sizes).
    MIN_BYTES = 1 << 20

    def __init__(self):
        self.buffers: dict = {}

    def take(self, role: str, shape: tuple, like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        n = math.prod(shape)
        dtype = dtype or like.dtype
        key = (role, dtype, like.device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self.buffers[key] = torch.empty(n, dtype=dtype, device=like.device)
        return buf[:n].view(shape)


_scratch = _Scratch()


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
    ):
        # gate_up .. down_bias: what autograd differentiates (the Parameters; None when deferring);
        # ``weights``: the same four in the rows' dtype, detached, for the GEMMs (under autocast one
        # copy per chunked forward, shared by the chunks: lancet_rt.runtime.casts).
        w_gate_up, w_down, b_gate_up, b_down = weights
        x_RD = x_in if to_expert is None else x_in.index_select(0, to_expert)
        # The references loop over host bounds: given those, they read nothing.
        ctx.bounds = bounds if bounds is not None and getattr(ops, "host_offsets", False) else None
        segments = offsets_E1 if ctx.bounds is None else ctx.bounds
        # The kernels' views: [E, 2F, D] and [E, D, F] (GPT-OSS: transposes of its parameters).
        w_E2FD = w_gate_up.transpose(1, 2) if spec.gpt_oss else w_gate_up
        w_EDF = w_down.transpose(1, 2) if spec.gpt_oss else w_down
        # (the references: gate and up as contiguous halves, for the activation's passes; GateUp)
        halves = dict(halves=True) if getattr(ops, "gate_up_halves", False) else {}
        h_RF, gu_R2F = ops.gate_up_swiglu(x_RD, w_E2FD, segments, b_gate_up, **spec.act(), **halves)
        y_RD = ops.grouped_mm(h_RF, w_EDF, segments, b_down)
        ctx.perms, ctx.link, ctx.spec = (to_expert, to_rank), link, spec
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
        return y_RD if to_rank is None else y_RD.index_select(0, to_rank)

    @staticmethod
    def backward(ctx, dy_out):
        with _trace.span("experts bwd", chunk=ctx.chunk):
            return _ExpertsFn._backward(ctx, dy_out)

    @staticmethod
    def _backward(ctx, dy_out):
        x_RD, h_RF, gate_up, down, offsets_E1, *pre = ctx.saved_tensors
        gu_R2F = GateUp(*pre) if len(pre) == 2 else pre[0]  # [R, 2F], or its halves
        ops, spec = ctx.ops, ctx.spec
        if ctx.bounds is not None:
            offsets_E1 = ctx.bounds
        w_E2FD = gate_up.transpose(1, 2) if spec.gpt_oss else gate_up
        w_EDF = down.transpose(1, 2) if spec.gpt_oss else down
        to_expert, to_rank = ctx.perms
        deferring = False
        if ctx.wgrad is not None:
            # params: (gate_up, down) then the biases the module has, in that order.
            present = (True, True) + ctx.has_bias
            it = iter(p.requires_grad for p in ctx.params)
            needs_all = tuple(next(it) if has else False for has in present)
            deferring = any(needs_all) and wgrad.accumulating(ctx.probe)
        # The reference path's temporaries in reused memory (_Scratch); a deferred dW holds dgu.
        R, F2 = gu_R2F.shape
        scratch = (
            getattr(ops, "host_offsets", False)
            and dy_out.device.type == "cpu"
            and R * F2 * h_RF.element_size() >= _Scratch.MIN_BYTES
        )
        out = (lambda role, shape: dict(out=_scratch.take(role, shape, h_RF))) if scratch else (lambda *_: {})
        if to_expert is None:
            dy_RD = dy_out.contiguous()
        else:
            dy_RD = torch.index_select(dy_out, 0, to_expert, **({} if deferring else out("dy", (R, dy_out.shape[1]))))
        low = scratch and h_RF.dtype in (torch.bfloat16, torch.float16)  # (16-bit: their copies in scratch too)
        along = (lambda role, w: dict(work=_scratch.take(role, (w.numel(),), w))) if low else (lambda *_: {})
        dh_RF = ops.grouped_mm_dx(dy_RD, w_EDF, offsets_E1, **out("dh", (R, F2 // 2)), **along("along_dh", w_EDF))
        # Without dX, and without a gate/up bias, the references' dgu may be contiguous halves too
        # (GateUp): its passes and the dW GEMMs then stream (the fused dX GEMM reads one [R, 2F]).
        halves = isinstance(gu_R2F, GateUp) and not ctx.needs_input_grad[0] and not ctx.has_bias[0]
        dgu_out = {} if deferring else out("dgu", (2, R, F2 // 2) if halves else (R, F2))
        if halves:
            dgu_out = dict(halves=True, **{k: GateUp(*v) for k, v in dgu_out.items()})
        if low:  # (the float32 copy of gu)
            work = _scratch.take(
                "gu32", (2, R, F2 // 2) if isinstance(gu_R2F, GateUp) else (R, F2), h_RF, torch.float32
            )
            dgu_out["work"] = GateUp(*work) if isinstance(gu_R2F, GateUp) else work
        dgu_R2F = ops.swiglu_bwd(gu_R2F, dh_RF, **spec.act(), **dgu_out)
        del dh_RF
        dx_in = None
        if ctx.needs_input_grad[0]:
            # (else the rows came from tokens that need no gradient, e.g. a first layer's input: no
            # dX GEMM and no dual all-to-all, whose forward then recorded no backward to wait for it)
            dx_RD = ops.grouped_mm_dx(
                dgu_R2F,
                w_E2FD,
                offsets_E1,
                **along("along_dx", w_E2FD),
                **({} if to_rank is None else out("dx", (R, x_RD.shape[1]))),
            )
            dx_in = dx_RD if to_rank is None else dx_RD.index_select(0, to_rank)
            if ctx.link is not None:
                ctx.link.issue(dx_in)  # the dispatch's backward all-to-all starts now
        none = (None,) * 10

        def param_grads(needs):
            """Gradients of (gate_up, down, gate_up_bias, down_bias), each None where not needed. In the
            GPT-OSS layout the dW GEMMs take their operands swapped, so they write the parameters' own
            [E, D, 2F] and [E, F, D] layouts."""
            if spec.gpt_oss:
                dgate_up = ops.grouped_mm_dw(x_RD, dgu_R2F, offsets_E1) if needs[0] else None
                ddown = ops.grouped_mm_dw(h_RF, dy_RD, offsets_E1) if needs[1] else None
            else:
                dgate_up = ops.grouped_mm_dw(dgu_R2F, x_RD, offsets_E1) if needs[0] else None
                ddown = ops.grouped_mm_dw(dy_RD, h_RF, offsets_E1) if needs[1] else None
            dgate_up_bias = ops.segment_sum(dgu_R2F, offsets_E1) if needs[2] else None
            ddown_bias = ops.segment_sum(dy_RD, offsets_E1) if needs[3] else None
            return dgate_up, ddown, dgate_up_bias, ddown_bias

        if ctx.wgrad is not None:
            if deferring:
                flops = 3 * x_RD.shape[0] * gu_R2F.shape[1] * x_RD.shape[1]  # 2RD(2F) + 2RDF

                def weight_grads():
                    grads = param_grads(needs_all)
                    return tuple(g for g, has in zip(grads, present) if has)

                needs = tuple(n for n, has in zip(needs_all, present) if has)
                ctx.wgrad.push(
                    ctx.params,
                    needs,
                    weight_grads,
                    flops,
                    wgrad.held_bytes(x_RD, *GateUp.tensors(dgu_R2F), h_RF, dy_RD),
                    x_RD.dtype,
                )
            return (dx_in, None, None, None, None) + none
        needs = ctx.needs_input_grad[1:5]
        grads = tuple(None if g is None else g.to(dtype) for g, dtype in zip(param_grads(needs), ctx.grad_dtypes))
        return (dx_in, *grads) + none


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
                host bounds (the references) and ``bounds`` holds them.
            ops: the kernel namespace (:func:`lancet_rt.ops.get_ops`).
            to_expert, to_rank: optional row permutations received -> expert-major and back.
            link: the dispatch all-to-all that produced ``x_RD``; its backward is issued from here.
            bounds: ``offsets_E1`` as host ints, when known (the references then read nothing).
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
        return _ExpertsFn.apply(
            x_RD, *tensors, weights, offsets_E1, bounds, ops, self._spec, to_expert, to_rank, link, None, None
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
