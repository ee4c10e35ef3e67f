"""The GPU lane's summary reads benchmark rows and judges the worst one against each target."""

from __future__ import annotations

import json

from bench.gpu_lane import summary


def test_summary_judges_worst_row_and_reports_missing(tmp_path):
    (tmp_path / "overlap.json").write_text(
        json.dumps(
            [
                dict(
                    speedup_vs_sequential=1.7, speedup_vs_moe_pipelined=1.1, over_bound=0.12, hidden_comm_fraction=0.85
                ),
                dict(
                    speedup_vs_sequential=1.4, speedup_vs_moe_pipelined=1.2, over_bound=0.20, hidden_comm_fraction=0.90
                ),
            ]
        )
    )
    rows = {r["metric"]: r for r in summary(tmp_path)}
    assert rows["Overlapped vs sequential"]["value"] == 1.4 and rows["Overlapped vs sequential"]["met"] == "NOT met"
    assert rows["Overlapped over bound_ms"]["value"] == 0.2 and rows["Overlapped over bound_ms"]["met"] == "NOT met"
    assert rows["hidden communication fraction"]["met"] == "met"
    assert rows["permute fwd, fraction of copy BW"]["met"] == "not measured"


def test_summary_ignores_rows_that_failed_their_check(tmp_path):
    base = dict(op="permute_fwd", T=16384, D=4096)
    (tmp_path / "kernels.json").write_text(
        json.dumps(
            [
                dict(base, frac_copy=0.90, check="ok"),
                dict(base, frac_copy=5.0, check="MISMATCH"),  # fast and wrong: must not count
                dict(base, check="error", error="CompilationError: ..."),
            ]
        )
    )
    row = {r["metric"]: r for r in summary(tmp_path)}["permute fwd, fraction of copy BW"]
    assert row["value"] == 0.9 and row["rows"] == 1 and row["failed"] == 2 and row["met"] == "met"


def test_summary_shows_informational_rows_unjudged(tmp_path):
    (tmp_path / "overlap.json").write_text(json.dumps([dict(over_pass_bound=0.05, max_hidden_comm_fraction=0.84)]))
    rows = {r["metric"]: r for r in summary(tmp_path)}
    assert rows["Overlapped over the pass-aware bound"]["met"] == "info"
    assert rows["most communication any schedule could hide"]["value"] == 0.84


def test_lane_writes_its_summary_when_steps_fail(tmp_path):
    """On this CPU machine the real lane's pre-flight finds no CUDA device: the lane stops there, at
    once and non-zero (no step spends the call on what cannot work), and still records the
    step and leaves summary.json and the archive with the step's log in --out (a lent GPU's call
    returns only what is under it)."""
    import tarfile

    from bench.gpu_lane import main

    assert main(["--out", str(tmp_path), "--only", "kernels", "--budget", "120"]) != 0
    result = json.loads((tmp_path / "summary.json").read_text())
    assert [s["step"] for s in result["steps"]] == ["preflight"] and result["steps"][0]["rc"] != 0
    with tarfile.open(tmp_path / "lane.tar.gz") as tar:
        assert "no CUDA device" in tar.extractfile("preflight.log").read().decode()


def test_collect_appends_rows_and_merges_defaults(tmp_path):
    """--collect brings a GPU call's $OUT into the repository: rows appended (never replaced),
    the timeline under the GPU's name, the exported autotune entry merged into the shipped file
    with its other fields kept."""
    from bench.gpu_lane import collect

    src, results = tmp_path / "out", tmp_path / "results"
    src.mkdir()
    results.mkdir()
    (results / "experts.json").write_text(json.dumps([dict(device="older", frac_dense=0.5)]))
    (src / "experts.json").write_text(json.dumps([dict(device="NVIDIA H200", frac_dense=0.8)]))
    (src / "summary.json").write_text(json.dumps(dict(steps=[], targets=[])))
    (src / "overlap.png").write_bytes(b"\x89PNG")
    (src / "defaults.json").write_text(json.dumps(dict(entries={"H200|x": dict(value=dict(chunks=4))})))
    shipped = tmp_path / "defaults.json"
    shipped.write_text(json.dumps(dict(schema="s", comment="keep me", entries={"H100|y": dict(value=dict(chunks=2))})))
    collect(src, results, shipped)
    assert [r["device"] for r in json.loads((results / "experts.json").read_text())] == ["older", "NVIDIA H200"]
    assert json.loads((results / "gpu_lane.json").read_text())[0]["device"] == "NVIDIA H200"
    assert (results / "overlap_nvidia_h200.png").read_bytes() == b"\x89PNG"
    merged = json.loads(shipped.read_text())
    assert merged["comment"] == "keep me" and set(merged["entries"]) == {"H100|y", "H200|x"}
