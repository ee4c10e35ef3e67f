"""dPRO-style trace replay (lancet_rt.autotune.replay): parsing a trace by stage and replaying a recorded step."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks

D = 16


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
    for t0, nbytes in [
        (3, 0),
        (5, 0),
        (7.5, 1200),
        (9.5, 800),
        (13, 1200),
        (14, 800),
        (21, 800),
        (23, 1200),
        (26, 800),
        (31, 1200),
    ]:
        span("all_to_all" if nbytes else "exchange", "link", t0, t0 + 0.02 + nbytes / 1e3, bytes=nbytes)
    return ev


def test_replay_parses_a_trace_by_stage():
    from lancet_rt.autotune.replay import parse_trace

    s = parse_trace(_synthetic_trace())
    assert (s.chunks, s.layers, s.tokens) == (2, ["moe"], [6, 4])
    f = {k: [round(v, 6) for v in vals] for k, vals in s.forward.items()}
    assert f[(0, "pre")] == [2.0, 0.4] and f[(0, "route")] == [1.0, 1.0]
    assert f[(0, "permute")] == [1.5, 0.9]  # 3-3.5 and 6-7 (the 5-6 wait is not work); 7.6-8.5
    assert f[(0, "issue")] == [0.5, 1.0]
    assert f[(0, "experts")] == [2.1, 1.0]  # 7.5-7.6, 11-13; 9.5-9.6, 13.1-14
    assert f[(0, "post")] == [1.1, 0.5] and f[(-1, "tail")] == [1.0, 0.5]
    assert math.isclose(s.forward_ms, 18.0) and math.isclose(s.forward_waits_ms, 3.0)
    assert math.isclose(s.glue_ms, 18.0 - 3.0 - sum(map(sum, s.forward.values())))
    assert s.bytes[(0, "dispatch")] == [1200, 800] and s.bytes[(0, "combine")] == [1200, 800]
    assert {k: round(v, 6) for k, v in s.backward.items()} == dict(post=2.0, experts=6.0, dw=0.0, rest=10.0)
    assert not s.deferred and math.isclose(s.step_ms, 40.0)
    with pytest.raises(ValueError, match="one step"):
        parse_trace(_synthetic_trace() + [e for e in _synthetic_trace() if e["name"] == "route"])
    # Between traced chunk counts stage totals are interpolated, beyond them extended (ratios held).
    from lancet_rt.autotune.replay_profile import _interp

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
        assert math.isclose(own.comm_ms, q.comm_ms - L * n * 0.5, rel_tol=1e-9)
        # and, as the runtime on the CPU, a chunk waits for its own channel's counts: no turn there
        assert own.segments == q.segments - (L * n if n > 1 else 0), (own.segments, q.segments)
    with pytest.raises(ValueError, match="counts_channel"):
        replay(p, 2, 0.05, 0.5, counts_channel="separate")
    # A step traced with the counts on their own channel: the replay runs the runtime's schedule.
    own_link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.05, latency_us=500, counts_channel="own")
    own_model = copy.deepcopy(model)
    for m in own_model.moe_layers():
        m.group = own_link
    s_own = parse_trace(_record(own_link, own_model, 3, x, g))
    assert replay(build_profile([s_own]), 3, 0.05, 0.5, counts_channel="own").segments == s_own.segments
    # Deferred dW: traced in the windows and the flush, replayed from a pool that the waits drain.
    sd = parse_trace(_record(link, copy.deepcopy(model), 2, x, g, defer=True))
    pd = build_profile([sd])
    assert sd.deferred and sd.backward["dw"] > 0 and pd.dw(2) > 0
    assert math.isclose(
        replay(pd, 2, 0.05, 0.5).compute_ms,
        sum(map(sum, sd.forward.values())) + sd.glue_ms + sum(sd.backward.values()),
        rel_tol=1e-9,
    )
    path = tmp_path / "t.json"
    tr.save(str(path))
    preds = main([str(path), "--chunks", "1,2", "--bandwidth-gbps", "0.05,1", "--json", str(tmp_path / "p.json")])
    assert [(q.chunks, q.gbps) for q in preds] == [(1, 0.05), (2, 0.05), (1, 1.0), (2, 1.0)]
    assert len(json.loads((tmp_path / "p.json").read_text())) == 4
