"""Gating: scores, top-k, capacity slots and aux/z statistics, in Triton (the launchers).

Semantics are those of :func:`lancet_rt.kernels.reference.gating_fwd_ref` and ``gating_bwd_ref``
(docs/design.md, routing contract); the launchers here have the same signatures (plus an optional
keyword-only ``out=``) and return the same types. Turning slots into dispatch rows is the permute
family's (:func:`lancet_rt.kernels.permute.dispatch_rows`), which the forward can also do in its last
launch (``row_TK=``), where the experts, slots and kept rows already are. The kernels, the algorithm and the config
spaces are in :mod:`lancet_rt.kernels._gating_kernels`.

The forward reads the logits once: one program per span of tokens (all of them when the call is
small, then a single launch), else the spans, then one launch that reduces the spans' counts and sums
and fixes the slots up (two launches, no atomics, no host synchronisation). The last of them can also
write the rows the call keeps per expert (``kept_E=``) and add them and the aux/z sums to a batch's
running sums (``totals=``, :class:`GatingTotals`), so a caller carrying them across chunks dispatches no
ops for it. The backward is one pass over token tiles.
``LANCET_GATING_FWD_CONFIG`` / ``LANCET_GATING_BWD_CONFIG`` pin a config, e.g.
``"BLOCK_T=16,num_warps=4"``.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple, Optional

import torch
import triton

from ._common import check_out as _check_out
from ._common import check_tensor as _check_tensor
from ._common import on_tensor_device, run_autotuned
from ._gating_kernels import (
    _ENV_BWD_CONFIG,
    _ENV_FWD_CONFIG,
    _gating_bwd_kernel,
    _gating_finish_kernel,
    _gating_fwd_kernel,
)
from .reference import GatingOutput, check_router_args, check_scaling

__all__ = ["gating_fwd", "gating_bwd", "GatingOutput", "GatingTotals"]

_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38
_MAX_EXPERTS = 1024  # BLOCK_E lives in registers; 1024 still leaves a 4-token tile
_SCAN_BLOCK_E = 32  # expert columns per sums program of the finish launch
_SCAN_BLOCK_B = 64  # spans per step of a sums program
_FLAT_BLOCK = 1024  # assignments per step of a slot program of the finish launch
_SLOT_PASS_ELEMENTS = 4096  # span counts per step of a slot program's pass over them (BLOCK_B x BLOCK_E)
_SPAN_MIN, _SPAN_MAX = 32, 512
_PROGRAMS_PER_SM = 4
# A call this small runs as one program with the scan fused (one launch): up to this many
# tokens, and at most this many logits. Tests lower the first to force the multi-program path.
_SINGLE_PROGRAM_MAX_T = 128
_SINGLE_PROGRAM_MAX_ELEMENTS = 16384


class GatingTotals(NamedTuple):
    """Running sums over the chunks of one batch, to which :func:`gating_fwd` (``totals=``) adds a
    call's results in place, in its last launch: the additions a caller carrying the batch's routing
    state would make after each call (the same ones, so the same bits), without host ops of its own.

    Attributes:
        kept_E: int64 [E], += the rows the call keeps per expert, ``min(counts_E, max(capacity -
            used_E, 0))`` with ``used_E`` the carried counter given to the call (``counts_E`` when
            dropless).
        score_sum_E: [E] in the logits' dtype, += the call's ``score_sum_E``.
        zsq_sum: [] in the logits' dtype, += the call's ``zsq_sum``.
    """

    kept_E: torch.Tensor
    score_sum_E: torch.Tensor
    zsq_sum: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _plan_span(T: int, block_e: int, device: torch.device) -> int:
    """Tokens per forward program: all of them when small, else ~_PROGRAMS_PER_SM programs per SM."""
    if T <= _SINGLE_PROGRAM_MAX_T and T * block_e <= _SINGLE_PROGRAM_MAX_ELEMENTS:
        return max(T, 1)
    span = triton.next_power_of_2(triton.cdiv(T, _PROGRAMS_PER_SM * _num_sms(device)))
    return min(max(span, _SPAN_MIN), _SPAN_MAX)


def _slot_steps(N: int, span: int) -> int:
    """Steps of ``_FLAT_BLOCK`` assignments per slot program of the finish launch: a power of two making
    at most ``span`` programs, so their passes over the ``[NB, E]`` span counts (``NB * E`` int32 each) read
    at most about the logits' ``T * E`` float32 in all."""
    return triton.next_power_of_2(triton.cdiv(triton.cdiv(N, _FLAT_BLOCK), span))


def _slot_pass_rows(block_e: int) -> int:
    """Spans per step of a slot program's pass over the span counts: ``_SLOT_PASS_ELEMENTS`` counts a step."""
    return max(1, _SLOT_PASS_ELEMENTS // block_e)


def _split_scaling(scaling: float):
    """``scaling`` as two float32 values whose sum is it to ~48 bits: exact in a float32 kernel
    (the first one, as torch rounds a Python scalar), and float64 kernels add the second."""
    if not abs(scaling) <= _FLOAT32_MAX:
        raise ValueError(f"scaling must be at most {_FLOAT32_MAX:.4g} (float32), got {scaling!r}")
    hi = struct.unpack("f", struct.pack("f", scaling))[0]
    return hi, struct.unpack("f", struct.pack("f", scaling - hi))[0]


_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8)
_LOGIT_DTYPES = (torch.float32, torch.float64)


def _fwd_lanes(E: int, n_group: int):
    """(BLOCK_G, BLOCK_GS, BLOCK_E) of the forward: group-major lanes (see _gating_fwd_kernel) with
    each group padded to a power of two when grouped, else next_pow2(E)."""
    if n_group <= 1:
        return 1, 1, triton.next_power_of_2(E)
    block_g, block_gs = triton.next_power_of_2(n_group), triton.next_power_of_2(E // n_group)
    block_e = block_g * block_gs
    if block_e > _MAX_EXPERTS:
        raise ValueError(
            f"n_group={n_group} with E={E} needs {block_g} x {block_gs} expert lanes, more than {_MAX_EXPERTS}"
        )
    return block_g, block_gs, block_e


def _check_fwd_args(logits_TE, top_k, score_fn, capacity) -> None:
    """The forward's argument checks that do not need the router's (bias, groups, scaling)."""
    _check_tensor("logits_TE", logits_TE, ndim=2, dtypes=_LOGIT_DTYPES)
    T, E = logits_TE.shape
    if not 1 <= E <= _MAX_EXPERTS:
        raise ValueError(f"logits_TE must have 1..{_MAX_EXPERTS} experts (columns), got {E}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, E={E}], got {top_k!r}")
    if score_fn not in ("softmax", "sigmoid"):
        raise ValueError(f"score_fn must be 'softmax' or 'sigmoid', got {score_fn!r}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity must be None or an int >= 0, got {capacity!r}")
    if T * top_k > _INT32_MAX:
        raise ValueError(f"T * top_k must fit int32, got {T} * {top_k}")


def _fwd_outputs(logits_TE: torch.Tensor, K: int, used_E: torch.Tensor, out: Optional[GatingOutput]) -> GatingOutput:
    """The forward's outputs: fresh, or ``out`` checked (shapes, dtypes, device, no aliasing)."""
    (T, E), dev = logits_TE.shape, logits_TE.device
    shapes = GatingOutput((T, K), (T, K), (T, K), (E,), (E,), (E,), ())
    dtypes = GatingOutput(
        torch.int32, logits_TE.dtype, torch.int32, torch.int32, torch.int32, logits_TE.dtype, logits_TE.dtype
    )
    if out is None:
        return GatingOutput(*(torch.empty(s, dtype=d, device=dev) for s, d in zip(shapes, dtypes)))
    if not isinstance(out, GatingOutput):
        raise TypeError(f"out must be a GatingOutput, got {type(out).__name__}")
    for field, t, s, d in zip(GatingOutput._fields, out, shapes, dtypes):
        _check_out(f"out.{field}", t, s, d, dev)
    if out.used_E.data_ptr() == used_E.data_ptr():
        raise ValueError("out.used_E must not alias used_E")
    return out


def _check_totals(totals, logits_TE: torch.Tensor) -> GatingTotals:
    """``totals=``: a :class:`GatingTotals` of contiguous tensors of the right shapes and dtypes."""
    if not isinstance(totals, tuple) or len(totals) != 3:
        raise TypeError(f"totals must be a GatingTotals (or a tuple of its three tensors), got {type(totals).__name__}")
    totals = GatingTotals(*totals)
    (_, E), dev, dtype = logits_TE.shape, logits_TE.device, logits_TE.dtype
    _check_out("totals.kept_E", totals.kept_E, (E,), torch.int64, dev)
    _check_out("totals.score_sum_E", totals.score_sum_E, (E,), dtype, dev)
    _check_out("totals.zsq_sum", totals.zsq_sum, (), dtype, dev)
    return totals


def _no_alias(used_E, kept_E, totals, row_TK, out: GatingOutput) -> None:
    """``kept_E``, the totals and ``row_TK`` are written by the last launch (the totals read, too): no two
    of them, nor a field of ``out``, may share memory; nor may ``used_E``, which the last launch reads while
    it writes them (on the scan path in other programs)."""
    written = [t for t in (*out, kept_E, row_TK, *(totals or ())) if t is not None and t.numel()]
    if any(t.data_ptr() == used_E.data_ptr() for t in written):
        raise ValueError("used_E must not alias out, kept_E, the totals or row_TK")
    mine = [t for t in (kept_E, row_TK) if t is not None and t.numel()]
    mine += list(totals) if totals is not None else []
    if not mine:
        return
    ptrs = {t.data_ptr() for t in mine}
    if len(ptrs) < len(mine) or any(t.data_ptr() in ptrs for t in out if t.numel()):
        raise ValueError("kept_E and totals must not alias each other nor any field of out")


def _span_buffers(scratch: Optional[dict], n_spans: int, E: int, dtype: torch.dtype, dev) -> tuple:
    """The multi-span path's per-span counts, score sums and z sums: ``scratch``'s where it holds them at
    these shapes (kept there when made), else fresh. Only the launches of one call read and write them."""
    shapes = (((n_spans, E), torch.int32), ((n_spans, E), dtype), ((n_spans,), dtype))
    got = None if scratch is None else scratch.get("spans")
    if got is None or any(
        not isinstance(t, torch.Tensor) or t.shape != s or t.dtype != d or t.device != dev or not t.is_contiguous()
        for t, (s, d) in zip(got, shapes)
    ):
        got = tuple(torch.empty(s, dtype=d, device=dev) for s, d in shapes)
        if scratch is not None:
            scratch["spans"] = got
    return got


def _launch_fwd(
    logits_TE, bias, used_E, out: GatingOutput, K, span, sizes, meta, kept_E, totals, row_TK, scratch
) -> None:
    """One fused program when one span holds the call, else the spans, then the finish launch (its sums
    programs reduce the span counts and sums, its slot programs fix the slots up); the totals (if any) are
    added by the single program, else by the sums programs; the rows (if any) written by the single
    program, else by the slot programs."""
    (T, E), dev = logits_TE.shape, logits_TE.device
    n_spans = triton.cdiv(T, span)
    # (used_E: the stand-in for an absent kept_E or totals, never read)
    tot = (used_E if kept_E is None else kept_E, *((used_E,) * 3 if totals is None else totals))
    flags = dict(HAS_KEPT=kept_E is not None, HAS_TOTALS=totals is not None)
    rows = out.slot_TK if row_TK is None else row_TK  # (the stand-in for an absent row_TK, never written)
    if n_spans == 1:
        args = (
            logits_TE,
            bias,
            used_E,
            out.expert_TK,
            out.weight_TK,
            out.slot_TK,
            out.counts_E,
            out.used_E,
            out.score_sum_E,
            out.zsq_sum,
            *tot,
            rows,
            *sizes,
        )
        meta = dict(SINGLE_PROGRAM=True, HAS_ROWS=row_TK is not None, **flags, **meta)
        run_autotuned(_gating_fwd_kernel, (1,), args, meta, _ENV_FWD_CONFIG)
        return
    span_count, span_score, span_zsq = _span_buffers(scratch, n_spans, E, logits_TE.dtype, dev)
    args = (
        logits_TE,
        bias,
        used_E,
        out.expert_TK,
        out.weight_TK,
        out.slot_TK,
        span_count,
        out.used_E,
        span_score,
        span_zsq,
        *(used_E,) * 4,
        rows,
        *sizes,
    )
    meta = dict(SINGLE_PROGRAM=False, HAS_KEPT=False, HAS_TOTALS=False, HAS_ROWS=False, **meta)
    run_autotuned(_gating_fwd_kernel, (n_spans,), args, meta, _ENV_FWD_CONFIG)
    N = T * K
    per_prog = _FLAT_BLOCK * _slot_steps(N, span)
    block_e = triton.next_power_of_2(E)
    grid = (triton.cdiv(E, _SCAN_BLOCK_E) + triton.cdiv(N, per_prog),)
    _gating_finish_kernel[grid](
        out.expert_TK,
        out.slot_TK,
        span_count,
        span_score,
        span_zsq,
        used_E,
        out.counts_E,
        out.used_E,
        out.score_sum_E,
        out.zsq_sum,
        *tot,
        rows,
        N,
        n_spans,
        E,
        span * K,
        per_prog,
        sizes[4],  # sizes[4]: the capacity
        **flags,
        HAS_ROWS=row_TK is not None,
        SCAN_BLOCK_B=_SCAN_BLOCK_B,
        SCAN_BLOCK_E=_SCAN_BLOCK_E,
        BLOCK=_FLAT_BLOCK,
        BLOCK_B=_slot_pass_rows(block_e),
        BLOCK_E=block_e,
    )


@on_tensor_device
def gating_fwd(
    logits_TE: torch.Tensor,
    top_k: int,
    used_E: Optional[torch.Tensor] = None,
    *,
    capacity: Optional[int] = None,
    score_fn: str = "softmax",
    normalize_topk: bool = True,
    expert_bias: Optional[torch.Tensor] = None,
    n_group: int = 1,
    topk_group: Optional[int] = None,
    scaling: float = 1.0,
    out: Optional[GatingOutput] = None,
    kept_E: Optional[torch.Tensor] = None,
    totals: Optional[GatingTotals] = None,
    row_TK: Optional[torch.Tensor] = None,
    scratch: Optional[dict] = None,
) -> GatingOutput:
    """Scores, top-k, capacity slots and aux/z statistics for one chunk of router logits.

    Same semantics as :func:`lancet_rt.kernels.reference.gating_fwd_ref` (DeepSeek-V3's biased,
    group-limited selection included).

    Args:
        logits_TE: float32 (or float64) [T, E] router logits, any strides.
        top_k: experts per token, 1 <= top_k <= topk_group * E / n_group.
        used_E: integer [E] slots claimed by earlier chunks of the same batch (None: zeros).
        capacity: slots per expert for the whole batch, or None for dropless.
        score_fn: "softmax" or "sigmoid".
        normalize_topk: divide the K weights of a token by their sum.
        expert_bias: None or float [E] on the logits' device, added to the scores to select
            experts (not to the weights); no gradient.
        n_group: groups of E / n_group consecutive experts (dividing E); 1: no restriction.
        topk_group: groups a token may choose from, 1..n_group (None: n_group).
        scaling: finite factor > 0 on the K weights, after the normalisation.
        out: optional preallocated :class:`GatingOutput` (contiguous, the dtypes and shapes
            below) written in place; ``out.used_E`` must not alias ``used_E``.
        kept_E: optional contiguous int32 [E] written with the rows the call keeps per expert,
            ``min(counts_E, max(capacity - used_E, 0))`` (the counts when dropless).
        totals: optional :class:`GatingTotals` (or a tuple of its three tensors; contiguous, sharing
            no memory with each other or ``out``) to which this call's kept rows, ``score_sum_E`` and
            ``zsq_sum`` are added in place.
        row_TK: optional contiguous int32 [T, K] written with the dispatch rows, bitwise those of
            :func:`lancet_rt.kernels.permute.dispatch_rows` given this call's ``expert_TK``, ``slot_TK``,
            the carried ``used_E`` and the kept rows above (-1 where dropped); it shares no memory with
            ``out``, ``kept_E`` or the totals.
        scratch: optional dict in which a call of several spans keeps the per-span buffers its launches
            share (made at the first such call, reused by the next ones of the same shapes; nothing else
            is read from it): a caller running the chunks of one batch in stream order passes one dict
            and allocates them once, not per chunk.

    Returns:
        :class:`GatingOutput`: expert_TK int32 [T, K], weight_TK [T, K], slot_TK int32 [T, K],
        counts_E int32 [E], used_E int32 [E], score_sum_E [E], zsq_sum [] (floats in the
        logits dtype).
    """
    _check_fwd_args(logits_TE, top_k, score_fn, capacity)
    T, E = logits_TE.shape
    dev = logits_TE.device
    topk_group = check_router_args(E, top_k, expert_bias, n_group, topk_group, scaling, dev)
    scale_hi, scale_lo = _split_scaling(scaling)
    K = top_k
    block_g, block_gs, block_e = _fwd_lanes(E, n_group)
    bias = logits_TE if expert_bias is None else expert_bias.contiguous()  # logits: never read
    if used_E is None:
        used_E = torch.zeros(E, dtype=torch.int32, device=dev)
    else:
        _check_tensor("used_E", used_E, shape=(E,), dtypes=_INT_DTYPES, device=dev)
        used_E = used_E.to(torch.int32).contiguous()
    cap = _INT32_MAX if capacity is None else min(capacity, _INT32_MAX)
    if kept_E is not None:
        _check_out("kept_E", kept_E, (E,), torch.int32, dev)
    if scratch is not None and not isinstance(scratch, dict):
        raise TypeError(f"scratch must be None or a dict, got {type(scratch).__name__}")
    if totals is not None:
        totals = _check_totals(totals, logits_TE)
    if row_TK is not None:
        _check_out("row_TK", row_TK, (T, K), torch.int32, dev)
    out = _fwd_outputs(logits_TE, K, used_E, out)
    _no_alias(used_E, kept_E, totals, row_TK, out)

    if T == 0:
        out.counts_E.zero_()
        out.used_E.copy_(used_E)
        out.score_sum_E.zero_()
        out.zsq_sum.zero_()
        if kept_E is not None:
            kept_E.zero_()
        if totals is not None:  # (no row kept; the float sums as a caller's additions leave them)
            totals.score_sum_E.add_(out.score_sum_E)
            totals.zsq_sum.add_(out.zsq_sum)
        return out

    span = _plan_span(T, block_e, dev)
    meta = dict(
        SIGMOID=score_fn == "sigmoid",
        NORMALIZE=bool(normalize_topk),
        HAS_BIAS=expert_bias is not None,
        HAS_SCALE=scaling != 1.0,
        GROUPED=n_group > 1,
        BLOCK_G=block_g,
        BLOCK_GS=block_gs,
        BLOCK_E=block_e,
    )
    sizes = (T, E, K, span, cap, n_group, E // n_group, topk_group, scale_hi, scale_lo, *logits_TE.stride())
    _launch_fwd(logits_TE, bias, used_E, out, K, span, sizes, meta, kept_E, totals, row_TK, scratch)
    return out


@on_tensor_device
def gating_bwd(
    logits_TE: torch.Tensor,
    expert_TK: torch.Tensor,
    grad_weight_TK: Optional[torch.Tensor],
    grad_score_sum_E: Optional[torch.Tensor],
    grad_zsq_sum: Optional[torch.Tensor],
    *,
    score_fn: str = "softmax",
    normalize_topk: bool = True,
    scaling: float = 1.0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradient of the logits from the gradients of ``weight_TK``, ``score_sum_E`` and ``zsq_sum``.

    Same semantics as :func:`lancet_rt.kernels.reference.gating_bwd_ref`; any incoming gradient may be None.

    Args:
        logits_TE: float32 (or float64) [T, E], any strides.
        expert_TK: integer [T, K] from :func:`gating_fwd` (distinct experts per token).
        grad_weight_TK: float [T, K] or None (any strides, e.g. expanded).
        grad_score_sum_E: float [E] or None.
        grad_zsq_sum: float [] (or one element) or None.
        score_fn, normalize_topk, scaling: as given to :func:`gating_fwd` (the expert bias and
            groups only select, so the backward does not need them).
        out: optional contiguous [T, E] buffer in the logits dtype.

    Returns:
        grad_logits_TE, same dtype and shape as ``logits_TE`` (contiguous).
    """
    _check_tensor("logits_TE", logits_TE, ndim=2, dtypes=_LOGIT_DTYPES)
    T, E = logits_TE.shape
    dev = logits_TE.device
    if not 1 <= E <= _MAX_EXPERTS:
        raise ValueError(f"logits_TE must have 1..{_MAX_EXPERTS} experts (columns), got {E}")
    if score_fn not in ("softmax", "sigmoid"):
        raise ValueError(f"score_fn must be 'softmax' or 'sigmoid', got {score_fn!r}")
    check_scaling(scaling)
    scale_hi, scale_lo = _split_scaling(scaling)
    _check_tensor("expert_TK", expert_TK, ndim=2, dtypes=_INT_DTYPES, device=dev)
    if expert_TK.shape[0] != T or not 1 <= expert_TK.shape[1] <= E:
        raise ValueError(f"expert_TK must have shape [T={T}, K<=E={E}], got {tuple(expert_TK.shape)}")
    K = expert_TK.shape[1]
    float_dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if grad_weight_TK is not None:
        _check_tensor("grad_weight_TK", grad_weight_TK, shape=(T, K), dtypes=float_dtypes, device=dev)
    if grad_score_sum_E is not None:
        _check_tensor("grad_score_sum_E", grad_score_sum_E, shape=(E,), dtypes=float_dtypes, device=dev)
    if grad_zsq_sum is not None:
        _check_tensor("grad_zsq_sum", grad_zsq_sum, dtypes=float_dtypes, device=dev)
        if grad_zsq_sum.numel() != 1:
            raise ValueError(f"grad_zsq_sum must have one element, got shape {tuple(grad_zsq_sum.shape)}")
    if out is None:
        out = torch.empty(T, E, dtype=logits_TE.dtype, device=dev)
    else:
        _check_out("out", out, (T, E), logits_TE.dtype, dev)
    if grad_weight_TK is None and grad_score_sum_E is None and grad_zsq_sum is None:
        return out.zero_()
    if T == 0:
        return out

    if expert_TK.dtype != torch.int32:
        expert_TK = expert_TK.to(torch.int32)
    dummy = logits_TE  # stands in for an absent gradient; never read (HAS_* is False)
    grad_w = dummy if grad_weight_TK is None else grad_weight_TK
    grad_p = dummy if grad_score_sum_E is None else grad_score_sum_E
    grad_z = dummy if grad_zsq_sum is None else grad_zsq_sum
    stride_gt, stride_gk = (0, 0) if grad_weight_TK is None else grad_weight_TK.stride()
    stride_pe = 0 if grad_score_sum_E is None else grad_score_sum_E.stride(0)
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_T"]),)
    args = (
        logits_TE,
        expert_TK,
        grad_w,
        grad_p,
        grad_z,
        out,
        T,
        E,
        K,
        scale_hi,
        scale_lo,
        *logits_TE.stride(),
        *expert_TK.stride(),
        stride_gt,
        stride_gk,
        stride_pe,
    )
    meta = dict(
        SIGMOID=score_fn == "sigmoid",
        NORMALIZE=bool(normalize_topk),
        HAS_GRAD_W=grad_weight_TK is not None,
        HAS_GRAD_P=grad_score_sum_E is not None,
        HAS_GRAD_Z=grad_zsq_sum is not None,
        HAS_SCALE=scaling != 1.0,
        BLOCK_E=triton.next_power_of_2(E),
    )
    run_autotuned(_gating_bwd_kernel, grid, args, meta, _ENV_BWD_CONFIG)
    return out
