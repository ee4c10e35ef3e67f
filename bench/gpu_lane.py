"""The whole GPU lane in one command (../shared/GPU.md), ending with every headline number and its target.

    PYTHONPATH=. python3 -m bench.gpu_lane --out "$OUT"        # on an H100/H200, from the repo root

Steps, each in its own process with a time limit, so one failure does not hide the others:
versions and device; ``pytest -m gpu``; bench.kernels, bench.experts and bench.overlap (cuda,
emulated link at --comm-ratio 1, with the timeline PNG), each writing JSON rows with the ceilings
measured in the same run; ``lancet-autotune`` on bench.overlap's block, exporting the choice as
shipped defaults. Results land in ``--out`` (copy them to bench/results/ and autotune/defaults.json
to commit them); the summary is printed last and written as summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Issue targets: (label, JSON file, row filter, value, target, higher is better).
TARGETS = [
    ("permute fwd, fraction of copy BW", "kernels.json", dict(op="permute_fwd", T=16384, D=4096), "frac_copy", 0.85, True),
    ("unpermute fwd, fraction of copy BW", "kernels.json", dict(op="unpermute_fwd", T=16384, D=4096), "frac_copy", 0.85, True),
    ("gating fwd, fraction of copy BW", "kernels.json", dict(op="gating_fwd", T=16384), "frac_copy", 0.70, True),
    ("routing kernels, x eager (worst)", "kernels.json", dict(T=16384), "x_eager", 3.0, True),
    ("routing kernels, x torch.compile (worst)", "kernels.json", dict(T=16384), "x_compiled", 1.0, True),
    ("grouped GEMM balanced F=14336, fraction of dense", "experts.json", dict(routing="balanced", F=14336), "frac_dense", 0.75, True),
    ("grouped GEMM balanced F=2048, fraction of dense", "experts.json", dict(routing="balanced", F=2048), "frac_dense", 0.75, True),
    ("grouped GEMM skewed, x loop of matmuls", "experts.json", dict(routing="skewed"), "speedup_vs_loop", 1.5, True),
    ("Overlapped vs sequential", "overlap.json", {}, "speedup_vs_sequential", 1.5, True),
    ("Overlapped vs MoE-internal chunking", "overlap.json", {}, "speedup_vs_moe_pipelined", 1.15, True),
    ("Overlapped over bound_ms", "overlap.json", {}, "over_bound", 0.15, False),
    ("hidden communication fraction", "overlap.json", {}, "hidden_comm_fraction", 0.80, True),
]


def run(step: str, cmd: list, out: Path, timeout: int) -> dict:
    print(f"\n=== {step}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=".", PYTHONUNBUFFERED="1")
    with open(out / f"{step}.log", "w") as log:
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               timeout=timeout)
            text, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            text, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
        log.write(text)
    print(text[-4000:], flush=True)
    return dict(step=step, rc=rc, seconds=round(time.time() - t0, 1))


def _rows(out: Path, name: str) -> list:
    path = out / name
    return json.loads(path.read_text()) if path.exists() else []


def summary(out: Path) -> list:
    results = []
    for label, name, where, key, target, higher in TARGETS:
        rows = [r for r in _rows(out, name) if all(r.get(k) == v for k, v in where.items())]
        values = [r[key] for r in rows if r.get(key) is not None]
        if not values:
            results.append(dict(metric=label, value=None, target=target, met="not measured"))
            continue
        value = min(values) if higher else max(values)  # the worst row must meet the target
        met = value >= target if higher else value <= target
        results.append(dict(metric=label, value=round(value, 3), target=("<= " if not higher else ">= ") + str(target),
                            met="met" if met else "NOT met", rows=len(values)))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-lane-out"))
    p.add_argument("--skip", default="", help="comma-separated steps to skip: tests,kernels,experts,overlap,autotune")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    py = sys.executable
    steps = [run("versions", [py, "-c", "import torch, triton; print('torch', torch.__version__, 'triton', "
                              "triton.__version__, torch.cuda.get_device_name())"], out, 60)]
    subprocess.run(["nvidia-smi", "-L"])
    plan = [
        ("tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-x"], 600),
        ("kernels", [py, "-m", "bench.kernels", "--device", "cuda", "--json", str(out / "kernels.json")], 600),
        ("experts", [py, "-m", "bench.experts", "--device", "cuda", "--json", str(out / "experts.json")], 600),
        ("overlap", [py, "-m", "bench.overlap", "--device", "cuda", "--json", str(out / "overlap.json"),
                     "--png", str(out / "overlap.png")], 600),
    ]
    for step, cmd, timeout in plan:
        if step not in skip:
            steps.append(run(step, cmd, out, timeout))
    if "autotune" not in skip:
        ov = _rows(out, "overlap.json")
        bw = ov[-1]["bandwidth_gbps"] if ov else 50.0
        steps.append(run("autotune", [
            py, "-m", "autotune", "--device", "cuda", "--link", "emulated", "--world-size", "8",
            "--bandwidth-gbps", f"{bw:.6g}", "--latency-us", "20", "--d-model", "2048", "--d-ffn", "4096",
            "--experts", "16", "--top-k", "2", "--capacity-factor", "1.25", "--tokens", "16384", "--seq", "1024",
            "--layers", "4", "--heads", "16", "--dtype", "bfloat16", "--cache", str(out / "autotune-cache.json"),
            "--export-defaults", str(out / "defaults.json"), "--no-progress"], out, 600))
    table = summary(out)
    (out / "summary.json").write_text(json.dumps(dict(steps=steps, targets=table), indent=1))
    print("\n=== steps")
    for s in steps:
        print(f"{s['step']:10s} rc={s['rc']}  {s['seconds']} s")
    print("\n=== headline numbers vs targets")
    for r in table:
        print(f"{r['metric']:52s} {str(r['value']):>8s}  target {r['target']:>8}  {r['met']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
