"""bench.overlap --routing: the rows a run writes (tiny sizes; no timing asserted)."""

import pytest

from bench.overlap import run as overlap


def test_routing_rows(tmp_path):
    out = tmp_path / "rows.json"
    rows = overlap.main(
        [
            "--device",
            "cpu",
            "--quick",
            "--layers",
            "1",
            "--d-model",
            "32",
            "--d-ffn",
            "32",
            "--batch",
            "2",
            "--seq",
            "32",
            "--steps",
            "1",
            "--routing",
            "balanced,zipf",
            "--json",
            str(out),
        ]
    )
    assert [r["routing"] for r in rows] == ["balanced", "zipf"]
    assert rows[1]["max_over_mean"] == pytest.approx(3.0, abs=0.35)  # the preset, calibrated on the model
    assert rows[0]["max_over_mean"] < rows[1]["max_over_mean"]
    assert rows[1]["bandwidth_gbps"] == rows[0]["bandwidth_gbps"]  # one cluster, two routings
    assert rows[1]["skew_link_ms"] > rows[0]["skew_link_ms"] >= 0
    for r in rows:
        for m in ("sequential", "moe_pipelined", "overlapped", "overlapped_dw", "mitigated"):
            # The fraction is what the row's own timings give (a bound like <= 1 would be timing-dependent:
            # on a loaded machine a one-step run on the link can come back faster than its free-link twin).
            assert r[f"{m}_ms"] > 0 and r[f"{m}_compute_ms"] > 0
            assert r[f"hidden_{m}"] == pytest.approx(1 - (r[f"{m}_ms"] - r[f"{m}_compute_ms"]) / r["comm_ms"])
    assert "recovered" in rows[1] and "recovered" not in rows[0]
    # The shadowed schedule (MoE(shadow_experts=2) on the same weights): its own link time, and under the
    # zipf preset a hot expert shadowed in some layer.
    assert rows[1]["shadowed_ms"] > 0 and rows[1]["shadowed_link_ms"] > 0 and "recovered_step_shadowed" in rows[1]
    assert any(layer for layer in rows[1]["shadowed_experts"])
    written = out.read_text().strip()
    assert written and "overlap_routing" in written
    with pytest.raises(ValueError, match="routing"):
        overlap.main(["--device", "cpu", "--quick", "--routing", "uniform"])
