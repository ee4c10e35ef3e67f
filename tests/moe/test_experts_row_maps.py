"""On the Triton path the experts regroup their rows through the kernels' row maps, not index_select,
and compute the activation's gradient in the dH GEMM's epilogue.

The rows arrive in received (rank-major) order; the grouped GEMMs read x and dY through the dispatch's
permutation and write y and dX through it (lancet_rt.moe.experts.row_maps), and dgu comes out of the
dH GEMM (``grouped_mm_dx(gu_R2F=)``). Checked under the interpreter against the same layer on the same
kernels regrouping with index_select and storing dH for a SwiGLU backward launch: the output, the
input gradient and every parameter gradient bit for bit, in both layouts (GPT-OSS's with biases) and
chunked, and four index_select fewer per experts call (two forward, two backward).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lancet_rt
from lancet_rt.moe import experts as experts_mod


class _IndexSelects(TorchDispatchMode):
    """Counts aten.index_select calls."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_select.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _moe(layout: str):
    torch.manual_seed(0)
    moe = lancet_rt.MoE(32, 24, 8, 2, ep_group=lancet_rt.EmulatedGroup(4, float("inf"), 0.0))
    if layout == "gpt_oss":
        e = moe.experts
        moe.experts = experts_mod.Experts(e.num_local_experts, e.d_model, e.d_ffn, layout="gpt_oss")
        with torch.no_grad():
            for b in (moe.experts.gate_up_proj_bias, moe.experts.down_proj_bias):
                b.normal_(std=0.1)
    return moe


def _step(moe, chunks: int):
    x = torch.randn(45, 32, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    runner = lancet_rt.Overlapped(moe, chunks=chunks) if chunks > 1 else moe
    counter = _IndexSelects()
    with counter:
        y = runner(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
    return y.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters()}, counter.count


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("layout", ["lancet", "gpt_oss"])
def test_row_maps_are_exact_and_replace_index_select(layout, chunks, monkeypatch):
    monkeypatch.setenv("LANCET_KERNELS", "triton")  # the interpreter on CPU (tests/conftest.py)
    mapped = _step(_moe(layout), chunks)
    calls = []
    real = experts_mod.triton_gemms

    def spied(ops):
        calls.append(real(ops))
        return False  # index_select and the unfused dH -> dgu around the same kernels

    monkeypatch.setattr(experts_mod, "triton_gemms", spied)
    regrouped = _step(_moe(layout), chunks)
    assert calls and all(calls), "the Triton path takes row maps and fuses dgu"
    assert torch.equal(mapped[0], regrouped[0]) and torch.equal(mapped[1], regrouped[1])
    assert mapped[2].keys() == regrouped[2].keys()
    for n, g in regrouped[2].items():
        assert torch.equal(mapped[2][n], g), f"grad {n}"
    # per experts call: forward x and y, backward dY and dX (GPT-OSS's down bias gradient, a segment
    # sum over grouped rows, still regroups dY)
    saved = 4 * chunks - (chunks if layout == "gpt_oss" else 0)
    assert regrouped[3] - mapped[3] == saved, (regrouped[3], mapped[3])


def test_no_row_maps_on_the_cpu_path(monkeypatch):
    monkeypatch.delenv("LANCET_KERNELS", raising=False)
    from lancet_rt import ops as ops_mod

    ops = ops_mod.get_ops(torch.device("cpu"), torch.float32)
    assert not experts_mod.row_maps(ops, torch.arange(3))
