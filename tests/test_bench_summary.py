"""The GPU lane's summary reads benchmark rows and judges the worst one against each target."""
from __future__ import annotations

import json

from bench.gpu_lane import summary


def test_summary_judges_worst_row_and_reports_missing(tmp_path):
    (tmp_path / "overlap.json").write_text(json.dumps([
        dict(speedup_vs_sequential=1.7, speedup_vs_moe_pipelined=1.1, over_bound=0.12, hidden_comm_fraction=0.85),
        dict(speedup_vs_sequential=1.4, speedup_vs_moe_pipelined=1.2, over_bound=0.20, hidden_comm_fraction=0.90),
    ]))
    rows = {r["metric"]: r for r in summary(tmp_path)}
    assert rows["Overlapped vs sequential"]["value"] == 1.4 and rows["Overlapped vs sequential"]["met"] == "NOT met"
    assert rows["Overlapped over bound_ms"]["value"] == 0.2 and rows["Overlapped over bound_ms"]["met"] == "NOT met"
    assert rows["hidden communication fraction"]["met"] == "met"
    assert rows["permute fwd, fraction of copy BW"]["met"] == "not measured"
