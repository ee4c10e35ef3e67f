"""Plain PyTorch references for the dense (non-MoE) kernels: fused residual add + RMSNorm and the
per-chunk softmax cross-entropy with its gradient (the inner step of the chunked linear cross-entropy).

Like :mod:`lancet_rt.kernels.reference`, these define the semantics the Triton launchers in
:mod:`lancet_rt.kernels.norm` and :mod:`lancet_rt.kernels.linear_ce` meet, and they are the
``LANCET_KERNELS=torch`` path. Statistics are computed in float32 (float64 inputs: in float64).

Shape letters: R rows, D features, C rows of a loss chunk, V vocabulary.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def add_rmsnorm_fwd_ref(
    x_RD: torch.Tensor, residual_RD: Optional[torch.Tensor], weight_D: torch.Tensor, eps: float = 1e-6
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (in x's dtype, as transformers adds), ``y = s / rms(s) * weight``.

    Args:
        x_RD: [R, D] input (or any leading dimensions, [..., D]: rstd is then flat).
        residual_RD: like x, the residual in x's dtype, or None (plain RMSNorm: ``s`` is ``x``).
        weight_D: [D] scale.
        eps: added to the mean square.

    Returns:
        (y_RD in x's dtype, s_RD the sum for the next residual, rstd_R float32 1 / rms(s)).
    """
    s = x_RD if residual_RD is None else x_RD + residual_RD
    acc = _acc(s.dtype)
    s_f = s.to(acc)
    rstd = torch.rsqrt(s_f.pow(2).mean(-1, keepdim=True) + eps)
    y = (s_f * rstd) * weight_D.to(acc)
    return y.to(x_RD.dtype), s, rstd.view(-1)


def add_rmsnorm_bwd_ref(
    grad_y_RD: torch.Tensor,
    grad_s_RD: Optional[torch.Tensor],
    s_RD: torch.Tensor,
    rstd_R: torch.Tensor,
    weight_D: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`add_rmsnorm_fwd_ref`: with n = s * rstd,
    ds = rstd * (dy * w - n * mean(dy * w * n)) + grad_s, dweight = sum_r dy * n.

    Returns:
        (grad_s_RD: the gradient of x and of the residual, in s's dtype; grad_weight_D in weight's dtype).
    """
    acc = _acc(s_RD.dtype)
    r = rstd_R.to(acc).view(s_RD.shape[:-1] + (1,))
    n = s_RD.to(acc) * r
    dy = grad_y_RD.to(acc)
    dn = dy * weight_D.to(acc)
    ds = r * (dn - n * (dn * n).mean(-1, keepdim=True))
    if grad_s_RD is not None:
        ds = ds + grad_s_RD.to(acc)
    return ds.to(s_RD.dtype), (dy * n).sum(tuple(range(s_RD.dim() - 1))).to(weight_D.dtype)


def bad_label_mask(labels: torch.Tensor, V: int, ignore_index: int) -> torch.Tensor:
    """The labels a cross-entropy over ``V`` classes refuses, without a host read.

    Args:
        labels: integer targets, any shape.
        V: the number of classes.
        ignore_index: the label of rows without loss (never bad).

    Returns:
        A boolean tensor like ``labels``: True where a label is outside ``[0, V)`` and not ``ignore_index``.
    """
    return (labels != ignore_index) & ((labels < 0) | (labels >= V))


def check_label_range(name: str, labels: torch.Tensor, V: int, ignore_index: int) -> None:
    """Refuse labels outside ``[0, V)`` other than ``ignore_index``, as ``torch.nn.functional.cross_entropy``
    does. One host read on a GPU tensor; more only when raising.

    Args:
        name: the argument's name, for the message.
        labels: integer targets.
        V: the number of classes.
        ignore_index: the label of rows without loss.

    Raises:
        ValueError: naming ``name``, the bad values, ``V`` and ``ignore_index``.
    """
    bad = bad_label_mask(labels, V, ignore_index)
    if bool(bad.any()):
        values = labels[bad]
        shown = sorted(set(values.tolist()))
        more = f" (and {len(shown) - 8} more distinct)" if len(shown) > 8 else ""
        raise ValueError(
            f"{name} must be in [0, V={V}) or the ignore index {ignore_index}; got "
            f"{values.numel()} outside: {shown[:8]}{more}"
        )


def ce_grad_fwd_ref(
    logits_CV: torch.Tensor,
    labels_C: torch.Tensor,
    scale: float,
    ignore_index: int = -100,
    *,
    check_labels: bool = True,
) -> torch.Tensor:
    """Cross-entropy of each row and its gradient, the gradient written over the logits.

    Args:
        logits_CV: [C, V] float32 (float64 accepted) logits, overwritten with
            ``scale * (softmax(logits) - onehot(label))`` (zero on ignored rows).
        labels_C: [C] integer targets; ``ignore_index`` rows contribute no loss and no gradient.
        scale: the factor of the gradient (1 / the number of valid tokens of the whole batch).
        ignore_index: the label of rows without loss.
        check_labels: raise ValueError on a label outside ``[0, V)`` other than ``ignore_index``
            (False: the caller checked them, e.g. once for the whole batch).

    Returns:
        loss_C [C] in the logits' dtype: ``logsumexp(logits) - logits[label]``, 0 on ignored rows.
    """
    if check_labels:
        check_label_range("labels_C", labels_C, logits_CV.shape[-1], ignore_index)
    valid = labels_C != ignore_index
    target = torch.where(valid, labels_C, 0).long()
    lse = torch.logsumexp(logits_CV, dim=-1)
    picked = logits_CV.gather(1, target[:, None])
    loss = torch.where(valid, lse - picked[:, 0], 0.0)
    # In place: one read for lse and four passes over [C, V] (out of place, this took seven passes
    # and three [C, V] buffers: the CPU path runs it once per inner chunk of every chunk).
    grad = logits_CV.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, target[:, None], torch.full_like(picked, -1.0))
    grad.mul_(scale).masked_fill_(~valid[:, None], 0.0)  # (scale first: inf * 0 would be NaN)
    return loss


__all__ = ["add_rmsnorm_fwd_ref", "add_rmsnorm_bwd_ref", "ce_grad_fwd_ref"]
