"""The whole GPU lane in one command (../shared/GPU.md), ending with every headline number and its target.

    python3 -m bench.gpu_lane --out "$OUT"        # on an H100/H200, from the repo root

The lane first installs the checkout itself (``pip install --no-index --no-deps --no-build-isolation
--target SITE .``: setuptools maps kernels/ and autotune/ to lancet_rt.kernels and lancet_rt.autotune,
which the bare repository on PYTHONPATH does not) into a temporary site directory, then runs its
steps from a scratch directory with that site ahead of the repository on PYTHONPATH (the repository
still provides bench/ and tests/), so ``import lancet_rt`` finds the installed package.

Steps, each in its own process, so one failure does not hide the others: versions and device;
``pytest -m gpu`` (tests; verbose, so each failure shows as it happens even if the step is stopped);
bench.kernels, bench.experts and bench.overlap (cuda, emulated link at
--comm-ratio 1, with the timeline PNG), each writing JSON rows with the ceilings measured in the same
run; ``lancet-autotune`` on bench.overlap's block, exporting the choice as shipped defaults
(autotune). Results land in ``--out`` (copy them to bench/results/ and autotune/defaults.json to
commit them); the summary is printed last and written as summary.json.

A lent GPU takes commands of at most 10 minutes, so the lane keeps to ``--budget`` seconds of wall
clock: each step gets a share of what is left (by its weight in :data:`STEPS`), the benchmarks stop
starting new cases when their share is spent and keep every finished row, and a step that outlives
its share is interrupted (SIGINT: pytest still prints its failures' tracebacks) and then stopped
(bench.overlap leaves its cross-microbatch part out once its share is spent, and writes its row
before it draws the timeline). Split the lane over calls with ``--only``; a
step run alone gets the whole budget (the tests need it: an H100 ran 11 of them in a 233 s share)::

    python3 -m bench.gpu_lane --out "$OUT" --only tests
    python3 -m bench.gpu_lane --out "$OUT" --only experts,kernels
    python3 -m bench.gpu_lane --out "$OUT" --only overlap,autotune

The tests and bench.experts share their grouped-GEMM shapes, so on the same machine (one call, or
the next while it is still warm) the benchmark finds the configs the tests' autotuning compiled and
chose in Triton's on-disk caches (the routing kernels' spaces prune to one config per key; the
grouped GEMM's to up to 14).

Back on the development machine, ``python -m bench.gpu_lane --collect DIR`` (DIR: a call's returned
``$OUT``) appends the rows to ``bench/results/`` (kernels, experts, overlap, and the summary as
gpu_lane.json), copies the timeline PNG and trace under the GPU's name, and merges the exported
autotune defaults into ``autotune/defaults.json``; run it once per call, then commit.

Packages the GPU machine lacks (greenlet, pytest-timeout) travel as wheels in ``.whl/`` (``make
gpu-wheels`` where PyPI is reachable, then ``carry: [".whl"]``); the lane installs them into the
same temporary site directory.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Issue targets: (label, JSON file, row filter, value, target (None: shown, not judged), higher is better).
TARGETS = [
    ("permute fwd, fraction of copy BW", "kernels.json", dict(op="permute_fwd", T=16384, D=4096), "frac_copy", 0.85, True),
    ("unpermute fwd, fraction of copy BW", "kernels.json", dict(op="unpermute_fwd", T=16384, D=4096), "frac_copy", 0.85, True),
    # Per E: at E = 8 the forward moves under 1 MB, a few microseconds of launches whatever the kernel.
    *[(f"gating fwd E={E}, fraction of copy BW", "kernels.json", dict(op="gating_fwd", T=16384, E=E), "frac_copy",
       0.70, True) for E in (8, 64, 256)],
    ("routing kernels, x eager (worst)", "kernels.json", dict(T=16384), "x_eager", 3.0, True),
    ("routing kernels, x torch.compile (worst)", "kernels.json", dict(T=16384), "x_compiled", 1.0, True),
    ("grouped GEMM balanced F=14336, fraction of dense", "experts.json", dict(routing="balanced", F=14336), "frac_dense", 0.75, True),
    ("grouped GEMM balanced F=2048, fraction of dense", "experts.json", dict(routing="balanced", F=2048), "frac_dense", 0.75, True),
    ("grouped GEMM skewed, x loop of matmuls", "experts.json", dict(routing="skewed"), "speedup_vs_loop", 1.5, True),
    ("Overlapped vs sequential", "overlap.json", {}, "speedup_vs_sequential", 1.5, True),
    ("Overlapped vs MoE-internal chunking", "overlap.json", {}, "speedup_vs_moe_pipelined", 1.15, True),
    ("Overlapped over bound_ms", "overlap.json", {}, "over_bound", 0.15, False),
    ("hidden communication fraction", "overlap.json", {}, "hidden_comm_fraction", 0.80, True),
    ("hidden communication fraction, cross-microbatch", "overlap.json", {}, "hidden_comm_fraction_accum", 0.90, True),
    # Not issue targets: what a perfect schedule could reach in the same run (bench/overlap.py).
    ("Overlapped over the pass-aware bound", "overlap.json", {}, "over_pass_bound", None, False),
    ("most communication any schedule could hide", "overlap.json", {}, "max_hidden_comm_fraction", None, True),
    ("speedup of a schedule at the pass-aware bound", "overlap.json", {}, "pass_bound_speedup", None, True),
    ("chunking overhead over the lean eager layer's", "overlap.json", {}, "overhead_over_lean", None, False),
]


# name -> (share weight, seconds kept back for a graceful stop, or None if the step has no --max-seconds).
STEPS = {
    "tests": (4, None),
    "kernels": (5, 45),
    "experts": (5, 120),   # one (F, routing) group: 6 projections, autotuned on first sight
    "overlap": (3, 30),    # kept back for the trace and timeline after the row is written
    "host": (1, None),     # what each extra chunk costs the host (issue 20), every configuration
    "autotune": (2, None),
}
SUMMARY_SECONDS = 10   # kept back from --budget for the summary
REPO = Path(__file__).resolve().parent.parent
INTERRUPT_SECONDS = 15  # of a step's share: from its interrupt to its kill, for its own summary


def step_command(step: str, py: str, out: Path, max_seconds: float) -> list:
    bench = {"kernels": "bench.kernels", "experts": "bench.experts"}
    if step == "tests":
        # Not -x: a first run on a GPU should show every failure, not the first (the share still bounds it).
        # -v --tb=short: each test's outcome as it finishes, so a step stopped by its share still shows
        # its failures. --import-mode=append: tests/ is a package, and prepending the repository would
        # put its lancet_rt (without kernels/ and autotune/ mapped in) ahead of the installed one.
        return [py, "-m", "pytest", str(REPO / "tests"), "-m", "gpu", "-v", "--tb=short", "-rfE", "--durations=15",
                "--maxfail=10", "--import-mode=append", "-p", "no:cacheprovider"]
    if step in bench:
        return [py, "-m", bench[step], "--device", "cuda", "--json", str(out / f"{step}.json"),
                "--max-seconds", f"{max_seconds:.0f}"]
    if step == "overlap":
        # --microbatches 4: the same run also measures the cross-microbatch step (issue #12's GPU part)
        return [py, "-m", "bench.overlap", "--device", "cuda", "--microbatches", "4", "--json", str(out / "overlap.json"),
                "--png", str(out / "overlap.png"), "--trace", str(out / "overlap-trace.json"),
                "--max-seconds", f"{max_seconds:.0f}"]
    if step == "host":
        # fine-grained experts (E=64 over 8 emulated ranks, 4096 tokens): the host-bound case
        return [py, "-m", "bench.host", "--device", "cuda", "--sweep", "--world-size", "8", "--experts", "64",
                "--d-model", "1024", "--d-ffn", "512", "--heads", "8", "--batch", "8", "--seq", "512",
                "--reps", "10", "--json", str(out / "host.json")]
    ov = _rows(out, "overlap.json")
    bw = ov[-1]["bandwidth_gbps"] if ov else 50.0
    return [py, "-m", "lancet_rt.autotune", "--device", "cuda", "--link", "emulated", "--world-size", "8",
            "--bandwidth-gbps", f"{bw:.6g}", "--latency-us", "20", "--d-model", "2048", "--d-ffn", "4096",
            "--experts", "16", "--top-k", "2", "--capacity-factor", "1.25", "--tokens", "16384", "--seq", "1024",
            "--layers", "4", "--heads", "16", "--dtype", "bfloat16", "--cache", str(out / "autotune-cache.json"),
            "--export-defaults", str(out / "defaults.json"), "--no-progress"]


def run(step: str, cmd: list, out: Path, timeout: float, env: dict, cwd: str | None = None) -> dict:
    """Run one step's ``cmd`` (in ``cwd``) for at most ``timeout`` seconds, its output in ``out/STEP.log``.

    Returns:
        ``dict(step=, rc=, seconds=)``; rc is "timeout" when the step was stopped.
    """
    print(f"\n=== {step} (at most {timeout:.0f} s): {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(out / f"{step}.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
        try:
            text, _ = p.communicate(timeout=max(1.0, timeout - INTERRUPT_SECONDS))
            rc = p.returncode
        except subprocess.TimeoutExpired:
            # Interrupted first, as Ctrl-C would: pytest then prints its summary with the failures'
            # tracebacks, which a kill would lose.
            p.send_signal(signal.SIGINT)
            try:
                text, _ = p.communicate(timeout=INTERRUPT_SECONDS)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            rc = "timeout"
        text = text or ""
        log.write(text)
    failed = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR ")) or
              line.rstrip().endswith((" FAILED", " ERROR")) or " FAILED " in line]
    if failed:  # before the tail, which may have cut them off
        print("failures:\n  " + "\n  ".join(dict.fromkeys(failed)))
    print(text[-1500:], flush=True)   # the whole log is in --out; the reply keeps only a tail
    return dict(step=step, rc=rc, seconds=round(time.time() - t0, 1))


def install_checkout(repo: Path, site: str) -> bool:
    """Install the checkout itself into ``site`` (no registry, no build isolation: the machine's own
    setuptools builds it), so its steps import lancet_rt.kernels and lancet_rt.autotune as mapped by
    package-dir; returns whether pip succeeded."""
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                        "--target", site, str(repo)], capture_output=True, text=True, cwd=repo)
    if p.returncode != 0:  # the steps then fail at their imports and say so
        print(f"could not install the checkout into {site}:\n{p.stderr.strip()[-600:]}")
    return p.returncode == 0


def carried_packages(repo: Path, site: str) -> bool:
    """Install the wheels carried in ``.whl/`` (``make gpu-wheels``: greenlet, pytest-timeout; the GPU
    machine has no package registry) into ``site``; returns whether there were any and they installed."""
    wheels = sorted(str(w) for w in (repo / ".whl").glob("*.whl"))
    if not wheels:
        return False
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site,
                        *wheels], capture_output=True, text=True)
    if p.returncode != 0:  # a wheel for another Python, say: the steps say what is missing
        print(f"could not install the carried wheels {wheels}:\n{p.stderr.strip()[-600:]}")
        return False
    return True


def _rows(out: Path, name: str) -> list:
    path = out / name
    return json.loads(path.read_text()) if path.exists() else []


def summary(out: Path) -> list:
    """Each target against the worst matching row. A row whose kernel failed its correctness check
    (``check`` other than ok) never counts as a measurement; the count of such rows is reported."""
    results = []
    for label, name, where, key, target, higher in TARGETS:
        rows = [r for r in _rows(out, name) if all(r.get(k) == v for k, v in where.items())]
        failed = sum(r.get("check", "ok") != "ok" for r in rows)
        values = [r[key] for r in rows if r.get(key) is not None and r.get("check", "ok") == "ok"]
        shown = "-" if target is None else ("<= " if not higher else ">= ") + str(target)
        if not values:
            results.append(dict(metric=label, value=None, target=shown, met="not measured", failed=failed))
            continue
        value = min(values) if higher else max(values)  # the worst row must meet the target
        if target is None:
            met = "info"
        else:
            met = "met" if (value >= target if higher else value <= target) else "NOT met"
        results.append(dict(metric=label, value=round(value, 3), target=shown, met=met, rows=len(values),
                            failed=failed))
    return results


def collect(src: Path, results: Path, defaults: Path) -> list:
    """Bring one call's ``$OUT`` into the repository (see the module docstring); returns what was
    written. Rows are appended, never replaced: each carries its device, commit and date."""
    from bench.common import write_json

    written = []
    for name in ("kernels", "experts", "overlap", "host"):
        rows = _rows(src, f"{name}.json")
        if rows:
            write_json(results / f"{name}.json", rows)
            written.append(f"{results / name}.json (+{len(rows)} rows)")
    device = next((r["device"] for name in ("kernels", "experts", "overlap") for r in _rows(src, f"{name}.json")
                   if r.get("device")), None)
    slug = "".join(ch if ch.isalnum() else "_" for ch in (device or "gpu")).strip("_").lower()
    if (src / "summary.json").exists():
        summary_row = dict(json.loads((src / "summary.json").read_text()), device=device)
        write_json(results / "gpu_lane.json", [summary_row])
        written.append(f"{results / 'gpu_lane.json'} (+1 row)")
    for name, dest in (("overlap.png", f"overlap_{slug}.png"), ("overlap-trace.json", f"overlap_{slug}_trace.json")):
        if (src / name).exists():
            (results / dest).write_bytes((src / name).read_bytes())
            written.append(str(results / dest))
    exported = src / "defaults.json"
    if exported.exists():
        new = json.loads(exported.read_text()).get("entries", {})
        shipped = json.loads(defaults.read_text())
        shipped.setdefault("entries", {}).update(new)   # the other fields (schema, comment) stay
        defaults.write_text(json.dumps(shipped, indent=1) + "\n")
        written.append(f"{defaults} (+{len(new)} entries)")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-lane-out"))
    p.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps to run, of {','.join(STEPS)}")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out")
    p.add_argument("--budget", type=float, default=560.0,
                   help="wall-clock seconds for the whole call (a lent GPU's command limit is 600)")
    p.add_argument("--collect", metavar="DIR", default=None,
                   help="instead of running: bring a call's returned $OUT into bench/results/ and autotune/")
    args = p.parse_args(argv)
    repo = REPO
    if args.collect:
        src = Path(args.collect)
        if not src.is_dir():
            p.error(f"--collect: {src} is not a directory")
        for line in collect(src, repo / "bench" / "results", repo / "autotune" / "defaults.json") or ["nothing"]:
            print("collected:", line)
        return 0
    t_end = time.time() + args.budget - SUMMARY_SECONDS
    out = Path(args.out).resolve()  # the steps run from a scratch directory
    out.mkdir(parents=True, exist_ok=True)
    chosen = [s for s in filter(None, args.only.split(",")) if s not in set(args.skip.split(","))]
    unknown = sorted(set(chosen) - set(STEPS))
    if unknown:
        p.error(f"--only/--skip: unknown steps {unknown}; expected some of {list(STEPS)}")
    site = tempfile.mkdtemp(prefix="lancet-site-")
    install_checkout(repo, site)
    carried_packages(repo, site)
    # The site ahead of the repository (which still provides bench/ and tests/), and the steps run from
    # a scratch directory, not the repository root, whose lancet_rt would come first on sys.path.
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [site, str(repo), os.environ.get("PYTHONPATH")])))
    scratch = tempfile.mkdtemp(prefix="lancet-lane-")
    py = sys.executable
    steps = [run("versions", [py, "-c", "import lancet_rt.kernels, lancet_rt.autotune; print('lancet_rt from', "
                              "lancet_rt.__file__); import torch, triton, greenlet; print('torch', torch.__version__, "
                              "'triton', triton.__version__, 'greenlet', greenlet.__version__, "
                              "torch.cuda.get_device_name())"], out, 60, env, scratch)]
    try:
        subprocess.run(["nvidia-smi", "-L"], timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"nvidia-smi -L: {e}")
    for i, step in enumerate(chosen):
        weight, margin = STEPS[step]
        left = t_end - time.time()
        share = left * weight / sum(STEPS[s][0] for s in chosen[i:])
        if share < 30:
            steps.append(dict(step=step, rc="no time left", seconds=0))
            continue
        cmd = step_command(step, py, out, share - (margin or 0))
        steps.append(run(step, cmd, out, share, env, scratch))
    shutil.rmtree(site, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    table = summary(out)
    (out / "summary.json").write_text(json.dumps(dict(steps=steps, targets=table), indent=1))
    print("\n=== steps")
    for s in steps:
        print(f"{s['step']:10s} rc={s['rc']}  {s['seconds']} s")
    print("\n=== headline numbers vs targets")
    for r in table:
        print(f"{r['metric']:52s} {str(r['value']):>8s}  target {r['target']:>8}  {r['met']}"
              + (f"  ({r['failed']} rows failed their check)" if r.get("failed") else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
