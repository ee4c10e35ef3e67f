"""Permute (dispatch layout) and unpermute (weighted combine) of token rows, in Triton.

Semantics are those of :func:`lancet_rt.kernels.reference.permute_fwd_ref`, ``permute_bwd_ref``,
``unpermute_fwd_ref`` and ``unpermute_bwd_ref``; the launchers here have the same signatures (plus
an optional keyword-only ``out=``, and ``permute_fwd``'s ``with_src=False``: no ``src_S``, which
only the references' ``unpermute_bwd`` reads) and return the same types.

``row_TK[t, k]`` is the dispatch row of assignment ``(t, k)`` (-1 when dropped); the kept rows are a
bijection onto ``range(S)``. :func:`dispatch_rows` makes it from the gating's expert and slot
(``lancet_rt.kernels.reference.dispatch_rows_ref``): an exclusive scan of the kept counts per expert
in one tiny launch, then ``row = base[e] + slot`` per assignment, ``T*K*12`` bytes (expert, slot in,
row out). Every kernel (in :mod:`lancet_rt.kernels._permute_kernels`) is driven by ``row_TK`` from
the token side, so no kernel needs atomics and every result is deterministic:

* ``permute_fwd``: a program loads a ``[BLOCK_T, BLOCK_D]`` tile of tokens once and writes it to
  the K rows it feeds. Each dispatch row has exactly one writer (bijection), so this scatter of
  copies is race-free, and it reads every token once instead of K times as a gather through
  ``src_S`` would. ``src_S[row] = t * K + k`` is written on the way (unless ``with_src=False``).
* ``permute_bwd`` / ``unpermute_fwd`` (one kernel, ``HAS_WEIGHT`` off / on): a gather-reduce,
  ``out[t] = sum_k w[t, k] * rows[row_TK[t, k]]`` over the kept k, in k order, in float32, so
  there is no scatter-add and no atomics.
* ``unpermute_bwd``: a program owns ``BLOCK_T`` tokens and walks D; per k it gathers the row of
  ``y_SD`` for the weight gradient (a float32 dot over D, owned by this program, so no cross-program
  reduction) and writes ``w * grad_y`` to that row of ``grad_y_SD`` (again a single writer). The
  token's ``grad_y`` tile is re-read per k from L1/L2, not from DRAM. ``src_S`` is accepted for
  signature parity with the reference but not needed.

All four are memory-bound. Bytes moved, with ``b`` the element size of x / y, ``S`` kept rows,
``N = T * K`` assignments (indices int32, weights float32):

  permute_fwd    ``T*D*b`` (read x) + ``S*D*b`` (write x_SD) + ``N*4`` (row) + ``S*4`` (src)
  permute_bwd    ``S*D*b`` (read) + ``T*D*b`` (write) + ``N*4``
  unpermute_fwd  ``S*D*b`` (read) + ``T*D*b`` (write) + ``N*(4 + 4)``
  unpermute_bwd  ``T*D*b`` (grad_y) + ``S*D*b`` (y) + ``S*D*b`` (write grad_y_SD) + ``N*(4 + 4 + 4)``

Offsets are int64 (``S * D`` passes 2^31 at T=64K, K=8, D=4096). Tiles are ``[BLOCK_T, BLOCK_D]``
with D split across programs (except ``unpermute_bwd``, whose dot needs the whole row); the
config space is pruned on D to 8..16 elements per thread (16-byte vectors for 16-bit types),
autotuned on CUDA keyed on (D, K) and the dtypes, and pinned by ``LANCET_PERMUTE_FWD_CONFIG``,
``LANCET_UNPERMUTE_FWD_CONFIG`` (also serves ``permute_bwd``) or ``LANCET_UNPERMUTE_BWD_CONFIG``,
e.g. ``"BLOCK_T=2,BLOCK_D=1024,num_warps=4"``. Under ``TRITON_INTERPRET=1`` the largest tile
is used, untimed.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from ._common import check_out as _check_out
from ._common import check_tensor as _check_tensor
from ._common import on_tensor_device, run_autotuned
from ._permute_kernels import (
    _ENV_PERMUTE_FWD_CONFIG,
    _ENV_UNPERMUTE_BWD_CONFIG,
    _ENV_UNPERMUTE_FWD_CONFIG,
    _dispatch_rows_kernel,
    _permute_fwd_kernel,
    _regroup_rows_kernel,
    _unpermute_bwd_kernel,
    _unpermute_fwd_kernel,
)

__all__ = ["dispatch_rows", "permute_fwd", "permute_bwd", "unpermute_fwd", "unpermute_bwd", "regroup_rows"]

_INT32_MAX = 2**31 - 1
_FLAT_BLOCK = 1024  # assignments per program of the flat [T * K] dispatch-row kernel


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64, torch.int16)
# The gating's outputs and counters: dispatch_rows takes what gating_fwd and its reference take.
_COUNTER_DTYPES = _INT_DTYPES + (torch.uint8, torch.int8)


def _check_rows(row_TK: torch.Tensor, device) -> torch.Tensor:
    _check_tensor("row_TK", row_TK, ndim=2, dtypes=_INT_DTYPES, device=device)
    if row_TK.numel() > _INT32_MAX:
        raise ValueError(f"row_TK must have fewer than 2^31 elements, got {row_TK.numel()}")
    return row_TK.to(torch.int32).contiguous()


def _row_grid(T: int, D: int):
    return lambda meta: (triton.cdiv(T, meta["BLOCK_T"]), max(1, triton.cdiv(D, meta["BLOCK_D"])))


@on_tensor_device
def permute_fwd(
    x_TD: torch.Tensor,
    row_TK: torch.Tensor,
    num_rows: int,
    *,
    out: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None,
    with_src: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Copy token rows into the dispatch layout.

    Args:
        x_TD: [T, D] tokens (float32, bfloat16, float16 or float64; any strides).
        row_TK: int32 [T, K] destination row of each assignment, -1 when dropped. Kept rows must be
            a bijection onto ``range(num_rows)``.
        num_rows: S, the number of kept assignments.
        out: optional contiguous ``(x_SD, src_S)`` buffers (``(x_SD, None)`` without ``with_src``).
        with_src: False: no src_S is made (None returned in its place), one allocation less;
            :func:`unpermute_bwd`, its only reader on the kernels, does not need it.

    Returns:
        (x_SD [S, D] in x's dtype, src_S int32 [S] or None): the rows, and for each row the flat
        assignment index t * K + k it came from.
    """
    _check_tensor("x_TD", x_TD, ndim=2, dtypes=_ROW_DTYPES)
    dev = x_TD.device
    row_TK = _check_rows(row_TK, dev)
    T, D = x_TD.shape
    K = row_TK.shape[1]
    if row_TK.shape[0] != T:
        raise ValueError(f"row_TK must have T={T} rows, got {row_TK.shape[0]}")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or not 0 <= num_rows <= T * K:
        raise ValueError(f"num_rows must be an int in [0, T*K={T * K}], got {num_rows!r}")
    if not isinstance(with_src, bool):
        raise TypeError(f"with_src must be a bool, got {type(with_src).__name__}")
    S = num_rows
    if out is None:
        x_SD = torch.empty(S, D, dtype=x_TD.dtype, device=dev)
        src_S = torch.empty(S, dtype=torch.int32, device=dev) if with_src else None
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out must be a pair (x_SD, src_S)")
        x_SD, src_S = out
        _check_out("out[0] (x_SD)", x_SD, (S, D), x_TD.dtype, dev)
        if with_src:
            _check_out("out[1] (src_S)", src_S, (S,), torch.int32, dev)
        elif src_S is not None:
            raise ValueError("out[1] (src_S) must be None with with_src=False")
    if S == 0:
        return x_SD, src_S
    run_autotuned(
        _permute_fwd_kernel,
        _row_grid(T, D),
        (x_TD, row_TK, x_SD, x_SD if src_S is None else src_S, T, D, K, S, *x_TD.stride()),
        dict(HAS_SRC=with_src),
        _ENV_PERMUTE_FWD_CONFIG,
    )
    return x_SD, src_S


def _gather_reduce(y_SD, row_TK, weight_TK, out, out_name):
    """out[t] = sum over kept k of (weight[t, k] *) y_SD[row_TK[t, k]]: shared by permute_bwd and
    unpermute_fwd."""
    dev = y_SD.device
    S, D = y_SD.shape
    T, K = row_TK.shape
    if out is None:
        out = torch.empty(T, D, dtype=y_SD.dtype, device=dev)
    else:
        _check_out(out_name, out, (T, D), y_SD.dtype, dev)
    if T * D == 0:
        return out
    has_weight = weight_TK is not None
    args = (
        y_SD,
        row_TK,
        weight_TK if has_weight else y_SD,
        out,
        T,
        D,
        K,
        S,
        *y_SD.stride(),
        *(weight_TK.stride() if has_weight else (0, 0)),
    )
    run_autotuned(_unpermute_fwd_kernel, _row_grid(T, D), args, dict(HAS_WEIGHT=has_weight), _ENV_UNPERMUTE_FWD_CONFIG)
    return out


@on_tensor_device
def permute_bwd(grad_x_SD: torch.Tensor, row_TK: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """grad_x_TD[t] = sum over kept k of grad_x_SD[row_TK[t, k]] (float32 accumulation, k order).

    Args:
        grad_x_SD: [S, D] gradient of the dispatch rows (any strides).
        row_TK: int32 [T, K] as given to :func:`permute_fwd`.
        out: optional contiguous [T, D] buffer in grad_x_SD's dtype.

    Returns:
        grad_x_TD [T, D] in grad_x_SD's dtype.
    """
    _check_tensor("grad_x_SD", grad_x_SD, ndim=2, dtypes=_ROW_DTYPES)
    row_TK = _check_rows(row_TK, grad_x_SD.device)
    return _gather_reduce(grad_x_SD, row_TK, None, out, "out")


@on_tensor_device
def unpermute_fwd(
    y_SD: torch.Tensor,
    row_TK: torch.Tensor,
    weight_TK: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y_TD[t] = sum over kept k (in k order) of weight_TK[t, k] * y_SD[row_TK[t, k]].

    Args:
        y_SD: [S, D] expert outputs in dispatch order (any strides).
        row_TK: int32 [T, K] dispatch row of each assignment, -1 when dropped.
        weight_TK: float [T, K] combine weights (any strides).
        out: optional contiguous [T, D] buffer in y's dtype.

    Returns:
        y_TD [T, D] in y's dtype, accumulated in float32.
    """
    _check_tensor("y_SD", y_SD, ndim=2, dtypes=_ROW_DTYPES)
    dev = y_SD.device
    row_TK = _check_rows(row_TK, dev)
    _check_tensor("weight_TK", weight_TK, shape=row_TK.shape, dtypes=_ROW_DTYPES, device=dev)
    return _gather_reduce(y_SD, row_TK, weight_TK, out, "out")


@on_tensor_device
def unpermute_bwd(
    grad_y_TD: torch.Tensor,
    y_SD: torch.Tensor,
    row_TK: torch.Tensor,
    weight_TK: torch.Tensor,
    src_S: Optional[torch.Tensor],
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`unpermute_fwd`.

    Args:
        grad_y_TD: [T, D] gradient of the combined output (any strides).
        y_SD: [S, D] expert outputs in dispatch order (any strides).
        row_TK: int32 [T, K] dispatch row of each assignment, -1 when dropped.
        weight_TK: float [T, K] combine weights.
        src_S: int32 [S] inverse map from :func:`permute_fwd` (checked, not needed: each row's
            gradient is written from its token), or None (a :func:`permute_fwd` without ``with_src``).
        out: optional contiguous ``(grad_y_SD, grad_weight_TK)`` buffers.

    Returns:
        (grad_y_SD [S, D] in y's dtype, grad_weight_TK float32 [T, K], zero where dropped).
    """
    _check_tensor("grad_y_TD", grad_y_TD, ndim=2, dtypes=_ROW_DTYPES)
    dev = grad_y_TD.device
    _check_tensor("y_SD", y_SD, ndim=2, dtypes=_ROW_DTYPES, device=dev)
    row_TK = _check_rows(row_TK, dev)
    T, D = grad_y_TD.shape
    S = y_SD.shape[0]
    K = row_TK.shape[1]
    if y_SD.shape[1] != D:
        raise ValueError(f"y_SD must have D={D} columns, got {y_SD.shape[1]}")
    if row_TK.shape[0] != T:
        raise ValueError(f"row_TK must have T={T} rows, got {row_TK.shape[0]}")
    _check_tensor("weight_TK", weight_TK, shape=(T, K), dtypes=_ROW_DTYPES, device=dev)
    if src_S is not None:
        _check_tensor("src_S", src_S, shape=(S,), dtypes=_INT_DTYPES, device=dev)
    if out is None:
        grad_y_SD = torch.empty(S, D, dtype=y_SD.dtype, device=dev)
        grad_w_TK = torch.empty(T, K, dtype=torch.float32, device=dev)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out must be a pair (grad_y_SD, grad_weight_TK)")
        grad_y_SD, grad_w_TK = out
        _check_out("out[0] (grad_y_SD)", grad_y_SD, (S, D), y_SD.dtype, dev)
        _check_out("out[1] (grad_weight_TK)", grad_w_TK, (T, K), torch.float32, dev)
    if T * K == 0:
        return grad_y_SD, grad_w_TK
    args = (
        grad_y_TD,
        y_SD,
        row_TK,
        weight_TK,
        grad_y_SD,
        grad_w_TK,
        T,
        D,
        K,
        S,
        *grad_y_TD.stride(),
        *y_SD.stride(),
        *weight_TK.stride(),
    )
    run_autotuned(
        _unpermute_bwd_kernel, lambda meta: (triton.cdiv(T, meta["BLOCK_T"]),), args, {}, _ENV_UNPERMUTE_BWD_CONFIG
    )
    return grad_y_SD, grad_w_TK


@on_tensor_device
def dispatch_rows(
    expert_TK: torch.Tensor,
    slot_TK: torch.Tensor,
    used_E: torch.Tensor,
    kept_E: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Row of each kept assignment in the dispatch layout (grouped by expert), -1 when dropped.

    Same semantics as :func:`lancet_rt.kernels.reference.dispatch_rows_ref`: rows of expert e are contiguous,
    in slot order, after the kept rows of experts < e.

    Args:
        expert_TK, slot_TK: integer [T, K] from :func:`lancet_rt.kernels.gating.gating_fwd`.
        used_E: integer [E] the carried counter *before* this chunk.
        kept_E: integer [E] kept assignments per expert in this chunk.
        out: optional contiguous int32 [T, K] buffer.

    Returns:
        row_TK int32 [T, K].
    """
    _check_tensor("expert_TK", expert_TK, ndim=2, dtypes=_COUNTER_DTYPES)
    dev = expert_TK.device
    _check_tensor("slot_TK", slot_TK, shape=expert_TK.shape, dtypes=_COUNTER_DTYPES, device=dev)
    _check_tensor("used_E", used_E, ndim=1, dtypes=_COUNTER_DTYPES, device=dev)
    E = used_E.shape[0]
    _check_tensor("kept_E", kept_E, shape=(E,), dtypes=_COUNTER_DTYPES, device=dev)
    T, K = expert_TK.shape
    if T * K > _INT32_MAX:
        raise ValueError(f"T * K must fit int32, got {T} * {K}")
    if out is None:
        out = torch.empty(T, K, dtype=torch.int32, device=dev)
    else:
        _check_out("out", out, (T, K), torch.int32, dev)
    if T * K == 0:
        return out
    expert_TK = expert_TK.to(torch.int32).contiguous()
    slot_TK = slot_TK.to(torch.int32).contiguous()
    _dispatch_rows_kernel[(triton.cdiv(T * K, _FLAT_BLOCK),)](
        expert_TK,
        slot_TK,
        kept_E.contiguous(),
        used_E.contiguous(),
        out,
        T * K,
        E,
        BLOCK=_FLAT_BLOCK,
        BLOCK_E=triton.next_power_of_2(E),
    )
    return out


_REGROUP_BLOCK = 256  # rows per step of a regroup program


@on_tensor_device
def regroup_rows(
    counts_WL: torch.Tensor, total: int, experts: Optional[int] = None, *, out: Optional[torch.Tensor] = None
):
    """Row maps between the received (rank-major) and the grouped (expert-major) order, in one launch.

    Same semantics as :func:`lancet_rt.kernels.reference.regroup_rows_ref`, made on the device from the
    received counts where they arrived (no host-built index tensors, no host-to-device copies).

    Args:
        counts_WL: integer [W, L] rows per (rank, local expert), any strides (e.g. a view of the
            exchanged counts).
        total: R, the sum of the counts (a host int: the received split sizes).
        experts: L, when ``counts_WL`` has more columns (other words riding along the counts, read
            from its first L columns without a slice); None: all of them.
        out: optional contiguous int64 [2 R + L + 1] buffer the three maps are views of.

    Returns:
        (to_expert [R], to_rank [R], offsets_L1 [L + 1]), int64 views of one buffer.
    """
    _check_tensor("counts_WL", counts_WL, ndim=2, dtypes=_INT_DTYPES)
    dev = counts_WL.device
    W, L = counts_WL.shape
    if experts is not None:
        if isinstance(experts, bool) or not isinstance(experts, int) or not 0 <= experts <= L:
            raise ValueError(f"experts must be an int in [0, {L}] (counts_WL's columns), got {experts!r}")
        L = experts
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be an int >= 0, got {total!r}")
    n = 2 * total + L + 1
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=dev)
    else:
        _check_out("out", out, (n,), torch.int64, dev)
    to_expert, to_rank, offsets_L1 = out.split_with_sizes((total, total, L + 1))
    if W * L == 0:
        return to_expert, to_rank, offsets_L1.zero_()
    _regroup_rows_kernel[(W * L,)](
        counts_WL,
        to_expert,
        to_rank,
        offsets_L1,
        W,
        L,
        *counts_WL.stride(),
        BLOCK_B=triton.next_power_of_2(W * L),
        BLOCK_L=triton.next_power_of_2(L + 1),
        BLOCK=_REGROUP_BLOCK,
    )
    return to_expert, to_rank, offsets_L1
