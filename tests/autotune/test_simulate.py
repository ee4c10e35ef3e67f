"""The cluster simulator: built on the replay (the same prediction where the replay covers the case), skew, CLI."""

import json

import pytest
from lancet_rt.autotune import cluster as simulate
from lancet_rt.autotune import simulate_model
from lancet_rt.autotune.replay_sim import Skew, replay


def test_balanced_step_equals_the_replay():
    # Balanced routing is a case the replay covers: the simulator's Overlapped and sequential steps are
    # the replay's own predictions on the profile it builds, at every candidate chunk count.
    shape = simulate_model.SHAPES["qwen3_moe"]
    name, gbps, lat, share = simulate_model.link_for(64, None)
    assert name == "ib" and share == pytest.approx(56 / 63)
    profile = simulate_model.build_profile(shape, 4096, 4096, 64, gbps, lat, share)
    row = simulate.simulate_step("qwen3_moe", 64, tokens=4096, chunks=(1, 2, 4), routing="balanced")
    preds = {n: replay(profile, n) for n in (1, 2, 4)}
    assert row["sequential_ms"] == preds[1].step_ms
    best = min(preds.values(), key=lambda p: p.step_ms)
    assert row["overlapped_ms"] == best.step_ms and row["overlapped_chunks"] == best.chunks
    assert row["comm_ms"] == preds[1].comm_ms and row["straggler_ms"] == 0.0
    assert replay(profile, 2, skew=Skew()).step_ms == preds[2].step_ms  # no skew: the replay unchanged


def test_tutel_at_one_chunk_is_the_sequential_step():
    shape = simulate_model.SHAPES["mixtral"]
    profile = simulate_model.build_profile(shape, 2048, 2048, 8, 450.0, 0.01)
    for skew in (Skew(), Skew(port=2.0, hot=3.0)):
        step, compute = simulate_model.tutel_step(profile, 1, skew)
        pred = replay(profile, 1, skew=skew)
        assert step == pytest.approx(pred.step_ms, rel=1e-9)
        assert compute == pytest.approx(pred.compute_ms, rel=1e-9)


def test_skew_slows_and_exposes():
    bal = simulate.simulate_step("mixtral", 8, routing="balanced")
    skw = simulate.simulate_step("mixtral", 8, routing="zipf")
    assert skw["hot"] == pytest.approx(3.0, rel=1e-6)  # 8 experts on 8 ranks: the preset's max/mean
    assert skw["straggler_ms"] > 0
    for s in simulate.SCHEDULES:
        assert skw[f"{s}_ms"] > bal[f"{s}_ms"]
    assert skw["overlapped_hidden"] < bal["overlapped_hidden"]
    assert skw["overlapped_ms"] <= skw["sequential_ms"]


def test_bad_arguments_and_cli(tmp_path, capsys):
    with pytest.raises(ValueError, match="model"):
        simulate.simulate_step("gpt", 8)
    with pytest.raises(ValueError, match="ep"):
        simulate.simulate_step("mixtral", 8, ep=3)
    with pytest.raises(ValueError, match="link"):
        simulate.simulate_step("mixtral", 8, link="pcie")
    out = tmp_path / "sim.json"
    rows = simulate.main(["--model", "deepseek_v3", "--gpus", "16", "--tokens", "1024", "--json", str(out)])
    assert [r["routing"] for r in rows] == ["balanced", "zipf"]
    assert rows[0]["ep"] == 16 and rows[0]["link"] == "ib"
    assert json.loads(out.read_text())["rows"][1]["hot"] == rows[1]["hot"]
    assert "MODEL, not a measurement" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        simulate.main(["--model", "mixtral"])


def test_shadowing_in_the_simulator():
    # Balanced routing shadows nothing (the same step); under the zipf preset the shadowed experts' rows stay
    # home: a smaller busiest port and hot rank (the fetches added to the port), a faster step, still
    # slower than balanced routing.
    bal = simulate.simulate_step("mixtral", 8, routing="balanced", shadow=2)
    assert bal["shadowed_experts"] == 0 and bal["shadowed_ms"] == bal["overlapped_ms"]
    skw = simulate.simulate_step("mixtral", 8, routing="zipf", shadow=2)
    assert skw["shadowed_experts"] >= 1
    assert skw["shadowed_hot"] < skw["hot"] and skw["shadowed_port"] < skw["port"]
    assert bal["overlapped_ms"] < skw["shadowed_ms"] < skw["overlapped_ms"]
    assert "shadowed_ms" not in simulate.simulate_step("mixtral", 8, routing="zipf")
    # By hand, one layer of 8 experts on 8 ranks with the hot expert shadowed: port and hot rows from the
    # remaining shares, plus the fetch's bytes over the pass's all-to-all bytes.
    from lancet_rt.routing.traces import parse_routing

    shape = simulate_model.SHAPES["mixtral"]
    src = parse_routing("zipf")
    sk, k = simulate_model.shadow_skew_for(src, shape, 8, 8192, 1)
    assert k == 1
    shares = src.shares(0, 8)
    hot = shares.index(max(shares))
    kept = [0.0 if e == hot else v for e, v in enumerate(shares)]
    port = max(max(sum(kept) - v, 7 * v) for v in kept) / (7 / 8)
    fetch = 3 * 4096 * 14336 * 2 / (2 * 8192 * 2 * 4096 * 2 * 7 / 8)
    # (every layer's zipf shares are the same values in another order, so the layer average is this layer's)
    assert sk.port == pytest.approx(port + fetch)
    assert sk.hot == pytest.approx(8 * max(kept) + max(shares))
