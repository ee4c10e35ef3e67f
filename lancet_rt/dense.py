"""The dense (non-MoE) fused layers: residual add + RMSNorm and the chunked linear cross-entropy.

Both are torch custom operators (``torch.library.custom_op``, namespace ``lancet``) with fake
implementations and autograd formulas, so ``torch.compile(fullgraph=True)`` traces through them;
their implementations pick the Triton kernels or the references through :func:`lancet_rt.ops.get_ops`
(Triton on CUDA and under ``TRITON_INTERPRET=1``, the references on CPU).

:func:`linear_cross_entropy` computes ``CE(hidden @ weight.T, labels)`` chunk by chunk and its
gradients w.r.t. hidden and weight in the forward (Liger-Kernel's fused linear cross-entropy
scheme): at most one chunk's [C, V] float32 logits exist at a time, and the backward only scales
the saved gradients by the incoming one. The mean is over the valid labels of the whole input (or
``num_items_in_batch``), as transformers' ``ForCausalLMLoss`` computes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lancet_rt import ops as _ops
from lancet_rt.kernels.reference_dense import bad_label_mask, check_label_range
from lancet_rt.runtime import scope as _scope


# ------------------------------------------------------------------------------------- add + RMSNorm
@torch.library.custom_op("lancet::add_rmsnorm", mutates_args=())
def _add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ops.get_ops(x.device, x.dtype).add_rmsnorm_fwd(x, residual, weight, eps)


@torch.library.custom_op("lancet::rmsnorm", mutates_args=())
def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = _ops.get_ops(x.device, x.dtype).add_rmsnorm_fwd(x, None, weight, eps)
    return y, rstd


@torch.library.custom_op("lancet::add_rmsnorm_bwd", mutates_args=())
def _add_rmsnorm_bwd(
    grad_y: torch.Tensor, grad_s: Optional[torch.Tensor], s: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _ops.get_ops(s.device, s.dtype).add_rmsnorm_bwd(grad_y, grad_s, s, rstd, weight)


@_add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@_rmsnorm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@_add_rmsnorm_bwd.register_fake
def _(grad_y, grad_s, s, rstd, weight):
    return torch.empty_like(s), torch.empty_like(weight)


def _add_rmsnorm_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2], inputs[2])


def _add_rmsnorm_backward(ctx, grad_y, grad_s, _grad_rstd):
    s, rstd, weight = ctx.saved_tensors
    ds, dw = _add_rmsnorm_bwd(grad_y.contiguous(), None if grad_s is None else grad_s.contiguous(), s, rstd, weight)
    return ds, ds, dw, None


def _rmsnorm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1], inputs[1])


def _rmsnorm_backward(ctx, grad_y, _grad_rstd):
    x, rstd, weight = ctx.saved_tensors
    ds, dw = _add_rmsnorm_bwd(grad_y.contiguous(), None, x, rstd, weight)
    return ds, dw, None


_add_rmsnorm.register_autograd(_add_rmsnorm_backward, setup_context=_add_rmsnorm_setup)
_rmsnorm.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup)


def add_rmsnorm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6):
    """Fused ``s = x + residual``, ``y = s * rsqrt(mean(s^2) + eps) * weight`` over the last dimension.

    Args:
        x: [..., D] bf16/fp16/fp32 (float64 runs the reference).
        residual: like x, or None (plain RMSNorm); another float dtype promotes both (y and s in the
            promoted dtype).
        weight: [D].
        eps: added to the mean square.

    Returns:
        ``y`` when ``residual`` is None, else ``(y, s)``: s the sum, the next residual.
    """
    if residual is not None and residual.dtype != x.dtype:
        # (under autocast a bf16 sublayer output meets a float32 residual): the sum in the promoted
        # dtype, as ``x + residual`` computes it, then normed in that dtype
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    if not torch.compiler.is_compiling() and _ops.implementation(x.device) == "torch":
        # eager on the references, which take [..., D] as it is: the same arithmetic without the
        # custom-op dispatch and the reshapes (host time, paid once per chunk)
        return _AddRMSNormFn.apply(x, residual, weight, float(eps))
    if (
        not torch.compiler.is_compiling()
        and x.dim() > 2
        and x.is_contiguous()
        and (residual is None or residual.is_contiguous())
    ):  # the kernels take contiguous [..., D] rows as they are: no reshape to [N, D] and back (4 views
        # a call, forward and backward)
        return _AddRMSNormFn.apply(x, residual, weight, float(eps))
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    r2 = None if residual is None else residual.reshape(-1, D).contiguous()
    if not torch.compiler.is_compiling():  # eager on the kernels: [N, D] rows, no custom-op dispatch
        if r2 is None:
            return _AddRMSNormFn.apply(x2, None, weight, float(eps)).view(x.shape)
        y, s = _AddRMSNormFn.apply(x2, r2, weight, float(eps))
    elif r2 is None:  # compiling: the custom ops, traceable
        return _rmsnorm(x2, weight, float(eps))[0].view(x.shape)
    else:
        y, s, _ = _add_rmsnorm(x2, r2, weight, float(eps))
    return y.view(x.shape), s.view(x.shape)


class _AddRMSNormFn(torch.autograd.Function):
    """Eager :func:`add_rmsnorm` (on [N, D] rows for the kernels): the forward and backward of
    ``lancet::add_rmsnorm`` (of ``lancet::rmsnorm`` when ``residual`` is None, returning y alone),
    called directly."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        ops = _ops.get_ops(x.device, x.dtype)
        # The kernels recompute rstd from s in the backward (the same value): no [R] statistics
        # allocated and saved. The references (the CPU path) save it, as before.
        kernels = "norm" not in getattr(ops, "reference_families", ("norm",))
        # On the kernels, y and s are this chunk's pieces of batch-sized buffers in a chunked forward
        # (scope.chunk_empty: one allocation per batch, not per chunk)
        kw = {}
        if kernels:
            kw = dict(with_rstd=False)
            if residual is None:
                kw["out"] = _scope.chunk_empty("rmsnorm.y", x.shape, x.dtype, x.device)
            else:
                kw["out"], kw["out_sum"] = _scope.chunk_empty("add_rmsnorm.y_s", x.shape, x.dtype, x.device, count=2)
        y, s, rstd = ops.add_rmsnorm_fwd(x, residual, weight, eps, **kw)
        ctx.save_for_backward(s, rstd, weight)
        ctx.eps = eps
        # On the kernels in a chunked forward, what the chunks' backward share here (its ChunkSite):
        # the gradient's pieces of one batch-sized buffer and one dweight partials buffer used in turn
        ctx.site = _scope.chunk_site("rmsnorm.bwd" if residual is None else "add_rmsnorm.bwd") if kernels else None
        ctx.chunk = _scope.current().chunk if ctx.site is not None else None
        ctx.residual = residual is not None
        ctx.set_materialize_grads(False)
        return (y, s) if ctx.residual else y

    @staticmethod
    def backward(ctx, grad_y, grad_s=None):
        s, rstd, weight = ctx.saved_tensors
        if grad_y is None:  # (only the sum is used downstream)
            grad_y = torch.zeros_like(s)
        kw = {} if rstd is not None else {"eps": ctx.eps}
        site = ctx.site
        if site is not None:  # this chunk's piece of the chunks' ds (None: allocated by the kernel's launcher)
            got = site.take(ctx.chunk, 1, s.shape, s.dtype, s.device)
            if got is not None:
                kw["out"] = got[0]
            kw["partials"] = lambda shape: site.lend(shape, torch.float32, s.device)
        ds, dw = _ops.get_ops(s.device, s.dtype).add_rmsnorm_bwd(
            grad_y.contiguous(), None if grad_s is None else grad_s.contiguous(), s, rstd, weight, **kw
        )
        return ds, ds if ctx.residual else None, dw, None


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with an optional fused residual add (see :func:`add_rmsnorm`).

    ``forward(x)`` returns y; ``forward(x, residual)`` returns ``(y, x + residual)``.
    """

    def __init__(self, d_model: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return add_rmsnorm(x, residual, self.weight, self.eps)


# ------------------------------------------------------------------------------------- linear CE
@torch.library.custom_op("lancet::linear_ce", mutates_args=())
def _linear_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    divisor: torch.Tensor,
    ignore_index: int,
    chunk: int,
    need_grad_h: bool,
    need_grad_w: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(hidden.device.type, enabled=False):  # the inputs' dtype, as the op's contract says
        return _linear_ce_chunks(hidden, weight, labels, divisor, ignore_index, chunk, need_grad_h, need_grad_w)


def _linear_ce_chunks(hidden, weight, labels, divisor, ignore_index, chunk, need_grad_h, need_grad_w, grad_w_acc=None):
    """The chunk loop; with ``grad_w_acc`` (float32 [V, D]) the head's gradient accumulates there.
    ``divisor``: a tensor (read here) or its value already read (a float: no host read)."""
    ops = _ops.get_ops(hidden.device, hidden.dtype)
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    d = divisor if isinstance(divisor, float) else float(divisor)  # the whole batch's count of valid labels
    scale = 1.0 / d if d else float("inf")  # (no valid label: loss 0 / 0 = NaN, as transformers')
    total = torch.zeros((), device=hidden.device, dtype=acc)
    grad_h = torch.empty_like(hidden) if need_grad_h else hidden.new_empty(0)
    grad_w = (
        grad_w_acc
        if grad_w_acc is not None
        else torch.zeros(weight.shape, device=weight.device, dtype=acc)
        if need_grad_w
        else weight.new_empty(0)
    )
    if d != d:  # a NaN divisor: perhaps flagged by _flag_bad_labels (raises if so)
        check_label_range("labels", labels, weight.shape[0], ignore_index)
    for c0 in range(0, hidden.shape[0], chunk):
        h_CD = hidden[c0 : c0 + chunk]
        logits_CV = (h_CD @ weight.t()).to(acc)  # the head in the model's dtype, the loss in float32
        total += ops.ce_grad_fwd(logits_CV, labels[c0 : c0 + chunk], scale, ignore_index, check_labels=False).sum()
        if need_grad_h:  # logits_CV now holds d loss / d logits
            torch.mm(logits_CV.to(weight.dtype), weight, out=grad_h[c0 : c0 + chunk])
        if need_grad_w or grad_w_acc is not None:
            grad_w.addmm_(logits_CV.t(), h_CD.to(acc))
    return total / d, grad_h, grad_w if grad_w_acc is not None else grad_w.to(weight.dtype)


@_linear_ce.register_fake
def _(hidden, weight, labels, divisor, ignore_index, chunk, need_grad_h, need_grad_w):
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return (
        hidden.new_empty((), dtype=acc),
        torch.empty_like(hidden) if need_grad_h else hidden.new_empty(0),
        torch.empty_like(weight) if need_grad_w else weight.new_empty(0),
    )


def _linear_ce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _linear_ce_backward(ctx, grad_loss, _g1, _g2):
    grad_h, grad_w = ctx.saved_tensors
    dh = grad_h * grad_loss.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
    dw = grad_w * grad_loss.to(grad_w.dtype) if ctx.needs_input_grad[1] else None
    return dh, dw, None, None, None, None, None, None


_linear_ce.register_autograd(_linear_ce_backward, setup_context=_linear_ce_setup)


def _flag_bad_labels(labels_T: torch.Tensor, V: int, ignore_index: int, divisor: torch.Tensor) -> torch.Tensor:
    """The divisor (float64), NaN if a label is outside ``[0, V)`` and not ``ignore_index``.

    The chunk loop reads the divisor on the host once anyway; a NaN there makes it check the labels
    and raise ValueError naming them. So the whole batch's labels are checked with a few device ops
    and no host read of their own (on CUDA no extra sync); a label never reaches a kernel unchecked.
    """
    bad = bad_label_mask(labels_T, V, ignore_index).any()
    return torch.where(bad, float("nan"), divisor.to(torch.float64))


def _default_chunk(T: int, D: int, V: int) -> int:
    """Rows per chunk: about T * D logits per chunk (the hidden state's size), a power of two."""
    per = max(1, -(-T * D // max(V, 1)))
    return 1 << (per - 1).bit_length()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift_labels: bool = True,
    num_items_in_batch=None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, labels)`` without holding the [T, V] logits.

    The logits are computed in hidden's dtype and upcast to float32, the loss is summed over the
    valid labels and divided by their count over the whole input (or by ``num_items_in_batch``):
    transformers' ``ForCausalLMLoss``. The gradients w.r.t. hidden and weight are computed in the
    forward, chunk by chunk; the backward scales them.

    Args:
        hidden: [..., D] last hidden state (bf16/fp16/fp32/fp64).
        weight: [V, D] the LM head's weight, hidden's dtype.
        labels: [...] integer labels in ``[0, V)``, hidden's leading shape; ``ignore_index`` marks
            no loss. Any other label raises ValueError (checked on the device; no extra host sync).
        ignore_index: the label without loss.
        shift_labels: predict token t + 1 from position t (pad with ``ignore_index`` and shift along
            the last label dimension, as transformers does); False: labels are already aligned.
        num_items_in_batch: the divisor instead of the count of valid labels (int or tensor).
        chunk_size: rows per chunk (default: about T * D / V, a power of two).

    Returns:
        The scalar loss (float32; float64 for float64 hidden).
    """
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise TypeError("hidden must be a floating-point tensor [..., D]")
    D = hidden.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != D:
        raise ValueError(f"weight must be [V, D={D}], got {getattr(weight, 'shape', type(weight).__name__)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if (
        not isinstance(labels, torch.Tensor)
        or labels.is_floating_point()
        or tuple(labels.shape) != tuple(hidden.shape[:-1])
    ):
        raise ValueError(
            f"labels must be an integer tensor of shape {tuple(hidden.shape[:-1])}, "
            f"got {getattr(labels, 'shape', type(labels).__name__)}"
        )
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
    if shift_labels and labels.dim() > 0:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    labels_T = labels.reshape(-1).long().contiguous()
    h_TD = hidden.reshape(-1, D).contiguous()
    if num_items_in_batch is None:
        divisor = (labels_T != ignore_index).sum()
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device)
    chunk = chunk_size or _default_chunk(h_TD.shape[0], D, weight.shape[0])
    grad = torch.is_grad_enabled()
    divisor = _flag_bad_labels(labels_T, weight.shape[0], int(ignore_index), divisor)
    loss, _, _ = _linear_ce(
        h_TD,
        weight,
        labels_T,
        divisor,
        int(ignore_index),
        int(chunk),
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
    )
    return loss


class LinearCrossEntropy(nn.Module):
    """The LM head and its loss as one module: ``forward(hidden, labels)`` is
    :func:`linear_cross_entropy` with ``head.weight`` (the logits never exist whole).

    Args:
        head: the LM head, an ``nn.Linear`` without bias (its weight is shared, not copied).
        ignore_index, shift_labels, chunk_size: as in :func:`linear_cross_entropy`.
    """

    def __init__(
        self, head: nn.Linear, *, ignore_index: int = -100, shift_labels: bool = True, chunk_size: Optional[int] = None
    ):
        super().__init__()
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise ValueError("head must be an nn.Linear without bias")
        self.head = head
        self.ignore_index, self.shift_labels, self.chunk_size = ignore_index, shift_labels, chunk_size

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        return linear_cross_entropy(
            hidden,
            self.head.weight,
            labels,
            ignore_index=self.ignore_index,
            shift_labels=self.shift_labels,
            num_items_in_batch=num_items_in_batch,
            chunk_size=self.chunk_size,
        )


class _ChunkTerm(torch.autograd.Function):
    """One chunk's loss term; its backward gives the hidden state's gradient (computed in the forward),
    the head's accumulates in a :class:`SharedHeadGrad`."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, divisor, ignore_index, grad_w_acc, chunk, scale):
        loss, grad_h, _ = _linear_ce_chunks(
            hidden, weight, labels, divisor, ignore_index, chunk, ctx.needs_input_grad[0], False, grad_w_acc
        )
        ctx.save_for_backward(grad_h)
        ctx.scale = scale
        if scale is not None and ctx.needs_input_grad[0]:
            scale.grad_hidden = grad_h
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_h,) = ctx.saved_tensors
        if ctx.scale is not None:  # (a dual issued from the forward takes this factor)
            ctx.scale.received = grad_loss
        return grad_h * grad_loss.to(grad_h.dtype), None, None, None, None, None, None, None


class _AttachHeadGrad(torch.autograd.Function):
    """Identity on the summed loss; its backward hands the head its gradient accumulated by the chunks."""

    @staticmethod
    def forward(ctx, loss, weight, grad_w_acc):
        ctx.save_for_backward(grad_w_acc)
        ctx.weight_dtype = weight.dtype
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        (acc,) = ctx.saved_tensors
        return grad_loss, (acc * grad_loss.to(acc.dtype)).to(ctx.weight_dtype), None


class SharedHeadGrad:
    """The chunked linear cross-entropy of a batch cut into pieces (the chunks of
    :class:`lancet_rt.Overlapped`): :meth:`term` gives each piece's loss term (its share of the whole
    batch's mean) and its hidden-state gradient, all pieces accumulate the head's gradient into one
    float32 [V, D] buffer, and :meth:`attach` on the summed loss hands it to the head in the backward
    (one head gradient held, however many pieces). The divisor is read on the host once, here: one
    host read per batch, however many pieces.

    ``rows``: the whole batch's token count. Each piece then runs the inner chunks
    (:func:`linear_cross_entropy`'s default ``chunk_size``) the whole batch would: cutting the batch
    changes neither the transient logits' bound nor the GEMMs' shapes (sized from a piece's own rows,
    4 pieces ran 4x as many 4x thinner GEMMs, slower; bench/results/HISTORY.md). None: from each
    piece's rows. ``labels``: the whole batch's (shifted) labels, checked here within the divisor's one
    host read (a ValueError naming them if one is outside ``[0, V)`` and not ``ignore_index``); None:
    each piece's are checked in :meth:`term`, a host read each."""

    def __init__(
        self,
        weight: torch.Tensor,
        divisor: torch.Tensor,
        ignore_index: int = -100,
        rows: Optional[int] = None,
        labels: Optional[torch.Tensor] = None,
    ):
        self.weight, self.divisor, self.ignore_index = weight, divisor.to(torch.float64), ignore_index
        self.labels_checked = labels is not None
        if self.labels_checked:  # the whole batch's labels, flagged into the divisor: no read of their own
            self.divisor = _flag_bad_labels(labels.reshape(-1), weight.shape[0], ignore_index, self.divisor)
        self.divisor_value = float(self.divisor)  # the one host read of the batch
        if self.labels_checked and self.divisor_value != self.divisor_value:
            check_label_range("labels", labels, weight.shape[0], ignore_index)
        self.rows = rows
        wants = torch.is_grad_enabled() and weight.requires_grad
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.acc = torch.zeros(weight.shape, device=weight.device, dtype=acc) if wants else None

    def term(self, hidden: torch.Tensor, labels: torch.Tensor, scale=None) -> torch.Tensor:
        """hidden [..., D], labels [...] already aligned (shifted): this piece's loss term.
        ``scale``: a :class:`lancet_rt.schedule.early_backward.GradScale` that receives the hidden
        state's gradient (in the forward) and the loss gradient (in the backward)."""
        h_TD = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        labels_T = labels.reshape(-1).long().contiguous()
        chunk = _default_chunk(self.rows or h_TD.shape[0], h_TD.shape[1], self.weight.shape[0])
        if not self.labels_checked:  # labels not given to the constructor: checked here, one host read
            check_label_range("labels", labels_T, self.weight.shape[0], self.ignore_index)
        # (a frozen head, or no grad: acc is None and the term hands the hidden state its gradient alone)
        h_TD = h_TD if torch.is_grad_enabled() else h_TD.detach()
        return _ChunkTerm.apply(
            h_TD, self.weight.detach(), labels_T, self.divisor_value, self.ignore_index, self.acc, chunk, scale
        )

    def attach(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.acc is None else _AttachHeadGrad.apply(loss, self.weight, self.acc)
