"""The real-link acceptance, the schedules and the peers on a real link, in one command (root; a quiet
machine for numbers that count):

    python -m bench.reallink_acceptance            # or: make bench-link

Runs ``bench.overlap --link real`` three times, each on a link of its own (bench.reallink), the rate
calibrated so that the sequential step's communication is 1x its compute:

1. the blocks model, 2 ranks (with the peers' schedules where bench.peers is installed);
2. Mixtral via from_hf, 2 ranks;
3. the blocks model, 4 ranks (our schedules only: four ranks time-slice two cores here);

appends every row to ``--json`` (default ``out/overlap_real.json``, outside the tracked results; the
project's own rows go to bench/results/overlap_real.json by asking) and prints the table the issue's
acceptance reads: Overlapped's speedup over the sequential step and its hidden fraction (targets:
>= 1.6x and >= 0.80 on run 1, >= 1.4x on run 2; run 3 reported), Overlapped's step over each peer's
(targets: <= 0.55x torchtitan, <= 0.50x DeepSpeed-MoE), with the configured and achieved rates, the
device, the date and the load average; beside them the cross-microbatch ``accumulate`` schedule's
speedup and hidden fraction, and the link's own bound (``bound_speedup``, ``bound_hidden``: the busiest
port's bytes at the configured rate, which no schedule beats; bench.overlap_real.link_bound). A run that
fails does not stop the others: the table shows every run measured, and the exit status is then the
first failure's (0 when every run finished, whether or not the targets are met: they are printed met
or missed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from bench.common import _read_rows, print_table
from lancet_rt.cli import int_in, list_of

RUNS = (
    ("blocks, W=2", ["--world-size", "2"]),
    ("mixtral, W=2", ["--world-size", "2", "--model", "mixtral"]),
    # (4 ranks time-sliced on this machine's cores: reported, no peer target; the peers are timed at W=2)
    (
        "blocks, W=4",
        ["--world-size", "4", "--schedules", "sequential,moe_pipelined,overlapped,overlapped_dw,accumulate"],
    ),
)
TARGETS = {"blocks, W=2": dict(speedup=1.6, hidden=0.80), "mixtral, W=2": dict(speedup=1.4)}
PEER_TARGETS = {"torchtitan": 0.55, "torchtitan_fp32": 0.55, "deepspeed": 0.50}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--json",
        default="out/overlap_real.json",
        help="append the rows here (default out/, untracked; bench/results/overlap_real.json for the project's)",
    )
    p.add_argument("--rounds", type=int_in(1), default=15)
    p.add_argument(
        "--runs",
        type=list_of(int_in(0, len(RUNS) - 1), unique=True),
        default=",".join(str(i) for i in range(len(RUNS))),
        help="which of the runs (0, 1, 2: module docstring), comma-separated",
    )
    return p.parse_args(argv)


def _rows(path: Path) -> list:
    return _read_rows(path)  # (a damaged results file is a ValueError naming it)


def main(argv=None) -> int:
    args = parse_args(argv)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for i in args.runs:
        name, extra = RUNS[i]
        before = len(_rows(path))
        cmd = [
            sys.executable,
            "-m",
            "bench.overlap",
            "--link",
            "real",
            "--rounds",
            str(args.rounds),
            "--json",
            str(path),
            *extra,
        ]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd).returncode
        rows = _rows(path)[before:]
        if rc != 0 or not rows:
            print(
                f"bench.reallink_acceptance: {name} failed (exit status {rc}); going on with the other runs",
                file=sys.stderr,
                flush=True,
            )
            failed.append((name, rc or 1))
            continue
        results.append((name, rows[-1]))
    table = []
    for name, row in results:
        cell = dict(
            run=name,
            rate_mbit=row["configured_mbit"],
            achieved_mbit=row.get("socket_mbit"),
            comm_ratio=row["measured_comm_ratio"],
            sequential_ms=row["sequential_ms"],
            overlapped_ms=row["overlapped_ms"],
            speedup=row["speedup_vs_sequential"],
            hidden=row["hidden_comm_fraction"],
            accumulate_speedup=row.get("speedup_accumulate"),
            accumulate_hidden=row.get("hidden_accumulate"),
            bound_speedup=row.get("bound_speedup"),
            bound_hidden=row.get("bound_hidden"),
        )
        target = TARGETS.get(name, {})
        verdict = [f"{k} {'met' if cell[k] >= v else 'MISSED'} (>= {v})" for k, v in target.items()]
        for key, value in row.items():
            if key.startswith("overlapped_over_peer_"):
                peer = key[len("overlapped_over_peer_") :]
                cell[f"vs_{peer}"] = value
                if peer in PEER_TARGETS and name == "blocks, W=2":
                    verdict.append(
                        f"vs {peer} {'met' if value <= PEER_TARGETS[peer] else 'MISSED'} (<= {PEER_TARGETS[peer]})"
                    )
        cell["targets"] = "; ".join(verdict) or "reported"
        table.append(cell)
    cols = [
        "run",
        "rate_mbit",
        "achieved_mbit",
        "comm_ratio",
        "sequential_ms",
        "overlapped_ms",
        "speedup",
        "hidden",
        "accumulate_speedup",
        "accumulate_hidden",
        "bound_speedup",
        "bound_hidden",
    ]
    cols += sorted({k for c in table for k in c if k.startswith("vs_")}) + ["targets"]
    first = results[0][1] if results else {}
    if table:
        print_table(
            table,
            cols,
            title=f"acceptance on a real link: {first.get('device')}, {first.get('date')}, "
            f"commit {first.get('commit')}, load average {first.get('load_avg_before')}",
        )
        print("hidden below 0: that schedule pays more link time than the sequential step (bench.overlap --link real)")
    print(f"rows appended to {path}")
    for name, rc in failed:
        print(f"FAILED: {name} (exit status {rc}; its output is above)", file=sys.stderr)
    return failed[0][1] if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
