"""The experts' two dW GEMMs in one launch (``weight_gradients`` on the Triton GEMMs): where both weight
gradients are needed, one ``grouped_mm_dw_pair`` call (writing, or adding into the running sums), with
the bits of the two ``grouped_mm_dw`` calls it replaces; one single call where only one is needed; the
CPU backend's two calls unchanged. Both layouts, with and without a row map."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lancet_rt.kernels import grouped_gemm as gg

from lancet_rt import ops as ops_mod
from lancet_rt.moe.experts import weight_gradients

E, D, F = 3, 20, 12
COUNTS = [7, 0, 11]


def _counted(ns, calls: list) -> SimpleNamespace:
    """``ns`` with its dW launchers recording their names."""

    def spy(name):
        fn = getattr(ns, name)
        return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    return SimpleNamespace(**{**vars(ns), **{n: spy(n) for n in ("grouped_mm_dw", "grouped_mm_dw_pair")}})


def _operands(gen, dtype):
    R = sum(COUNTS)
    t = lambda *s: torch.randn(*s, generator=gen).to(dtype)
    off = torch.tensor([0, *torch.tensor(COUNTS).cumsum(0).tolist()], dtype=torch.int32)
    return t(R, D), t(R, F), t(R, 2 * F), t(R, D), off, torch.randperm(R, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["lancet", "gpt_oss"])
@pytest.mark.parametrize("mapped", [False, True], ids=["grouped", "row_map"])
def test_one_launch_for_both_dw_with_the_two_launches_bits(mapped, gpt_oss, dtype, monkeypatch, gen):
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    ns = ops_mod.get_ops(torch.device("cpu"), dtype)
    x, h, dgu, dy, off, rows = _operands(gen, dtype)
    rows = rows if mapped else None
    needs = (True, True, False, False)
    calls: list = []
    launched: list = []  # the kernel launches: the pair's one, written or added, mapped or not
    launch = gg._launch_gemm
    monkeypatch.setattr(gg, "_launch_gemm", lambda op, *a, **k: (launched.append(op), launch(op, *a, **k))[1])
    got = weight_gradients(_counted(ns, calls), gpt_oss, x, h, dgu, dy, off, needs, rows)
    assert calls == ["grouped_mm_dw_pair"] and launched == ["dw_pair"]
    # the two launches of before: gate_up's, then down's
    maps = (dict(dy_rows=rows), dict(x_rows=rows)) if gpt_oss else (dict(x_rows=rows), dict(dy_rows=rows))
    maps = maps if mapped else ({}, {})
    gu_args, down_args = ((x, dgu), (h, dy)) if gpt_oss else ((dgu, x), (dy, h))
    want = (ns.grouped_mm_dw(*gu_args, off, **maps[0]), ns.grouped_mm_dw(*down_args, off, **maps[1]))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2:] == (None, None)
    # the chunks' running sums: both added into, in one launch, as PyTorch's a + b
    into = tuple(torch.randn(g.shape, generator=gen).to(dtype) for g in got[:2])
    sums = tuple(t.clone() for t in into)
    calls.clear()
    launched.clear()
    added = weight_gradients(_counted(ns, calls), gpt_oss, x, h, dgu, dy, off, needs, rows, into=into)
    assert calls == ["grouped_mm_dw_pair"] and launched == ["dw_pair"]
    assert added[0] is into[0] and added[1] is into[1]
    assert torch.equal(added[0], sums[0] + want[0]) and torch.equal(added[1], sums[1] + want[1])
    # one weight frozen: its single launch, as before
    for needs, name in (((True, False, False, False), 0), ((False, True, False, False), 1)):
        calls.clear()
        one = weight_gradients(_counted(ns, calls), gpt_oss, x, h, dgu, dy, off, needs, rows)
        assert calls == ["grouped_mm_dw"] and torch.equal(one[name], want[name]) and one[1 - name] is None


def test_the_cpu_backend_keeps_its_two_calls(monkeypatch, gen):
    monkeypatch.delenv("LANCET_KERNELS", raising=False)
    ns = ops_mod.get_ops(torch.device("cpu"), torch.float32)
    assert ns.name == "torch"
    x, h, dgu, dy, _, _ = _operands(gen, torch.float32)
    bounds = [0, *torch.tensor(COUNTS).cumsum(0).tolist()]
    calls: list = []
    got = weight_gradients(_counted(ns, calls), False, x, h, dgu, dy, bounds, (True, True, False, False))
    assert calls == ["grouped_mm_dw", "grouped_mm_dw"]
    assert torch.equal(got[0], ns.grouped_mm_dw(dgu, x, bounds)) and torch.equal(
        got[1], ns.grouped_mm_dw(dy, h, bounds)
    )
