"""The acceptance on a real link, in one command (root; a quiet machine for numbers that count):

    python -m bench.reallink.acceptance            # or: make bench-link

Runs ``bench.overlap --link real`` four times, each on a link of its own (bench.reallink), the rate
calibrated so that the sequential step's communication is 1x its compute:

0. the blocks model, 2 ranks, ``accumulate`` over 4 microbatches, with ``--loaded`` (each schedule's computation
   also timed beside traffic of no dependency) and the peers' schedules where bench.peers is installed;
1. Mixtral via from_hf, 2 ranks;
2. the blocks model, 4 ranks (our schedules only: four ranks time-slice two cores here);
3. the blocks model, 2 ranks, ``accumulate`` over 8 microbatches (with ``--loaded``; ours only);

appends every row to ``--json`` (default ``out/overlap_real.json``, outside the tracked results; the
project's own rows go to bench/results/overlap_real.json by asking) and prints the table the acceptance
reads: Overlapped's single step against its own pass bound (``of_pass_bound``: the bound over its step,
target >= 0.95, and ``of_pass_bound_hidden``: its hidden fraction over the bound's, target >= 0.95; a step's
backward starts after its forward, so it is at least max(forward compute, forward bytes at the rate) +
max(backward compute, backward bytes), bench.overlap.real_bounds.pass_bound; ``of_pass_bound_on_link``: the same
stated with its computation as it ran on the link; ``of_pass_bound_stated``: that with each pass's fill, drain and
first transfer too, bench.overlap.real_fill, reported), the cross-microbatch ``accumulate`` over 4 and 8
microbatches (target: >= 1.6x the sequential step per microbatch, or >= 0.95 of its bound, max(its compute, the
link time) per microbatch, with its unshaped computation, with its computation on the link, or with that and its
step's fill and drain), and Overlapped's step over
each peer's on the same transport, a plain gloo group (target <= 0.60x torchtitan with float32 experts and
DeepSpeed-MoE), beside it ours on its split lanes over theirs (bench.overlap.real.peer_ratios); with the
configured and achieved rates, the device, the date and the load average, the link's whole-step bound
(``bound_speedup``: the busiest port's bytes at the configured rate, bench.overlap.real_bounds.link_bound), and
``inflation``: the computation beside the traffic over the computation off the link. Runs 1 and 2 are reported with the
same fields. A run that fails does not stop the others: the table shows every run measured, and the exit
status is then the first failure's (0 when every run finished, whether or not the targets are met: they
are printed met or missed).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.common import _read_rows, print_table
from lancet_rt.cli import int_in, list_of

RUNS = (
    ("blocks, W=2", ["--world-size", "2", "--microbatches", "4", "--loaded"]),
    ("mixtral, W=2", ["--world-size", "2", "--model", "mixtral"]),
    # (4 ranks time-sliced on this machine's cores: reported, no peer target; the peers are timed at W=2)
    (
        "blocks, W=4",
        ["--world-size", "4", "--schedules", "sequential,moe_pipelined,overlapped,overlapped_dw,accumulate"],
    ),
    # (accumulate over 8 microbatches: its step's fill and drain spread over twice as many)
    (
        "blocks, W=2, 8 microbatches",
        ["--world-size", "2", "--microbatches", "8", "--loaded", "--schedules", "sequential,overlapped,accumulate"],
    ),
)
#: Run 1's targets, each at least: a single step near its pass bound; accumulate at 1.6x or near its bound.
TARGETS = {"blocks, W=2": dict(of_pass_bound=0.95, of_pass_bound_hidden=0.95)}
_ACCUMULATE = dict(
    accumulate_speedup=1.6, accumulate_of_bound=0.95, accumulate_of_bound_on_link=0.95, accumulate_of_bound_stated=0.95
)
ACCUMULATE_TARGETS = {"blocks, W=2": _ACCUMULATE, "blocks, W=2, 8 microbatches": _ACCUMULATE}  # (any one)
#: Run 1's peer targets, at most: Overlapped's step over the peer's on the same transport.
PEER_TARGETS = {"torchtitan_fp32": 0.60, "deepspeed": 0.60}


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
        help="which of the runs (0-3: module docstring), comma-separated",
    )
    return p.parse_args(argv)


def _rows(path: Path) -> list:
    return _read_rows(path)  # (a damaged results file is a ValueError naming it)


def _run(args, path: Path, name: str, extra: list) -> tuple:
    """One run of ``bench.overlap --link real``: (its row or None, its exit status)."""
    before = len(_rows(path))
    cmd = [sys.executable, "-m", "bench.overlap", "--link", "real", "--rounds", str(args.rounds), "--json", str(path)]
    cmd += extra
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.run(cmd).returncode
    rows = _rows(path)[before:]
    if rc != 0 or not rows:
        print(
            f"bench.reallink.acceptance: {name} failed (exit status {rc}); going on with the other runs",
            file=sys.stderr,
            flush=True,
        )
        return None, rc or 1
    return rows[-1], 0


#: A row's peer ratios: ``overlapped_over_peer_<name>`` on the peers' transport (the headline, with a target),
#: ``overlapped_<channels>_over_peer_<name>`` ours on its own channels (bench.overlap.real.peer_ratios).
_PEER_RATIO = re.compile(r"^overlapped_(?:(split|counts|plain)_)?over_peer_(.+)$")


def _ratio(row: dict, a: str, b: str):
    return row[a] / row[b] if row.get(a) is not None and row.get(b) else None


def _cell(name: str, row: dict) -> dict:
    """One run's line of the table, with its targets met or missed."""
    cell = dict(
        run=name,
        rate_mbit=row["configured_mbit"],
        achieved_mbit=row.get("socket_mbit"),
        comm_ratio=row["measured_comm_ratio"],
        sequential_ms=row["sequential_ms"],
        overlapped_ms=row["overlapped_ms"],
        speedup=row["speedup_vs_sequential"],
        hidden=row["hidden_comm_fraction"],
        pass_bound_speedup=row.get("pass_bound_speedup_overlapped"),
        of_pass_bound=row.get("of_pass_bound_overlapped"),
        of_pass_bound_hidden=row.get("of_pass_bound_hidden_overlapped"),
        of_pass_bound_on_link=row.get("of_pass_bound_on_link_overlapped"),
        of_pass_bound_stated=row.get("of_pass_bound_on_link_filled_overlapped"),
        inflation=_ratio(row, "overlapped_computing_loaded_ms", "overlapped_computing_unshaped_ms"),
        microbatches=row.get("microbatches"),
        accumulate_speedup=row.get("speedup_accumulate"),
        accumulate_hidden=row.get("hidden_accumulate"),
        accumulate_of_bound=row.get("of_bound_accumulate"),
        accumulate_of_bound_on_link=row.get("of_bound_on_link_accumulate"),
        accumulate_of_bound_stated=row.get("of_bound_on_link_filled_accumulate"),
        accumulate_inflation=_ratio(row, "accumulate_computing_loaded_ms", "accumulate_computing_unshaped_ms"),
        bound_speedup=row.get("bound_speedup"),
        bound_hidden=row.get("bound_hidden"),
    )
    met = lambda k, v: cell[k] is not None and cell[k] >= v
    verdict = [f"{k} {'met' if met(k, v) else 'MISSED'} (>= {v})" for k, v in TARGETS.get(name, {}).items()]
    either = ACCUMULATE_TARGETS.get(name)
    if either:
        ok = any(met(k, v) for k, v in either.items())
        verdict.append(
            f"accumulate {'met' if ok else 'MISSED'} ({' or '.join(f'{k} >= {v}' for k, v in either.items())})"
        )
    for key, value in row.items():
        m = _PEER_RATIO.match(key)
        if not m:
            continue
        channels, peer = m.groups()
        cell[f"vs_{peer}" + (f"@ours_{channels}" if channels else "")] = value
        if channels is None and peer in PEER_TARGETS and name == "blocks, W=2":
            verdict.append(f"vs {peer} {'met' if value <= PEER_TARGETS[peer] else 'MISSED'} (<= {PEER_TARGETS[peer]})")
    cell["targets"] = "; ".join(verdict) or "reported"
    return cell


COLUMNS = [
    "run",
    "rate_mbit",
    "achieved_mbit",
    "comm_ratio",
    "sequential_ms",
    "overlapped_ms",
    "speedup",
    "hidden",
    "pass_bound_speedup",
    "of_pass_bound",
    "of_pass_bound_hidden",
    "of_pass_bound_on_link",
    "of_pass_bound_stated",
    "inflation",
    "microbatches",
    "accumulate_speedup",
    "accumulate_hidden",
    "accumulate_of_bound",
    "accumulate_of_bound_on_link",
    "accumulate_of_bound_stated",
    "accumulate_inflation",
    "bound_speedup",
    "bound_hidden",
]


def main(argv=None) -> int:
    args = parse_args(argv)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for i in args.runs:
        name, extra = RUNS[i]
        row, rc = _run(args, path, name, extra)
        if row is None:
            failed.append((name, rc))
        else:
            results.append((name, row))
    table = [_cell(name, row) for name, row in results]
    cols = COLUMNS + sorted({k for c in table for k in c if k.startswith("vs_")}) + ["targets"]
    first = results[0][1] if results else {}
    if table:
        print_table(
            table,
            cols,
            title=f"acceptance on a real link: {first.get('device')}, {first.get('date')}, "
            f"commit {first.get('commit')}, load average {first.get('load_avg_before')}",
        )
        print("hidden below 0: that schedule pays more link time than the sequential step (bench.overlap --link real)")
        print(
            "vs_<peer>: Overlapped's step over the peer's, both on the peers' transport (a plain gloo group; the "
            "targets read these); vs_<peer>@ours_split: ours on its split lanes, theirs on the plain group"
        )
    print(f"rows appended to {path}")
    for name, rc in failed:
        print(f"FAILED: {name} (exit status {rc}; its output is above)", file=sys.stderr)
    return failed[0][1] if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
