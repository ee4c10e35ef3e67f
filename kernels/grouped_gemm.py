"""Grouped GEMM for the MoE experts: one launch per projection over all local experts.

The rows a rank receives are grouped by local expert: segment e is ``offsets[e]:offsets[e+1]`` of
``x_RK``, and expert e's weight is ``w_ENK[e]`` (the Hugging Face layout, out features first). The
launchers here have the signatures and results of their references in :mod:`lancet_rt.kernels.reference`:

================  ======================================  =========================  =============
launcher          computes                                reference                  FLOPs
================  ======================================  =========================  =============
grouped_mm        y[r] = x[r] @ w[e].T (+ b[e])           grouped_mm_ref             2 R N K
grouped_mm_dx     dx[r] = dy[r] @ w[e]                    grouped_mm_dx_ref          2 R N K
  with gu_R2F     dgu = swiglu_bwd(gu, dy @ w[e])         swiglu_bwd_ref of dx_ref   2 R N K
grouped_mm_dw     dw[e] = dy_seg.T @ x_seg (0 if empty)   grouped_mm_dw_ref          2 R N K
  accumulate      out[e] += dw[e] (in out's dtype)        out + grouped_mm_dw_ref    2 R N K
grouped_mm_dw_    two grouped_mm_dw over the same         grouped_mm_dw_pair_ref     2 R (N K +
  pair            segments, one launch                                               N_b K_b)
gate_up_swiglu    gu = x @ w[e].T (+ b[e]), h = act(g, u) gate_up_swiglu_ref         2 R (2F) D
segment_sum       s[e] = sum of g_seg's rows (0 if empty) segment_sum_ref            memory-bound
swiglu_fwd/_bwd   elementwise act and its gradient        swiglu_fwd_ref / _bwd_ref  memory-bound
================  ======================================  =========================  =============

``segment_sum`` is :mod:`lancet_rt.kernels.segment_sum`'s and ``swiglu_fwd``/``swiglu_bwd`` are
:mod:`lancet_rt.kernels.swiglu`'s (re-exported here: ``segment_sum``).

Expert variants (GPT-OSS's experts are all three): an optional per-expert bias on ``grouped_mm`` and
``gate_up_swiglu`` (``HAS_BIAS``), the activation ``act`` = "swiglu" (silu(g) * u) or "swiglu_oai"
(GPT-OSS: (clamp(u, -limit, limit) + 1) * gc * sigmoid(alpha * gc), gc = min(g, limit); ``ACTIVATION``),
and the gate/up order of gate_up's weight rows, bias and gu: gate first, or ``interleaved`` (gate 2j,
up 2j + 1; ``INTERLEAVED``). Weights may be any strided view, so GPT-OSS's transposed parameters
(``gate_up_proj [E, D, 2F]``, ``down_proj [E, F, D]``) pass as their transposes, not copies.

Row maps: the rows may be read from, or written to, another row order through an int32/int64 [R]
permutation of [0, R) (``x_rows``/``dy_rows``: grouped row g reads row ``rows[g]`` of the operand;
``out_rows``: grouped row g is written to row ``out_rows[g]`` of the output), so rows received in
rank-major order are computed expert-major without an ``index_select`` either way. The results are
those of the launch on the regrouped rows, bit for bit (only addresses change).

``grouped_mm_dw_pair`` is for the experts' backward, which needs gate_up's and down's dW for every
chunk: one launch instead of two, each problem with its own operands, row maps, ``out`` and
``accumulate``, bit for bit the two ``grouped_mm_dw`` launches at the same tile config. The host must
issue a chunk's work faster than the GPU runs it, and every launch is host time, so the experts' dW
cost each chunk's backward 1 launch instead of 2 (deferred or not); the pair moves the bytes the two
launches move.

The kernels and their algorithm are in :mod:`lancet_rt.kernels._grouped_gemm_kernels` (the dW kernels
in :mod:`lancet_rt.kernels._grouped_gemm_dw_kernels`).

Tuning
------
On CUDA each projection has its own autotuner (fwd, dx, gate_up, dw, and dw_pair: one config for both
of its problems, keyed on both problems' N and K, pruned as dW's for the larger), over :func:`_gemm_configs`
pruned by :func:`_prune_configs` (registers, fewer where fp32 operands sit in registers, shared memory,
128-byte K steps, problem size; ``python -m bench.kernels.compile_check`` builds every survivor for sm_90). The key is
(N, K, E, a power-of-two bucket of the mean rows per expert) and the dtypes, never the raw row count,
so chunked runs with varying R do not retune. ``LANCET_GEMM_CONFIG="BM,BN,BK,num_warps,num_stages"``
pins one config for all four (``LANCET_GEMM_CONFIG_<FWD|DX|GATE_UP|DW>`` for one of them; ``_DW`` pins
the dW pair too, so a pinned config gives the pair the two launches' bits; the pair's kernel runs one
tile loop, so it needs one dW's shared memory and takes dW's configs); for dW
the triple reads (output rows of N, output cols of K, reduction rows), i.e. it is always
"output tile rows, output tile cols, reduction step". Under ``TRITON_INTERPRET=1`` (the CPU lane) one
small fixed config is used, because the interpreter's cost grows with the tile size.

Limits
------
* Padding: each segment's last M tile is partly empty; the waste is at most E * BLOCK_M rows, a 32nd
  at 4096 rows per expert and BM=128, but dominant for tiny segments.
* Non-persistent kernels with plain pointer loads (cp.async pipelining, wgmma via Triton): no TMA,
  no warp specialisation, no stream-K. Expect below cuBLAS's dense rate on H100/H200; the benchmark
  ``python -m bench.kernels.experts`` measures the fraction.
* dW has no split over rows: an expert's tiles loop over all its rows, so with very few output tiles
  (small N*K) and one large segment the GPU is under-filled. At D=4096, F>=2048 every expert has
  thousands of tiles.
* Offsets are trusted to be non-decreasing with offsets[0] = 0 and offsets[E] = R (checking would
  need a host sync); they are clamped to [0, R] in the kernels so bad offsets cannot fault. Rows
  outside every segment are not written, as in the reference.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional, Tuple

import torch
import triton

from ._common import check_config_vars, on_tensor_device
from ._expert_checks import (
    _INTERPRET,
    _check_activation,
    _check_bias,
    _check_device,
    _check_float,
    _check_ndim,
    _check_offsets,
    _check_out,
    _check_rows,
    _check_same_dtype,
)
from ._gemm_space import (
    _TILE_NAMES,
    CONFIG_ENV,
    _gemm_configs,
    _make_config,
    _pinned_config,
    _prune_configs,
    _tile_of,
)
from ._grouped_gemm_dw_kernels import _grouped_gemm_dw_kernel, _grouped_gemm_dw_pair_kernel
from ._grouped_gemm_kernels import _gate_up_swiglu_fwd_kernel, _grouped_gemm_fwd_kernel
from .segment_sum import segment_sum  # the bias gradients: in the grouped_gemm op family (lancet_rt.ops)

# ------------------------------------------------------------------------------------------------
# Environment: the interpreter switch in lancet_rt.kernels._expert_checks, pinned configs in
# lancet_rt.kernels._gemm_space.
# ------------------------------------------------------------------------------------------------
# (output tile rows, output tile cols, reduction step, num_warps, num_stages) under the interpreter.
_INTERPRETER_CONFIG = (16, 32, 32, 4, 1)


# ================================================================================================
# Kernel variants
# ================================================================================================
def _even_k(args) -> bool:
    """The EVEN_K heuristic: the reduction length is a multiple of BLOCK_K (no K masks)."""
    return args["K" if "K" in args else "D"] % args["BLOCK_K"] == 0


_INT32_LIMIT = 2**31


def _tile_i64(block: str, *strides: str):
    """The TILE_I64 heuristic: whether ``block`` times one of ``strides`` (the bound of the in-tile
    offset and per-step pointer products) reaches 2^31."""

    def needs_int64(args) -> bool:
        return max(args[s] for s in strides) * args[block] >= _INT32_LIMIT

    return needs_int64


_FWD = triton.heuristics({"EVEN_K": _even_k, "TILE_I64": _tile_i64("BLOCK_K", "stride_xk", "stride_wk")})(
    _grouped_gemm_fwd_kernel
)
_GATE_UP = triton.heuristics({"EVEN_K": _even_k, "TILE_I64": _tile_i64("BLOCK_K", "stride_xd", "stride_wd")})(
    _gate_up_swiglu_fwd_kernel
)
_DW = triton.heuristics({"TILE_I64": _tile_i64("BLOCK_M", "stride_dym", "stride_xm")})(_grouped_gemm_dw_kernel)
_DW_PAIR = triton.heuristics(
    {"TILE_I64": _tile_i64("BLOCK_M", "stride_dym", "stride_xm", "stride_dybm", "stride_xbm")}
)(_grouped_gemm_dw_pair_kernel)
_KERNELS = {"fwd": _FWD, "dx": _FWD, "gate_up": _GATE_UP, "dw": _DW, "dw_pair": _DW_PAIR}


@functools.lru_cache(maxsize=None)
def _autotuned(op: str):
    kernel = _KERNELS[op]
    # The gate_up key holds the weight layout: interleaved loads one [BK, 2 BN] tile, not two [BK, BN].
    # dx's key holds whether the activation's gradient is fused into its epilogue (the down projection's).
    keys = {
        "gate_up": ["F", "D", "E", "M_BUCKET", "INTERLEAVED"],
        "dx": ["N", "K", "E", "M_BUCKET", "GLU_GRAD"],
        "dw_pair": ["N", "K", "N_B", "K_B", "E", "M_BUCKET"],  # one config for both problems
    }
    keys = keys.get(op, ["N", "K", "E", "M_BUCKET"])
    # Keep tuned choices on disk across processes where this Triton supports it (3.2+).
    extra = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    # dW's search reruns the launch: an accumulating one must find its output as it was. Its key holds
    # no ACCUMULATE: the chunks' accumulating launches take the config of the overwriting one.
    if op == "dw":
        extra["restore_value"] = ["dw_ptr"]
    elif op == "dw_pair":
        extra["restore_value"] = ["dw_ptr", "dwb_ptr"]
    # One autotuner per op (fwd and dx share a kernel but not a cache: their strides differ).
    return triton.autotune(
        configs=_gemm_configs(op), key=keys, prune_configs_by={"early_config_prune": _prune_configs(op)}, **extra
    )(kernel)


_LAST_CONFIG: dict = {}  # op -> the config of its latest launch, for selected_config()


def _launch_gemm(op: str, grid, args: tuple, device: torch.device, **const) -> None:
    """Launch ``op`` with the pinned config, the interpreter config, or the CUDA autotuner."""
    kernel = _KERNELS[op]
    check_config_vars()  # any bad kernel-config variable raises before the first launch
    pinned = _pinned_config(op)
    if pinned is None and (device.type != "cuda" or _INTERPRET):
        pinned = _INTERPRETER_CONFIG
    if pinned is not None:
        cfg = _make_config(op, *pinned)
        kernel[grid](*args, **const, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        tuner = _autotuned(op)
        tuner[grid](*args, **const)
        cfg = tuner.best_config
    _LAST_CONFIG[op] = (*_tile_of(op, cfg), cfg.num_warps, cfg.num_stages)
    if op == "dw_pair":  # (a dW launch too: pinned by dW's variable, reported as dW's latest config)
        _LAST_CONFIG["dw"] = _LAST_CONFIG[op]


def selected_config(op: str) -> Optional[str]:
    """The config of ``op``'s latest launch ("fwd", "dx", "gate_up", "dw" or "dw_pair") in the
    ``LANCET_GEMM_CONFIG`` format (output tile rows, cols, reduction step, warps, stages), so a
    tuned config can be recorded and pinned; None before the first launch. "dw" is that of the
    latest dW launch, single or pair (:func:`grouped_mm_dw_pair`)."""
    if op not in _TILE_NAMES:
        raise ValueError(f"op must be one of {sorted(_TILE_NAMES)}, got {op!r}")
    cfg = _LAST_CONFIG.get(op)
    return None if cfg is None else ",".join(map(str, cfg))


def _m_bucket(R: int, E: int) -> int:
    """Autotune key from the row count: a power of two of the mean rows per expert, in [16, 4096]."""
    return min(4096, max(16, triton.next_power_of_2(max(1, -(-R // max(E, 1))))))


def _dot_meta(dtype: torch.dtype, allow_tf32: bool) -> dict:
    """The dot constexprs: TF32 only when asked for fp32 inputs; fp32 operands for bf16 when interpreted."""
    return dict(
        INPUT_PRECISION="tf32" if (allow_tf32 and dtype == torch.float32) else "ieee",
        DOT_FP32=_INTERPRET and dtype == torch.bfloat16,
    )


# ================================================================================================
# Launchers
# ================================================================================================
def _grouped_mm(
    op: str,
    x_RK: torch.Tensor,
    w_ENK: torch.Tensor,
    offsets_E1: torch.Tensor,
    out: Optional[torch.Tensor],
    allow_tf32: bool,
    bias_EN: Optional[torch.Tensor] = None,
    transposed: bool = False,
    x_rows: Optional[torch.Tensor] = None,
    out_rows: Optional[torch.Tensor] = None,
    glu: Optional[tuple] = None,
) -> torch.Tensor:
    """y[r] = x[r] @ w[e].T (+ bias[e]) over segments; w is any [E, N, K] view, or with ``transposed``
    an [E, K, N] tensor read as its [E, N, K] transpose through swapped strides (dx: w[e].T, no
    transpose op dispatched); x's and y's rows through their row maps where given. ``glu``: (gu_R2N,
    activation, interleaved, alpha, limit): y [R, 2N] is then swiglu_bwd(gu, the product)."""
    R, K = x_RK.shape
    if transposed:
        E, _, N = w_ENK.shape
        w_strides = (w_ENK.stride(0), w_ENK.stride(2), w_ENK.stride(1))
    else:
        E, N, _ = w_ENK.shape
        w_strides = w_ENK.stride()
    y = _check_out(out, (R, N if glu is None else 2 * N), x_RK.dtype, x_RK.device)
    if R == 0 or N == 0:
        return y
    if K == 0 and bias_EN is None:  # (with glu too: both activations' gradients of dh = 0 are 0)
        return y.zero_()
    gu, activation, interleaved, alpha, limit = (y, "swiglu", False, 0.0, 1.0) if glu is None else glu
    grid = lambda META: ((triton.cdiv(R, META["BLOCK_M"]) + E - 1) * triton.cdiv(N, META["BLOCK_N"]),)
    b, b_strides = (w_ENK, (0, 0)) if bias_EN is None else (bias_EN, bias_EN.stride())  # unread without bias
    args = (
        x_RK,
        w_ENK,
        b,
        y,
        offsets_E1,
        offsets_E1 if x_rows is None else x_rows,  # (unread without a row map)
        offsets_E1 if out_rows is None else out_rows,
        gu,  # (unread without glu)
        R,
        N,
        K,
        E,
        _m_bucket(R, E),
        float(alpha),
        float(limit),
        x_RK.stride(0),
        x_RK.stride(1),
        *w_strides,
        *b_strides,
        y.stride(0),
        y.stride(1),
        gu.stride(0),
        gu.stride(1),
    )
    _launch_gemm(
        op,
        grid,
        args,
        x_RK.device,
        BLOCK_E=max(16, triton.next_power_of_2(E)),
        HAS_BIAS=bias_EN is not None,
        GATHER_X=x_rows is not None,
        SCATTER_Y=out_rows is not None,
        GLU_GRAD=glu is not None,
        INTERLEAVED=bool(interleaved),
        ACTIVATION=activation,
        **_dot_meta(x_RK.dtype, allow_tf32),
    )
    return y


@on_tensor_device
def grouped_mm(
    x_RK: torch.Tensor,
    w_ENK: torch.Tensor,
    offsets_E1: torch.Tensor,
    bias_EN: Optional[torch.Tensor] = None,
    *,
    x_rows: Optional[torch.Tensor] = None,
    out_rows: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """y[r] = x[r] @ w[e].T (+ bias[e]) for the rows r of segment e = offsets[e]:offsets[e+1]; one launch.

    Args:
        x_RK: [R, K] bf16/fp16/fp32 rows grouped by local expert (any strides).
        w_ENK: [E, N, K] weights, x's dtype (the Hugging Face layout: out features first; any
            strides, so GPT-OSS's [E, K, N] parameter passes as its transpose view).
        offsets_E1: int32/int64 [E + 1] segment bounds on x's device, offsets[0] = 0,
            offsets[E] = R, non-decreasing (not checked: that would synchronise).
        bias_EN: optional [E, N] per-expert bias in x's dtype, added to the fp32 accumulator
            before the one rounding to x's dtype.
        x_rows: optional int32/int64 [R] row map (a permutation of [0, R), not checked): grouped
            row r is ``x_RK[x_rows[r]]`` (x in another row order, e.g. rank-major).
        out_rows: optional int32/int64 [R] row map: grouped row r is written to ``y[out_rows[r]]``.
        out: optional [R, N] output buffer in x's dtype.
        allow_tf32: fp32 inputs only: use TF32 tensor cores (about 1e-3 relative error).

    Returns:
        y_RN [R, N] in x's dtype.
    """
    _check_float("x_RK", x_RK)
    _check_float("w_ENK", w_ENK)
    _check_ndim("x_RK", x_RK, 2, "RK")
    _check_ndim("w_ENK", w_ENK, 3, "ENK")
    _check_same_dtype("w_ENK", w_ENK, x_RK.dtype, "x_RK")
    _check_device("x_RK", x_RK, x_RK.device)
    _check_device("w_ENK", w_ENK, x_RK.device)
    if w_ENK.shape[2] != x_RK.shape[1]:
        raise ValueError(
            f"w_ENK must be [E, N, K] with K = x_RK.shape[1] = {x_RK.shape[1]}, got shape {tuple(w_ENK.shape)}"
        )
    _check_offsets(offsets_E1, w_ENK.shape[0], x_RK.shape[0], x_RK.device)
    _check_bias("bias_EN", bias_EN, w_ENK.shape[:2], x_RK.dtype, x_RK.device, "x_RK")
    _check_rows("x_rows", x_rows, x_RK.shape[0], x_RK.device)
    _check_rows("out_rows", out_rows, x_RK.shape[0], x_RK.device)
    return _grouped_mm("fwd", x_RK, w_ENK, offsets_E1, out, allow_tf32, bias_EN, x_rows=x_rows, out_rows=out_rows)


@on_tensor_device
def grouped_mm_dx(
    dy_RN: torch.Tensor,
    w_ENK: torch.Tensor,
    offsets_E1: torch.Tensor,
    *,
    dy_rows: Optional[torch.Tensor] = None,
    out_rows: Optional[torch.Tensor] = None,
    gu_R2F: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    out: Optional[torch.Tensor] = None,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """dx[r] = dy[r] @ w[e] for the rows of segment e: the input gradient of :func:`grouped_mm`.

    With ``gu_R2F`` (the down projection's dX is dH, the activation's output gradient) the activation's
    gradient is fused into the epilogue: the result is ``swiglu_bwd(gu_R2F, dx)`` [R, 2K] (dx rounded to
    dy's dtype first, as stored), bit for bit the two launches', without dx's buffer.

    Args:
        dy_RN: [R, N] output gradient, rows grouped by expert.
        w_ENK: [E, N, K] forward weights, dy's dtype.
        offsets_E1: int32/int64 [E + 1] segment bounds (as in :func:`grouped_mm`).
        dy_rows: optional int32/int64 [R] row map: grouped row r is ``dy_RN[dy_rows[r]]``.
        out_rows: optional int32/int64 [R] row map: grouped row r is written to ``dx[out_rows[r]]``
            (not with ``gu_R2F``: dgu is grouped, as gu).
        gu_R2F: optional [R, 2K] grouped pre-activation in dy's dtype (gate_up_swiglu's gu).
        activation, interleaved, alpha, limit: with ``gu_R2F``, as in :func:`swiglu.swiglu_bwd`.
        out: optional [R, K] (with ``gu_R2F``: [R, 2K]) output buffer in dy's dtype.
        allow_tf32: fp32 inputs only: use TF32 tensor cores.

    Returns:
        dx_RK [R, K] in dy's dtype, or with ``gu_R2F`` dgu_R2K [R, 2K] in gu's column order.
    """
    _check_float("dy_RN", dy_RN)
    _check_float("w_ENK", w_ENK)
    _check_ndim("dy_RN", dy_RN, 2, "RN")
    _check_ndim("w_ENK", w_ENK, 3, "ENK")
    _check_same_dtype("w_ENK", w_ENK, dy_RN.dtype, "dy_RN")
    _check_device("dy_RN", dy_RN, dy_RN.device)
    _check_device("w_ENK", w_ENK, dy_RN.device)
    if w_ENK.shape[1] != dy_RN.shape[1]:
        raise ValueError(
            f"w_ENK must be [E, N, K] with N = dy_RN.shape[1] = {dy_RN.shape[1]}, got shape {tuple(w_ENK.shape)}"
        )
    _check_offsets(offsets_E1, w_ENK.shape[0], dy_RN.shape[0], dy_RN.device)
    _check_rows("dy_rows", dy_rows, dy_RN.shape[0], dy_RN.device)
    _check_rows("out_rows", out_rows, dy_RN.shape[0], dy_RN.device)
    glu = None
    if gu_R2F is not None:
        _check_glu_grad(gu_R2F, dy_RN, w_ENK.shape[2], out_rows, activation, alpha, limit)
        glu = (gu_R2F, activation, bool(interleaved), alpha, limit)
    # dx = dy @ w[e] is the forward kernel on the [E, K, N] view w[e].T: only the strides change.
    return _grouped_mm(
        "dx", dy_RN, w_ENK, offsets_E1, out, allow_tf32, transposed=True, x_rows=dy_rows, out_rows=out_rows, glu=glu
    )


def _check_glu_grad(gu_R2F, dy_RN: torch.Tensor, K: int, out_rows, activation, alpha, limit) -> None:
    """grouped_mm_dx's fused activation gradient: gu [R, 2K] in dy's dtype and device, no out_rows."""
    _check_float("gu_R2F", gu_R2F)
    _check_same_dtype("gu_R2F", gu_R2F, dy_RN.dtype, "dy_RN")
    _check_device("gu_R2F", gu_R2F, dy_RN.device)
    if tuple(gu_R2F.shape) != (dy_RN.shape[0], 2 * K):
        raise ValueError(f"gu_R2F must have shape [R, 2K] = [{dy_RN.shape[0]}, {2 * K}], got {tuple(gu_R2F.shape)}")
    if out_rows is not None:
        raise ValueError("out_rows cannot be given with gu_R2F (dgu is written in grouped order, as gu)")
    _check_activation(activation, alpha, limit)


def _dw_problem(names: tuple, dy_RN, x_RK, offsets_E1, dy_rows, x_rows, out, accumulate) -> tuple:
    """One dW problem's arguments checked (``names``: dy's, x's, their row maps', out's and accumulate's
    argument names): (R, N, K, dw), dw being ``out`` or a new [E, N, K] buffer."""
    dy_name, x_name, dy_rows_name, x_rows_name, out_name, acc_name = names
    _check_float(dy_name, dy_RN)
    _check_float(x_name, x_RK)
    _check_ndim(dy_name, dy_RN, 2, "RN")
    _check_ndim(x_name, x_RK, 2, "RK")
    _check_same_dtype(dy_name, dy_RN, x_RK.dtype, x_name)
    _check_device(x_name, x_RK, x_RK.device)
    _check_device(dy_name, dy_RN, x_RK.device)
    if dy_RN.shape[0] != x_RK.shape[0]:
        raise ValueError(f"{dy_name} must have R = {x_name}.shape[0] = {x_RK.shape[0]} rows, got {dy_RN.shape[0]}")
    if not isinstance(offsets_E1, torch.Tensor) or offsets_E1.dim() != 1 or offsets_E1.shape[0] < 1:
        raise ValueError("offsets_E1 must be a 1-D tensor of E + 1 >= 1 segment bounds")
    E = offsets_E1.shape[0] - 1
    R, K = x_RK.shape
    N = dy_RN.shape[1]
    _check_offsets(offsets_E1, E, R, x_RK.device)
    _check_rows(dy_rows_name, dy_rows, R, x_RK.device)
    _check_rows(x_rows_name, x_rows, R, x_RK.device)
    if not isinstance(accumulate, bool):
        raise TypeError(f"{acc_name} must be a bool, got {type(accumulate).__name__}")
    if accumulate and out is None:
        raise ValueError(f"{acc_name}=True needs {out_name} (the tensor to add to)")
    return R, N, K, _check_out(out, (E, N, K), x_RK.dtype, x_RK.device, out_name)


def _dw_strides(dy_RN, x_RK, dw) -> tuple:
    """One dW problem's strides, in the kernels' order (dy's, x's, dw's)."""
    return (dy_RN.stride(0), dy_RN.stride(1), x_RK.stride(0), x_RK.stride(1), *dw.stride())


@on_tensor_device
def grouped_mm_dw(
    dy_RN: torch.Tensor,
    x_RK: torch.Tensor,
    offsets_E1: torch.Tensor,
    *,
    dy_rows: Optional[torch.Tensor] = None,
    x_rows: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """dw[e] = dy_seg.T @ x_seg over segment e, zeros for an empty segment: the weight gradient.

    Args:
        dy_RN: [R, N] output gradient, rows grouped by expert.
        x_RK: [R, K] forward input, dy's dtype.
        offsets_E1: int32/int64 [E + 1] segment bounds; E is taken from its length.
        dy_rows: optional int32/int64 [R] row map: grouped row r is ``dy_RN[dy_rows[r]]``.
        x_rows: optional int32/int64 [R] row map: grouped row r is ``x_RK[x_rows[r]]``.
        out: optional [E, N, K] output buffer in x's dtype (every element is written).
        accumulate: add to ``out`` (required then) instead of overwriting it: ``out`` becomes
            ``out + dw`` bit for bit as PyTorch adds two [E, N, K] tensors of x's dtype (dw rounded to
            that dtype first), e.g. the running sum of the chunks' gradients of one weight.
        allow_tf32: fp32 inputs only: use TF32 tensor cores.

    Returns:
        dw_ENK [E, N, K] in x's dtype (``out`` where given).
    """
    names = ("dy_RN", "x_RK", "dy_rows", "x_rows", "out", "accumulate")
    R, N, K, dw = _dw_problem(names, dy_RN, x_RK, offsets_E1, dy_rows, x_rows, out, accumulate)
    E = offsets_E1.shape[0] - 1
    if E == 0 or N == 0 or K == 0:
        return dw
    grid = lambda META: (E * triton.cdiv(N, META["BLOCK_N"]) * triton.cdiv(K, META["BLOCK_K"]),)
    dyr = offsets_E1 if dy_rows is None else dy_rows  # (unread without a row map)
    xr = offsets_E1 if x_rows is None else x_rows
    args = (dy_RN, x_RK, dw, offsets_E1, dyr, xr, R, N, K, E, _m_bucket(R, E), *_dw_strides(dy_RN, x_RK, dw))
    meta = dict(
        GATHER_DY=dy_rows is not None,
        GATHER_X=x_rows is not None,
        ACCUMULATE=accumulate,
        **_dot_meta(x_RK.dtype, allow_tf32),
    )
    _launch_gemm("dw", grid, args, x_RK.device, **meta)
    return dw


def _pair_map(dy_rows, x_rows) -> Optional[tuple]:
    """One problem's row map as the pair's kernel takes it: (which operand reads through it: 0 none,
    1 dy, 2 x; the map, or None without one), or None when both operands have one (the kernel maps at
    most one per problem)."""
    if dy_rows is not None and x_rows is not None:
        return None
    return (0, None) if dy_rows is None and x_rows is None else (1, dy_rows) if x_rows is None else (2, x_rows)


def _pair_of(name: str, value) -> tuple:
    """grouped_mm_dw_pair's per-problem ``name`` argument as a tuple of two (each checked with its problem)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a pair (one per problem), got {value!r}")
    return tuple(value)


@on_tensor_device
def grouped_mm_dw_pair(
    dy_RN: torch.Tensor,
    x_RK: torch.Tensor,
    dy_b_RN: torch.Tensor,
    x_b_RK: torch.Tensor,
    offsets_E1: torch.Tensor,
    *,
    dy_rows: Optional[torch.Tensor] = None,
    x_rows: Optional[torch.Tensor] = None,
    dy_b_rows: Optional[torch.Tensor] = None,
    x_b_rows: Optional[torch.Tensor] = None,
    out: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None),
    accumulate: Tuple[bool, bool] = (False, False),
    allow_tf32: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two weight gradients over the same row segments in one launch: ``grouped_mm_dw(dy_RN, x_RK, ...)``
    and ``grouped_mm_dw(dy_b_RN, x_b_RK, ...)``, bit for bit those two launches' (at the same tile config).

    The experts' backward needs both of its dW GEMMs (gate_up's and down's) per chunk; one launch
    instead of two halves their host cost (the module docstring of
    :mod:`lancet_rt.kernels._grouped_gemm_dw_kernels`).

    Args:
        dy_RN, x_RK: the first problem, as in :func:`grouped_mm_dw` ([R, N] and [R, K]).
        dy_b_RN, x_b_RK: the second problem ([R, N_b] and [R, K_b], its own N and K), x's dtype and device.
        offsets_E1: int32/int64 [E + 1] segment bounds of both problems' rows.
        dy_rows, x_rows, dy_b_rows, x_b_rows: optional int32/int64 [R] row maps of each operand.
        out: a pair of optional output buffers ([E, N, K], [E, N_b, K_b], x's dtype).
        accumulate: a pair of bools: add each problem's gradient to its ``out`` (as in :func:`grouped_mm_dw`).
        allow_tf32: fp32 inputs only: use TF32 tensor cores (both problems).

    Returns:
        (dw_ENK, dw_b_ENK) in x's dtype (the ``out`` tensors where given).

    The kernel takes one ``accumulate`` for both problems, at most one row map per problem (as the
    experts have: one operand of each in received order) and one dtype for the two maps; other
    arguments run as the two launches, with the same results.
    """
    out = _pair_of("out", out)
    accumulate = _pair_of("accumulate", accumulate)
    names_a = ("dy_RN", "x_RK", "dy_rows", "x_rows", "out[0]", "accumulate[0]")
    names_b = ("dy_b_RN", "x_b_RK", "dy_b_rows", "x_b_rows", "out[1]", "accumulate[1]")
    R, N, K, dw = _dw_problem(names_a, dy_RN, x_RK, offsets_E1, dy_rows, x_rows, out[0], accumulate[0])
    if isinstance(x_b_RK, torch.Tensor):  # (the kernels take one dtype and device for both problems)
        _check_same_dtype("x_b_RK", x_b_RK, x_RK.dtype, "x_RK")
        _check_device("x_b_RK", x_b_RK, x_RK.device)
    R_b, N_b, K_b, dw_b = _dw_problem(names_b, dy_b_RN, x_b_RK, offsets_E1, dy_b_rows, x_b_rows, out[1], accumulate[1])
    if R_b != R:
        raise ValueError(f"x_b_RK must have R = x_RK.shape[0] = {R} rows (the same segments), got {R_b}")
    E = offsets_E1.shape[0] - 1
    if E == 0 or (N * K == 0 and N_b * K_b == 0):
        return dw, dw_b
    maps = (_pair_map(dy_rows, x_rows), _pair_map(dy_b_rows, x_b_rows))
    given = [m[1] for m in maps if m is not None and m[1] is not None]
    if accumulate[0] != accumulate[1] or None in maps or len({r.dtype for r in given}) > 1:
        kw = dict(allow_tf32=allow_tf32)
        a = grouped_mm_dw(
            dy_RN, x_RK, offsets_E1, dy_rows=dy_rows, x_rows=x_rows, out=dw, accumulate=accumulate[0], **kw
        )
        b = grouped_mm_dw(
            dy_b_RN, x_b_RK, offsets_E1, dy_rows=dy_b_rows, x_rows=x_b_rows, out=dw_b, accumulate=accumulate[1], **kw
        )
        return a, b

    def grid(META):
        bn, bk = META["BLOCK_N"], META["BLOCK_K"]
        return (E * (triton.cdiv(N, bn) * triton.cdiv(K, bk) + triton.cdiv(N_b, bn) * triton.cdiv(K_b, bk)),)

    rows = [m[1] if m[1] is not None else (given[0] if given else offsets_E1) for m in maps]  # (unread: 0)
    args = (dy_RN, x_RK, dw, dy_b_RN, x_b_RK, dw_b, offsets_E1, *rows, R, N, K, N_b, K_b, E, _m_bucket(R, E))
    args = (*args, maps[0][0], maps[1][0], *_dw_strides(dy_RN, x_RK, dw), *_dw_strides(dy_b_RN, x_b_RK, dw_b))
    meta = dict(HAS_ROWS=bool(given), ACCUMULATE=accumulate[0], **_dot_meta(x_RK.dtype, allow_tf32))
    _launch_gemm("dw_pair", grid, args, x_RK.device, **meta)
    return dw, dw_b


def _gate_up_outs(out, R: int, F: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """(h [R, F], gu [R, 2F]): gate_up_swiglu's ``out`` pair checked, or new buffers."""
    if out is None:
        out = (None, None)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out must be None or a pair (h_RF, gu_R2F)")
    h = _check_out(out[0], (R, F), dtype, device, "out[0] (h_RF)")
    return h, _check_out(out[1], (R, 2 * F), dtype, device, "out[1] (gu_R2F)")


@on_tensor_device
def gate_up_swiglu(
    x_RD: torch.Tensor,
    w_E2FD: torch.Tensor,
    offsets_E1: torch.Tensor,
    bias_E2F: Optional[torch.Tensor] = None,
    *,
    x_rows: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    allow_tf32: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The expert input projection with its activation fused into the epilogue.

    Args:
        x_RD: [R, D] rows grouped by local expert.
        w_E2FD: [E, 2F, D] x's dtype, any strides: ``experts.gate_up_proj`` (gate rows first), or
            with ``interleaved`` gate rows 2j and up rows 2j + 1 (GPT-OSS's ``gate_up_proj`` [E, D, 2F]
            passes as its transpose view, no copy).
        offsets_E1: int32/int64 [E + 1] segment bounds (as in :func:`grouped_mm`).
        bias_E2F: optional [E, 2F] bias in w's row order, x's dtype, added before the rounding.
        x_rows: optional int32/int64 [R] row map: grouped row r is ``x_RD[x_rows[r]]`` (h and gu
            are in grouped order).
        activation: "swiglu": h = silu(gate) * up; "swiglu_oai" (GPT-OSS): with g = min(gate, limit)
            and u = clamp(up, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g).
        interleaved: w's rows, the bias and gu alternate gate and up (GPT-OSS) instead of gate first.
        alpha, limit: the "swiglu_oai" constants (GPT-OSS's ``swiglu_alpha``, ``swiglu_limit``).
        out: optional (h [R, F], gu [R, 2F]) output buffers in x's dtype.
        allow_tf32: fp32 inputs only: use TF32 tensor cores.

    Returns:
        (h_RF, gu_R2F): gu = grouped_mm(x, w, bias), kept for backward (in w's row order), and
        h = swiglu_fwd(gu) of that gu, as rounded to x's dtype.
    """
    _check_float("x_RD", x_RD)
    _check_float("w_E2FD", w_E2FD)
    _check_ndim("x_RD", x_RD, 2, "RD")
    _check_ndim("w_E2FD", w_E2FD, 3, ("E", "2F", "D"))
    _check_same_dtype("w_E2FD", w_E2FD, x_RD.dtype, "x_RD")
    _check_device("x_RD", x_RD, x_RD.device)
    _check_device("w_E2FD", w_E2FD, x_RD.device)
    _check_activation(activation, alpha, limit)
    E, F2, D = w_E2FD.shape
    R = x_RD.shape[0]
    if D != x_RD.shape[1] or F2 % 2:
        raise ValueError(
            f"w_E2FD must be [E, 2F, D] with D = x_RD.shape[1] = {x_RD.shape[1]} and an even "
            f"second dim, got shape {tuple(w_E2FD.shape)}"
        )
    _check_offsets(offsets_E1, E, R, x_RD.device)
    _check_bias("bias_E2F", bias_E2F, (E, F2), x_RD.dtype, x_RD.device, "x_RD")
    _check_rows("x_rows", x_rows, R, x_RD.device)
    F = F2 // 2
    h, gu = _gate_up_outs(out, R, F, x_RD.dtype, x_RD.device)
    if R == 0 or F == 0:
        return h, gu
    if D == 0 and bias_E2F is None:  # gu = 0, and both activations map (0, 0) to 0
        return h.zero_(), gu.zero_()
    grid = lambda META: ((triton.cdiv(R, META["BLOCK_M"]) + E - 1) * triton.cdiv(F, META["BLOCK_N"]),)
    b, b_strides = (w_E2FD, (0, 0)) if bias_E2F is None else (bias_E2F, bias_E2F.stride())  # unread without bias
    args = (
        x_RD,
        w_E2FD,
        b,
        h,
        gu,
        offsets_E1,
        offsets_E1 if x_rows is None else x_rows,  # (unread without a row map)
        R,
        F,
        D,
        E,
        _m_bucket(R, E),
        float(alpha),
        float(limit),
        x_RD.stride(0),
        x_RD.stride(1),
        w_E2FD.stride(0),
        w_E2FD.stride(1),
        w_E2FD.stride(2),
        *b_strides,
        h.stride(0),
        h.stride(1),
        gu.stride(0),
        gu.stride(1),
    )
    _launch_gemm(
        "gate_up",
        grid,
        args,
        x_RD.device,
        BLOCK_E=max(16, triton.next_power_of_2(E)),
        HAS_BIAS=bias_E2F is not None,
        INTERLEAVED=bool(interleaved),
        ACTIVATION=activation,
        GATHER_X=x_rows is not None,
        **_dot_meta(x_RD.dtype, allow_tf32),
    )
    return h, gu


__all__ = [
    "grouped_mm",
    "grouped_mm_dx",
    "grouped_mm_dw",
    "gate_up_swiglu",
    "segment_sum",
    "selected_config",
    "CONFIG_ENV",
]
