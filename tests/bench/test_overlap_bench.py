"""bench.overlap: the eager floors of chunking (tiny sizes; no timing asserted)."""

import math

import torch

from bench import overlap
from bench.runner import Runner


def _tiny(*extra):
    return overlap.parse_args(
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
            "6",
            "--seq",
            "8",
            "--steps",
            "1",
            *extra,
        ]
    )


def test_plain_chunks_runs_the_unchunked_model_once_per_chunk_then_one_backward():
    args = _tiny("--chunks", "3")
    r = Runner(args, overlap.sizes(args), torch.device("cpu"))
    r.set_link(math.inf, 0.0)
    calls, backwards = [], []
    model = r.model
    original = model.forward

    def forward(x):
        calls.append((tuple(x.shape), torch.is_grad_enabled()))
        y = original(x)
        y.register_hook(lambda g: backwards.append(g.shape[0]))
        return y

    model.forward = forward
    r.moe_layers[0].pipeline_chunks = 4  # left over from a MoE-internal step: the floor resets it
    r.step("plain_chunks")
    assert calls == [((2, 8, 32), True)] * 3  # the model itself, on each chunk's rows
    assert sorted(backwards) == [2, 2, 2]  # one backward reached every chunk's output
    assert r.moe_layers[0].pipeline_chunks == 1
    assert all(p.grad is None for p in model.parameters())  # cleared like a timed step


def test_dense_floor_runs_the_model_without_its_moe_layers_then_puts_them_back():
    args = _tiny("--chunks", "3", "--layers", "2")
    r = Runner(args, overlap.sizes(args), torch.device("cpu"))
    r.set_link(math.inf, 0.0)
    layers = list(r.moe_layers)
    seen = []
    for m in layers:
        m.register_forward_pre_hook(lambda mod, inp: seen.append(mod))
    rows = []
    for b in r.model.blocks:  # what reaches each block, and what the MoE slot of the block holds then
        b.register_forward_pre_hook(lambda mod, inp: rows.append((inp[0].shape[0], type(mod.moe).__name__)))
    r.step("dense_chunks")
    assert seen == []  # no MoE layer ran
    assert rows == [(2, "Identity")] * 6  # both blocks, on each chunk's rows, the MoE slot an identity
    assert [b.moe for b in r.model.blocks] == layers  # put back
    assert all(p.grad is None for p in r.model.parameters())
    rows.clear()
    r.step("dense")
    assert rows == [(6, "Identity")] * 2 and seen == []
    r.step("plain_chunks")
    assert len(seen) == 6  # the floor with the MoE layers runs them again


def test_lean_floor_runs_the_lean_layer_in_every_block_then_puts_ours_back():
    args = _tiny("--chunks", "3", "--layers", "2")
    r = Runner(args, overlap.sizes(args), torch.device("cpu"))
    r.set_link(math.inf, 0.0)
    assert r.lean
    layers = list(r.moe_layers)
    seen, rows = [], []
    for m in layers:
        m.register_forward_pre_hook(lambda mod, inp: seen.append(mod))
    for b in r.model.blocks:
        b.register_forward_pre_hook(lambda mod, inp: rows.append((inp[0].shape[0], type(mod.moe).__name__)))
    r.step("lean_chunks")
    assert seen == []  # our layers did not run
    assert rows == [(2, "LeanBlockMoE")] * 6  # both blocks, on each chunk's rows
    assert [b.moe for b in r.model.blocks] == layers and all(p.grad is None for p in r.model.parameters())
    r.step("lean")
    assert rows[6:] == [(6, "LeanBlockMoE")] * 2
    # the lean layer computes only one local expert with softmax scores: elsewhere no lean floor
    r2 = Runner(_tiny("--world-size", "4"), overlap.sizes(_tiny("--world-size", "4")), torch.device("cpu"))
    assert not r2.lean and "lean" not in r2.steps


def test_row_carries_the_floor_and_the_overhead(tmp_path):
    row = overlap.main(
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
            "4",
            "--seq",
            "16",
            "--steps",
            "1",
            "--json",
            str(tmp_path / "rows.json"),
        ]
    )
    assert row["chunking_overhead"] == row["compute_ms"] / row["sequential_compute_ms"]
    assert row["sequential_excess"] == row["sequential_ms"] / (row["sequential_compute_ms"] + row["comm_ms"]) - 1
    assert row["plain_chunks_compute_ms"] > 0
    assert 0 < row["plain_chunks_overhead"] < math.inf and 0 < row["overhead_over_floor"] < math.inf
    # the overhead of the floors' timing, cut into its three parts
    parts = row["overhead_dense"] + row["overhead_moe"] + row["overhead_schedule"]
    assert math.isclose(1 + parts, row["overhead_over_floor"] * row["plain_chunks_overhead"], rel_tol=1e-9)
    floor_sequential_ms = row["plain_chunks_compute_ms"] / row["plain_chunks_overhead"]
    assert math.isclose(
        row["overhead_dense"],
        (row["dense_chunks_compute_ms"] - row["dense_compute_ms"]) / floor_sequential_ms,
        rel_tol=1e-9,
    )
    assert row["dense_compute_ms"] > 0 and row["dense_chunks_compute_ms"] > 0
    assert set(overlap._floor_fields(None).values()) == {None}  # a transformers model: no floor row
    # the lean floor, in the same timing: our unchunked step plus the lean layer's increment
    assert row["lean_compute_ms"] > 0 and row["lean_chunks_compute_ms"] > 0
    assert math.isclose(
        row["lean_overhead"],
        1 + (row["lean_chunks_compute_ms"] - row["lean_compute_ms"]) / floor_sequential_ms,
        rel_tol=1e-9,
    )
    overlapped_floor_ms = row["overhead_over_floor"] * row["plain_chunks_compute_ms"]
    assert math.isclose(
        row["overhead_over_lean"],
        overlapped_floor_ms / floor_sequential_ms - row["lean_overhead"],
        rel_tol=1e-9,
        abs_tol=1e-12,
    )
    # what the speedup can reach: at this overhead, a schedule at the pass-aware bound
    assert row["pass_bound_speedup"] == row["sequential_ms"] / row["pass_bound_ms"]
    assert row["pass_bound_speedup_no_overhead"] >= row["pass_bound_speedup"] or row["chunking_overhead"] < 1


def test_speedup_ceiling_scales_the_link_with_the_chunked_compute():
    """The link is calibrated to Overlapped's compute: at overhead o the pass-aware bound is p x its
    compute and the sequential step c_s + e x its compute, so the speedup there is (1 / o + e) / p."""
    c_s, c_o, seq, bound = 50.0, 60.0, 100.0, 66.0  # o = 1.2, p = 1.1, e = 5 / 6
    f = overlap._ceiling_fields(seq, c_s, c_o, bound, target=1.6)
    assert math.isclose(f["pass_bound_speedup"], seq / bound)
    assert math.isclose(f["pass_bound_speedup_no_overhead"], (1 + 5 / 6) / 1.1)
    o = f["overhead_for_target"]
    assert math.isclose(o, 1 / (1.6 * 1.1 - 5 / 6))
    # at that overhead (the same link ratio and pass structure), a run would sit exactly on the target
    c_o2 = c_s * o
    assert math.isclose((c_s + 5 / 6 * c_o2) / (1.1 * c_o2), 1.6)
    assert overlap._ceiling_fields(seq, c_s, c_o, bound, target=2.0)["overhead_for_target"] is None  # not even at o = 1
    assert overlap._ceiling_fields(seq, c_s, c_o, bound, target=0.5)["overhead_for_target"] == math.inf


def test_row_is_on_disk_after_the_link_passes_and_survives_sigint(tmp_path):
    """The single-step row is written right after the two link passes, before the bound,
    the floors and the cross-microbatch part; a real SIGINT to a running ``python -m bench.overlap``
    once it is there leaves it on disk (marked incomplete), not a half-written file."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.overlap",
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
        "4",
        "--seq",
        "16",
        "--steps",
        "3",
        "--microbatches",
        "4",
        "--json",
        str(path),
    ]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not path.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert path.exists(), f"no row before the process ended (rc {p.poll()})"
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode != 0, "the run finished before the interrupt reached it:\n" + out[-2000:]
    assert "KeyboardInterrupt" in out
    (row,) = json.loads(path.read_text())
    assert row["complete"] is False and row["bench"] == "overlap"
    assert 0 < row["overlapped_ms"] < math.inf and 0 < row["sequential_ms"] < math.inf
    assert row["hidden_comm_fraction"] == 1 - (row["overlapped_ms"] - row["compute_ms"]) / row["comm_ms"]
    assert row["pass_bound_ms"] is None and "hidden_comm_fraction_accum" not in row


def test_cross_microbatch_part_runs_only_if_its_projected_time_fits(tmp_path, monkeypatch):
    """--max-seconds: the part is left out when its projection exceeds what is left; the row is then
    complete without it (written once, not twice)."""
    import json

    args = overlap.parse_args(["--quick", "--microbatches", "3", "--accum-steps", "2", "--steps", "4"])
    row = dict(overlapped_ms=30.0, compute_ms=10.0)
    # 3 rounds (2 timed + a warm-up) x 8 runs (4 schedules x 2 links) x 3 microbatches x 20 ms x 1.5
    assert math.isclose(overlap._extras_seconds(row, args, overlap.sizes(args)), 3 * 8 * 3 * 0.020 * 1.5)
    assert overlap._extras_seconds(row, overlap.parse_args(["--quick"]), {}) == 0.0
    monkeypatch.setattr(overlap, "_extras_seconds", lambda *a: 1e9)
    path = tmp_path / "rows.json"
    out = overlap.main(
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
            "4",
            "--seq",
            "16",
            "--steps",
            "1",
            "--microbatches",
            "2",
            "--max-seconds",
            "3600",
            "--json",
            str(path),
        ]
    )
    (saved,) = json.loads(path.read_text())
    assert saved == out and out["complete"] and "hidden_comm_fraction_accum" not in out
