"""The main job runs end to end on 2 gloo ranks under torchrun and its loss falls."""
from __future__ import annotations

import json
import subprocess
import sys


def test_main_job_two_ranks(tmp_path):
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bench.train_lm", "--steps", "40", "--log-every", "20", "--timing-steps", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["world"] == 2 and summary["chunks"] == 2
    assert summary["final_loss"] < summary["first_loss"] - 0.3
    assert "expert load" in proc.stdout and "summary:" in proc.stdout
