"""The main job (examples.train_lm) and ``lancet-autotune --link torch`` call ``lancet_rt.warmup`` before
their first step, inside the autocast their steps compute in (``lancet_rt.warmup`` replaced by a
recorder that then runs the real one)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import lancet_rt
from tests.dist import assert_all_ok, run_ranks

pytestmark = pytest.mark.timeout(600)


def _recording(calls: list) -> None:
    """``lancet_rt.warmup`` records each call (this rank's process only), then warms."""
    real = lancet_rt.warmup

    def record(model, *args, **kwargs):
        layers = [m for m in model.modules() if isinstance(m, lancet_rt.MoE)]
        calls.append(
            dict(
                model=type(model).__name__,
                autocast=str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None,
                stepped=any(m.tokens_per_expert is not None for m in layers),
                shapes=[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)],
            )
        )
        return real(model, *args, **kwargs)

    lancet_rt.warmup = record


def _train_lm(rank, world, autocast):
    import os

    import torch.distributed as dist

    from examples import train_lm

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    dist.init_process_group = lambda *a, **k: None  # (the ranks' gloo group is up already)
    calls: list = []
    _recording(calls)
    argv = [
        "--steps",
        "2",
        "--log-every",
        "1",
        "--timing-steps",
        "0",
        "--batch",
        "4",
        "--seq",
        "8",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--d-ffn",
        "32",
    ] + (["--autocast", autocast] if autocast != "none" else [])
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train_lm.main(argv)
    return summary["steps"], calls


@pytest.mark.parametrize("autocast,expected", [("none", None), ("bf16", "torch.bfloat16")])
def test_train_lm_warms_up_before_its_first_step_in_its_autocast(autocast, expected):
    results = run_ranks(_train_lm, 2, autocast, timeout=300)
    assert_all_ok(results)
    for _, (steps, calls) in results.values():
        assert steps == 2
        assert [c["model"] for c in calls] == ["Overlapped", "MoELanguageModel"], calls  # both runners it times
        assert all(c["autocast"] == expected and not c["stepped"] and c["shapes"] == [(4, 8)] for c in calls), calls


def _autotune_on_gloo(rank, world, path):
    from lancet_rt.autotune import __main__ as cli

    calls: list = []
    _recording(calls)
    torch.set_num_threads(1)
    argv = [
        "--device",
        "cpu",
        "--link",
        "torch",
        "--d-model",
        "16",
        "--d-ffn",
        "32",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--tokens",
        "64",
        "--seq",
        "16",
        "--layers",
        "1",
        "--heads",
        "2",
        "--candidates",
        "1,2",
        "--warmup",
        "0",
        "--reps",
        "1",
        "--no-progress",
        "--cache",
        path,
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        cli.run(argv)
    return calls


def test_autotune_link_torch_warms_up_before_measuring(tmp_path):
    results = run_ranks(_autotune_on_gloo, 2, str(tmp_path / "gloo.json"), timeout=300)
    assert_all_ok(results)
    for _, calls in results.values():
        assert [(c["model"], c["stepped"], c["shapes"], c["autocast"]) for c in calls] == [
            ("Overlapped", False, [(4, 16, 16)], None)
        ], calls
