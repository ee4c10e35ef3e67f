"""The grouped GEMM's CUDA config space (:mod:`lancet_rt.kernels.grouped_gemm`): candidate tiles, the pruning
predicate the autotuner applies per problem and dtype, and the configs pinned by the environment.

Pure Python over ``triton.Config``: ``python -m bench.kernels.compile_check --all-configs`` builds every
survivor for sm_90, and the tests check the predicate without a GPU.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton

from ._common import parse_config

#: "BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages" pins one config (suffix _FWD/_DX/_GATE_UP/_DW: one op;
#: _DW pins the dW pair too).
CONFIG_ENV = "LANCET_GEMM_CONFIG"
_GROUP_M = 8  # M tiles per L2 group in the swizzled launch order

# How each op names its tile: (output rows, output cols, reduction step) -> kernel meta-parameters.
_TILE_NAMES = {
    "fwd": ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
    "dx": ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
    "gate_up": ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
    "dw": ("BLOCK_N", "BLOCK_K", "BLOCK_M"),
    "dw_pair": ("BLOCK_N", "BLOCK_K", "BLOCK_M"),  # both dW problems in one launch, one tile config
}
# fp32 accumulators per program: the fused gate/up kernel holds two.
_NUM_ACC = {"fwd": 1, "dx": 1, "gate_up": 2, "dw": 1, "dw_pair": 1}


def _make_config(op: str, rows: int, cols: int, red: int, num_warps: int, num_stages: int) -> triton.Config:
    names = _TILE_NAMES[op]
    meta = {names[0]: rows, names[1]: cols, names[2]: red, "GROUP_M": _GROUP_M}
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


def _tile_of(op: str, cfg: triton.Config) -> Tuple[int, int, int]:
    names = _TILE_NAMES[op]
    return tuple(cfg.kwargs[n] for n in names)


# Candidate (tile rows, tile cols, num_warps) for the CUDA autotuner, largest first.
_TILES = (
    (128, 256, 8),  # the Hopper sweet spot for long segments and wide outputs
    (256, 128, 8),  # the same area, favouring long segments
    (128, 128, 8),
    (128, 128, 4),
    (128, 64, 4),  # narrow outputs
    (64, 128, 4),  # short segments (skewed routing, small chunks)
    (64, 64, 4),  # tiny problems
)


def _gemm_configs(op: str) -> list:
    """The CUDA search space of one op: :data:`_TILES` x reduction steps of 32 or 64 (128 bytes of
    fp32 or of bf16/fp16) x 3 or 4 pipeline stages, kept when the fp32 accumulators fit in
    registers. :func:`_prune_configs` narrows it per problem and dtype (at most 14 survive)."""
    configs = []
    for rows, cols, num_warps in _TILES:
        for red in (32, 64):
            for num_stages in (3, 4):
                cfg = _make_config(op, rows, cols, red, num_warps, num_stages)
                if _acc_regs(op, cfg) <= 128:
                    configs.append(cfg)
    return configs


# fp32 accumulator registers per thread allowed where fp32 operands sit in registers next to the
# accumulators: on the FMA units (fp32 without TF32), and in dW with TF32 too, whose operands are both
# MN-major (dy_seg.T, x_seg), which tf32 wgmma cannot read from shared memory. There, sm_90 builds with
# 128 accumulator registers spill heavily, those with 64 little (``python -m bench.kernels.compile_check
# --all-configs``). The interleaved gate_up (GPT-OSS's [E, D, 2F] weight: an MN-major operand, and a
# gate/up split in the epilogue) joins them in fp32 (with TF32 too, 128 accumulator registers spilled),
# and at 4 warps in every dtype (bf16 128 x 64 spilled even without bias). The spills and register
# counts per Triton version: bench/results/HISTORY.md.
_FP32_ACC_REGS = 64
# dH's GEMM with the activation's gradient in its epilogue (dx with GLU_GRAD) holds the gate, up and
# their gradients' fp32 tiles next to the accumulator: sm_90 builds with 128 or 64 accumulator
# registers spilled (bf16, and interleaved gate/up in fp32), with 32 none; as many values per thread
# as the standalone SwiGLU backward kernel's tiles hold.
_GLU_ACC_REGS = 32


def _acc_regs(op: str, cfg: triton.Config) -> int:
    """fp32 accumulator registers per thread (beyond ~128 the kernel spills)."""
    rows, cols, _ = _tile_of(op, cfg)
    return rows * cols * _NUM_ACC[op] // (32 * cfg.num_warps)


def _smem_fits(op: str, cfg: triton.Config, *, elt_bytes: int, smem_bytes: int) -> bool:
    """Whether ``op``'s pipelined operand stages at ``cfg`` fit in the shared memory of one block."""
    rows, cols, red = _tile_of(op, cfg)
    stage_bytes = (rows * red + _NUM_ACC[op] * red * cols) * elt_bytes
    return stage_bytes * cfg.num_stages <= smem_bytes


def _config_fits(op: str, cfg: triton.Config, *, elt_bytes: int, smem_bytes: int) -> bool:
    """Predicate for one element size: each reduction step loads 128 bytes per operand row (one
    swizzled shared-memory line: BK=64 for bf16/fp16, 32 for fp32), and the pipelined operand
    stages fit in the shared memory of one block (:func:`_smem_fits`)."""
    _, _, red = _tile_of(op, cfg)
    return red * elt_bytes == 128 and _smem_fits(op, cfg, elt_bytes=elt_bytes, smem_bytes=smem_bytes)


def _smem_bytes(device: torch.device) -> int:
    """Opt-in shared memory per block (227 KiB on H100/H200; also assumed off CUDA)."""
    if device.type != "cuda":
        return 227 * 1024
    return _cuda_smem_bytes(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_smem_bytes(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 227 * 1024))


def _prune_configs(op: str):
    """The autotuner's early_config_prune for one op: :func:`_config_fits` for the input's element
    size and the device's shared memory, at most :data:`_FP32_ACC_REGS` accumulator registers where
    fp32 operands live in registers (no TF32, dW, the interleaved gate_up) and for the interleaved
    gate_up at 4 warps, :data:`_GLU_ACC_REGS` for dx with the activation's gradient fused, and no
    tile much larger than the problem (tile rows against the mean rows per expert, tile columns
    against the output width)."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        x = args["x_ptr"]
        smem = _smem_bytes(x.device)
        interleaved = op == "gate_up" and bool(args.get("INTERLEAVED", False))
        fp32_in_regs = x.element_size() == 4 and (
            op in ("dw", "dw_pair") or args.get("INPUT_PRECISION", "ieee") == "ieee" or interleaved
        )

        glu = op == "dx" and bool(args.get("GLU_GRAD", False))

        def max_acc(cfg) -> int:
            if glu:
                return _GLU_ACC_REGS
            return _FP32_ACC_REGS if fp32_in_regs or (interleaved and cfg.num_warps < 8) else 128

        if op == "dw":
            out_rows, out_cols = args["N"], args["K"]
        elif op == "dw_pair":  # (the larger problem's output bounds the tile)
            out_rows, out_cols = max(args["N"], args["N_B"]), max(args["K"], args["K_B"])
        elif op == "gate_up":
            out_rows, out_cols = args["M_BUCKET"], args["F"]
        else:
            out_rows, out_cols = args["M_BUCKET"], args["N"]
        max_rows = max(64, triton.next_power_of_2(out_rows))
        max_cols = max(64, triton.next_power_of_2(out_cols))
        kept = [
            cfg
            for cfg in configs
            if _config_fits(op, cfg, elt_bytes=x.element_size(), smem_bytes=smem)
            and _acc_regs(op, cfg) <= max_acc(cfg)
            and _tile_of(op, cfg)[0] <= max_rows
            and _tile_of(op, cfg)[1] <= max_cols
        ]
        # Never return nothing: the smallest tile with the right reduction step always compiles.
        if not kept:
            red = 128 // x.element_size()
            kept = [_make_config(op, 64, 64, red, 4, 3)]
        return kept

    return prune


def _pinned_config(op: str) -> Optional[Tuple[int, int, int, int, int]]:
    """The config pinned by the environment for ``op`` (op-specific variable first), or None; the dW
    pair is pinned by dW's (it replaces two dW launches, so the same pin keeps the same bits)."""
    name = "dw" if op == "dw_pair" else op
    for var in (f"{CONFIG_ENV}_{name.upper()}", CONFIG_ENV):
        parsed = parse_config(var)  # (kernels._common: the one parser of every kernel-config variable)
        if parsed is not None:
            tiles, num_warps, num_stages = parsed
            return (*tiles.values(), num_warps, num_stages)
    return None
