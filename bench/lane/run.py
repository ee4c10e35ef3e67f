"""The GPU lane: one call on a lent H100/H200 that brings the project's headline numbers home first.

A lent GPU gives a session 15 minutes of device time in all (the machine's start, every call, idle
waits, the close), at most 10 minutes a command, and brings back at most 8 files from ``$OUT``. So the
lane is ONE prepared call of about 8 minutes, in priority order, that keeps what it measured however
it ends. Here, where PyPI is reachable, first::

    make gpu-wheels            # .whl/: greenlet and xxhash, the packages the GPU image lacks

then THE call (the device tool's ``run``), and ``give_back`` after it unless you rerun at once::

    run(command="PYTHONUNBUFFERED=1 python3 -m bench.lane --budget 480 --out $OUT",
        carry=[".whl"], timeout_s=540)

What comes back: ``$OUT/lane.tar.gz`` (every step's JSON rows, logs, pytest JUnit XML, the overlap
timeline PNG and trace) and ``$OUT/summary.json`` (the plan, each step's outcome and each headline
number against its target), both refreshed after every step and every 20 s while one runs; the reply's
output tail ends with the steps and the targets table. Bring it home and commit::

    python -m bench.lane --collect /path/to/lane.tar.gz    # rows appended under bench/results/

The default plan (``--plan priority``; each step a fixed cap, time a step leaves over flows down to the
next, and a short ``--budget`` cuts the last steps first; the plan with each cap is printed first):

    P0  pre-flight, 40 s from the end of the installs (the carried wheels and the checkout, each with
        its own timeout, come first): import everything (greenlet too), versions, nvidia-smi -L, the
        copy-bandwidth and matmul ceilings (bench.lane.preflight). The lane stops at once, non-zero, on a
        failed import or no CUDA device, and only then (a ceiling that fails or runs long does not stop it)
    P1  bench.overlap on CUDA, 150 s: its single-step row is on disk right after the two link passes;
        then the bound and floors, then 4 microbatches if their projected time fits
    P2  bench.host --device cuda, 35 s + 35 s: host against GPU us per layer-chunk, Qwen3-30B-A3B-like
        (128 experts of F=768, top-8) and Mixtral-like (8 experts of F=14336, top-2): HOST_SHAPES
    P3  the steady-state host-sync test, 40 s: the full stack of every synchronizing call
    P4  the runtime's GPU tests, 90 s (streams, events, NCCL with one rank, accumulate and
        early-backward twins, the fused loss's host reads, chunked router logits; 90 s per test)
    P5  P1's single step again with CUDA_DEVICE_MAX_CONNECTIONS=1, 60 s (P1 runs with it unset: the
        driver's default), rows in overlap_conn1.json
    P6  bench.kernels at T=16384 without torch.compile baselines, 45 s
    P7  the routing kernels tuned unpinned at the lane's shapes, 40 s: each autotuner's choice beside
        the pin (bench.lane.configs, routing_configs.json)
    P8  the kernel tests, with what is left (90 s per test)

The installs' time comes out of the last steps: no step runs past ``--budget``. The tests' per-test
timeout uses pytest-timeout's thread method, which also ends a test blocked in C++ (a CUDA wait).
P1-P5 pin the grouped GEMM's configs (bench.lane.steps.GEMM_PINS: those that won on an H100 on
2026-11-24) and the routing kernels' (bench.lane.configs.ROUTING_PINS: gating, permute, unpermute), so
each kernel variant compiles once instead of autotuning; P6-P8 and ``--plan tuning`` (bench.kernels.experts
autotuned, the routing configs, then lancet-autotune, for a later call) tune. Each step runs in its own
process (one failure does not hide the others) from a scratch directory, with the checkout installed
into a temporary site ahead of the repository on PYTHONPATH (setuptools maps kernels/ and autotune/ to
lancet_rt.kernels and lancet_rt.autotune, which the bare repository does not); a step that outlives its
allowance is interrupted (SIGINT: pytest still prints its failures), then killed.

``--dry-run`` runs the same plan at toy sizes on the CPU (TRITON_INTERPRET=1): every step's command
really runs, so each module parses its arguments (tests/bench/test_gpu_lane_dry_run.py, in CI).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.lane import files as lane_files
from bench.lane import preflight
from bench.lane.files import collect  # the lane's API: bench.lane.run.collect
from bench.lane.steps import MIN_STEP_SECONDS, PLANS, SUMMARY_SECONDS, Context, allot, deadlines, pin_env

REPO = Path(__file__).resolve().parents[2]
INTERRUPT_SECONDS = 15  # at most, of a step's allowance: from its interrupt to its kill
TAIL_CHARS = 700  # of each step's log printed (the reply keeps the last 12,000 characters of all)
INSTALL_TIMEOUT_S = 60
#: --dry-run: each step's allowance is its cap times this. The toy steps need a few CPU seconds each,
#: but on a shared 2-core machine importing torch alone can take longer than a GPU machine's cap.
DRY_RUN_SLOWDOWN = 4

# Issue targets: (label, JSON file, row filter, value, target (None: shown, not judged), higher is better).
TARGETS = [
    (
        "permute fwd, fraction of copy BW",
        "kernels.json",
        dict(op="permute_fwd", T=16384, D=4096),
        "frac_copy",
        0.85,
        True,
    ),
    (
        "unpermute fwd, fraction of copy BW",
        "kernels.json",
        dict(op="unpermute_fwd", T=16384, D=4096),
        "frac_copy",
        0.85,
        True,
    ),
    # Per E: at E = 8 the forward moves under 1 MB, a few microseconds of launches whatever the kernel.
    *[
        (
            f"gating fwd E={E}, fraction of copy BW",
            "kernels.json",
            dict(op="gating_fwd", T=16384, E=E),
            "frac_copy",
            0.70,
            True,
        )
        for E in (8, 64, 256)
    ],
    ("routing kernels, x eager (worst)", "kernels.json", dict(T=16384), "x_eager", 3.0, True),
    ("routing kernels, x torch.compile (worst)", "kernels.json", dict(T=16384), "x_compiled", 1.0, True),
    (
        "grouped GEMM balanced F=14336, fraction of dense",
        "experts.json",
        dict(routing="balanced", F=14336),
        "frac_dense",
        0.75,
        True,
    ),
    (
        "grouped GEMM balanced F=2048, fraction of dense",
        "experts.json",
        dict(routing="balanced", F=2048),
        "frac_dense",
        0.75,
        True,
    ),
    ("grouped GEMM skewed, x loop of matmuls", "experts.json", dict(routing="skewed"), "speedup_vs_loop", 1.5, True),
    ("Overlapped vs sequential", "overlap.json", {}, "speedup_vs_sequential", 1.5, True),
    ("Overlapped vs MoE-internal chunking", "overlap.json", {}, "speedup_vs_moe_pipelined", 1.15, True),
    ("Overlapped over bound_ms", "overlap.json", {}, "over_bound", 0.15, False),
    ("hidden communication fraction", "overlap.json", {}, "hidden_comm_fraction", 0.80, True),
    ("hidden communication fraction, cross-microbatch", "overlap.json", {}, "hidden_comm_fraction_accum", 0.90, True),
    # The same single step with CUDA_DEVICE_MAX_CONNECTIONS=1 (P5), beside P1's (the driver's default).
    (
        "Overlapped vs sequential, CUDA_DEVICE_MAX_CONNECTIONS=1",
        "overlap_conn1.json",
        {},
        "speedup_vs_sequential",
        None,
        True,
    ),
    (
        "hidden communication fraction, CUDA_DEVICE_MAX_CONNECTIONS=1",
        "overlap_conn1.json",
        {},
        "hidden_comm_fraction",
        None,
        True,
    ),
    # Not issue targets: what a perfect schedule could reach in the same run (bench/overlap/run.py).
    ("Overlapped over the pass-aware bound", "overlap.json", {}, "over_pass_bound", None, False),
    ("most communication any schedule could hide", "overlap.json", {}, "max_hidden_comm_fraction", None, True),
    ("speedup of a schedule at the pass-aware bound", "overlap.json", {}, "pass_bound_speedup", None, True),
    ("chunking overhead over the lean eager layer's", "overlap.json", {}, "overhead_over_lean", None, False),
    # Host against GPU per layer-chunk at 4 chunks (bench.host on CUDA): near 1, the GPU waits for the host.
    *[
        (
            f"host / GPU time per layer-chunk, {label}, 4 chunks",
            "host.json",
            dict(experts=E, top_k=K, chunks=4),
            "host_over_gpu",
            None,
            False,
        )
        for label, E, K in (("Qwen3-30B-A3B-like", 128, 8), ("Mixtral-like", 8, 2))
    ],
]


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
        results.append(
            dict(metric=label, value=round(value, 3), target=shown, met=met, rows=len(values), failed=failed)
        )
    return results


def install(repo: Path, site: str, log: Path) -> bool:
    """Install the carried wheels (``.whl/``, ``make gpu-wheels``; the GPU machine has no package
    registry) and the checkout itself (no registry, no build isolation: the machine's own setuptools)
    into ``site``, each with a timeout, their output in ``log``; returns whether both went through.
    A failure shows at the pre-flight's imports, which stop the lane."""
    wheels = sorted(str(w) for w in (repo / ".whl").glob("*.whl"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site]
    ok = True
    with open(log, "a") as f:
        for what, cmd in (
            ("carried wheels", [*pip, *wheels] if wheels else None),
            ("the checkout", [*pip, "--no-build-isolation", str(repo)]),
        ):
            if cmd is None:
                f.write(f"no carried wheels in {repo / '.whl'}\n")
                continue
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, timeout=INSTALL_TIMEOUT_S)
                rc, text = p.returncode, p.stdout + p.stderr
            except subprocess.TimeoutExpired:
                rc, text = "timeout", f"pip did not finish in {INSTALL_TIMEOUT_S} s"
            f.write(f"install {what}: rc {rc}\n{text}\n")
            if rc != 0:
                print(f"could not install {what} into {site}: {text.strip()[-400:]}", flush=True)
                ok = False
    return ok


def run_step(cmd: list, env: dict, cwd: str, log: Path, seconds: float, refresh) -> tuple:
    """Run ``cmd`` for at most ``seconds`` (its output appended to ``log``), calling ``refresh()`` every
    :data:`lane_files.REFRESH_SECONDS`; returns (rc, seconds taken, CPU seconds). Past its time the step's process
    group is interrupted (SIGINT, as Ctrl-C: pytest prints its failures, the benchmarks keep their
    rows), then killed; rc is then "timeout". Also returns the CPU seconds its processes took."""
    t0, cpu0 = time.monotonic(), _children_cpu()
    grace = min(INTERRUPT_SECONDS, seconds / 4)
    soft, last = t0 + seconds - grace, t0
    with open(log, "a") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        stopped = False
        while p.poll() is None:
            now = time.monotonic()
            if now >= soft:
                _signal(p, signal.SIGKILL if stopped else signal.SIGINT)
                soft, stopped = now + grace, True
            if now - last >= lane_files.REFRESH_SECONDS:
                refresh()
                last = now
            time.sleep(0.1)
    return ("timeout" if stopped else p.returncode), round(time.monotonic() - t0, 1), round(_children_cpu() - cpu0, 1)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _signal(p: subprocess.Popen, sig) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _show(log: Path) -> None:
    """Print a step's failures (before its tail, which may have cut them off) and its tail."""
    text = log.read_text(errors="replace") if log.exists() else ""
    failed = [
        line
        for line in text.splitlines()
        if line.startswith(("FAILED ", "ERROR ")) or line.rstrip().endswith((" FAILED", " ERROR"))
    ]
    failed = list(dict.fromkeys(failed))
    if failed:  # (at most 20 lines: the reply keeps the last 12,000 characters of the whole call)
        print(
            "failures:\n  "
            + "\n  ".join(failed[:20])
            + (f"\n  ... {len(failed) - 20} more" if len(failed) > 20 else "")
        )
    print(text[-TAIL_CHARS:], flush=True)


def junit_counts(path: Path) -> dict | None:
    """tests, failures, errors, skipped of a pytest --junitxml file (None if there is none)."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


class Lane:
    """The records of one run and its two files in ``--out``, refreshed after every step."""

    def __init__(self, args, plan: list, caps: list, out: Path, work: Path):
        self.out, self.work, self.plan, self.caps = out, work, plan, caps
        self.head = dict(
            plan_name=args.plan,
            budget_s=args.budget,
            dry_run=args.dry_run,
            started=time.time(),
            plan=[dict(label=s.label, step=s.name, cap_s=round(c, 1), what=s.what) for s, c in zip(plan, caps)],
        )
        self.steps: list = []
        self.left_out: list = []

    def refresh(self) -> None:
        lane_files.write_summary(self.work, self.summary())  # (the archive holds it too)
        self.left_out = lane_files.pack(self.work, self.out)
        lane_files.write_summary(self.out, self.summary())

    def summary(self) -> dict:
        return dict(
            self.head,
            steps=self.steps,
            targets=summary(self.work),
            left_out_of_archive=self.left_out,
            seconds=round(time.time() - self.head["started"], 1),
        )


def print_plan(plan: list, caps: list, budget: float) -> None:
    print(f"=== plan (--budget {budget:g} s; each step's cap, time left over flows down)")
    t = 0.0
    for step, cap in zip(plan, caps):
        print(
            f"{step.label:3s} {step.name:13s} {cap:5.0f} s  (by {t + cap:4.0f} s)  {step.what}"
            + (f"  [configs pinned: GEMM {step.pins}, routing]" if step.pins else "")
            + "".join(f"  [{k}={'(unset)' if v is None else v}]" for k, v in step.env)
        )
        t += cap
    print(flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out",
        default=os.environ.get("OUT", "gpu-lane-out"),
        help="where the archive and summary.json go (default: $OUT)",
    )
    p.add_argument("--plan", choices=sorted(PLANS), default="priority")
    p.add_argument("--only", default=None, help="comma-separated steps of the plan to run (the pre-flight always runs)")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out")
    p.add_argument(
        "--budget",
        type=float,
        default=480.0,
        help="wall-clock seconds for the whole call (run it with timeout_s 60 s more)",
    )
    p.add_argument("--dry-run", action="store_true", help="the same plan at toy sizes on the CPU (TRITON_INTERPRET=1)")
    p.add_argument(
        "--collect",
        metavar="ARCHIVE",
        default=None,
        help="instead of running: bring a call's lane.tar.gz (or $OUT directory) into bench/results/",
    )
    p.add_argument("--results", default=str(REPO / "bench" / "results"), help="--collect: where the rows go")
    args = p.parse_args(argv)
    if args.collect:
        src = Path(args.collect)
        if not src.exists():
            p.error(f"--collect: {src} does not exist")
        for line in collect(src, Path(args.results), REPO / "autotune" / "defaults.json") or ["nothing"]:
            print("collected:", line)
        return 0
    if args.budget <= 0:
        p.error(f"--budget must be > 0 seconds, got {args.budget:g}")
    names = [s.name for s in PLANS[args.plan]]
    only = names if args.only is None else ["preflight", *args.only.split(",")]
    skip = [n for n in args.skip.split(",") if n and n != "preflight"]
    unknown = sorted(set(only + skip) - set(names))
    if unknown:
        p.error(f"--only/--skip: unknown steps {unknown}; the {args.plan} plan has {names}")
    plan = [s for s in PLANS[args.plan] if s.name in only and s.name not in skip]
    caps = allot(plan, args.budget)
    print_plan(plan, caps, args.budget)
    out = Path(args.out).resolve()  # the steps run from a scratch directory
    out.mkdir(parents=True, exist_ok=True)
    dirs = [Path(tempfile.mkdtemp(prefix=f"lancet-lane-{d}-")) for d in ("work", "site", "cwd")]
    try:
        lane = Lane(args, plan, caps, out, dirs[0])
        rc = run_plan(lane, args.dry_run, *dirs[1:])
        lane.refresh()
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    _report(lane.summary())
    return rc


def run_plan(lane: Lane, dry: bool, site: Path, scratch: Path) -> int:
    """Install, then run ``lane``'s steps in order, each until its deadline; returns the lane's exit
    status (non-zero: the pre-flight failed, and nothing after it ran)."""
    slow = DRY_RUN_SLOWDOWN if dry else 1
    if dry:
        print(f"(dry run on the CPU: each allowance is its cap x {slow})", flush=True)
    start, work = time.monotonic(), lane.work
    install(REPO, str(site), work / "preflight.log")
    # The plan's clock starts after the installs (the pre-flight's cap is its own imports and ceilings);
    # the installs' time comes out of the last steps: no step runs past the budget's end.
    t0 = time.monotonic()
    last = start + (lane.head["budget_s"] - SUMMARY_SECONDS) * slow
    # The site ahead of the repository (which still provides bench/ and tests/); the steps run from a
    # scratch directory, not the repository root, whose lancet_rt would come first on sys.path.
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(site), str(REPO), os.environ.get("PYTHONPATH")])),
    )
    if dry:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    for step, cap, end in zip(lane.plan, lane.caps, deadlines(lane.caps)):
        now = time.monotonic()
        seconds = min(end * slow - (now - t0), last - now)
        record = dict(step=step.name, label=step.label, cap_s=round(cap, 1), allowance_s=round(max(seconds, 0), 1))
        if seconds < MIN_STEP_SECONDS:
            lane.steps.append(dict(record, rc="no time left", seconds=0))
            continue
        cmd = step.argv(Context(sys.executable, REPO, work, dry, seconds - step.stop_s))
        log = work / f"{step.name}.log"
        print(f"\n=== {step.label} {step.name} (at most {seconds:.0f} s): {' '.join(cmd)}", flush=True)
        rows_before = len(_rows(work, step.rows)) if step.rows else 0
        with open(log, "a") as f:  # (the pre-flight's log already holds the installs)
            f.write(f"$ {' '.join(cmd)}\n")
        rc, took, cpu = run_step(cmd, step_env(env, step), str(scratch), log, seconds, lane.refresh)
        record.update(rc=rc, seconds=took, cpu_s=cpu)
        if step.rows:
            record["rows"] = len(_rows(work, step.rows)) - rows_before
        tests = junit_counts(work / f"{step.name}.xml")
        if tests:
            record["tests"] = tests
        lane.steps.append(record)
        _show(log)
        lane.refresh()
        if step.name == "preflight" and rc in (preflight.IMPORT_FAILED, preflight.NO_CUDA):
            print(
                f"pre-flight failed (rc {rc}: {'an import' if rc == preflight.IMPORT_FAILED else 'no CUDA device'}):"
                " stopping here, before any step spends the call",
                flush=True,
            )
            return rc
        if step.name == "preflight" and rc != 0:  # (a ceiling that failed or ran long: the steps still can run)
            print(f"pre-flight: rc {rc}, but its imports and device were fine: going on", flush=True)
    return 0


def step_env(env: dict, step) -> dict:
    """``env`` with ``step``'s pinned configs and its own variables (a None value unsets one)."""
    out = dict(env, **pin_env(step.pins))
    for name, value in step.env:
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def _report(s: dict) -> None:
    print("\n=== steps")
    for r in s["steps"]:
        extra = f"  rows +{r['rows']}" if "rows" in r else ""
        if r.get("tests"):
            t = r["tests"]
            extra += f"  tests {t['tests']}: {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped"
        print(
            f"{r['label']:3s} {r['step']:13s} rc={r['rc']}  {r['seconds']} s of {r['allowance_s']}"
            f" (CPU {r.get('cpu_s', 0)} s){extra}"
        )
    print("\n=== headline numbers vs targets")
    for r in s["targets"]:
        print(
            f"{r['metric']:60s} {str(r['value']):>8s}  target {r['target']:>8}  {r['met']}"
            + (f"  ({r['failed']} rows failed their check)" if r.get("failed") else "")
        )
    print(
        f"\n{s['seconds']} s; --out holds {lane_files.ARCHIVE} and {lane_files.SUMMARY}"
        + (f" (left out of the archive to fit: {s['left_out_of_archive']})" if s["left_out_of_archive"] else "")
    )
