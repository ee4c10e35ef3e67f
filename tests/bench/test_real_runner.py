"""bench.overlap.real_runner (one process, no link): the real-link benchmark's schedules leave no gradient
behind, and the peers plug in as schedules through bench.peers' interface (a stand-in module here:
the peers themselves come with their own branch), checked equal before they are timed."""

from __future__ import annotations

import copy
import sys
import time
import types

import pytest
import torch

import bench.peers
from bench.overlap import run as overlap
from bench.overlap.real_runner import SCHEDULES, RealRunner, peer_schedules


def _runner():
    args = overlap.parse_args(
        [
            "--quick",
            "--layers",
            "1",
            "--d-model",
            "32",
            "--d-ffn",
            "32",
            "--experts",
            "4",
            "--batch",
            "2",
            "--seq",
            "8",
            "--chunks",
            "2",
        ]
    )
    return RealRunner(args, overlap.sizes(args), None, rank=0)


def test_every_schedule_steps_and_leaves_no_gradient():
    r = _runner()
    assert list(r.steps) == list(SCHEDULES) and r.per_step["accumulate"] == r.microbatches == 2
    for name in SCHEDULES:
        grads = r.outputs(name)
        assert grads and all(torch.isfinite(g).all() for g in grads), name
        marks = []
        r.on_forward_end = lambda: marks.append(any(p.grad is not None for m in r.models for p in m.parameters()))
        r.step(name)
        r.on_forward_end = None
        assert all(p.grad is None for m in r.models for p in m.parameters()), name
        # one forward then one backward: the forward's end is marked once, before any backward (the pass bound's
        # split); accumulate's passes interleave across microbatches: no mark
        assert (r.forward_end is None) == (name == "accumulate") and marks == ([] if name == "accumulate" else [False])
    # the unchunked and the chunked steps compute the same gradients (one process: no link between them)
    seq, ovl = r.outputs("sequential"), r.outputs("overlapped")
    for a, b in zip(seq, ovl):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _stub_peers(monkeypatch, ok: bool, calls: list):
    stub = types.ModuleType("bench.peers.layers")
    stub.PEERS = ("stub", "absent")
    stub.available = lambda peer: peer == "stub"

    def peer_blocks(model, peer, group=None):
        calls.append(("blocks", peer, group))
        return copy.deepcopy(model)

    def check_equal(ours, theirs, x):
        calls.append(("check", tuple(x.shape)))
        return dict(ok=ok, worst=("output", 0.0 if ok else 0.5))

    stub.peer_blocks, stub.check_equal = peer_blocks, check_equal
    monkeypatch.setitem(sys.modules, "bench.peers.layers", stub)
    monkeypatch.setattr(bench.peers, "layers", stub, raising=False)  # (if the real one was imported before)


def test_peers_are_checked_equal_then_timed_as_schedules(monkeypatch):
    calls = []
    _stub_peers(monkeypatch, True, calls)
    r = _runner()
    steps = peer_schedules(r)
    assert list(steps) == ["peer_stub"]  # a peer that does not import is left out
    assert calls == [("blocks", "stub", None), ("check", tuple(r.x.shape))]
    theirs = r.extra_models[-1]
    r.add_schedule("peer_stub", steps["peer_stub"])
    r.step("peer_stub")
    assert all(p.grad is None for p in theirs.parameters())  # its gradients dropped like ours
    steps["peer_stub"]()
    assert any(p.grad is not None for p in theirs.parameters())  # it trained its own copy


def test_a_peer_that_differs_is_not_timed(monkeypatch):
    _stub_peers(monkeypatch, False, [])
    with pytest.raises(RuntimeError, match="stub differs from ours"):
        peer_schedules(_runner())


def test_link_bound_from_the_ports_bytes_and_the_rate():
    """The link's own bound: 20 MB at 160 Mbit/s is 1000 ms, more than Overlapped's 800 ms of compute, so no
    schedule beats sequential 1500 / 1000 = 1.5x, and at that step Overlapped would leave 200 of the 700 ms of
    measured comm exposed (hidden 5/7); where compute is the longer, compute bounds it."""
    from bench.overlap.real_bounds import link_bound

    row = dict(configured_mbit=160.0, overlapped_compute_ms=800.0, sequential_ms=1500.0, comm_ms=700.0)
    got = link_bound(row, 20e6)
    assert got["link_time_ms"] == pytest.approx(1000.0)
    assert got["bound_speedup"] == pytest.approx(1.5)
    assert got["bound_hidden"] == pytest.approx(1 - 200 / 700)
    assert got["step_tx_mb"] == pytest.approx(20.0)
    fast = link_bound(dict(row, configured_mbit=320.0), 20e6)  # 500 ms of link: compute binds
    assert fast["bound_speedup"] == pytest.approx(1500 / 800) and fast["bound_hidden"] == pytest.approx(1.0)
    for missing in (link_bound(dict(row, configured_mbit=None), 20e6), link_bound(row, None)):
        assert missing["bound_speedup"] is None and missing["link_time_ms"] is None


def test_pass_bound_per_schedule_from_each_pass_bytes_and_compute():
    """A step's backward starts after its forward: 10 MB of forward bytes at 160 Mbit/s are 500 ms, more than
    Overlapped's 300 ms forward compute; the backward's 6 MB are 300 ms, less than its 500 ms of compute: the
    bound is 500 + 500 = 1000 ms (where the whole-step bound, max(800, 800), says 800), 1.6x the sequential
    1600 ms; at a 1250 ms step Overlapped is at 0.8 of it. accumulate's bound is the whole step's per
    microbatch, max(its 900 ms compute, 800 ms of link). The sequential step gets none, nor a peer (its
    all-to-alls run on another transport); no rate, nothing."""
    from bench.overlap.real_bounds import pass_bound

    row = dict(configured_mbit=160.0, sequential_ms=1600.0, comm_ms=800.0, sequential_compute_ms=800.0)
    row.update(overlapped_ms=1250.0, overlapped_compute_ms=800.0, overlapped_forward_compute_ms=300.0)
    row.update(hidden_overlapped=1 - 450 / 800, sequential_forward_compute_ms=250.0)
    row.update(accumulate_ms=1000.0, accumulate_compute_ms=900.0, hidden_accumulate=0.875)
    row.update(peer_x_ms=2000.0, peer_x_compute_ms=700.0, peer_x_forward_compute_ms=300.0)
    got = pass_bound(row, 16e6, 10e6, ["sequential", "overlapped", "accumulate", "peer_x"])
    assert got["forward_link_ms"] == pytest.approx(500.0) and got["backward_link_ms"] == pytest.approx(300.0)
    assert got["pass_bound_ms_overlapped"] == pytest.approx(1000.0)
    assert got["pass_bound_speedup_overlapped"] == pytest.approx(1.6)
    assert got["pass_bound_hidden_overlapped"] == pytest.approx(1 - 200 / 800)
    assert got["of_pass_bound_overlapped"] == pytest.approx(0.8)
    assert got["of_pass_bound_hidden_overlapped"] == pytest.approx((1 - 450 / 800) / 0.75)
    assert got["bound_ms_accumulate"] == pytest.approx(900.0) and got["of_bound_accumulate"] == pytest.approx(0.9)
    assert got["bound_speedup_accumulate"] == pytest.approx(1600 / 900)
    assert not any(k.endswith("_sequential") or k.endswith("_peer_x") for k in got)
    assert pass_bound(dict(row, configured_mbit=None), 16e6, 10e6, ["overlapped"]) == {}
    assert pass_bound(row, 16e6, None, ["overlapped"]) == {}


def test_bounds_on_the_link_take_each_steps_time_outside_its_waits():
    """``compute="on_link"``: the bound takes the shaped step's own computation (its time outside its waits,
    ``<n>_computing_ms``, 850 ms with a 330 ms forward): max(330, 500) + max(520, 300) = 1020 ms, and
    accumulate's max(950, 800). An unknown computation is a ValueError naming it."""
    from bench.overlap.real_bounds import pass_bound

    row = dict(configured_mbit=160.0, sequential_ms=1600.0, comm_ms=800.0, sequential_compute_ms=800.0)
    row.update(overlapped_ms=1250.0, overlapped_compute_ms=800.0, overlapped_forward_compute_ms=300.0)
    row.update(overlapped_computing_ms=850.0, overlapped_forward_computing_ms=330.0, hidden_overlapped=0.5)
    row.update(accumulate_ms=1000.0, accumulate_compute_ms=900.0, accumulate_computing_ms=950.0)
    got = pass_bound(row, 16e6, 10e6, ["overlapped", "accumulate"], compute="on_link")
    assert got["pass_bound_on_link_ms_overlapped"] == pytest.approx(1020.0)
    assert got["of_pass_bound_on_link_overlapped"] == pytest.approx(1020 / 1250)
    assert got["bound_on_link_ms_accumulate"] == pytest.approx(950.0)
    assert got["of_bound_on_link_accumulate"] == pytest.approx(0.95)
    with pytest.raises(ValueError, match="compute must be one of"):
        pass_bound(row, 16e6, 10e6, ["overlapped"], compute="with_bytes")


def test_bounds_with_fill_and_drain_add_what_each_pass_must_leave_idle():
    """With each pass's fill, drain and first transfer (one chunk's, bench.overlap.real_fill), 4 chunks: the
    forward's link is idle 10 + 5 ms, so max(300, 500 + 15); the backward's computation waits for a first
    transfer of 100 ms that the 3 other chunks' fills (2 ms each) cover only 6 ms of, so max(500 + 94, 300 + 2
    + 20): 515 + 594 = 1109 ms. accumulate's step (2 microbatches) shares the first forward's fill and the last
    backward's drain: max(800, 800 + 30 / 2). With the computation on the link (850 ms, 330 in the forward): 515 +
    max(520 + 100 - 6 x 1.04, 322), the fills grown as the backward's computation did (520 / 500). A missing
    figure: no filled bound at all."""
    from bench.overlap.real_bounds import FILL, pass_bound

    row = dict(configured_mbit=160.0, sequential_ms=1600.0, comm_ms=800.0, chunks=4, microbatches=2)
    row.update(overlapped_ms=1250.0, overlapped_compute_ms=800.0, overlapped_forward_compute_ms=300.0)
    row.update(accumulate_ms=1000.0, accumulate_compute_ms=800.0)
    fill = dict(forward_fill_ms=10.0, forward_drain_ms=5.0, backward_fill_ms=2.0, backward_drain_ms=20.0)
    fill.update(forward_first_ms=1.0, backward_first_ms=100.0)
    assert set(fill) == set(FILL)
    got = pass_bound(row, 16e6, 10e6, ["overlapped", "accumulate"], fill=fill)
    assert got["pass_bound_filled_ms_overlapped"] == pytest.approx(1109.0)
    assert got["of_pass_bound_filled_overlapped"] == pytest.approx(1109 / 1250)
    assert got["bound_filled_ms_accumulate"] == pytest.approx(815.0)
    assert not any(
        "filled" in k for k in pass_bound(row, 16e6, 10e6, ["overlapped"], fill=dict(fill, backward_first_ms=None))
    )
    row.update(overlapped_computing_ms=850.0, overlapped_forward_computing_ms=330.0)
    on_link = pass_bound(row, 16e6, 10e6, ["overlapped"], compute="on_link", fill=fill)
    assert on_link["pass_bound_on_link_filled_ms_overlapped"] == pytest.approx(515.0 + 520.0 + 100.0 - 6.0 * 1.04)


def test_fill_and_drain_from_a_traced_steps_collectives():
    """A step from 0 to 2 s whose forward ends at 1 s: its first collective issued at 0.1 s (fill 100 ms), the
    forward's last ended at 0.9 s (drain 100 ms), the first of its own spanning 50 ms; the backward's first issued
    at 1.2 s, its last ended at 1.8 s, its first spanning 150 ms. A pass with no collective: None. The trace's
    collectives come back as their issue times and spans on the backend."""
    import lancet_rt
    from bench.overlap.real_fill import link_times, step_fill
    from lancet_rt.comm.channels import Transfer

    issued = [0.1, 0.3, 1.2, 1.5]
    spans = [(0.35, 0.9), (0.15, 0.2), (1.25, 1.4), (1.55, 1.8)]
    got = step_fill(issued, spans, 0.0, 1.0, 2.0)
    want = dict(forward_fill_ms=100, forward_drain_ms=100, backward_fill_ms=200, backward_drain_ms=200)
    want.update(forward_first_ms=50, backward_first_ms=150)
    assert got == pytest.approx(want)
    assert step_fill(issued[:2], spans[:2], 0.0, 1.0, 2.0) is None
    trace = lancet_rt.Trace()
    with lancet_rt.tracing(trace):
        for t in (0.0, 0.25):
            transfer = Transfer("all-to-all")
            transfer.issued, transfer.start, transfer.end = (
                trace.origin + t,
                trace.origin + t + 0.1,
                trace.origin + t + 0.2,
            )
            lancet_rt.trace.record_link(transfer, 0)
        lancet_rt.trace.record_link(Transfer("all-to-all"), 0)  # (never started: left out)
    got_issued, got_spans = link_times(trace)
    assert [t - trace.origin for t in got_issued] == pytest.approx([0.0, 0.25])
    assert [(a - trace.origin, b - trace.origin) for a, b in got_spans] == [
        pytest.approx((0.1, 0.2)),
        pytest.approx((0.35, 0.45)),
    ]


def test_a_steps_waits_are_the_union_of_its_wait_spans_inside_it():
    """The wait clock keeps only the layers' ``"wait"`` spans (other spans record nothing); the time waited
    inside [t0, t1] counts overlapping waits (two threads) once and clips those reaching outside."""
    import lancet_rt
    from bench.overlap.real_waits import WaitClock, waited

    waits = [(0.0, 1.0, False), (0.5, 2.0, True), (3.0, 4.0, False), (4.5, 9.0, True)]
    assert waited(waits, 0.25, 5.0) == pytest.approx(1.75 + 1.0 + 0.5)
    assert waited(waits, 0.25, 5.0, counts=True) == pytest.approx(1.5 + 0.5)
    assert waited(waits, 0.25, 5.0, counts=False) == pytest.approx(0.75 + 1.0)
    assert waited([(2.0, 3.0, False), (1.0, 1.5, False)], 0.0, 10.0) == pytest.approx(1.5)
    assert waited([], 0.0, 1.0) == 0.0
    clock = WaitClock()
    with lancet_rt.tracing(clock):
        with lancet_rt.trace.span("experts"):
            pass
        with lancet_rt.trace.span("wait", "wait"):
            time.sleep(0.01)
        with lancet_rt.trace.span("wait", "wait", chunk=0, counts=True):
            pass
    assert len(clock.waits) == 2 and clock.waits[0][1] - clock.waits[0][0] >= 0.01
    assert [c for _, _, c in clock.waits] == [False, True]
    assert clock.spans == []


def test_the_cores_shares_come_from_the_machines_cpu_times():
    """/proc/stat's ticks between two readings: 100 ticks in all, 20 idle + 5 iowait, 3 + 7 in interrupts, 10
    stolen (guest ticks, counted in user, left out); a reading of the machine has its 8 first states."""
    from bench.overlap.real_waits import cpu_shares, cpu_times

    before = [100, 0, 50, 10, 0, 0, 0, 0, 7, 0]
    after = [130, 5, 70, 30, 5, 3, 7, 10, 9, 0]
    assert cpu_shares(before, after) == pytest.approx(dict(idle=0.25, irq=0.10, steal=0.10))
    assert cpu_shares(after, after) == dict(idle=0.0, irq=0.0, steal=0.0)
    now = cpu_times()
    assert len(now) >= 8 and all(v >= 0 for v in now)


def test_calibration_interpolates_between_tries_on_either_side():
    """Alone above the target it scales by what it got (at most 2x); once bracketed, log-log: tries at 100 and
    400 Mbit/s giving 2x and 0.5x the wanted comm (comm proportional to 1 / rate) meet at 200."""
    from bench.overlap.real import next_rate

    assert next_rate([(100e6, 4.0)]) == pytest.approx(200e6)
    assert next_rate([(100e6, 1.5)]) == pytest.approx(150e6)
    assert next_rate([(100e6, 4.0), (200e6, 2.0), (400e6, 0.5)]) == pytest.approx(200e6 * 2 ** (1 / 2))
    assert next_rate([(100e6, 2.0), (400e6, 0.5)]) == pytest.approx(200e6)


def test_the_peer_ratio_compares_on_the_peers_transport():
    """The peers' all-to-alls run on the plain gloo group: the headline ratio is Overlapped on that group
    (overlapped@plain) over the peer's step; ours on its split lanes over theirs is kept beside it. On
    --channels plain, ours is already on their transport."""
    from bench.overlap.real import PEER_TRANSPORT, peer_ratios

    shaped = {"sequential": 1500.0, "overlapped": 600.0, "overlapped@plain": 900.0, "peer_deepspeed": 1200.0}
    got = peer_ratios(shaped, "split")
    assert PEER_TRANSPORT == "plain" and got["peer_transport"] == "plain"
    assert got["overlapped_over_peer_deepspeed"] == pytest.approx(0.75)
    assert got["overlapped_split_over_peer_deepspeed"] == pytest.approx(0.5)
    plain = peer_ratios({"overlapped": 900.0, "peer_deepspeed": 1200.0}, "plain")
    assert plain == {"overlapped_over_peer_deepspeed": pytest.approx(0.75), "peer_transport": "plain"}
    assert peer_ratios({"overlapped": 600.0, "sequential": 1500.0}, "split") == {}  # no peer timed
