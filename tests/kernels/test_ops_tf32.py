"""The layer's float32 expert GEMMs honour torch's TF32 switch (``torch.backends.cuda.matmul``):
the kernel namespace passes ``allow_tf32`` from it at each call, the grouped GEMM then asks Triton
for TF32 products, and a caller's explicit ``allow_tf32`` wins. (CPU lane: the Triton path under the
interpreter; the precision it requests is what is checked, the interpreter computes in float32.)"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import grouped_gemm

from lancet_rt import ops


@pytest.fixture
def precision():
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision

    def set_(value):
        matmul.fp32_precision = value

    yield set_
    matmul.fp32_precision = before


def test_tf32_switch_reaches_the_grouped_gemm(precision, monkeypatch):
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    asked = []
    original = grouped_gemm._dot_meta
    monkeypatch.setattr(grouped_gemm, "_dot_meta", lambda dtype, tf32: asked.append(tf32) or original(dtype, tf32))
    ops._cache.clear()
    try:
        o = ops.get_ops(torch.device("cpu"), torch.float32)
        x, w = torch.randn(9, 16), torch.randn(3, 8, 16)
        off = torch.tensor([0, 4, 4, 9])
        want = torch.cat([x[:4] @ w[0].t(), x[4:] @ w[2].t()])
        for setting, expected in (("tf32", True), ("ieee", False), ("tf32", True)):
            precision(setting)
            assert ops.tf32_enabled() is expected
            y = o.grouped_mm(x, w, off)
            assert asked[-1] is expected, setting
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        o.grouped_mm(x, w, off, allow_tf32=False)  # the caller's choice wins
        assert asked[-1] is False
        bf16 = ops.get_ops(torch.device("cpu"), torch.bfloat16)
        assert bf16.grouped_mm is grouped_gemm.grouped_mm  # no TF32 question for 16-bit floats
    finally:
        ops._cache.clear()
