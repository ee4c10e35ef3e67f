"""The routing kernels' configs: the ones the GPU lane pins, and the ones autotuning chooses.

The lane's steps P1-P4 pin the routing kernels' configs (gating forward and backward, permute forward,
unpermute forward and backward: ``LANCET_*_CONFIG``, :data:`ROUTING_PINS`) as they pin the grouped
GEMM's, so a cold run compiles each kernel once instead of tuning 8-13 configs inside P1's cap. A pin
serves every shape (the kernels mask and tile any E and D); the ones here are in each kernel's config
space and kept by its prune at the lane's shapes (:data:`ROUTING_SHAPES`), tests/bench/test_gpu_lane.py
checks both. Which config would win is a measurement: this module's command, a step of the lane run
unpinned, tunes the kernels at those shapes and prints (and appends as JSON rows) each autotuner's
choice beside the pin, in the variable's format, to pin it next time::

    python -m bench.lane.configs --device cuda --json routing_configs.json

Under ``TRITON_INTERPRET=1`` nothing is timed: the rows say so (``config`` None).
"""

from __future__ import annotations

import argparse
import sys

import torch

#: The routing kernels' pins for P1-P4 (the variables kernels/_gating_kernels.py and _permute_kernels.py
#: read). Gating: 16 tokens a tile over 4 warps gives each thread 1..16 elements of the [BLOCK_T, E]
#: tile for E in 8..128 (the prune's range). Permute: a 4 x 1024 tile over 8 warps, 16 elements a
#: thread, within the prune's widths for D in 1024..4096. Correct at any shape, tuned at none yet.
ROUTING_PINS = {
    "LANCET_GATING_FWD_CONFIG": "BLOCK_T=16,num_warps=4",
    "LANCET_GATING_BWD_CONFIG": "BLOCK_T=16,num_warps=4",
    "LANCET_PERMUTE_FWD_CONFIG": "BLOCK_T=4,BLOCK_D=1024,num_warps=8",
    "LANCET_UNPERMUTE_FWD_CONFIG": "BLOCK_T=4,BLOCK_D=1024,num_warps=8",
    "LANCET_UNPERMUTE_BWD_CONFIG": "BLOCK_T=4,BLOCK_D=1024,num_warps=8",
}
#: (E, K, D) of the lane's MoE layers: bench.overlap's block (P1) and bench.host's two shapes (P2).
ROUTING_SHAPES = ((16, 2, 2048), (128, 8, 2048), (8, 2, 4096))
#: The ops whose launches tune each variable's kernel (permute_bwd runs the unpermute forward kernel).
_OPS = ("gating_fwd", "gating_bwd", "permute_fwd", "unpermute_fwd", "unpermute_bwd")


def tuners() -> dict:
    """Variable -> the ``triton.autotune`` object of the kernel it pins."""
    from lancet_rt.kernels import _gating_kernels as g
    from lancet_rt.kernels import _permute_kernels as p

    return {
        g._ENV_FWD_CONFIG: g._gating_fwd_kernel,
        g._ENV_BWD_CONFIG: g._gating_bwd_kernel,
        p._ENV_PERMUTE_FWD_CONFIG: p._permute_fwd_kernel,
        p._ENV_UNPERMUTE_FWD_CONFIG: p._unpermute_fwd_kernel,
        p._ENV_UNPERMUTE_BWD_CONFIG: p._unpermute_bwd_kernel,
    }


def config_string(config) -> str:
    """A ``triton.Config`` in the pin variables' format ("NAME=int,...,num_warps=int")."""
    return ",".join([*(f"{k}={v}" for k, v in config.kwargs.items()), f"num_warps={config.num_warps}"])


def chosen(tokens: int, device: torch.device, shapes=ROUTING_SHAPES) -> list:
    """Launch every routing op at ``shapes`` (``tokens`` a chunk), then return one row per kernel and
    autotune key: the variable, the key, the config autotuning chose (None: not tuned) and the pin."""
    from lancet_rt.kernels import gating, permute
    from lancet_rt.kernels._common import pinned_config

    from bench.kernels.run import _inputs

    pinned = sorted(v for v in ROUTING_PINS if pinned_config(v) is not None)
    if pinned:
        raise SystemExit(f"bench.lane.configs: {pinned} set: unset them to see what autotuning chooses")
    fns = dict(
        gating_fwd=gating.gating_fwd,
        gating_bwd=gating.gating_bwd,
        permute_fwd=permute.permute_fwd,
        unpermute_fwd=permute.unpermute_fwd,
        unpermute_bwd=permute.unpermute_bwd,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    for E, K, D in shapes:
        for op in _OPS:
            args, kwargs, _ = _inputs(dict(op=op, T=tokens, E=E, K=K, D=D), device, torch.bfloat16, gen)
            fns[op](*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rows = []
    for var, tuner in tuners().items():
        cache = dict(getattr(tuner, "cache", {}) or {})
        if not cache:
            rows.append(
                dict(
                    variable=var,
                    key=None,
                    config=None,
                    pinned=ROUTING_PINS[var],
                    note="not tuned (interpreter, or no launch)",
                )
            )
        for key, config in cache.items():
            text = config_string(config)
            rows.append(
                dict(
                    variable=var,
                    key=str(key),
                    config=text,
                    pinned=ROUTING_PINS[var],
                    same_as_pin=text == ROUTING_PINS[var],
                )
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tokens", type=int, default=4096, help="tokens a chunk (the gating keys ignore it)")
    p.add_argument("--quick", action="store_true", help="toy shapes (the lane's CPU dry run)")
    p.add_argument("--json", default=None, help="append the rows here")
    args = p.parse_args(argv)
    from bench.common import RowLog, run_metadata

    device = torch.device(args.device)
    shapes = ((8, 2, 32), (16, 4, 64)) if args.quick else ROUTING_SHAPES
    meta = dict(bench="routing_configs", **run_metadata(device), tokens=args.tokens, shapes=[list(s) for s in shapes])
    log = RowLog(args.json)
    for row in chosen(args.tokens, device, shapes):
        log.add(dict(meta, **row))
        print(
            f"{row['variable']:30s} {str(row['key']):40s} chose {row['config']}  (pinned {row['pinned']})", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
