"""The cases the sm_90 compile check builds (:mod:`bench.kernels.compile_check`): each Triton kernel of
lancet_rt.kernels with representative arguments, its config space, and the variants of the expert kernels.

``jobs()`` lists one :class:`Job` per compile; the check compiles them and reports registers, spills and
shared memory.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

#: Opt-in shared memory per block on H100/H200 (sm_90), bytes.
SMEM_LIMIT = 227 * 1024
#: Compute capability and warp size of the target.
ARCH, WARP_SIZE = 90, 32

# Representative sizes: all multiples of 16 (how real shapes specialize), below 2^31 (int32 args).
_T, _D, _F, _R, _E_LOCAL = 16384, 4096, 2048, 32768, 8
_GATING_E = (64, 8, 256)  # DeepSeek-like first (the default), then Mixtral-like and a wide router
_GATING_K = 8
# Biased selection (E, n_group, topk_group): DeepSeek-V3 first (the default), Kimi-K2 (no groups),
# and padded groups (E=160 in 8 groups of 20: 8 x 32 lanes).
_GATING_BIASED = ((256, 8, 4), (384, 1, 1), (160, 8, 3))
_PERMUTE_D = (4096, 128)  # model widths: the first covers every D >= 2048, the second small models
_SWIGLU_F = (2048, 512, 256)
# Grouped GEMM (dtype, dot precision): fp32 is exact ("ieee", FMA units) unless allow_tf32 asks for tf32.
_GEMM_CASES = (("bf16", "ieee"), ("fp16", "ieee"), ("fp32", "ieee"), ("fp32", "tf32"))
_GEMM_OPS = ("fwd", "dx", "gate_up", "dw", "dw_pair")
# Expert variants (the constexprs of the GEMM epilogues and the activation kernels), as (label, flags).
# "gpt_oss" is GPT-OSS's experts: interleaved gate/up in its transposed weight, biases, the clamped
# activation (for the fwd op: the down projection, bias and transposed weight); the other labels
# cover the remaining combinations in bf16.
_GPT_OSS = dict(HAS_BIAS=True, INTERLEAVED=True, ACTIVATION="swiglu_oai")
# "rows": the row maps the experts use on received rows (gate_up reads x through one, the down
# projection writes y through one, dH reads dY and dX writes through one, dW reads x and dY through
# them); "dgu": dH's GEMM with the activation's gradient in its epilogue (GLU_GRAD).
_DGU = dict(GLU_GRAD=True, GATHER_X=True)
_GEMM_VARIANTS = {
    "fwd": (("", {}), ("gpt_oss", dict(HAS_BIAS=True)), ("rows", dict(SCATTER_Y=True))),
    "dx": (
        ("", {}),
        ("rows", dict(SCATTER_Y=True)),
        ("dgu rows", _DGU),
        ("gpt_oss dgu rows", dict(_DGU, INTERLEAVED=True, ACTIVATION="swiglu_oai")),
    ),
    "dw": (("", {}), ("rows", dict(GATHER_X=True, GATHER_DY=True))),
    # the experts' two dW in one launch (the lancet layout maps gate_up's x and down's dy, GPT-OSS's the others)
    "dw_pair": (("", {}), ("rows", dict(HAS_ROWS=True))),
    "gate_up": (("", {}), ("gpt_oss", _GPT_OSS), ("rows", dict(GATHER_X=True))),
}
_GEMM_EXTRA = {
    "gate_up": (
        ("bias swiglu_oai", dict(HAS_BIAS=True, ACTIVATION="swiglu_oai")),
        ("interleaved", dict(INTERLEAVED=True)),
    )
}
_SWIGLU_VARIANTS = (
    ("", {}),
    ("gpt_oss", dict(INTERLEAVED=True, ACTIVATION="swiglu_oai")),
    ("swiglu_oai", dict(ACTIVATION="swiglu_oai")),
    ("interleaved", dict(INTERLEAVED=True)),
)
# The cases the default check compiles beyond each kernel's first: every dtype of the lancet GEMMs, and
# every branch of every expert constexpr once (the flags' code blocks compose: INTERLEAVED's main loop
# and split epilogue, HAS_BIAS in both gate_up branches and in fwd, "swiglu_oai"), GPT-OSS's gate_up in
# the dtypes whose registers are tightest (fp32 on the FMA units and with TF32, bf16 the common case).
# ``--all-configs`` compiles every case.
_DEFAULT_VARIANTS = {
    **{f"grouped_gemm.{op}": {"bf16", "fp16", "fp32", "fp32 tf32", "bf16 rows"} for op in _GEMM_OPS},
    "grouped_gemm.fwd": {"bf16", "fp16", "fp32", "fp32 tf32", "bf16 gpt_oss", "bf16 rows"},
    "grouped_gemm.dx": {
        "bf16",
        "fp16",
        "fp32",
        "fp32 tf32",
        "bf16 rows",
        "bf16 dgu rows",
        "fp32 dgu rows",
        "bf16 gpt_oss dgu rows",
        "fp32 gpt_oss dgu rows",
    },
    "grouped_gemm.gate_up": {
        "bf16",
        "fp16",
        "fp32",
        "fp32 tf32",
        "bf16 gpt_oss",
        "fp32 gpt_oss",
        "fp32 tf32 gpt_oss",
        "bf16 bias swiglu_oai",
        "bf16 rows",
    },
    "swiglu.fwd": {"F=2048 bf16", "F=2048 bf16 gpt_oss"},
    "swiglu.bwd": {"F=2048 bf16", "F=2048 bf16 gpt_oss"},
    "norm.fwd": {"D=4096 bf16 residual=False rstd=recomputed", "D=7168 fp32 residual=True rstd=saved"},
    "norm.bwd": {"D=4096 bf16 grad_s=False rstd=recomputed", "D=7168 fp32 grad_s=True rstd=saved"},
}


@dataclasses.dataclass(frozen=True)
class Job:
    """One compile: ``meta`` holds the constexprs and launch options (num_warps, num_stages)."""

    kernel: str
    variant: str
    case: tuple
    meta: Tuple[Tuple[str, object], ...]

    @property
    def config(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.meta)


# ------------------------------------------------------------------------------------------------
# The kernels, their representative arguments and their config spaces
# ------------------------------------------------------------------------------------------------
def _modules():
    """lancet_rt.kernels.* imported as compilable JITFunctions, or a RuntimeError saying why not.

    Triton decides when a kernel is *defined* whether ``@triton.jit`` returns a JITFunction or an
    interpreter stand-in (TRITON_INTERPRET=1); only the former compiles, and its helpers must be
    JITFunctions too, so kernels/ has to be imported with the interpreter off: ``main`` makes sure
    of it, and a process that imported kernels/ under the interpreter (the CPU test session) must
    run this module in a fresh process instead.
    """
    if "lancet_rt.kernels" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "0"
    from lancet_rt.kernels import gating, grouped_gemm, permute, swiglu
    from triton.runtime.jit import JITFunction

    if not isinstance(swiglu._swiglu_fwd_kernel, JITFunction):
        raise RuntimeError(
            "kernels/ was imported with TRITON_INTERPRET=1, so its kernels are interpreter "
            "stand-ins; run `python -m bench.kernels.compile_check` in a fresh process"
        )
    return gating, permute, grouped_gemm, swiglu


def _buf(dtype: str):
    """A small CPU tensor standing in for a device buffer: the JIT reads only its dtype and alignment."""
    import torch

    return torch.empty(
        64,
        dtype={
            "bf16": torch.bfloat16,
            "fp16": torch.float16,
            "fp32": torch.float32,
            "i32": torch.int32,
            "i64": torch.int64,
        }[dtype],
    )


def _next_pow2(n: int) -> int:
    """triton.next_power_of_2 without importing triton at module import."""
    return 1 << (n - 1).bit_length()


def _cfg_meta(cfg) -> Dict[str, object]:
    """A triton.Config as compile meta: its constexprs plus num_warps / num_stages."""
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _gating_fwd(case):
    gating, *_ = _modules()
    E, n_group, topk_group, biased, *single = case
    single = bool(single and single[0])
    args = (
        _buf("fp32"),
        _buf("fp32"),
        _buf("i32"),
        _buf("i32"),
        _buf("fp32"),
        _buf("i32"),
        _buf("i32"),
        _buf("i32"),
        _buf("fp32"),
        _buf("fp32"),
        _buf("i32"),  # (the kept rows', totals' and rows' stand-ins: off on the multi-span path)
        _buf("i32"),
        _buf("i32"),
        _buf("i32"),
        _buf("i32"),
        _T,
        E,
        _GATING_K,
        128,
        2**31 - 1,
        n_group,
        E // n_group,
        topk_group,
        2.5,
        0.0,
        E,
        1,
    )
    # The multi-span path with normalized weights: the common case at real T. Plain routing is
    # softmax; biased routing is DeepSeek-V3's (sigmoid, expert bias, groups if any, scaled weights).
    # ``single``: the one-program path with the kept rows, totals and dispatch rows (the layer's small chunks).
    grouped = n_group > 1
    block_g, block_gs = (_next_pow2(n_group), _next_pow2(E // n_group)) if grouped else (1, 1)
    const = dict(
        SIGMOID=biased,
        NORMALIZE=True,
        SINGLE_PROGRAM=single,
        HAS_BIAS=biased,
        HAS_SCALE=biased,
        GROUPED=grouped,
        HAS_KEPT=single,
        HAS_TOTALS=single,
        HAS_ROWS=single,
        BLOCK_G=block_g,
        BLOCK_GS=block_gs,
        BLOCK_E=block_g * block_gs if grouped else _next_pow2(E),
    )
    return gating._gating_fwd_kernel.fn, args, const


def _gating_bwd(case):
    gating, *_ = _modules()
    (E,) = case
    args = (
        _buf("fp32"),
        _buf("i32"),
        _buf("fp32"),
        _buf("fp32"),
        _buf("fp32"),
        _buf("fp32"),
        _T,
        E,
        _GATING_K,
        2.5,
        0.0,
        E,
        1,
        _GATING_K,
        1,
        _GATING_K,
        1,
        1,
    )
    # Every incoming gradient present, scaled weights: the most live tile-sized values.
    const = dict(
        SIGMOID=False,
        NORMALIZE=True,
        HAS_GRAD_W=True,
        HAS_GRAD_P=True,
        HAS_GRAD_Z=True,
        HAS_SCALE=True,
        BLOCK_E=_next_pow2(E),
    )
    return gating._gating_bwd_kernel.fn, args, const


def _gating_tile_configs(env_var_name: str):
    def configs(case):
        gating, *_ = _modules()
        E, n_group = case[0], (case[1] if len(case) > 1 else 1)
        # The expert lanes: next_pow2(E), or next_pow2(n_group) x next_pow2(E / n_group) when grouped.
        block_e = _next_pow2(n_group) * _next_pow2(E // n_group) if n_group > 1 else _next_pow2(E)
        from lancet_rt.kernels import _gating_kernels  # the config space lives with the kernels

        prune = _gating_kernels._token_tile_prune(getattr(gating, env_var_name))
        return [
            _cfg_meta(c)
            for c in prune(
                _gating_kernels._token_tile_configs(), {"E": E, "K": _GATING_K}, BLOCK_E=block_e, GROUPED=n_group > 1
            )
        ]

    return configs


def _gating_finish(case):
    gating, *_ = _modules()
    (e,) = case
    nb = 512
    bufs = (*("i32",) * 3, *("fp32",) * 2, *("i32",) * 3, *("fp32",) * 2, "i32", "i64", "fp32", "fp32", "i32")
    args = (*(_buf(d) for d in bufs), _T * _GATING_K, nb, e, 32 * _GATING_K, 4 * gating._FLAT_BLOCK, 2**31 - 1)
    # With the kept rows, the running totals and the dispatch rows (the layer's path with a capacity): the
    # most work per column and per assignment.
    const = dict(
        HAS_KEPT=True,
        HAS_TOTALS=True,
        HAS_ROWS=True,
        SCAN_BLOCK_B=gating._SCAN_BLOCK_B,
        SCAN_BLOCK_E=gating._SCAN_BLOCK_E,
        BLOCK=gating._FLAT_BLOCK,
        BLOCK_B=gating._slot_pass_rows(e),
        BLOCK_E=e,
    )
    return gating._gating_finish_kernel, args, const


def _dispatch_rows(case):
    _, permute, *_ = _modules()
    args = (_buf("i32"), _buf("i32"), _buf("i32"), _buf("i32"), _buf("i32"), _T * _GATING_K, 64)
    return permute._dispatch_rows_kernel, args, dict(BLOCK=permute._FLAT_BLOCK, BLOCK_E=64)


def _regroup_rows(case):
    _, permute, *_ = _modules()
    args = (_buf("i64"), _buf("i64"), _buf("i64"), _buf("i64"), 8, 16, 17, 1)
    return permute._regroup_rows_kernel, args, dict(BLOCK_B=128, BLOCK_L=32, BLOCK=permute._REGROUP_BLOCK)


def _permute_fwd(case):
    _, permute, *_ = _modules()
    (D,) = case
    args = (_buf("bf16"), _buf("i32"), _buf("bf16"), _buf("i32"), _T, D, _GATING_K, _T * _GATING_K, D, 1)
    return permute._permute_fwd_kernel.fn, args, dict(HAS_SRC=True)


def _unpermute_fwd(case):
    _, permute, *_ = _modules()
    (D,) = case
    args = (_buf("bf16"), _buf("i32"), _buf("fp32"), _buf("bf16"), _T, D, _GATING_K, _T * _GATING_K, D, 1, _GATING_K, 1)
    return permute._unpermute_fwd_kernel.fn, args, dict(HAS_WEIGHT=True)


def _unpermute_bwd(case):
    _, permute, *_ = _modules()
    (D,) = case
    args = (
        _buf("bf16"),
        _buf("bf16"),
        _buf("i32"),
        _buf("fp32"),
        _buf("bf16"),
        _buf("fp32"),
        _T,
        D,
        _GATING_K,
        _T * _GATING_K,
        D,
        1,
        D,
        1,
        _GATING_K,
        1,
    )
    return permute._unpermute_bwd_kernel.fn, args, {}


def _row_tile_configs(env_var_name: str):
    def configs(case):
        _, permute, *_ = _modules()
        (D,) = case
        from lancet_rt.kernels import _permute_kernels  # the config space lives with the kernels

        prune = _permute_kernels._row_tile_prune(getattr(permute, env_var_name))
        return [_cfg_meta(c) for c in prune(_permute_kernels._row_tile_configs(), {"D": D, "K": _GATING_K})]

    return configs


def _gemm(op: str):
    """Arguments of grouped GEMM ``op`` for case (dtype, dot precision, flags), laid out as its launcher
    lays them out; flags are the epilogue constexprs (HAS_BIAS, INTERLEAVED, ACTIVATION). The weights
    are views as the experts pass them: the lancet layout, or GPT-OSS's transposed parameters."""

    def build(case):
        *_, gg, _ = _modules()
        dtype, input_precision, flags = case
        flags = dict(flags)
        E, R, D, F = _E_LOCAL, _R, _D, _F
        x, w, b, y, off = _buf(dtype), _buf(dtype), _buf(dtype), _buf(dtype), _buf("i32")
        precision = dict(INPUT_PRECISION=input_precision, DOT_FP32=False)
        block_e = max(16, _next_pow2(E))
        if op == "fwd":  # down projection: y[R, D] = h[R, F] @ w[e].T, w [E, D, F] (GPT-OSS: [E, F, D] transposed)
            w_strides = (F * D, 1, D) if flags.get("HAS_BIAS") else (D * F, F, 1)
            args = (x, w, b, y, off, off, off, y, R, D, F, E, 4096, 1.702, 7.0, F, 1, *w_strides, D, 1, D, 1, D, 1)
            return gg._grouped_gemm_fwd_kernel, args, dict(BLOCK_E=block_e, **precision, **flags), F
        if op == "dx":  # dh[R, F] = dy[R, D] @ w[e] through the view w[e].T: [E, F, D], strides (D*F, 1, F)
            # (GLU_GRAD: y is dgu [R, 2F] = swiglu_bwd(gu [R, 2F], dh))
            y_stride = 2 * F if flags.get("GLU_GRAD") else F
            gu_args = (_buf(dtype), R, F, D, E, 4096, 1.702, 7.0, D, 1, D * F, 1, F, 0, 0, y_stride, 1, 2 * F, 1)
            args = (x, w, b, y, off, off, off) + gu_args
            return gg._grouped_gemm_fwd_kernel, args, dict(BLOCK_E=block_e, **precision, **flags), D
        if op == "gate_up":  # h, gu = act(x[R, D] @ w[e].T + b[e]), w [E, 2F, D] (GPT-OSS: [E, D, 2F] transposed)
            w_strides = (2 * F * D, 1, 2 * F) if flags.get("INTERLEAVED") else (2 * F * D, D, 1)
            args = (
                x,
                w,
                b,
                y,
                _buf(dtype),
                off,
                off,
                R,
                F,
                D,
                E,
                4096,
                1.702,
                7.0,
                D,
                1,
                *w_strides,
                2 * F,
                1,
                F,
                1,
                2 * F,
                1,
            )
            return gg._gate_up_swiglu_fwd_kernel, args, dict(BLOCK_E=block_e, **precision, **flags), D
        if op == "dw_pair":  # gate_up's dw [E, 2F, D] = dgu_seg.T @ x_seg, then down's [E, D, F] = dy_seg.T @ h_seg
            a = (y, x, w, y, x, w, *(off,) * 3, R, 2 * F, D, D, F, E, 4096, 2, 1, 2 * F, 1, D, 1, 2 * F * D, D, 1)
            return gg._grouped_gemm_dw_pair_kernel, (*a, D, 1, F, 1, D * F, F, 1), dict(**precision, **flags), None
        # dw[e] = dy_seg.T @ x_seg for the down projection: dy [R, D], x [R, F], dw [E, D, F]
        args = (x, w, y, off, off, off, R, D, F, E, 4096, D, 1, F, 1, D * F, F, 1)
        return gg._grouped_gemm_dw_kernel, args, dict(**precision, **flags), None

    def kernel(case):
        fn, args, const, k_dim = build(case)
        return fn, args, const

    def configs(case):
        *_, gg, _ = _modules()
        fn, args, const, k_dim = build(case)
        out = []
        for cfg in gg._prune_configs(op)(gg._gemm_configs(op), dict(zip(fn.arg_names, args)), **const):
            meta = _cfg_meta(cfg)
            if k_dim is not None:  # the launchers' EVEN_K heuristic
                meta["EVEN_K"] = gg._even_k({"K": k_dim, "BLOCK_K": cfg.kwargs["BLOCK_K"]})
            out.append(meta)
        return out

    return kernel, configs


def _gemm_cases(op: str) -> List[Tuple[str, tuple]]:
    """Every dtype case of each of ``op``'s variants, then the extra variants in bf16."""

    def label(dtype, precision, name):
        return " ".join(p for p in (dtype, "" if precision == "ieee" else precision, name) if p)

    cases = [
        (label(dt, p, name), (dt, p, tuple(flags.items())))
        for name, flags in _GEMM_VARIANTS[op]
        for dt, p in _GEMM_CASES
    ]
    return cases + [
        (label("bf16", "ieee", name), ("bf16", "ieee", tuple(flags.items()))) for name, flags in _GEMM_EXTRA.get(op, ())
    ]


def _segment_sum(case):
    _modules()  # first: with the interpreter off
    from lancet_rt.kernels import segment_sum

    dtype, N = case
    args = (_buf(dtype), _buf(dtype), _buf("i32"), _R, N, N, 1, N, 1)
    return segment_sum._segment_sum_kernel, args, {}


def _segment_sum_configs(case):
    import torch

    _modules()
    from lancet_rt.kernels import segment_sum

    _, N = case
    block_m, block_n, num_warps = segment_sum._segment_sum_blocks(N, _E_LOCAL, torch.device("cuda"))  # the CUDA choice
    return [dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)]


def _swiglu(direction: str):
    def kernel(case):
        *_, swiglu = _modules()
        F, flags = case
        if direction == "fwd":
            args = (_buf("bf16"), _buf("bf16"), _R, F, 1.702, 7.0, 2 * F, 1, F, 1)
            return swiglu._swiglu_fwd_kernel, args, dict(flags)
        args = (_buf("bf16"), _buf("bf16"), _buf("bf16"), _R, F, 1.702, 7.0, 2 * F, 1, F, 1, 2 * F, 1)
        return swiglu._swiglu_bwd_kernel, args, dict(flags)

    def configs(case):
        import torch

        *_, swiglu = _modules()
        F, _ = case
        block_r, block_f, num_warps = swiglu._swiglu_blocks(F, torch.device("cuda"))  # the CUDA choice
        return [dict(BLOCK_R=block_r, BLOCK_F=block_f, num_warps=num_warps)]

    return kernel, configs


def _norm(direction: str):
    """The fused add + RMSNorm (kernels/norm.py): with the residual (the sum's gradient) and without."""

    def kernel(case):
        _modules()  # first: with the interpreter off
        from lancet_rt.kernels import norm

        D, dtype, flag, rstd = case
        if direction == "fwd":
            args = (*[_buf(dtype)] * 5, _buf("fp32"), _T, D, 1e-6, D, D, D, D)
            return norm._add_rmsnorm_fwd_kernel, args, dict(HAS_RESIDUAL=flag, HAS_RSTD=rstd == "saved")
        args = (*[_buf(dtype)] * 3, _buf("fp32"), _buf(dtype), _buf(dtype), _buf("fp32"), _T, D, 1e-6, D, D, D, D)
        return norm._add_rmsnorm_bwd_kernel, args, dict(HAS_DS=flag, RECOMPUTE=rstd == "recomputed")

    def configs(case):
        import torch

        _modules()
        from lancet_rt.kernels import norm

        block_r, block_d, num_warps = norm._rows(case[0], torch.device("cuda"))  # the CUDA choice
        return [dict(BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)]

    return kernel, configs


def _ce_grad(case):
    _modules()
    from lancet_rt.kernels import linear_ce

    (V,) = case
    return linear_ce._ce_grad_fwd_kernel, (_buf("fp32"), _buf("i64"), _buf("fp32"), _T, V, 1e-4, -100, V), {}


def _ce_grad_configs(case):
    return [dict(BLOCK_V=4096, num_warps=8)]  # the launcher's CUDA choice for V >= 4096


def _fixed(case):
    return [{}]  # the launcher's constants, Triton's default num_warps / num_stages


# name -> (kernel builder, config space, cases as (variant label, case))
_SPECS: Dict[str, Tuple[Callable, Callable, List[Tuple[str, tuple]]]] = {
    "gating.fwd": (
        _gating_fwd,
        _gating_tile_configs("_ENV_FWD_CONFIG"),
        [(f"E={e} fp32", (e, 1, 1, False)) for e in _GATING_E],
    ),
    "gating.fwd_biased": (
        _gating_fwd,
        _gating_tile_configs("_ENV_FWD_CONFIG"),
        [(f"E={e} n_group={g} topk_group={kg} fp32", (e, g, kg, True)) for e, g, kg in _GATING_BIASED],
    ),
    "gating.fwd_single": (
        _gating_fwd,
        _gating_tile_configs("_ENV_FWD_CONFIG"),
        [("E=64 fp32", (64, 1, 1, False, True)), ("E=256 n_group=8 topk_group=4 fp32", (256, 8, 4, True, True))],
    ),
    "gating.bwd": (_gating_bwd, _gating_tile_configs("_ENV_BWD_CONFIG"), [(f"E={e} fp32", (e,)) for e in _GATING_E]),
    "gating.finish": (_gating_finish, _fixed, [(f"E={e} fp32", (e,)) for e in _GATING_E]),
    "permute.dispatch_rows": (_dispatch_rows, _fixed, [("i32", ())]),
    "permute.regroup_rows": (_regroup_rows, _fixed, [("i64", ())]),
    "permute.fwd": (
        _permute_fwd,
        _row_tile_configs("_ENV_PERMUTE_FWD_CONFIG"),
        [(f"D={d} bf16", (d,)) for d in _PERMUTE_D],
    ),
    "unpermute.fwd": (
        _unpermute_fwd,
        _row_tile_configs("_ENV_UNPERMUTE_FWD_CONFIG"),
        [(f"D={d} bf16", (d,)) for d in _PERMUTE_D],
    ),
    "unpermute.bwd": (
        _unpermute_bwd,
        _row_tile_configs("_ENV_UNPERMUTE_BWD_CONFIG"),
        [(f"D={d} bf16", (d,)) for d in _PERMUTE_D],
    ),
    **{f"grouped_gemm.{op}": (*_gemm(op), _gemm_cases(op)) for op in _GEMM_OPS},
    # Bias gradients: the segment sums of dgu [R, 2F] (and of dy [R, D]: the same compile at D = 2F).
    "segment_sum": (
        _segment_sum,
        _segment_sum_configs,
        [(f"N={2 * _F} {dt}", (dt, 2 * _F)) for dt in ("bf16", "fp32")],
    ),
    **{
        f"swiglu.{d}": (
            *_swiglu(d),
            [
                (f"F={f} bf16 {name}".rstrip(), (f, tuple(flags.items())))
                for f in _SWIGLU_F
                for name, flags in _SWIGLU_VARIANTS
            ],
        )
        for d in ("fwd", "bwd")
    },
    **{
        f"norm.{d}": (
            *_norm(d),
            [
                (f"D={D} {dt} {'residual' if d == 'fwd' else 'grad_s'}={flag} rstd={rstd}", (D, dt, flag, rstd))
                for D in (_D, 7168)
                for dt in ("bf16", "fp32")
                for flag in (True, False)
                for rstd in ("saved", "recomputed")  # (the eager layer's kernels recompute it)
            ],
        )
        for d in ("fwd", "bwd")
    },
    "linear_ce.ce_grad": (_ce_grad, _ce_grad_configs, [("V=151936 fp32", (151936,)), ("V=32000 fp32", (32000,))]),
}


def jobs(all_configs: bool = False, kernels: Optional[List[str]] = None) -> List[Job]:
    """The compiles to run: by default the first config of each kernel's first case and of its cases
    in ``_DEFAULT_VARIANTS``; with ``all_configs`` every config its pruned space keeps in every case,
    each distinct compile once."""
    out, seen = [], set()
    for name, (build, configs, cases) in _SPECS.items():
        if kernels and name not in kernels:
            continue
        if not all_configs:
            cases = [c for i, c in enumerate(cases) if i == 0 or c[0] in _DEFAULT_VARIANTS.get(name, ())]
        for variant, case in cases:
            space = configs(case)
            for meta in space if all_configs else space[:1]:
                fn, args, const = build(case)
                key = (name, tuple(map(_arg_kind, args)), tuple(sorted({**const, **meta}.items())))
                if key in seen:  # e.g. permute D=128 and D=4096 both keep BLOCK_D=512 tiles
                    continue
                seen.add(key)
                out.append(Job(name, variant, case, tuple(meta.items())))
    return out


def _arg_kind(arg) -> str:
    """What the JIT specializes an argument on: a tensor's dtype, an int's being 1 or a multiple of 16
    (a float: nothing)."""
    if isinstance(arg, float):
        return "f"
    if isinstance(arg, int):
        return "1" if arg == 1 else "D" if arg % 16 == 0 else "i"
    return str(arg.dtype)
