"""make bench-link's runner (bench.reallink.acceptance) without a link: a run that fails does not hide
the others' table, the rows go under out/ by default, and the main job says what its link was."""

from __future__ import annotations

import json
import subprocess

import bench.reallink.acceptance as acceptance
from examples.train_lm import _link_note

ROW = dict(
    configured_mbit=160.0,
    socket_mbit=150.0,
    measured_comm_ratio=1.0,
    sequential_ms=1400.0,
    overlapped_ms=1000.0,
    speedup_vs_sequential=1.4,
    hidden_comm_fraction=0.7,
    device="cpu",
    date="2026-12-06",
    commit="x",
    load_avg_before=[0.1, 0.1, 0.1],
)


def test_a_failed_run_leaves_the_others_table(tmp_path, monkeypatch, capsys):
    path = tmp_path / "rows.json"
    calls = []

    def fake_run(cmd, *a, **k):
        calls.append(cmd)
        if len(calls) == 2:  # the second run fails before writing a row
            return subprocess.CompletedProcess(cmd, 3)
        rows = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(rows + [dict(ROW, speedup_vs_sequential=1.0 + len(calls) / 10)]))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(acceptance.subprocess, "run", fake_run)
    rc = acceptance.main(["--json", str(path)])
    out, err = capsys.readouterr()
    assert rc == 3 and len(calls) == len(acceptance.RUNS) == 4
    assert "blocks, W=2" in out and "blocks, W=4" in out and "8 microbatches" in out and "1.1" in out and "1.4" in out
    assert "FAILED: mixtral, W=2 (exit status 3" in err


def test_rows_go_outside_the_tracked_results_by_default():
    assert acceptance.parse_args([]).json == "out/overlap_real.json"


def test_the_main_job_names_its_link(monkeypatch):
    monkeypatch.delenv("LANCET_REALLINK_RATE_BPS", raising=False)
    note = _link_note(dict(world=2, device="cpu"), None)
    assert "loopback" in note and "make train-link" in note and "bench.overlap" in note
    monkeypatch.setenv("LANCET_REALLINK_RATE_BPS", "163000000")
    assert "163 Mbit/s" in _link_note(dict(world=2, device="cpu"), None)


def test_the_peer_targets_read_the_same_transport_ratio():
    """vs_<peer> (both on the peers' plain group) is what the target reads; ours on its lanes is shown beside."""
    row = dict(ROW, overlapped_over_peer_deepspeed=0.65, overlapped_split_over_peer_deepspeed=0.4)
    cell = acceptance._cell("blocks, W=2", row)
    assert cell["vs_deepspeed"] == 0.65 and cell["vs_deepspeed@ours_split"] == 0.4
    assert "vs deepspeed MISSED (<= 0.6)" in cell["targets"]
    assert (
        "vs deepspeed met" in acceptance._cell("blocks, W=2", dict(row, overlapped_over_peer_deepspeed=0.6))["targets"]
    )


def test_the_targets_read_each_schedules_own_bound():
    """Run 1: Overlapped at >= 0.95 of its pass bound (speed and hidden); accumulate at 1.6x or >= 0.95 of its
    bound, or of its bound stated with its computation on the link (and its fill and drain), any one; a row
    without the fields (no rate) misses rather than passes."""
    near = dict(ROW, of_pass_bound_overlapped=0.96, of_pass_bound_hidden_overlapped=0.94)
    near.update(speedup_accumulate=1.5, of_bound_accumulate=0.96, microbatches=4)
    targets = acceptance._cell("blocks, W=2", near)["targets"]
    assert "of_pass_bound met (>= 0.95)" in targets and "of_pass_bound_hidden MISSED (>= 0.95)" in targets
    assert (
        "accumulate met (accumulate_speedup >= 1.6 or accumulate_of_bound >= 0.95 or accumulate_of_bound_on_link "
        ">= 0.95 or accumulate_of_bound_stated >= 0.95)" in targets
    )
    slow = acceptance._cell("blocks, W=2", dict(near, of_bound_accumulate=0.9))["targets"]
    assert "accumulate MISSED" in slow
    on_link = dict(near, of_bound_accumulate=0.9, of_bound_on_link_accumulate=0.95)  # (its computation on the link)
    assert "accumulate met" in acceptance._cell("blocks, W=2", on_link)["targets"]
    stated = dict(near, of_bound_accumulate=0.9, of_bound_on_link_filled_accumulate=0.95)  # (and its fill and drain)
    assert "accumulate met" in acceptance._cell("blocks, W=2", stated)["targets"]
    # the single step's verdict reads the pass bound itself; the bound with fill and drain is shown beside it
    filled = acceptance._cell(
        "blocks, W=2", dict(near, of_pass_bound_overlapped=0.9, of_pass_bound_on_link_filled_overlapped=0.97)
    )
    assert filled["of_pass_bound_stated"] == 0.97 and "of_pass_bound MISSED" in filled["targets"]
    assert (
        "accumulate met"
        in acceptance._cell("blocks, W=2", dict(near, of_bound_accumulate=0.9, speedup_accumulate=1.61))["targets"]
    )
    bare = acceptance._cell("blocks, W=2", ROW)["targets"]
    assert "of_pass_bound MISSED" in bare and "accumulate MISSED" in bare
    assert acceptance._cell("mixtral, W=2", near)["targets"] == "reported"
