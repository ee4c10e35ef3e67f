"""SkewedGroup: the asymmetric emulated link against hand-computed timelines."""

import math

import pytest
import torch

import lancet_rt
from lancet_rt.comm.emulated_skew import SkewedGroup, port_rows


def test_three_rank_skew_timeline():
    # 3 ranks route like rank 0: splits [2, 6, 1] -> rank 1 receives 3 * 6 = 18 rows (the hot rank).
    # Ports (rows): rank 0 max(9-2, 2*2)=7, rank 1 max(9-6, 2*6)=12, rank 2 max(9-1, 2*1)=8 -> 12.
    D = 4  # float32 rows of 16 bytes
    g = SkewedGroup(3, bandwidth_gbps=16e-6, latency_us=1000.0, expert_ms_per_row=20.0)  # 1 row = 1 ms on the wire
    x = torch.arange(9 * D, dtype=torch.float32).view(9, D)
    out = torch.full_like(x, float("nan"))
    splits = [2, 6, 1]
    a = g.all_to_all(out, x, splits, splits)
    assert torch.equal(out, x)  # the data moves as on the symmetric link
    assert a.end - a.start == pytest.approx((1.0 + 12 * 1.0) * 1e-3)  # latency + busiest port, 13 ms
    assert a.start >= a.submitted
    back_in = out * 2
    back = torch.empty_like(back_in)
    b = g.all_to_all(back, back_in, splits, splits)  # the return: waits for the hot rank's 18 rows of experts
    assert torch.equal(back, back_in)
    hot_done = a.end + 18 * 20.0e-3  # 360 ms of experts after the outbound transfer ends (well past any stall)
    assert b.start == pytest.approx(hot_done)
    assert b.end == pytest.approx(hot_done + 13e-3)
    assert g.straggler_ms == pytest.approx((hot_done - max(b.submitted, a.end)) * 1e3, abs=20.0)
    assert g.straggler_ms > 300.0
    # A third transfer with the same splits is outbound again (FIFO pairing): no hold-back.
    c = g.all_to_all(torch.empty_like(x), x, splits, splits)
    assert c.start == pytest.approx(b.end)
    assert g.modeled_ms == pytest.approx(3 * 13.0)
    assert g.transfers == 3
    c.wait()


def test_balanced_splits_match_the_symmetric_link():
    sym = lancet_rt.EmulatedGroup(4, bandwidth_gbps=1.0, latency_us=5.0)
    skw = SkewedGroup(4, bandwidth_gbps=1.0, latency_us=5.0, expert_ms_per_row=0.0)
    x = torch.randn(12, 8)
    for g in (sym, skw):
        g.all_to_all(torch.empty_like(x), x, [3, 3, 3, 3], [3, 3, 3, 3]).wait()
    assert skw.modeled_ms == pytest.approx(sym.modeled_ms)
    assert skw.off_rank_bytes == sym.off_rank_bytes
    assert skw.skew_ms == pytest.approx(0.0)
    assert port_rows([3, 3, 3, 3], 4) == 9
    assert port_rows([1, 9, 1, 1], 4) == 27


def test_bad_arguments():
    with pytest.raises(ValueError, match="expert_ms_per_row"):
        SkewedGroup(2, expert_ms_per_row=-1.0)
    with pytest.raises(ValueError, match="device"):
        SkewedGroup(2, device="meta")
    g = SkewedGroup(2)
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="splits"):
        g.all_to_all(torch.zeros(3, 2), x, [1, 2], [2, 1])


def test_training_step_is_exact_and_slower_under_skew():
    # A real MoE layer on the skewed link: the same outputs and gradients as on the symmetric link.
    torch.manual_seed(0)
    sym = lancet_rt.EmulatedGroup(4, math.inf, 0.0)
    skw = SkewedGroup(4, math.inf, 0.0, expert_ms_per_row=0.0)
    outs = []
    for g in (sym, skw):
        torch.manual_seed(0)
        moe = lancet_rt.MoE(16, d_ffn=32, num_experts=8, top_k=2, ep_group=g)
        x = torch.randn(2, 10, 16, requires_grad=True)
        y = lancet_rt.Overlapped(moe, chunks=2)(x)
        y.sum().backward()
        outs.append((y.detach(), x.grad, moe.experts.gate_up_proj.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert skw.transfers == sym.transfers


def test_free_link_keeps_the_pairing():
    # Steps on a free link (the benchmarks' compute-only timing) hold nothing back and leave no outbound
    # transfer unanswered, so the next step on the real link pairs its own transfers.
    g = SkewedGroup(2, math.inf, 0.0, expert_ms_per_row=5.0)
    x = torch.randn(4, 2)
    for _ in range(2):
        g.all_to_all(torch.empty_like(x), x, [1, 3], [1, 3])
    assert g._outbound == {} and g.straggler_ms == 0.0
    g.bandwidth_gbps, g.latency_us = 1.0, 1.0
    a = g.all_to_all(torch.empty_like(x), x, [1, 3], [1, 3])
    b = g.all_to_all(torch.empty_like(x), x, [1, 3], [1, 3])
    assert b.start == pytest.approx(a.end + 2 * 3 * 5.0e-3)


def test_hot_rank_runs_the_chunks_one_after_another():
    # Two chunks' outbound transfers, then their returns: the hot rank's expert work is serial, so the
    # second return waits for both chunks' work (1 row on the wire = 1 ms; 4 hot rows x 25 ms = 100 ms each).
    g = SkewedGroup(2, bandwidth_gbps=8e-6, latency_us=0.0, expert_ms_per_row=25.0)
    x, y = torch.randn(3, 2), torch.randn(5, 2)
    a0 = g.all_to_all(torch.empty_like(x), x, [1, 2], [1, 2])  # port max(3-1, 1, 3-2, 2) = 2 rows: 2 ms
    a1 = g.all_to_all(torch.empty_like(y), y, [2, 3], [2, 3])  # port 3 rows: 3 ms
    b0 = g.all_to_all(torch.empty_like(x), x, [1, 2], [1, 2])
    b1 = g.all_to_all(torch.empty_like(y), y, [2, 3], [2, 3])
    assert a1.start == pytest.approx(a0.end) and a1.end - a1.start == pytest.approx(3e-3)
    hot0 = a0.end + 2 * 2 * 25e-3  # W * max(splits) = 4 rows
    hot1 = max(a1.end, hot0) + 2 * 3 * 25e-3  # 6 rows, after chunk 0's work
    assert b0.start == pytest.approx(hot0)
    assert b1.start == pytest.approx(max(hot1, b0.end))
    b1.wait()


@pytest.mark.parametrize("order", ["fifo", "ready"])
def test_ready_order_fills_the_straggler_gap(order):
    # A return held back 200 ms for the hot rank, then a ready outbound transfer of another chunk:
    # FIFO queues it behind the held return; "ready" sends it in the gap. The data is the same.
    g = SkewedGroup(2, bandwidth_gbps=8e-6, latency_us=0.0, expert_ms_per_row=50.0, order=order)
    x, y = torch.randn(3, 2), torch.randn(4, 2)
    a = g.all_to_all(torch.empty_like(x), x, [1, 2], [1, 2])  # 2 ms on the wire
    b = g.all_to_all(torch.empty_like(x), x, [1, 2], [1, 2])  # its return: 4 hot rows x 50 ms after a
    out = torch.empty_like(y)
    c = g.all_to_all(out, y, [2, 2], [2, 2])  # another chunk's dispatch, 2 ms
    assert b.start == pytest.approx(a.end + 0.2)
    if order == "fifo":
        assert c.start == pytest.approx(b.end)
    else:
        assert c.start < b.start and c.end <= b.start
        assert c.start == pytest.approx(max(a.end, c.submitted), abs=0.05)
    assert torch.equal(out, y)
    b.wait()
    c.wait()
    with pytest.raises(ValueError, match="order"):
        SkewedGroup(2, order="lifo")
