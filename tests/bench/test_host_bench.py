"""bench.host's counts, which do not depend on the machine: the acceptance of the work on chunking's cost as
a regression test (host reads and saved bytes per extra chunk; ATen ops on the CPU path, host operations on
the Triton path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import host

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("extra", [[], ["--capacity-factor", "1.25", "--autocast", "bf16", "--defer-wgrad"]])
def test_an_extra_chunk_reads_once_and_saves_nothing_more(extra):
    threads = torch.get_num_threads()
    try:
        rows = host.main(["--device", "cpu", "--chunks", "4", "--reps", "1", *extra])
    finally:
        torch.set_num_threads(threads)  # (bench.host sets its own)
    row = next(r for r in rows if r["chunks"] == 4)
    assert row["reads_per_chunk"] <= 1
    assert row["saved_x"] <= 1.10
    limit = 250 if not extra else 280  # (autocast: the fp32 accumulations' casts, ~20 more)
    assert row["ops_per_chunk"] <= limit, row["ops_per_chunk"]
    assert "plain_us_per_chunk" in row  # (a time: reported, not asserted)


def test_host_vs_gpu_fields_per_layer_chunk():
    """The CUDA row's comparison from its phases' times: per layer and chunk, and the ratio."""
    f = host.host_vs_gpu(fwd_us=600.0, bwd_us=1000.0, fwd_gpu_us=1200.0, bwd_gpu_us=800.0, layer_chunks=8)
    assert f["host_us"] == 200.0 and f["gpu_us"] == 250.0 and f["host_over_gpu"] == 0.8
    assert f["fwd_host_over_gpu"] == 0.5 and f["bwd_host_over_gpu"] == 1.25
    assert (f["fwd_gpu_us"], f["bwd_gpu_us"]) == (1200.0, 800.0)


def test_cpu_rows_carry_the_shape_and_no_gpu_fields(tmp_path):
    threads = torch.get_num_threads()
    try:
        rows = host.main(
            [
                "--device",
                "cpu",
                "--chunks",
                "2",
                "--reps",
                "1",
                "--layers",
                "1",
                "--seq",
                "8",
                "--experts",
                "8",
                "--top-k",
                "4",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    for r in rows:
        assert (r["experts"], r["top_k"], r["layers"], r["seq"]) == (8, 4, 1, 8)
        assert r["fwd_us"] > 0 and r["bwd_us"] > 0
        assert not {"gpu_us", "host_over_gpu", "fwd_gpu_us", "host_us"} & set(r)


def test_the_fine_shape_preset_and_the_flags_that_override_it():
    threads = torch.get_num_threads()
    small = ["--d-model", "16", "--d-ffn", "8", "--heads", "2", "--layers", "1", "--batch", "2", "--seq", "8"]
    try:
        rows = host.main(["--device", "cpu", "--shape", "fine", "--count-only", *small])
    finally:
        torch.set_num_threads(threads)
    assert [r["chunks"] for r in rows] == [1, 4]  # (the preset's 4 chunks, against unchunked)
    for r in rows:  # the preset's routing, the flags' sizes
        assert (r["world_size"], r["experts"], r["top_k"]) == (4, 128, 8)
        assert (r["d_model"], r["d_ffn"], r["heads"], r["layers"], r["batch"], r["seq"]) == (16, 8, 2, 1, 2, 8)
    assert host.SHAPES["fine"]["d_model"] == 2048 and host.SHAPES["fine"]["batch"] * host.SHAPES["fine"]["seq"] == 16384


@pytest.mark.gpu
def test_cuda_row_carries_gpu_time_and_the_ratio():
    """GPU twin: a CUDA row has each phase's CUDA-event time beside its host time, per layer-chunk."""
    rows = host.main(["--device", "cuda", "--chunks", "2", "--reps", "3", "--autocast", "bf16"])
    for r in rows:
        assert r["fwd_gpu_us"] > 0 and r["bwd_gpu_us"] > 0
        per = r["layers"] * r["chunks"]
        assert r["gpu_us"] == pytest.approx((r["fwd_gpu_us"] + r["bwd_gpu_us"]) / per)
        assert r["host_us"] == pytest.approx((r["fwd_us"] + r["bwd_us"]) / per)
        assert r["host_over_gpu"] == pytest.approx(r["host_us"] / r["gpu_us"])
        # the GPU's span of a step starts when the host starts it and ends after the host's last enqueue
        assert r["host_over_gpu"] <= 1.05


def test_the_launch_counter_counts_and_times_each_launch_once(monkeypatch):
    """Launches are counted and timed once each (a launch inside a launch is the kernel's own work), and
    the time spent in them is summed; a warm-up call is not a launch."""
    pytest.importorskip("triton")
    from triton.runtime import jit

    def fake_run(fn_self, *args, **kwargs):
        if kwargs.pop("nested", False):
            jit.JITFunction.run(fn_self)  # (as the interpreter would: a launch inside the outer one)
        time.sleep(0.002)

    monkeypatch.setattr(jit.JITFunction, "run", fake_run)
    with host.LaunchCounter() as launches:
        jit.JITFunction.run(None)
        jit.JITFunction.run(None, nested=True)
        jit.JITFunction.run(None, warmup=True)
    assert launches.count == 2
    assert 0.006 <= launches.seconds < 1.0  # (the outer launch's time holds the inner one's)
    assert jit.JITFunction.run is fake_run  # (restored on exit)


def test_the_triton_path_stays_within_its_host_operation_count():
    """The GPU path's host operations per layer per extra chunk (ATen ops + Triton launches), counted on
    the CPU through its own sequence (the Triton interpreter), one layer, 2 chunks: at most what they are
    (91 ATen ops + 16 launches: the experts' two dW GEMMs are one launch), with one host read."""
    pytest.importorskip("triton")
    env = dict(os.environ, LANCET_KERNELS="triton", TRITON_INTERPRET="1")
    argv = ["--device", "cpu", "--chunks", "2", "--layers", "1", "--batch", "2", "--seq", "4", "--count-only"]
    code = f"import json; from bench import host; print(json.dumps(host.main({argv!r})[-1]))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=REPO, check=True
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])
    host_ops = row["ops_per_chunk"] + row["fwd_launches_per_chunk"] + row["bwd_launches_per_chunk"]
    assert row["fwd_launches_per_chunk"] + row["bwd_launches_per_chunk"] > 0  # (the kernels ran)
    assert host_ops <= 107, host_ops
    assert row["reads_per_chunk"] <= 1
