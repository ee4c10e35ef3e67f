"""The main job runs end to end on 2 gloo ranks under torchrun and its loss falls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_two_ranks(tmp_path):
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "train_lm.py"),  # as make train runs it: a script, not a module of the checkout
        "--steps",
        "40",
        "--log-every",
        "20",
        "--timing-steps",
        "1",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["world"] == 2 and summary["chunks"] == 2
    assert summary["final_loss"] < summary["first_loss"] - 0.3
    assert "expert load" in proc.stdout and "summary:" in proc.stdout


def test_step_timing_waits_for_the_device(monkeypatch):
    """The timed steps read the clock only after the device's queued work (torch.cuda.synchronize on
    CUDA; a CUDA step returns before its kernels end): both ends of each timed run, each way."""
    import torch

    from examples import train_lm

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    train_lm._clock(torch.device("cuda"))
    train_lm._clock(torch.device("cpu"))
    assert synced == [torch.device("cuda")]
    clocks = []
    real = train_lm._clock
    monkeypatch.setattr(train_lm, "_clock", lambda device: clocks.append(device.type) or real(device))
    monkeypatch.setattr(train_lm, "sync_gradients", lambda model, group: None)  # (one rank, no process group)
    summary = train_lm.main(
        [
            "--steps",
            "2",
            "--log-every",
            "1",
            "--timing-steps",
            "1",
            "--batch",
            "2",
            "--seq",
            "8",
            "--layers",
            "1",
            "--d-model",
            "16",
            "--d-ffn",
            "16",
            "--heads",
            "2",
        ]
    )
    assert clocks == [summary["device"]] * 4 and summary["sequential_step_ms"] > 0
