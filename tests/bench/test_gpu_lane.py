"""The GPU lane's parts on the CPU: the plan's caps, the pinned GEMM configs, the steps' test lists,
the archive and --collect (the whole lane runs in tests/bench/test_gpu_lane_dry_run.py)."""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest

from bench.lane import configs as lane_configs
from bench.lane import files as lane_files
from bench.lane import steps as lane_steps
from bench.lane.steps import GEMM_PINS, PRIORITY, allot, deadlines

REPO = Path(__file__).resolve().parents[2]


def test_priority_plan_gives_the_headline_its_caps_first():
    caps = dict(zip([s.name for s in PRIORITY], allot(PRIORITY, 700)))
    assert [s.label for s in PRIORITY] == ["P0", "P1", "P2", "P2", "P3", "P4", "P5", "P6", "P7", "P8"]
    for step in PRIORITY[:-1]:  # with 700 s every step but the last has its whole cap
        assert caps[step.name] == step.cap
    assert caps["kernel_tests"] == 700 - lane_steps.SUMMARY_SECONDS - sum(s.cap for s in PRIORITY[:-1]) > 0
    # the default budget: P0-P5 whole (the headline, host time, the tests, the one-queue overlap)
    assert allot(PRIORITY, 480)[:7] == [s.cap for s in PRIORITY[:7]]
    # a short budget cuts from the end: P0 and P1 whole, P2 what is left, nothing after
    short = allot(PRIORITY, 230)
    assert short[:3] == [40, 150, 230 - 10 - 190] and short[3:] == [0] * 7
    assert deadlines([40, 150, 30]) == [40, 190, 220]


def test_pytest_steps_time_out_by_thread():
    """pytest-timeout's signal method cannot interrupt a test blocked in C++; the thread method can."""
    from bench.lane.steps import Context

    ctx = Context("python", REPO, REPO, False, 60)
    for step in PRIORITY:
        argv = step.argv(ctx)
        if "pytest" in argv:
            assert "--timeout-method=thread" in argv and any(a.startswith("--timeout=") for a in argv), step.name


@pytest.mark.parametrize("var", sorted(lane_configs.ROUTING_PINS))
def test_routing_pins_are_in_the_spaces_and_kept_at_the_lanes_shapes(var):
    """Each pinned routing config is one of its kernel's candidates and survives the kernel's own
    prune at every (E, K, D) the lane's pinned steps run; the variables are the kernels'."""
    import triton
    from lancet_rt.kernels import _gating_kernels, _permute_kernels

    tuner = lane_configs.tuners()[var]
    text = lane_configs.ROUTING_PINS[var]
    assert text in {lane_configs.config_string(c) for c in tuner.configs}
    config = next(c for c in tuner.configs if lane_configs.config_string(c) == text)
    for E, _K, D in lane_configs.ROUTING_SHAPES:
        if "GATING" in var:
            assert _gating_kernels._token_tile_keep(config, triton.next_power_of_2(E)), (var, E)
        else:
            assert _permute_kernels._row_tile_keep(config, D), (var, D)
    env = lane_steps.pin_env("bf16")
    assert env[var] == text and lane_steps.pin_env("fp32")[var] == text


def test_pinned_routing_config_is_what_the_kernel_launches(monkeypatch):
    """The lane's routing variables are the ones the kernels' prune reads: pinned, it returns the pin alone."""
    for name, value in lane_steps.pin_env("bf16").items():
        monkeypatch.setenv(name, value)
    for var, tuner in lane_configs.tuners().items():
        prune = tuner.early_config_prune
        (config,) = prune(tuner.configs, dict(D=4096), BLOCK_E=16)
        assert lane_configs.config_string(config) == lane_configs.ROUTING_PINS[var]


def test_step_environment_sets_and_unsets_its_variables(monkeypatch):
    from bench.lane import run as gpu_lane

    steps = {s.name: s for s in PRIORITY}
    base = {"CUDA_DEVICE_MAX_CONNECTIONS": "4", "KEEP": "1"}
    p1, p5 = gpu_lane.step_env(base, steps["overlap"]), gpu_lane.step_env(base, steps["overlap_conn1"])
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in p1 and p5["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert p1["KEEP"] == p5["KEEP"] == "1" and p1["LANCET_GATING_FWD_CONFIG"] == p5["LANCET_GATING_FWD_CONFIG"]
    assert not any(k.startswith("LANCET_") for k in gpu_lane.step_env(base, steps["kernels"]))


def _fake_lane(monkeypatch, tmp_path, preflight_rc, install_s=1.5):
    """Run the lane's main with the installs taking ``install_s`` and every step faked: returns the
    lane's rc and the (step, allowance) of each step run."""
    import time

    from bench.lane import run as gpu_lane

    ran = []

    def run_step(cmd, env, cwd, log, seconds, refresh):
        name = log.stem
        ran.append((name, seconds))
        return (preflight_rc if name == "preflight" else 0), 0.0, 0.0

    monkeypatch.setattr(gpu_lane, "install", lambda *a: time.sleep(install_s))
    monkeypatch.setattr(gpu_lane, "run_step", run_step)
    rc = gpu_lane.main(["--budget", "480", "--out", str(tmp_path / "out"), "--only", "overlap,host_fine"])
    return rc, ran


def test_preflight_clock_starts_after_the_installs(monkeypatch, tmp_path):
    rc, ran = _fake_lane(monkeypatch, tmp_path, 0, install_s=1.5)
    assert rc == 0 and [n for n, _ in ran] == ["preflight", "overlap", "host_fine"]
    assert ran[0][1] > lane_steps.PREFLIGHT.cap - 0.5  # the installs' 1.5 s are not the pre-flight's


@pytest.mark.parametrize("rc", ["timeout", 1])
def test_preflight_that_ran_long_does_not_end_the_call(monkeypatch, tmp_path, rc):
    code, ran = _fake_lane(monkeypatch, tmp_path, rc, install_s=0)
    assert code == 0 and [n for n, _ in ran] == ["preflight", "overlap", "host_fine"]


@pytest.mark.parametrize("rc", [3, 4])
def test_failed_import_or_no_cuda_ends_the_call(monkeypatch, tmp_path, rc):
    from bench.lane import preflight

    assert rc in (preflight.IMPORT_FAILED, preflight.NO_CUDA)
    code, ran = _fake_lane(monkeypatch, tmp_path, rc, install_s=0)
    assert code == rc and [n for n, _ in ran] == ["preflight"]


def _h100_winners() -> dict:
    """op -> the configs bench.kernels.experts' autotuning chose on the H100 on 2026-11-24."""
    op_of = {
        "fwd gate_up+swiglu": "gate_up",
        "fwd down": "fwd",
        "bwd dx gate_up": "dx",
        "bwd dx down": "dx",
        "bwd dw gate_up": "dw",
        "bwd dw down": "dw",
    }
    rows = json.loads((REPO / "bench" / "results" / "experts.json").read_text())
    out: dict = {}
    for r in rows:
        if "H100" in r["device"] and r["date"].startswith("2026-11-24") and r["dtype"] == "bfloat16":
            out.setdefault(op_of[r["op"]], set()).add(r["config"])
    return out


def _survivors(op: str, dtype, **problem) -> list:
    """The configs the CUDA autotuner would try for ``op`` (its space after pruning), as pin strings."""
    import torch
    from lancet_rt.kernels._gemm_space import _gemm_configs, _prune_configs, _tile_of

    args = dict(x_ptr=torch.empty(1, dtype=dtype), INPUT_PRECISION="ieee", INTERLEAVED=False, **problem)
    kept = _prune_configs(op)(_gemm_configs(op), args)
    return [",".join(map(str, (*_tile_of(op, c), c.num_warps, c.num_stages))) for c in kept]


@pytest.mark.parametrize("op", ["fwd", "dx", "gate_up", "dw"])
def test_pinned_configs_are_the_h100_winners_and_the_largest_fp32_survivors(op):
    import torch
    from lancet_rt.kernels._gemm_space import CONFIG_ENV

    assert lane_steps.CONFIG_ENV == CONFIG_ENV
    assert GEMM_PINS["bf16"][op] in _h100_winners()[op]
    problem = dict(N=4096, K=4096, F=4096, M_BUCKET=1024)
    assert GEMM_PINS["bf16"][op] in _survivors(op, torch.bfloat16, **problem)
    assert GEMM_PINS["fp32"][op] == _survivors(op, torch.float32, **problem)[0]
    env = lane_steps.pin_env("bf16")
    assert env[f"{CONFIG_ENV}_{op.upper()}"] == GEMM_PINS["bf16"][op] and lane_steps.pin_env(None) == {}


def test_pinned_config_is_what_the_kernel_launches(monkeypatch):
    """The variables the lane sets are the ones the launcher reads (one config per op, no autotuning)."""
    from lancet_rt.kernels import _gemm_space

    for name, value in lane_steps.pin_env("fp32").items():
        monkeypatch.setenv(name, value)
    for op, cfg in GEMM_PINS["fp32"].items():
        assert _gemm_space._pinned_config(op) == tuple(int(v) for v in cfg.split(","))


def test_every_gpu_test_outside_the_kernels_is_in_the_runtime_step():
    """P4 lists its files (collecting the whole suite would cost the call time): a GPU test added
    elsewhere must join the list, or it would silently never run on a GPU."""
    marked = {
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", p.read_text()) and p.parts[len(REPO.parts) + 1] != "kernels"
    }
    assert marked == set(lane_steps.RUNTIME_TESTS), marked ^ set(lane_steps.RUNTIME_TESTS)
    assert lane_steps.HOST_SYNC_TEST.split("::")[0] in lane_steps.RUNTIME_TESTS


def test_archive_stays_under_its_limit_leaving_out_the_largest_non_rows(tmp_path, monkeypatch):
    import os

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out.mkdir()
    (work / "overlap.json").write_text(json.dumps([dict(hidden_comm_fraction=0.8)]))
    (work / "overlap.png").write_bytes(os.urandom(60_000))  # incompressible
    (work / "overlap-trace.json").write_bytes(os.urandom(30_000))
    (work / "runtime.log").write_text("PASSED\n" * 100)
    (work / "kernels.json.tmp").write_text("half-written")
    monkeypatch.setattr(lane_files, "MAX_ARCHIVE_BYTES", 40_000)
    assert lane_files.pack(work, out) == ["overlap.png"]
    with tarfile.open(out / lane_files.ARCHIVE) as tar:
        assert sorted(tar.getnames()) == ["overlap-trace.json", "overlap.json", "runtime.log"]
    assert sorted(p.name for p in out.iterdir()) == [lane_files.ARCHIVE]


def test_unpack_refuses_paths_outside_the_directory(tmp_path):
    import io

    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        info = tarfile.TarInfo("../escape.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"[]"))
    with pytest.raises(ValueError, match="escape.json"):
        lane_files.unpack(bad, tmp_path / "dest")
    assert not (tmp_path / "escape.json").exists()
