"""Hot-expert shadowing on the asymmetric emulated link: the choice and the timeline, hand-computed."""

import pytest
import torch

import lancet_rt
from lancet_rt.comm.emulated_skew import SkewedGroup, port_rows
from lancet_rt.moe.dispatch.shadow import HOT_LOAD, fetch_bytes, hot_experts
from tests.helpers import assert_close


def test_hot_experts_by_the_busiest_port():
    # 3 ranks, one expert each, every rank keeps [2, 6, 1] rows: loads 6, 18, 3 (mean 9; 18 > 1.25 x 9).
    # Ports (rows off rank, sent / received): sent 9 - own = [7, 3, 8], received [4, 12, 2] -> busiest 12.
    # Without expert 1: sent [1, 3, 2], received [4, 0, 2] -> busiest 4; dispatch + combine save
    # 2 x (12 - 4) = 16 rows per chunk.
    loads = [[2, 6, 1]] * 3
    assert port_rows([2, 6, 1], 3) == 12 and port_rows([2, 0, 1], 3) == 4  # the link's own port model agrees
    assert hot_experts(loads, 2, 1, row_bytes=16, fetch_bytes=16 * 16, chunks=1) == [1]
    assert hot_experts(loads, 2, 1, row_bytes=16, fetch_bytes=16 * 16 + 1, chunks=1) == []  # the fetch costs more
    assert hot_experts(loads, 2, 1, row_bytes=16, fetch_bytes=16 * 16 + 1, chunks=2) == [1]  # over two chunks it pays
    assert hot_experts(loads, 0, 1, row_bytes=16, fetch_bytes=1, chunks=1) == []
    # Expert 0 (6 rows, below 1.25 x the mean) is never chosen for its load, but once fetched it stays shadowed.
    assert 6 * 3 <= HOT_LOAD * 27
    assert hot_experts(loads, 2, 1, row_bytes=16, fetch_bytes=1, chunks=1, fetched=[0]) == [0, 1]
    assert hot_experts(loads, 1, 1, row_bytes=16, fetch_bytes=1, chunks=1, fetched=[0]) == [0]
    assert hot_experts([[0, 0, 0]] * 3, 2, 1, row_bytes=16, fetch_bytes=1, chunks=1) == []


def test_real_ranks_differ_and_all_agree():
    # Ranks that route differently: the decision reads every rank's row, so it is one list for all.
    loads = [[5, 0, 0, 1], [4, 1, 0, 0], [6, 0, 1, 0], [5, 0, 0, 0]]  # expert 0 (rank 0, L = 1) is hot: 20 of 23
    # received by rank 0 off rank: 15 rows; without expert 0 the busiest port is rank 1, 2 or 3's 1 row.
    assert hot_experts(loads, 1, 1, row_bytes=1, fetch_bytes=2 * (15 - 1), chunks=1) == [0]
    assert hot_experts(loads, 1, 1, row_bytes=1, fetch_bytes=2 * (15 - 1) + 1, chunks=1) == []


def test_fetch_bytes():
    assert fetch_bytes(lancet_rt.EmulatedGroup(4), 1000) == 1000.0  # a broadcast: once through each port

    class AllReduceOnly:
        size = 4

        def all_reduce(self, t, op="sum"):
            raise AssertionError

    assert fetch_bytes(AllReduceOnly(), 1000) == pytest.approx(1500.0)  # a ring all-reduce: 2 (W - 1) / W


def test_shadowed_timeline():
    # The shadow path's collectives on the 3-rank link of tests/comm/test_emulated_skew.py (1 row of 16
    # bytes = 1 ms, latency 1 ms, 20 ms of experts per row): the broadcast of 8 rows' worth of weights,
    # then the dispatch without the hot expert's rows ([2, 6, 1] -> [2, 0, 1]: port 4 rows), then its
    # return, which waits for the hot rank's 3 x 2 = 6 rows (120 ms; 18 rows, 360 ms, unshadowed), then
    # the gradient's reduce.
    D = 4
    g = SkewedGroup(3, bandwidth_gbps=16e-6, latency_us=1000.0, expert_ms_per_row=20.0)
    w = torch.randn(8, D)
    bc = g.broadcast(w.clone(), 1)
    assert bc.end - bc.start == pytest.approx(9e-3)  # latency + 8 rows
    x = torch.randn(3, D)
    a = g.all_to_all(torch.empty_like(x), x, [2, 0, 1], [2, 0, 1])
    assert a.start == pytest.approx(bc.end)
    assert a.end - a.start == pytest.approx(5e-3)  # latency + 4 rows (the unshadowed dispatch: 13 ms)
    b = g.all_to_all(torch.empty_like(x), x, [2, 0, 1], [2, 0, 1])
    assert b.start == pytest.approx(a.end + 6 * 20e-3)
    grad = torch.randn(8, D)
    red = g.reduce(grad, 1, "avg")
    assert red.start == pytest.approx(b.end) and red.end - red.start == pytest.approx(9e-3)
    red.wait()
    assert g.modeled_ms == pytest.approx(9 + 5 + 5 + 9)
    summed = torch.ones(2)
    g.reduce(summed, 0, "sum").wait()
    assert torch.equal(summed, torch.full((2,), 3.0))  # by symmetry, as all_reduce: W x tensor
    with pytest.raises(ValueError, match="op"):
        g.reduce(summed, 0, "max")


def _step(group, shadow, chunks):
    torch.manual_seed(0)
    moe = lancet_rt.MoE(16, d_ffn=24, num_experts=8, top_k=2, ep_group=group, shadow_experts=shadow)
    with torch.no_grad():
        moe.router.weight[3] += 3.0  # expert 3 hot
        moe.router.weight[6] += 1.0
    x = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = lancet_rt.Overlapped(moe, chunks=chunks)(x) if chunks > 1 else moe(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
    return moe, y.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters()}


@pytest.mark.parametrize("chunks", [1, 4])
def test_shadowing_on_the_skewed_link_is_exact_and_moves_fewer_bytes(chunks):
    # Rank 0's data stays symmetric on the emulated link, so shadowing changes no number there; the link
    # carries fewer bytes (the hot port) plus the fetches, per step.
    links = [SkewedGroup(8, bandwidth_gbps=1.0, latency_us=0.0) for _ in range(2)]
    plain, y0, gx0, g0 = _step(links[0], 0, chunks)
    shadowed, y1, gx1, g1 = _step(links[1], 2, chunks)
    assert 3 in shadowed.shadowed
    assert torch.equal(y1, y0)
    assert torch.equal(gx1, gx0)
    for name in g0:
        assert_close(f"grad {name}", g1[name], g0[name], rel_rms=1e-6)
    assert plain.tokens_per_expert.tolist() == shadowed.tokens_per_expert.tolist()
    # Each shadowed expert: one broadcast and one reduce per step, whatever the chunk count.
    assert links[1].transfers == links[0].transfers + 2 * len(shadowed.shadowed)
    assert links[1].modeled_ms < links[0].modeled_ms
    assert links[1].skew_ms < links[0].skew_ms


def test_balanced_routing_shadows_nothing():
    g = SkewedGroup(4, bandwidth_gbps=1.0, latency_us=0.0)
    moe = lancet_rt.MoE(16, d_ffn=24, num_experts=4, top_k=1, ep_group=g, shadow_experts=2)
    one_hot = 10.0 * torch.nn.functional.one_hot(torch.arange(64) % 4, 4)  # token t -> expert t % 4
    handle = moe.router.register_forward_hook(lambda m, a, out: out + one_hot)
    with torch.no_grad():
        moe(torch.randn(64, 16))
    handle.remove()
    assert moe.tokens_per_expert.tolist() == [16, 16, 16, 16]
    assert moe.shadowed == []
    assert g.transfers == 3  # the counts, the dispatch and the combine: no fetch
