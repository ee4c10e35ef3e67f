"""Every Triton launcher runs on its input tensors' GPU, not on whichever GPU is current.

Triton launches on the current CUDA device and its stream, whatever device the pointers are on, so a
rank that never called ``torch.cuda.set_device`` would launch on GPU 0. There is no GPU here: the
tensors are CUDA tensors without storage (a wrapper subclass claiming ``cuda:1``), ``torch.cuda``'s
current device and its ``device`` context are replaced by recorders, and each launcher is called with
only its first argument, so it fails inside its body, after the wrapper chose the device. That the
kernels then really run on that GPU needs two GPUs (the GPU lane), not this test.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from lancet_rt import ops

#: The op families whose launchers live in kernels/ files of this change (linear_ce is not one of them).
FAMILIES = ("gating", "permute", "grouped_gemm", "swiglu", "norm")
MODULES = {"gating": "gating", "permute": "permute", "grouped_gemm": "grouped_gemm", "swiglu": "swiglu", "norm": "norm"}


def _launchers():
    for family in FAMILIES:
        module = importlib.import_module(f"lancet_rt.kernels.{MODULES[family]}")
        for name in ops._OP_NAMES[family]:
            yield f"{family}.{name}", getattr(module, name)


class _OnGPU(torch.Tensor):
    """A tensor that claims a CUDA device and holds no data (any op on it raises)."""

    @staticmethod
    def __new__(cls, index: int):
        return torch.Tensor._make_wrapper_subclass(cls, (4, 8), dtype=torch.float32, device=torch.device("cuda", index))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"no data ({func})")


class _Devices:
    """Stands in for ``torch.cuda.current_device`` and ``torch.cuda.device``: records each context entered."""

    def __init__(self, current: int):
        self.current, self.entered, self.exits = current, [], []

    def current_device(self) -> int:
        return self.current

    def device(self, device):
        outer = self

        class _Context:
            def __enter__(self):
                self.prev, outer.current = outer.current, torch.device(device).index
                outer.entered.append(outer.current)

            def __exit__(self, exc_type, exc, tb):
                outer.exits.append(exc_type)
                outer.current = self.prev
                return False

        return _Context()


@pytest.fixture
def devices(monkeypatch):
    fake = _Devices(current=0)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    return fake


def test_every_launcher_takes_its_device_from_its_inputs():
    missing = [name for name, fn in _launchers() if not getattr(fn, "on_tensor_device", False)]
    assert not missing, f"launchers that launch on the current device: {missing}"


@pytest.mark.parametrize("name,launcher", list(_launchers()), ids=[n for n, _ in _launchers()])
def test_launcher_body_runs_on_the_tensors_gpu(devices, name, launcher):
    with pytest.raises(Exception):  # noqa: B017 - any failure: the body runs on no data  # (one argument, no data: the body fails)
        launcher(_OnGPU(1))
    assert devices.entered == [1], f"{name}: the launch did not make cuda:1 current"
    assert devices.exits[0] is not None, f"{name}: its body did not run inside the device context"
    assert devices.current == 0  # the caller's device is back


def test_launcher_on_the_current_gpu_or_the_cpu_enters_no_context(devices):
    from lancet_rt.kernels.grouped_gemm import grouped_mm

    devices.current = 1
    with pytest.raises(Exception):  # noqa: B017 - any failure: the body runs on no data
        grouped_mm(_OnGPU(1))
    with pytest.raises(Exception):  # noqa: B017 - any failure: the body runs on no data
        grouped_mm(torch.randn(4, 8))
    assert devices.entered == []


def test_keyword_tensor_also_sets_the_device(devices):
    from lancet_rt.kernels.swiglu import swiglu_fwd

    with pytest.raises(Exception):  # noqa: B017 - any failure: the body runs on no data
        swiglu_fwd(gu_R2F=_OnGPU(1))
    assert devices.entered == [1]
