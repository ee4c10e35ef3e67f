"""The GPU lane's pre-flight (bench.lane, P0), in one process: every import the lane's steps need,
the versions, the device and its two ceilings (device-to-device copy bandwidth, dense bf16 matmul
rate), as one JSON row. Exits 3 at the first import that fails, so a call does not spend its minutes
on steps that would all fail at their imports (greenlet, say, which the GPU image lacks: ``make
gpu-wheels``).

    python -m bench.lane.preflight --device cuda --json preflight.json
"""

from __future__ import annotations

import argparse
import importlib
import platform
import subprocess
import sys
import time

#: In import order: torch first, so that a broken torch is named as such.
IMPORTS = (
    "torch",
    "triton",
    "greenlet",
    "xxhash",
    "lancet_rt",
    "lancet_rt.kernels",
    "lancet_rt.autotune",
    "pytest",
    "pytest_timeout",
)
IMPORT_FAILED = 3
#: ``--device cuda`` and torch sees no CUDA device: the lane stops too.
NO_CUDA = 4


def check_imports(names=IMPORTS) -> dict:
    """Import each of ``names``; returns name -> version (or ""). Raises ImportError naming the first
    that fails."""
    versions = {}
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # any failure to import stops the lane
            raise ImportError(f"import {name} failed: {type(e).__name__}: {e}") from e
        versions[name] = str(getattr(module, "__version__", ""))
    return versions


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json", default=None, help="append the row here")
    p.add_argument("--quick", action="store_true", help="tiny ceilings (the lane's CPU dry run)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        versions = check_imports()
    except ImportError as e:
        print(f"pre-flight: {e}", flush=True)
        return IMPORT_FAILED
    import torch

    import lancet_rt
    from bench.common import RowLog, copy_bandwidth_gbs, matmul_tflops, run_metadata

    print(
        f"python {platform.python_version()} | " + " | ".join(f"{k} {v}" for k, v in versions.items() if v), flush=True
    )
    print(f"lancet_rt from {lancet_rt.__file__}", flush=True)
    device = torch.device(args.device)
    gpu = {}
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("pre-flight: --device cuda, but torch sees no CUDA device", flush=True)
            return NO_CUDA
        try:
            print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip())
        except (OSError, subprocess.SubprocessError) as e:
            print(f"nvidia-smi -L: {e}")
        props = torch.cuda.get_device_properties(device)
        gpu = dict(
            sm_count=props.multi_processor_count,
            memory_gb=round(props.total_memory / 1e9, 1),
            capability=f"{props.major}.{props.minor}",
        )
    if args.quick:
        copy_gbs, tflops = copy_bandwidth_gbs(device, nbytes=1 << 23), matmul_tflops(device, n=256)
    else:
        copy_gbs, tflops = copy_bandwidth_gbs(device), matmul_tflops(device)
    row = dict(
        bench="preflight",
        **run_metadata(device, copy_gbs=copy_gbs, matmul_tflops=tflops),
        **gpu,
        python=platform.python_version(),
        greenlet=versions.get("greenlet"),
        lancet_rt=lancet_rt.__file__,
        seconds=round(time.monotonic() - t0, 1),
    )
    RowLog(args.json).add(row)
    print(f"{row['device']}: copy {copy_gbs:.4g} GB/s (read + write), matmul {tflops:.4g} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
