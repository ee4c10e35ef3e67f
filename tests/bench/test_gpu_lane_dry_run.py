"""The GPU lane's acceptance on the CPU: ``bench.gpu_lane --dry-run`` runs the priority plan
at toy sizes, every step's command for real (so every module parses its arguments), and leaves an
archive that ``--collect`` brings home."""

from __future__ import annotations

import json
import tarfile
import time

from bench import gpu_lane, lane_configs, lane_files
from bench.lane_steps import HOST_SYNC_TEST, PRIORITY

#: Fields no CPU row can carry (bench.host's GPU time): the targets that read them are checked on CUDA.
CUDA_ONLY = {"host_over_gpu"}


def test_dry_run_runs_the_plan_and_brings_its_rows_home(tmp_path, capsys):
    out, results = tmp_path / "out", tmp_path / "results"
    t0 = time.monotonic()
    rc = gpu_lane.main(["--dry-run", "--budget", "700", "--out", str(out)])
    took = time.monotonic() - t0
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    print(f"dry run: {took:.0f} s")

    # The plan, each step with its cap, comes first; with --budget 700 all but the last have their whole
    # caps; P1-P5 with their pinned configs, P1 without CUDA_DEVICE_MAX_CONNECTIONS, P5 with it at 1.
    plan = printed[: printed.index("=== P0")]
    for step in PRIORITY[:-1]:
        assert f"{step.label:3s} {step.name:13s} {step.cap:5.0f} s" in plan, step.name
    lines = {line.split()[1]: line for line in plan.splitlines() if line[:1] == "P"}
    assert "[CUDA_DEVICE_MAX_CONNECTIONS=(unset)]" in lines["overlap"]
    assert "[CUDA_DEVICE_MAX_CONNECTIONS=1]" in lines["overlap_conn1"] and "routing]" in lines["overlap_conn1"]
    assert "pinned" not in lines["configs"] and "pinned" not in lines["kernels"]

    # Every step ran and exited 0; --out holds the archive and the summary, nothing else.
    assert sorted(p.name for p in out.iterdir()) == [lane_files.ARCHIVE, lane_files.SUMMARY]
    summary = json.loads((out / lane_files.SUMMARY).read_text())
    assert [(s["step"], s["rc"]) for s in summary["steps"]] == [(s.name, 0) for s in PRIORITY]
    assert all(s["rows"] > 0 for s in summary["steps"] if "rows" in s)

    work = tmp_path / "unpacked"
    work.mkdir()
    lane_files.unpack(out / lane_files.ARCHIVE, work)
    with tarfile.open(out / lane_files.ARCHIVE) as tar:
        assert {f"{s.name}.log" for s in PRIORITY} <= set(tar.getnames())
    # The tests' steps really collected their tests (skipped without CUDA), the host-sync test in P3 only.
    hostsync, runtime = (gpu_lane.junit_counts(work / f"{n}.xml") for n in ("hostsync", "runtime"))
    assert hostsync == dict(tests=1, failures=0, errors=0, skipped=1)
    assert runtime["tests"] == runtime["skipped"] > 5
    assert HOST_SYNC_TEST.split("::")[1] not in (work / "runtime.xml").read_text()

    # The fields the summary's targets read exist in the rows of the files the plan writes.
    for label, name, _, key, _, _ in gpu_lane.TARGETS:
        if name == "experts.json" or key in CUDA_ONLY:  # (the tuning plan's file; GPU-only fields)
            continue
        rows = json.loads((work / name).read_text())
        assert any(key in r for r in rows), (label, key)
    overlap = json.loads((work / "overlap.json").read_text())
    assert len(overlap) == 1 and overlap[0]["complete"] and overlap[0]["hidden_comm_fraction_accum"] is not None
    assert len(json.loads((work / "overlap_conn1.json").read_text())) == 1
    configs = json.loads((work / "routing_configs.json").read_text())  # (interpreted: nothing tuned)
    assert {r["variable"] for r in configs} == set(lane_configs.ROUTING_PINS) and "LANCET_GATING_FWD_CONFIG" in printed

    # --collect: the rows come home appended, the summary with its pre-flight row.
    assert gpu_lane.main(["--collect", str(out / lane_files.ARCHIVE), "--results", str(results)]) == 0
    for name in ("overlap", "host", "kernels", "overlap_conn1", "routing_configs"):
        assert json.loads((results / f"{name}.json").read_text()) == json.loads((work / f"{name}.json").read_text())
    lane_row = json.loads((results / "gpu_lane.json").read_text())[-1]
    assert lane_row["preflight"]["copy_gbs"] > 0 and lane_row["targets"] == summary["targets"]
    assert len(list(results.glob("gpu_lane_*_tests.log"))) == 1
