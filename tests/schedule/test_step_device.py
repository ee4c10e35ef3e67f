"""A step runs with its inputs' GPU as the current CUDA device.

The counts exchange, the configuration and schedule all-gathers (``TorchGroup``'s small control
tensors) and pinned host buffers go to ``torch.cuda.current_device()``: a rank that skipped
``torch.cuda.set_device`` would put them on GPU 0. So ``Overlapped.forward`` (the schedule check
included), ``Overlapped.forward_chunked`` (what ``accumulate`` calls), the step's start and a layer's
eager forward outside Overlapped make the inputs' GPU current. No GPU here: the inputs are CUDA
tensors without storage (cuda:1), ``torch.cuda.current_device``/``device`` are recorders, and the
step's body is replaced by a probe that reads the current device. Whether NCCL then really runs on
each rank's own GPU needs two GPUs.
"""

from __future__ import annotations

import torch

import lancet_rt
from lancet_rt.schedule.overlap import Overlapped
from tests.kernels.test_launch_device import _Devices, _OnGPU


def _fake(monkeypatch) -> _Devices:
    fake = _Devices(current=0)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    return fake


def _layer():
    return lancet_rt.MoE(8, 16, 4, 2)


def test_bare_layer_forward_runs_on_the_inputs_gpu(monkeypatch):
    fake = _fake(monkeypatch)
    seen = []
    monkeypatch.setattr(lancet_rt.MoE, "_forward_eager", lambda self, x: seen.append(fake.current) or x, raising=False)
    layer = _layer()
    layer.forward_eager(_OnGPU(1))
    assert seen == [1] and fake.current == 0


def test_overlapped_step_runs_on_the_inputs_gpu(monkeypatch):
    fake = _fake(monkeypatch)
    seen = {}
    from lancet_rt.schedule import guard

    check_schedule = guard.check_schedule
    monkeypatch.setattr(
        guard,
        "check_schedule",
        lambda ov, layers: seen.setdefault("schedule", fake.current) or check_schedule(ov, layers),
    )
    monkeypatch.setattr(
        Overlapped, "run_chunked", lambda self, n, args, kwargs: seen.setdefault("chunks", fake.current)
    )
    model = torch.nn.Sequential(_layer())
    Overlapped(model, chunks=2)(_OnGPU(1))
    assert seen == {"schedule": 1, "chunks": 1} and fake.current == 0
    seen.clear()
    ov = Overlapped(model, chunks=2)
    ov.forward_chunked(ov._resolve_chunks((_OnGPU(1),), {}), (_OnGPU(1),), {})  # (as accumulate runs a step)
    assert seen == {"chunks": 1} and fake.current == 0


def test_cpu_step_enters_no_cuda_context(monkeypatch):
    fake = _fake(monkeypatch)
    model = torch.nn.Sequential(_layer())
    x = torch.randn(4, 3, 8)
    torch.testing.assert_close(Overlapped(model, chunks=2)(x), model(x))
    assert fake.entered == []
