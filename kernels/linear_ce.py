"""Softmax cross-entropy of a chunk of logits with its gradient written in place: the inner step of
the chunked linear cross-entropy (``lancet_rt.dense.LinearCrossEntropy``), which never holds more
than one chunk's [C, V] logits.

One program per row, two passes over V: an online max / sum-of-exp, then ``scale * (softmax - onehot)``
over the logits (zero on ``ignore_index`` rows). A label outside ``[0, V)`` (not the ignore index)
is never used as an offset: its row's loss and gradient are NaN. The launcher refuses such labels
(ValueError) unless told its caller checked them (``check_labels=False``: the chunked loss checks the
whole batch once, without a host read of its own). The row count ``C`` is not specialised on, so a
new chunk length does not compile the kernel again. It replaces PyTorch's log_softmax + nll + their
backward (which read and write [C, V] five times) with two reads and one write.
Reference: :func:`lancet_rt.kernels.reference_dense.ce_grad_fwd_ref`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import check_out, check_tensor, interpreting
from .reference_dense import check_label_range


@triton.jit(do_not_specialize=["C"])
def _ce_grad_fwd_kernel(
    # pointers
    logits_ptr,  # [C, V] float32, overwritten with the gradient
    labels_ptr,  # [C] int64 targets
    loss_ptr,  # [C] float32 output
    # sizes
    C,
    V,
    scale,
    ignore_index,
    # strides
    stride_lc,
    # meta-parameters
    BLOCK_V: tl.constexpr,
):
    """loss = lse - logit[label]; logits <- scale * (exp(logits - lse) - onehot), 0 on ignored rows."""
    pid_c = tl.program_id(0).to(tl.int64)
    row = logits_ptr + pid_c * stride_lc
    label = tl.load(labels_ptr + pid_c)
    valid = label != ignore_index
    bad = valid & ((label < 0) | (label >= V))  # (never an offset: NaN loss and gradient)
    m = float("-inf")
    acc = 0.0
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        b_x = tl.load(row + offs_v, mask=offs_v < V, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(b_x, axis=0))
        acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(b_x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(acc)
    target = tl.where(valid & ~bad, label, 0)
    picked = tl.load(row + target)
    tl.store(loss_ptr + pid_c, tl.where(bad, float("nan"), tl.where(valid, lse - picked, 0.0)))
    g_scale = tl.where(bad, float("nan"), tl.where(valid, scale, 0.0))
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        b_x = tl.load(row + offs_v, mask=mask_v, other=0.0)
        b_g = tl.exp(b_x - lse) - tl.where(offs_v == target, 1.0, 0.0)
        tl.store(row + offs_v, b_g * g_scale, mask=mask_v)


def ce_grad_fwd(
    logits_CV: torch.Tensor,
    labels_C: torch.Tensor,
    scale: float,
    ignore_index: int = -100,
    *,
    out: Optional[torch.Tensor] = None,
    check_labels: bool = True,
) -> torch.Tensor:
    """Cross-entropy per row and its gradient over the logits, in place.

    Args:
        logits_CV: [C, V] float32, unit stride along V; overwritten with
            ``scale * (softmax(logits) - onehot(label))``, zero on ignored rows.
        labels_C: [C] int64 targets in [0, V) or ``ignore_index``.
        scale: the gradient's factor (1 / the number of valid tokens of the whole batch).
        ignore_index: the label of rows without loss.
        out: optional contiguous [C] float32 buffer for the loss.
        check_labels: raise ValueError on a label outside ``[0, V)`` other than ``ignore_index`` (a
            host read on CUDA). False: the caller checked them; such a row's loss and gradient are NaN.

    Returns:
        loss_C [C] float32, 0 on ignored rows.
    """
    check_tensor("logits_CV", logits_CV, ndim=2, dtypes=(torch.float32,))
    if logits_CV.stride(-1) != 1:
        raise ValueError("logits_CV must have unit stride along V")
    C, V = logits_CV.shape
    check_tensor("labels_C", labels_C, shape=(C,), dtypes=(torch.int64,), device=logits_CV.device)
    loss = torch.empty(C, device=logits_CV.device, dtype=torch.float32) if out is None else out
    if out is not None:
        check_out("out", out, (C,), torch.float32, logits_CV.device)
    if C == 0:
        return loss
    if check_labels:
        check_label_range("labels_C", labels_C, V, ignore_index)
    block_v = min(64 if interpreting() or logits_CV.device.type != "cuda" else 4096, triton.next_power_of_2(V))
    _ce_grad_fwd_kernel[(C,)](
        logits_CV,
        labels_C.contiguous(),
        loss,
        C,
        V,
        float(scale),
        int(ignore_index),
        logits_CV.stride(0),
        BLOCK_V=block_v,
        num_warps=4 if block_v <= 1024 else 8,
    )
    return loss


__all__ = ["ce_grad_fwd"]
