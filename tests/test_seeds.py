"""The seed systems: PPMoE's all-reduce dispatch, DynaPipe-style balanced chunks, dPRO-style replay."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

import lancet_rt
from bench.model import MoEBlocks
from bench.varlen import VarlenBlocks, cu_seqlens_of, skewed_lengths
from lancet_rt.schedule.balance import BalancedChunks, balanced_bounds, transformer_costs
from tests.contract_ref import moe_contract_ref
from tests.dist import assert_all_ok, run_ranks
from tests.helpers import assert_close

D = 16


def _run(model, runner, inputs: tuple, kwargs: dict, g):
    x = inputs[0].clone().requires_grad_(True)
    y = runner(x, *inputs[1:], **kwargs)
    y.backward(g)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads, [(m.aux_loss, m.z_loss, m.dropped) for m in model.moe_layers()]


def _assert_same(ref, got, what=""):
    assert_close(f"{what}y", got[0], ref[0])
    assert_close(f"{what}grad x", got[1], ref[1])
    assert ref[2].keys() == got[2].keys()
    for n in ref[2]:
        assert_close(f"{what}grad {n}", got[2][n], ref[2][n])
    for (a0, z0, d0), (a1, z1, d1) in zip(ref[3], got[3]):
        assert_close(f"{what}aux", a1.reshape(1), a0.reshape(1))
        assert_close(f"{what}z", z1.reshape(1), z0.reshape(1))
        assert d0 == d1


# ------------------------------------------------------------------------------ balanced chunks
def test_balanced_bounds_properties():
    costs = [9.0, 1.0, 1.0, 7.0, 0.0, 2.0, 3.0, 3.0, 1.0]
    for n in (1, 2, 3, 4, 9):
        b = balanced_bounds(costs, n)
        assert len(b) == n + 1 and b[0] == 0 and b[-1] == len(costs)
        assert all(x < y for x, y in zip(b, b[1:])), b  # every chunk gets an item (9 items >= n)
        chunk = [sum(costs[x:y]) for x, y in zip(b, b[1:])]
        assert max(chunk) - sum(costs) / n <= max(costs), (n, chunk)
    assert balanced_bounds([5.0, 5.0, 5.0, 5.0], 2) == [0, 2, 4]
    assert balanced_bounds([1.0, 1.0, 1.0, 100.0], 3) == [0, 2, 3, 4]
    assert balanced_bounds([1.0, 2.0], 4) == [0, 1, 2, 2, 2]          # fewer items than chunks: as tensor_split
    assert balanced_bounds([0.0] * 7, 3) == [0, 3, 5, 7]                # no cost: equal counts
    assert balanced_bounds([0.0, 0.0, 6.0, 1.0, 1.0], 3, nonempty_first=[0, 0, 6, 1, 1])[1] == 3  # chunk 0 holds a token


def test_balanced_chunks_packed_equals_model():
    """Packed sequences of skewed lengths, cut at cost-balanced sequence boundaries: outputs, drops,
    aux/z losses and every gradient equal the unchunked model's (capacity carried across uneven chunks)."""
    torch.manual_seed(0)
    model = VarlenBlocks(1, D, 2, dict(d_ffn=12, num_experts=4, top_k=2, capacity_factor=0.75,
                                       aux_loss_coef=0.01, z_loss_coef=0.001))
    twin = copy.deepcopy(model)
    lengths = skewed_lengths(9, 24, seed=1)
    cu = cu_seqlens_of(lengths)
    x, g = torch.randn(sum(lengths), D), torch.randn(sum(lengths), D)
    balance = BalancedChunks(cu_seqlens="cu_seqlens", **transformer_costs(D, 12, 2))
    bounds = balanced_bounds(balance.costs(lengths), 3, nonempty_first=lengths)
    assert bounds != [0, 3, 6, 9], "the skewed batch must cut other than equal sequence counts"
    ov = lancet_rt.Overlapped(twin, chunks=3, defer_wgrad=True, balance=balance)
    _assert_same(_run(model, model, (x, cu), {}, g), _run(twin, ov, (x,), dict(cu_seqlens=cu), g))
    assert sum(m.dropped for m in twin.moe_layers()) > 0, "the capacity case must drop"


def test_a_chunk_with_every_assignment_dropped():
    """Uneven chunks make it likelier that capacity is spent before the last chunks: a chunk whose
    every assignment is dropped (no rows at all) equals the unchunked run (the PyTorch references
    once read row 0 of an empty tensor there)."""
    torch.manual_seed(0)
    model = MoEBlocks(1, D, 2, dict(d_ffn=8, num_experts=2, top_k=1, capacity_factor=0.05))
    twin = copy.deepcopy(model)
    x, g = torch.randn(8, 4, D), torch.randn(8, 4, D)
    _assert_same(_run(model, model, (x,), {}, g), _run(twin, lancet_rt.Overlapped(twin, chunks=4), (x,), {}, g))
    assert twin.moe_layers()[0].dropped >= 30


class _Masked(nn.Module):
    """A padded batch and its mask (positional): the blocks see the masked tokens."""

    def __init__(self):
        super().__init__()
        self.body = MoEBlocks(1, D, 2, dict(d_ffn=8, num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01))

    def forward(self, x_BSD, mask_BS):
        return self.body(x_BSD * mask_BS.unsqueeze(-1))

    def moe_layers(self):
        return self.body.moe_layers()


@pytest.mark.parametrize("chunks", [2, 5])
def test_balanced_chunks_mask_equals_model(chunks):
    model = _Masked()
    twin = copy.deepcopy(model)
    mask = torch.zeros(6, 7)
    for i, n in enumerate([7, 7, 6, 2, 1, 1]):
        mask[i, :n] = 1
    x, g = torch.randn(6, 7, D), torch.randn(6, 7, D)
    ov = lancet_rt.Overlapped(twin, chunks=chunks, balance=BalancedChunks(mask=1, per_token_pair=1.0))
    _assert_same(_run(model, model, (x, mask), {}, g), _run(twin, ov, (x, mask), {}, g))


def test_balanced_chunks_rejects_bad_arguments():
    with pytest.raises(ValueError, match="exactly one of mask= and cu_seqlens="):
        BalancedChunks()
    with pytest.raises(TypeError, match="mask"):
        BalancedChunks(mask=1.5)
    with pytest.raises(ValueError, match="per_token_pair"):
        BalancedChunks(mask=0, per_token_pair=-1.0)
    with pytest.raises(TypeError, match="balance"):
        lancet_rt.Overlapped(_Masked(), balance="tokens")
    model = _Masked()
    x, mask = torch.randn(4, 3, D), torch.ones(4, 3)
    with pytest.raises(ValueError, match="keyword argument"):
        lancet_rt.Overlapped(model, chunks=2, balance=BalancedChunks(mask="attention_mask"))(x, mask)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        lancet_rt.Overlapped(VarlenBlocks(1, D, 2, dict(d_ffn=8, num_experts=4, top_k=2)), chunks=2,
                             balance=BalancedChunks(cu_seqlens=1))(torch.randn(5, D), torch.tensor([0, 2, 4]))


# ----------------------------------------------------------------------------------------- replay
def _synthetic_trace():
    """One layer, two chunks, every span placed by hand (times in us; stage durations in ms below)."""
    ev = []

    def span(name, tid, t0, t1, **args):
        ev.append(dict(name=name, ph="X", pid=0, tid=tid, ts=t0 * 1e3, dur=(t1 - t0) * 1e3, args=args))

    span("tracing", "tracing", 0, 40)
    lay = dict(layer="moe")
    # chunk 0: pre 0-2, route 2-3, (switch) | wait 5-6, permute 6-7, dispatch 7-7.5 | wait 10-11, experts,
    # combine end 13 | wait 14-15, unpermute 15-16, tail 16-17
    span("chunk 0", "compute", 0, 3.5, chunk=0)
    span("route", "compute", 2, 3, chunk=0, tokens=6, **lay)
    span("chunk 1", "compute", 3.6, 5, chunk=1)
    span("route", "compute", 4, 5, chunk=1, tokens=4, **lay)
    span("chunk 0", "compute", 5, 7.6, chunk=0)
    span("wait", "wait", 5, 6, chunk=0)
    span("permute", "compute", 6, 7, chunk=0, **lay)
    span("dispatch", "compute", 7, 7.5, rows=12, **lay)
    span("chunk 1", "compute", 7.6, 9.6, chunk=1)
    span("permute", "compute", 7.7, 8.5, chunk=1, **lay)
    span("dispatch", "compute", 8.5, 9.5, rows=8, **lay)
    span("chunk 0", "compute", 10, 13.1, chunk=0)
    span("wait", "wait", 10, 11, chunk=0)
    span("experts", "compute", 11, 12.5, rows=12, **lay)
    span("combine", "compute", 12.5, 13, rows=12, **lay)
    span("chunk 1", "compute", 13.1, 14, chunk=1)
    span("experts", "compute", 13.1, 13.5, rows=8, **lay)
    span("combine", "compute", 13.5, 14, rows=8, **lay)
    span("chunk 0", "compute", 14, 17, chunk=0)
    span("wait", "wait", 14, 15, chunk=0)
    span("unpermute", "compute", 15, 16, chunk=0, **lay)
    span("chunk 1", "compute", 17, 18, chunk=1)
    span("unpermute", "compute", 17, 17.5, chunk=1, **lay)
    # backward 18-40: unpermute bwd x2 (2 ms), experts bwd x2 (6 ms), waits 4 ms, untraced 10 ms
    span("unpermute bwd", "compute", 19, 20, chunk=1)
    span("unpermute bwd", "compute", 20, 21, chunk=0)
    span("wait", "wait", 21, 23, chunk=1)
    span("experts bwd", "compute", 23, 26, chunk=1)
    span("wait", "wait", 26, 28, chunk=0)
    span("experts bwd", "compute", 28, 31, chunk=0)
    for t0, nbytes in [(3, 0), (5, 0), (7.5, 1200), (9.5, 800), (13, 1200), (14, 800),
                       (21, 800), (23, 1200), (26, 800), (31, 1200)]:
        span("all_to_all" if nbytes else "exchange", "link", t0, t0 + 0.02 + nbytes / 1e3, bytes=nbytes)
    return ev


def test_replay_parses_a_trace_by_stage():
    from lancet_rt.autotune.replay import parse_trace

    s = parse_trace(_synthetic_trace())
    assert (s.chunks, s.layers, s.tokens) == (2, ["moe"], [6, 4])
    f = {k: [round(v, 6) for v in vals] for k, vals in s.forward.items()}
    assert f[(0, "pre")] == [2.0, 0.4] and f[(0, "route")] == [1.0, 1.0]
    assert f[(0, "permute")] == [1.5, 0.9]         # 3-3.5 and 6-7 (the 5-6 wait is not work); 7.6-8.5
    assert f[(0, "issue")] == [0.5, 1.0]
    assert f[(0, "experts")] == [2.1, 1.0]         # 7.5-7.6, 11-13; 9.5-9.6, 13.1-14
    assert f[(0, "post")] == [1.1, 0.5] and f[(-1, "tail")] == [1.0, 0.5]
    assert math.isclose(s.forward_ms, 18.0) and math.isclose(s.forward_waits_ms, 3.0)
    assert math.isclose(s.glue_ms, 18.0 - 3.0 - sum(map(sum, s.forward.values())))
    assert s.bytes[(0, "dispatch")] == [1200, 800] and s.bytes[(0, "combine")] == [1200, 800]
    assert {k: round(v, 6) for k, v in s.backward.items()} == dict(post=2.0, experts=6.0, dw=0.0, rest=10.0)
    assert not s.deferred and math.isclose(s.step_ms, 40.0)
    with pytest.raises(ValueError, match="one step"):
        parse_trace(_synthetic_trace() + [e for e in _synthetic_trace() if e["name"] == "route"])
    # Between traced chunk counts stage totals are interpolated, beyond them extended (ratios held).
    from lancet_rt.autotune.replay import _interp
    assert [_interp({2: 10.0, 8: 22.0}, n, extend=True) for n in (1, 2, 4, 8, 10)] == [8.0, 10.0, 14.0, 22.0, 26.0]
    assert [_interp({2: 10.0, 8: 22.0}, n) for n in (1, 5, 10)] == [10.0, 16.0, 22.0]
    assert _interp({4: 3.0}, 1, extend=True) == 3.0
    with pytest.raises(ValueError, match="extent"):
        parse_trace([e for e in _synthetic_trace() if e["tid"] != "tracing"])


def _record(link, model, n, x, g, defer=False):
    ov = lancet_rt.Overlapped(model, chunks=n, defer_wgrad=defer)
    ov(x).backward(g)
    with lancet_rt.tracing() as tr:
        ov(x).backward(g)
    return tr


def test_replay_of_a_recorded_step(tmp_path):
    """The deterministic parts of a replay of a real trace: stage attribution conserves the traced
    work, the replay runs Overlapped's own schedule (as many chunk segments as traced), its link time
    is the link model over the right transfers, and it is monotone in the bandwidth."""
    from lancet_rt.autotune.replay import build_profile, main, parse_trace, replay

    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.05, latency_us=500)
    torch.manual_seed(0)
    model = MoEBlocks(2, D, 2, dict(d_ffn=12, num_experts=8, top_k=2, capacity_factor=1.0, ep_group=link))
    x, g = torch.randn(6, 5, D), torch.randn(6, 5, D)
    tr = _record(link, model, 3, x, g)
    link.reset()
    s = parse_trace(tr)
    assert (s.chunks, len(s.layers), sum(s.tokens)) == (3, 2, 30)
    work = sum(map(sum, s.forward.values())) + s.glue_ms
    assert math.isclose(work + s.forward_waits_ms, s.forward_ms, rel_tol=1e-9)
    assert math.isclose(sum(s.backward.values()) + s.backward_waits_ms, s.step_ms - s.forward_ms, rel_tol=1e-9)
    # Forward a2a bytes of one step equal what the link counted for a forward alone.
    model_fwd = lancet_rt.Overlapped(model, chunks=3)
    with torch.no_grad():
        model_fwd(x)
    fwd_bytes = link.off_rank_bytes
    assert sum(map(sum, s.bytes.values())) == fwd_bytes

    p = build_profile([s])
    same = replay(p, 3, 0.05, 0.5)
    assert same.segments == s.segments
    assert math.isclose(same.compute_ms, work + sum(s.backward.values()), rel_tol=1e-9)
    L = 2
    for n in (1, 2, 4):
        q = replay(p, n, 0.05, 0.5)
        # per layer and chunk: the counts exchange and four all-to-alls, each 0.5 ms + its bytes at 50 MB/s
        assert math.isclose(q.comm_ms, L * n * 5 * 0.5 + 2 * fwd_bytes / 0.05e6, rel_tol=1e-9)
        assert q.step_ms >= max(q.compute_ms, q.comm_ms) - 1e-9
        free = replay(p, n, math.inf, 0.0)
        assert math.isclose(free.step_ms, free.compute_ms, rel_tol=1e-9)
        assert replay(p, n, 0.01, 0.5).step_ms >= q.step_ms >= replay(p, n, 1.0, 0.5).step_ms
        own = replay(p, n, 0.05, 0.5, counts_channel="own")  # the counts' latency leaves the link
        assert math.isclose(own.comm_ms, q.comm_ms - L * n * 0.5, rel_tol=1e-9) and own.step_ms <= q.step_ms + 1e-9
    with pytest.raises(ValueError, match="counts_channel"):
        replay(p, 2, 0.05, 0.5, counts_channel="separate")
    # Deferred dW: traced in the windows and the flush, replayed from a pool that the waits drain.
    sd = parse_trace(_record(link, copy.deepcopy(model), 2, x, g, defer=True))
    pd = build_profile([sd])
    assert sd.deferred and sd.backward["dw"] > 0 and pd.dw(2) > 0
    assert math.isclose(replay(pd, 2, 0.05, 0.5).compute_ms,
                        sum(map(sum, sd.forward.values())) + sd.glue_ms + sum(sd.backward.values()), rel_tol=1e-9)
    path = tmp_path / "t.json"
    tr.save(str(path))
    preds = main([str(path), "--chunks", "1,2", "--bandwidth-gbps", "0.05,1", "--json", str(tmp_path / "p.json")])
    assert [(q.chunks, q.gbps) for q in preds] == [(1, 0.05), (2, 0.05), (1, 1.0), (2, 1.0)]
    assert len(json.loads((tmp_path / "p.json").read_text())) == 4


# --------------------------------------------------------------------------- PPMoE all-reduce dispatch
def _allreduce_matches(rank, world):
    """dispatcher="allreduce" on 2 gloo ranks with the same tokens: every output, loss and gradient
    equals the unsharded layer's (and the contract's); chunked under Overlapped too; other tokens on
    one rank raise on both."""
    import torch.distributed as dist

    out = []
    for K, cf, score_fn, aux in [(2, None, "softmax", 0.0), (2, 0.75, "sigmoid", 0.01)]:
        kw = dict(capacity_factor=cf, score_fn=score_fn, aux_loss_coef=aux, z_loss_coef=aux / 10)
        torch.manual_seed(0)
        full = lancet_rt.MoE(D, 6, 4, K, **kw)
        ar = lancet_rt.MoE(D, 6, 4, K, ep_group=dist.group.WORLD, dispatcher="allreduce", **kw)
        L = 4 // world
        sl = slice(rank * L, (rank + 1) * L)
        with torch.no_grad():
            ar.router.weight.copy_(full.router.weight)
            ar.experts.gate_up_proj.copy_(full.experts.gate_up_proj[sl])
            ar.experts.down_proj.copy_(full.experts.down_proj[sl])
        gen = torch.Generator().manual_seed(7)  # the same tokens on every rank
        x, g = torch.randn(23, D, generator=gen), torch.randn(23, D, generator=gen)
        ref = _run_moe(full, x, g)
        got = _run_moe(ar, x, g)
        for name, a, b in zip(("y", "grad x", "grad router"), got[:3], ref[:3]):
            assert_close(name, a, b)
        assert_close("grad gate_up", got[3], ref[3][sl])
        assert_close("grad down", got[4], ref[4][sl])
        assert_close("aux", ar.aux_loss.reshape(1), full.aux_loss.reshape(1))
        assert_close("z", ar.z_loss.reshape(1), full.z_loss.reshape(1))
        assert ar.dropped == full.dropped and torch.equal(ar.tokens_per_expert, full.tokens_per_expert)
        xd = x.double().requires_grad_(True)
        y_c, aux_c, z_c, _, dropped_c = moe_contract_ref(
            xd, full.router.weight.double(), full.experts.gate_up_proj.double(), full.experts.down_proj.double(),
            top_k=K, capacity_factor=cf, score_fn=score_fn)
        assert_close("y vs contract", got[0], y_c.float())
        assert dropped_c == ar.dropped and math.isclose(ar.aux_loss.item(), aux_c.item(), rel_tol=1e-5)
        out.append(ar.dropped)

    # Chunked: Overlapped around attention + MoE blocks with the all-reduce dispatcher.
    torch.manual_seed(1)
    model = MoEBlocks(2, D, 2, dict(d_ffn=12, num_experts=4, top_k=2, capacity_factor=0.75, aux_loss_coef=0.01,
                                    z_loss_coef=0.001, ep_group=dist.group.WORLD, dispatcher="allreduce"))
    torch.manual_seed(10 + rank)  # each rank its own experts
    for m in model.moe_layers():
        m.experts.reset_parameters()
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(5, 4, D, generator=gen), torch.randn(5, 4, D, generator=gen)
    _assert_same(_run(model, model, (x,), {}, g),
                 _run(twin, lancet_rt.Overlapped(twin, chunks=3, defer_wgrad=True), (x,), {}, g), "overlapped ")
    out.append(sum(m.dropped for m in twin.moe_layers()))

    # Other tokens on one rank: every rank raises instead of hanging in the all-reduce.
    try:
        full_ar = lancet_rt.MoE(D, 6, 4, 2, ep_group=dist.group.WORLD, dispatcher="allreduce")
        full_ar(torch.randn(9, D, generator=torch.Generator().manual_seed(rank)))
        out.append("no error")
    except ValueError as exc:
        out.append(str(exc))
    # A rejected input on one rank (the wrong width): the other raises too.
    try:
        full_ar(torch.randn(9, D + 1 if rank else D))
        out.append("no error")
    except ValueError as exc:
        out.append(str(exc))
    return out


def _run_moe(moe, x, g):
    x = x.clone().requires_grad_(True)
    y = moe(x)
    y.backward(g)
    return y.detach(), x.grad, moe.router.weight.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad


def test_allreduce_dispatch_equals_contract_on_two_ranks():
    results = assert_all_ok(run_ranks(_allreduce_matches, 2, timeout=120))
    for r in results:
        assert r[1] > 0 and r[2] > 0, "the capacity cases must drop"
        assert "same on every rank" in r[3], r[3]
    assert "d_model=16" in results[1][4] and "rejected on expert-parallel rank(s) [1]" in results[0][4], results


def test_allreduce_dispatch_on_the_emulated_link():
    """One process as rank 0 of W: it computes only its experts' rows, and the link carries a ring
    all-reduce of the output [T, D] per layer and chunk (2 (W-1)/W x bytes) and the two backward
    all-reduces (x's and the routing weights' gradients), plus the counts exchanges."""
    W, T = 4, 24
    link = lancet_rt.EmulatedGroup(W, bandwidth_gbps=math.inf)
    moe = lancet_rt.MoE(D, 8, 8, 2, ep_group=link, dispatcher="allreduce")
    x = torch.randn(T, D, requires_grad=True)
    y = moe(x)
    assert link.transfers == 2 and link.off_rank_bytes == 2 * (W - 1) * T * D * 4 // W
    y.backward(torch.randn_like(y))
    assert link.transfers == 4
    assert link.off_rank_bytes == 2 * (W - 1) * T * D * 4 // W * 2 + 2 * (W - 1) * T * 2 * 4 // W
    with pytest.raises(ValueError, match="dispatcher"):
        lancet_rt.MoE(D, 8, 8, 2, dispatcher="ring")
    with pytest.raises(ValueError, match="pipeline_chunks"):
        lancet_rt.MoE(D, 8, 8, 2, ep_group=link, dispatcher="allreduce", pipeline_chunks=2)
