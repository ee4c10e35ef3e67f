"""Routing stages as autograd Functions: gate, permute, unpermute.

The gating state of one forward of one MoE layer is a :class:`BatchRouting`: it carries each
expert's used capacity from chunk to chunk and sums the aux/z statistics over the whole local
batch, so chunking changes no slot and no drop; the losses and gradients only by float32 rounding
(sums taken chunk by chunk; docs/design.md, idea 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from lancet_rt import trace as _trace
from lancet_rt.kernels.reference import GatingOutput
from lancet_rt.runtime import scope as _scope


@dataclass
class BatchRouting:
    """The routing state of one MoE layer over one local batch, shared by its chunks.

    Args:
        num_experts: E.
        top_k: K.
        total_tokens: T of the whole local batch (capacity and the losses' means use it).
        capacity_factor: None for dropless.
        device: where the counters live.
    """

    num_experts: int
    top_k: int
    total_tokens: int
    capacity_factor: Optional[float]
    device: torch.device
    used_E: torch.Tensor = field(init=False)
    score_sum_E: torch.Tensor = field(init=False)
    zsq_sum: torch.Tensor = field(init=False)
    kept_E: torch.Tensor = field(init=False)
    routed_tokens: int = 0
    next_chunk: int = 0
    _loss_grads: Optional[tuple] = field(default=None, init=False, repr=False)
    # The Triton gating's per-batch buffers (gating_buffers): the spare carried counter, the chunk's slots
    # (by shape) and its aux/z sums (by dtype), each reused from chunk to chunk
    _spare: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        E = self.num_experts
        self.used_E = torch.zeros(E, dtype=torch.int32, device=self.device)
        self.kept_E = torch.zeros(E, dtype=torch.int64, device=self.device)
        self.score_sum_E = torch.zeros(E, dtype=torch.float32, device=self.device)
        self.zsq_sum = torch.zeros((), dtype=torch.float32, device=self.device)

    @property
    def capacity(self) -> Optional[int]:
        """C = ceil(capacity_factor * T * K / E) over the whole local batch, or None (dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.total_tokens * self.top_k / self.num_experts)

    @property
    def complete(self) -> bool:
        return self.routed_tokens == self.total_tokens

    def aux_loss(self) -> torch.Tensor:
        """E * sum_e f_e * P_e over the tokens routed so far (the whole batch once complete)."""
        T = max(self.total_tokens, 1)
        f_E = self.used_E.to(self.score_sum_E.dtype) / (T * self.top_k)
        return self.num_experts * (f_E * self.score_sum_E / T).sum()

    def z_loss(self) -> torch.Tensor:
        return self.zsq_sum / max(self.total_tokens, 1)

    def gating_buffers(self, T: int, dtype: torch.dtype) -> dict:
        """``out=``, ``totals=``, ``row_TK=``, ``scratch=`` and (with a capacity) ``kept_E=`` for the Triton
        gating of the next chunk (T tokens, logits of ``dtype``): fresh tensors for the chunk's results
        (experts, weights, dispatch rows: in a chunked forward each the chunk's piece of one batch-sized
        buffer, :func:`lancet_rt.runtime.scope.chunk_empty`, which lives until the last chunk's piece dies;
        and its kept rows: the counts when dropless, else ``kept_E``), and buffers of the batch reused from
        chunk to chunk for what only this forward reads (the slots, the counts with a capacity, the chunk's
        aux/z sums, the next carried counter: the one the previous chunk read, see :meth:`recycle`; the
        per-span buffers of a call of several spans, kept in ``scratch``). The totals are this state's
        sums, which the kernel adds the chunk to in place (in ``dtype``, as the unfused path's additions
        convert them)."""
        E, K, dev = self.num_experts, self.top_k, self.device
        if self.score_sum_E.dtype != dtype:
            self.score_sum_E, self.zsq_sum = self.score_sum_E.to(dtype), self.zsq_sum.to(dtype)
        spare = self._spare
        if spare.get("slot_TK") is None or spare["slot_TK"].shape[0] != T:
            spare["slot_TK"] = torch.empty(T, K, dtype=torch.int32, device=dev)
        if spare.get("sums") is None or spare["sums"][0].dtype != dtype:
            spare["sums"] = (torch.empty(E, dtype=dtype, device=dev), torch.empty((), dtype=dtype, device=dev))
        used = spare.pop("used_E", None)
        kept = torch.empty(E, dtype=torch.int32, device=dev)
        if self.capacity is not None and spare.get("counts_E") is None:
            spare["counts_E"] = torch.empty(E, dtype=torch.int32, device=dev)
        expert_TK, row_TK = _scope.chunk_empty("gate.expert_row_TK", (T, K), torch.int32, dev, count=2)
        out = GatingOutput(
            expert_TK,
            _scope.chunk_empty("gate.weight_TK", (T, K), dtype, dev),
            spare["slot_TK"],
            kept if self.capacity is None else spare["counts_E"],
            torch.empty(E, dtype=torch.int32, device=dev) if used is None else used,
            *spare["sums"],
        )
        totals = (self.kept_E, self.score_sum_E, self.zsq_sum)
        buffers = dict(out=out, totals=totals, row_TK=row_TK, scratch=spare.setdefault("scratch", {}))
        if self.capacity is not None:
            buffers["kept_E"] = kept
        return buffers

    def recycle(self, used_E: torch.Tensor) -> None:
        """Keep a carried counter no longer current (the one a chunk read; its forward is done with it)
        as the next chunk's output buffer (:meth:`gating_buffers`)."""
        self._spare["used_E"] = used_E

    def loss_grads(self, dtype: torch.dtype, aux_coef: float, z_coef: float) -> tuple:
        """(gradient of ``score_sum_E``, of ``zsq_sum``; None where the coefficient is 0) that the aux
        and z losses of the whole batch give every chunk: made once, at the first chunk's backward
        (the batch's counts are final by then), and shared by the others."""
        key = (dtype, aux_coef, z_coef)
        if self._loss_grads is None or self._loss_grads[0] != key:
            T = max(self.total_tokens, 1)
            grad_score_sum = grad_zsq = None
            if aux_coef > 0:
                # d(E * sum_e f_e * score_sum_e / T) / d score_sum_e = E * f_e / T, f_e = used_e / (T K)
                f_E = self.used_E.to(dtype) / (T * self.top_k)
                grad_score_sum = (aux_coef * self.num_experts / T) * f_E
            if z_coef > 0:
                # torch.full, not torch.tensor(..., device=...): the latter is a pageable host-to-device
                # copy, which on CUDA syncs the host with the stream.
                grad_zsq = torch.full((), z_coef / T, dtype=dtype, device=self.device)
            self._loss_grads = (key, (grad_score_sum, grad_zsq))
        return self._loss_grads[1]


class _Gate(torch.autograd.Function):
    """logits_TE -> (weight_TK, expert_TK, row_TK, kept_E); updates the batch's carried state.

    Backward adds the aux and z losses' gradients (scaled by their coefficients, over the whole
    batch) to the weights' gradient, so they reach the router without the user adding anything to
    the loss. The batch statistics they need are final by the time any backward runs.
    """

    @staticmethod
    def forward(
        ctx,
        logits_TE,
        state: BatchRouting,
        ops,
        score_fn,
        normalize_topk,
        aux_coef,
        z_coef,
        expert_bias,
        n_group,
        topk_group,
        scaling,
    ):
        used_in = state.used_E
        # The Triton gating writes into the state's buffers and adds the chunk to its sums itself
        fused = _fused_gating(ops)
        buffers = state.gating_buffers(logits_TE.shape[0], logits_TE.dtype) if fused else {}
        out = ops.gating_fwd(
            logits_TE,
            state.top_k,
            used_in,
            capacity=state.capacity,
            score_fn=score_fn,
            normalize_topk=normalize_topk,
            expert_bias=expert_bias,
            n_group=n_group,
            topk_group=topk_group,
            scaling=scaling,
            **buffers,
        )
        C = state.capacity
        # Rows this chunk keeps per expert (int32): its counts, up to the room the capacity leaves after
        # the earlier chunks (min(used_in + counts, C) - min(used_in, C)): the kernel's when fused, else in
        # three ops (torch.rsub: ``C - used_in`` would go through Tensor.__rsub__, a Python wrapper).
        # The dispatch rows too: the kernel's when fused, else dispatch_rows
        if fused:
            kept_E = buffers.get("kept_E", out.counts_E)
        elif C is None:
            kept_E = out.counts_E
        else:
            kept_E = torch.minimum(out.counts_E, torch.rsub(used_in, C).clamp_(min=0))
        state.used_E = out.used_E
        if not fused:
            state.kept_E += kept_E
            state.score_sum_E = state.score_sum_E.to(out.score_sum_E.dtype) + out.score_sum_E
            state.zsq_sum = state.zsq_sum.to(out.zsq_sum.dtype) + out.zsq_sum
        state.routed_tokens += logits_TE.shape[0]
        if fused:
            row_TK = buffers["row_TK"]
            state.recycle(used_in)
        else:
            row_TK = ops.dispatch_rows(out.expert_TK, out.slot_TK, used_in, kept_E)

        ctx.save_for_backward(logits_TE, out.expert_TK)
        ctx.state, ctx.ops, ctx.score_fn, ctx.normalize, ctx.scaling = state, ops, score_fn, normalize_topk, scaling
        ctx.grads = _GradPieces("gate.grad_logits_TE") if fused else None
        ctx.aux_coef, ctx.z_coef = aux_coef, z_coef
        ctx.mark_non_differentiable(out.expert_TK, row_TK, kept_E)
        ctx.set_materialize_grads(False)  # (no zero gradients made for the three integer outputs)
        return out.weight_TK, out.expert_TK, row_TK, kept_E

    @staticmethod
    def backward(ctx, grad_weight_TK, _g_expert, _g_row, _g_kept):
        logits_TE, expert_TK = ctx.saved_tensors
        grad_score_sum, grad_zsq = ctx.state.loss_grads(logits_TE.dtype, ctx.aux_coef, ctx.z_coef)
        grad_logits = ctx.ops.gating_bwd(
            logits_TE,
            expert_TK,
            grad_weight_TK,
            grad_score_sum,
            grad_zsq,
            score_fn=ctx.score_fn,
            normalize_topk=ctx.normalize,
            scaling=ctx.scaling,
            **_out(ctx.grads, 0, logits_TE.shape, logits_TE.dtype, logits_TE.device),
        )
        return grad_logits, None, None, None, None, None, None, None, None, None, None


class _GradPieces:
    """Where a routing Function's backward gets its per-token gradients ([T, ...] each): the chunk's pieces
    of batch-sized buffers shared by the chunks' n-th calls of the Function in one chunked forward, one
    :class:`lancet_rt.runtime.scope.ChunkSite` per output (its first caller in backward allocates for all
    the chunks, whichever chunk's backward runs first: 2 host ops per batch instead of one allocation
    per chunk). Made in the forward and kept on the Function's ctx, since the backward runs after the
    forward's scope has ended, maybe on another thread. Each chunk's piece is handed out once: a
    backward run again (``retain_graph``), a recomputation (no scope), a chunk whose shape differs,
    and the references' path allocate as before (:func:`_out`: no ``out=``)."""

    def __init__(self, *sites: str):
        scope = _scope.current()
        self.chunk = None if scope is None else scope.chunk
        self.sites = tuple(_scope.chunk_site(site) for site in sites)

    def take(self, i: int, shape, dtype: torch.dtype, device) -> Optional[torch.Tensor]:
        """This chunk's piece for output ``i``, or None (the kernel allocates)."""
        site = self.sites[i]
        got = None if site is None else site.take(self.chunk, 1, tuple(shape), dtype, device)
        return None if got is None else got[0]


def _out(grads: Optional[_GradPieces], i: int, shape, dtype: torch.dtype, device) -> dict:
    """``out=`` for a kernel's gradient from ``grads`` (its piece for output ``i``), or no argument."""
    piece = None if grads is None else grads.take(i, shape, dtype, device)
    return {} if piece is None else {"out": piece}


def _kernels(ops, family: str) -> bool:
    """Whether ``ops`` run ``family``'s Triton kernels (their ``out=``): the references' and the CPU backend's
    paths keep their own allocations."""
    return getattr(ops, "name", None) == "triton" and family not in getattr(ops, "reference_families", ())


def _fused_gating(ops) -> bool:
    """Whether ``ops`` run the Triton gating (its ``out=`` and ``totals=``): the references' path keeps its
    own allocations and additions."""
    return _kernels(ops, "gating")


def gate(
    logits_TE,
    state,
    ops,
    *,
    score_fn,
    normalize_topk,
    aux_coef,
    z_coef,
    expert_bias=None,
    n_group=1,
    topk_group=None,
    scaling=1.0,
):
    """Run the gating stage for one chunk, carrying ``state`` (capacity, aux/z statistics).

    Args:
        logits_TE: float32 (or float64) [T, E] router logits of this chunk (differentiable).
        state: the layer's :class:`BatchRouting` for this batch.
        ops: the kernel namespace (:func:`lancet_rt.ops.get_ops`).
        score_fn, normalize_topk: as :func:`kernels.reference.gating_fwd_ref`.
        aux_coef, z_coef: coefficients of the aux and z losses, whose gradients the backward adds.
        expert_bias: None or float [E]: selection-only bias (DeepSeek-V3's
            ``e_score_correction_bias``); it gets no gradient.
        n_group, topk_group: group-limited selection (1, None: none).
        scaling: factor on the weights after the normalisation (``routed_scaling_factor``).

    Returns:
        (weight_TK, expert_TK, row_TK, kept_E): the weights (differentiable), the chosen experts,
        each assignment's dispatch row (-1 when dropped), and the rows kept per expert.
    """
    return _Gate.apply(
        logits_TE, state, ops, score_fn, normalize_topk, aux_coef, z_coef, expert_bias, n_group, topk_group, scaling
    )


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, row_TK, num_rows, ops):
        # The kernels' unpermute_bwd needs no src_S: not made there (None). The references read it.
        kernels = "permute" not in getattr(ops, "reference_families", ("permute",))
        x_SD, src_S = ops.permute_fwd(x_TD, row_TK, num_rows, **({"with_src": False} if kernels else {}))
        ctx.save_for_backward(row_TK)
        ctx.ops = ops
        ctx.grads = _GradPieces("permute.grad_x_TD") if _kernels(ops, "permute") else None
        if src_S is not None:
            ctx.mark_non_differentiable(src_S)
        ctx.set_materialize_grads(False)
        return x_SD, src_S

    @staticmethod
    def backward(ctx, grad_x_SD, _g_src):
        if grad_x_SD is None:
            return None, None, None, None
        (row_TK,) = ctx.saved_tensors
        shape = (row_TK.shape[0], grad_x_SD.shape[-1])
        out = _out(ctx.grads, 0, shape, grad_x_SD.dtype, grad_x_SD.device)
        return ctx.ops.permute_bwd(grad_x_SD.contiguous(), row_TK, **out), None, None, None


def permute(x_TD, row_TK, num_rows, ops):
    """x_TD rows into the dispatch layout. Returns (x_SD, src_S); src_S is None on the kernels (whose
    unpermute backward does not read it)."""
    return _Permute.apply(x_TD, row_TK, num_rows, ops)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_SD, row_TK, weight_TK, src_S, ops, link, dropless):
        ctx.save_for_backward(y_SD, row_TK, weight_TK, src_S)
        ctx.ops, ctx.link = ops, link
        ctx.chunk = _scope.current().chunk if _scope.current() is not None else None
        ctx.grads = None
        if _kernels(ops, "permute"):
            # The gradients' pieces: the weights' [T, K], and the rows' [S, D] where S = T K in every chunk
            # (dropless: proportional to the chunk's tokens too; else the kernel allocates them)
            ctx.grads = _GradPieces("unpermute.grad_weight_TK", "unpermute.grad_y_SD")
            ctx.rows_piece = dropless and y_SD.shape[0] == row_TK.shape[0] * row_TK.shape[1]
            # the chunk's piece of one batch-sized output (scope.chunk_empty); the references allocate their own
            out = _scope.chunk_empty("unpermute.y_TD", (row_TK.shape[0], y_SD.shape[-1]), y_SD.dtype, y_SD.device)
            return ops.unpermute_fwd(y_SD, row_TK, weight_TK, out=out)
        return ops.unpermute_fwd(y_SD, row_TK, weight_TK)

    @staticmethod
    def backward(ctx, grad_y_TD):
        y_SD, row_TK, weight_TK, src_S = ctx.saved_tensors
        grads, kw = ctx.grads, {}
        if grads is not None:
            grad_w = grads.take(0, row_TK.shape, torch.float32, y_SD.device)
            if grad_w is not None:
                grad_y_SD = grads.take(1, y_SD.shape, y_SD.dtype, y_SD.device) if ctx.rows_piece else None
                if grad_y_SD is None:
                    grad_y_SD = torch.empty(y_SD.shape, dtype=y_SD.dtype, device=y_SD.device)
                kw["out"] = (grad_y_SD, grad_w)
        with _trace.span("unpermute bwd", chunk=ctx.chunk):
            grad_y_SD, grad_w = ctx.ops.unpermute_bwd(grad_y_TD.contiguous(), y_SD, row_TK, weight_TK, src_S, **kw)
        if ctx.link is not None and ctx.link.early is None:  # (None: not issued from the forward)
            ctx.link.issue(grad_y_SD)  # the combine's backward all-to-all starts now
        return grad_y_SD, None, grad_w, None, None, None, None


def unpermute(y_SD, row_TK, weight_TK, src_S, ops, link=None, dropless=False):
    """Weighted sum over K of the expert outputs back into token order: y_TD.

    ``link``: the combine all-to-all whose output ``y_SD`` is; its backward is issued from here.
    ``dropless``: every assignment is kept in every chunk (``y_SD`` has T K rows), so the rows' gradient
    is a per-token piece of one batch-sized buffer too (:class:`_GradPieces`).
    """
    return _Unpermute.apply(y_SD, row_TK, weight_TK, src_S, ops, link, dropless)
