"""Overlapped equals the unwrapped model: outputs, aux losses, every gradient; plus the runtime parts."""

from __future__ import annotations

import copy
import json
import math
import time

import pytest
import torch
from torch import nn

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from tests import cuda_semantics  # noqa: F401 - the execution modes, in the ranks too
from tests.dist import assert_all_ok, run_ranks
from tests.helpers import assert_close

D = 16


def make_model(capacity_factor, ep_group=None, seed=0, layers=2, E=4):
    torch.manual_seed(seed)
    return MoEBlocks(
        layers,
        D,
        2,
        dict(
            d_ffn=12,
            num_experts=E,
            top_k=2,
            capacity_factor=capacity_factor,
            aux_loss_coef=0.01,
            z_loss_coef=0.001,
            ep_group=ep_group,
        ),
    )


def run_and_grads(model, runner, x, g):
    x = x.clone().requires_grad_(True)
    y = runner(x)
    y.backward(g)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    losses = [(m.aux_loss.clone(), m.z_loss.clone(), m.dropped) for m in model.moe_layers()]
    return y.detach(), x.grad, grads, losses


def assert_same_run(ref, got):
    y0, gx0, grads0, losses0 = ref
    y1, gx1, grads1, losses1 = got
    assert_close("y", y1, y0)
    assert_close("grad x", gx1, gx0)
    assert grads0.keys() == grads1.keys()
    for n in grads0:
        assert_close(f"grad {n}", grads1[n], grads0[n])
    for (a0, z0, d0), (a1, z1, d1) in zip(losses0, losses1):
        assert_close("aux_loss", a1.reshape(1), a0.reshape(1))
        assert_close("z_loss", z1.reshape(1), z0.reshape(1))
        assert d0 == d1


@pytest.mark.parametrize("chunks", [2, 3, 4])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
@pytest.mark.parametrize("defer_wgrad", [False, True])
def test_overlapped_equals_model(chunks, capacity_factor, defer_wgrad):
    model = make_model(capacity_factor)
    twin = copy.deepcopy(model)
    x, g = torch.randn(7, 5, D), torch.randn(7, 5, D)
    ref = run_and_grads(model, model, x, g)
    got = run_and_grads(twin, lancet_rt.Overlapped(twin, chunks=chunks, defer_wgrad=defer_wgrad), x, g)
    assert_same_run(ref, got)
    if capacity_factor is not None:
        assert any(m.dropped > 0 for m in twin.moe_layers()), "the capacity case must drop something"


def test_overlapped_on_emulated_link_equals_model():
    # Every transfer holds the link 100 ms: longer than the backward compute between a backward
    # all-to-all's early issue and its wait, even on a loaded machine or with the interpreted
    # kernels (30 ms was not, there), so the waits find time left for deferred dW.
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=1.0, latency_us=100_000)
    model = make_model(0.75, ep_group=link, E=8)
    twin = copy.deepcopy(model)
    x, g = torch.randn(6, 5, D), torch.randn(6, 5, D)
    ref = run_and_grads(model, model, x, g)
    ov = lancet_rt.Overlapped(twin, chunks=3, defer_wgrad=True)
    run_and_grads(twin, ov, x, g)  # warm-up
    for p in twin.parameters():
        p.grad = None
    got = run_and_grads(twin, ov, x, g)
    assert_same_run(ref, got)
    assert ov.wgrad_queue.ran_in_windows > 0
    assert not ov.wgrad_queue.items


def test_chunks_one_is_exactly_the_model():
    model = make_model(1.0)
    x = torch.randn(4, 3, D)
    assert torch.equal(lancet_rt.Overlapped(model, chunks=1)(x), model(x))


def test_fewer_rows_than_chunks():
    model = make_model(1.0)
    twin = copy.deepcopy(model)
    x, g = torch.randn(2, 5, D), torch.randn(2, 5, D)
    assert_same_run(run_and_grads(model, model, x, g), run_and_grads(twin, lancet_rt.Overlapped(twin, chunks=4), x, g))


def test_moe_pipeline_chunks_equals_model():
    link = lancet_rt.EmulatedGroup(2)
    model = make_model(0.75, ep_group=link)
    twin = copy.deepcopy(model)
    for m in twin.moe_layers():
        m.pipeline_chunks = 3
    x, g = torch.randn(5, 6, D), torch.randn(5, 6, D)
    assert_same_run(run_and_grads(model, model, x, g), run_and_grads(twin, twin, x, g))


class _BatchCoupled(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = lancet_rt.MoE(D, 8, 4, 2)

    def forward(self, x):
        return self.moe(x - x.mean(dim=0, keepdim=True))  # couples rows: not separable


def test_check_detects_non_separable_model():
    with pytest.raises(ValueError, match="separable"):
        lancet_rt.Overlapped(_BatchCoupled(), chunks=2, check=True)(torch.randn(6, 3, D))


def test_check_passes_separable_model():
    model = make_model(0.75)
    lancet_rt.Overlapped(model, chunks=3, check=True)(torch.randn(6, 3, D))


@pytest.mark.parametrize(
    "kwargs, exc", [(dict(chunks=0), ValueError), (dict(chunks=2.5), ValueError), (dict(chunks=True), ValueError)]
)
def test_bad_chunks(kwargs, exc):
    with pytest.raises(exc, match="chunks"):
        lancet_rt.Overlapped(make_model(None), **kwargs)


class _FixedPolicy:
    """A chunk policy that records its calls."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def next_chunks(self, args, kwargs):
        self.calls += 1
        return self.n


def test_chunk_policy_instance_factory_and_name():
    from lancet_rt.schedule.policy import register_chunk_policy, registered_chunk_policies

    model, x = make_model(None), torch.randn(6, 3, D)
    policy = _FixedPolicy(3)
    ov = lancet_rt.Overlapped(model, chunks=policy)
    assert_close("policy chunks", ov(x), model(x))
    assert policy.calls == 1 and ov._auto is policy
    built = []
    ov = lancet_rt.Overlapped(model, chunks=lambda o: built.append(o) or _FixedPolicy(2))
    ov(x), ov(x)
    assert built == [ov]  # the factory runs once, on the first forward
    register_chunk_policy("test-two", lambda o: _FixedPolicy(2))
    assert "test-two" in registered_chunk_policies()
    assert lancet_rt.Overlapped(model, chunks="test-two")._resolve_chunks((x,), {}) == 2
    with pytest.raises(ValueError, match="chunks must be an int >= 1 or 'auto'"):
        lancet_rt.Overlapped(model, chunks="no-such-policy")
    with pytest.raises(TypeError, match="next_chunks"):
        lancet_rt.Overlapped(model, chunks=lambda o: 2)(x)


def test_auto_needs_the_autotuner_imported():
    # A fresh interpreter: the runtime alone never imports lancet_rt.autotune, so "auto" is unregistered.
    import subprocess
    import sys

    code = (
        "import sys, torch, lancet_rt\n"
        "try:\n"
        "    lancet_rt.Overlapped(torch.nn.Linear(2, 2), chunks='auto')\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
        "print('autotune imported:', 'lancet_rt.autotune' in sys.modules)\n"
        "import lancet_rt.autotune\n"
        "print('after import:', lancet_rt.Overlapped(torch.nn.Linear(2, 2), chunks='auto').chunks)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=True).stdout
    assert "ValueError:" in out and "import lancet_rt.autotune" in out
    assert "autotune imported: False" in out
    assert "after import: auto" in out


def test_bad_model_and_inputs():
    with pytest.raises(TypeError, match="model"):
        lancet_rt.Overlapped(lambda x: x)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = lancet_rt.MoE(D, 8, 4, 2)

        def forward(self, a, b):
            return self.moe(a + b)

    with pytest.raises(ValueError, match=r"the batch's 5 rows \(or 1 row.*got sizes \[4\]"):
        lancet_rt.Overlapped(Two(), chunks=2)(torch.randn(4, D), torch.randn(5, D))

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = lancet_rt.MoE(D, 8, 4, 2)

        def forward(self, a):
            return self.moe(a).sum()

    with pytest.raises(ValueError, match="0-dim"):
        lancet_rt.Overlapped(Scalar(), chunks=2)(torch.randn(4, D))


def test_deferred_wgrad_complete_when_backward_returns():
    model = make_model(None)
    ov = lancet_rt.Overlapped(model, chunks=2, defer_wgrad=True)
    ov(torch.randn(4, 3, D)).sum().backward()
    assert not ov.wgrad_queue.items
    assert all(p.grad is not None for p in model.parameters())
    assert any(isinstance(m, lancet_rt.runtime.wgrad.DeferredLinear) for m in model.modules())


def test_deferred_wgrad_reaches_parameter_hooks(execution):
    """Deferred dW goes through each parameter's gradient accumulator: its hooks run once per backward,
    with the whole gradient (as without deferral), and the windows still ran dW."""
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=1.0, latency_us=100_000)
    model = make_model(0.75, ep_group=link, E=8)
    twin = copy.deepcopy(model)
    x, g = torch.randn(6, 5, D), torch.randn(6, 5, D)
    _, _, ref, _ = run_and_grads(model, model, x, g)
    at_hook, pre_hook = {}, {}
    for n, p in twin.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: at_hook.setdefault(n, []).append(p.grad.clone()))
        p.register_hook(lambda grad, n=n: pre_hook.setdefault(n, []).append(None if grad is None else grad.clone()))
    ov = lancet_rt.Overlapped(twin, chunks=3, defer_wgrad=True)
    run_and_grads(twin, ov, x, g)
    assert ov.wgrad_queue.ran_in_windows > 0
    assert at_hook.keys() == ref.keys() and pre_hook.keys() == ref.keys()
    for n in ref:
        assert len(at_hook[n]) == 1 and len(pre_hook[n]) == 1, (n, len(at_hook[n]), len(pre_hook[n]))
        assert_close(f"grad {n} at its post-accumulate hook", at_hook[n][0], ref[n])
        assert_close(f"grad {n} at its tensor hook", pre_hook[n][0], ref[n])


def test_deferred_wgrad_under_autograd_grad(execution):
    """autograd.grad accumulates nothing: deferring layers compute and queue no dW, and leave every
    .grad alone. Deferred weights are outside the autograd graph, so autograd.grad cannot ask for them."""
    model = make_model(0.75)
    twin = copy.deepcopy(model)
    x, g = torch.randn(6, 5, D), torch.randn(6, 5, D)
    _, gx_ref, _, _ = run_and_grads(model, model, x, g)
    ov = lancet_rt.Overlapped(twin, chunks=2, defer_wgrad=True)
    xr = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(ov(xr), [xr], g)
    assert_close("grad x", gx, gx_ref)
    assert all(p.grad is None for p in twin.parameters()) and not ov.wgrad_queue.items
    assert not ov.wgrad_queue._sums
    weight = twin.blocks[0].moe.experts.down_proj
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(ov(xr), [weight], g)
    run_and_grads(twin, ov, x, g)  # and a backward() after them is complete
    assert all(p.grad is not None for p in twin.parameters())


def test_backward_that_raises_leaves_no_orphaned_wgrad(execution):
    """A backward that raises (out of memory, say) after deferring some dW: the engine drops the
    queue's flush, and the next step must neither lose its own dW nor keep the stale work."""
    model = make_model(None)
    twin = copy.deepcopy(model)
    x, g = torch.randn(6, 5, D), torch.randn(6, 5, D)
    ov = lancet_rt.Overlapped(twin, chunks=2, defer_wgrad=True)

    def fail_in_backward(module, inputs, out):  # raises once the last block's backward has queued dW
        out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("injected backward failure")))

    handle = twin.blocks[0].register_forward_hook(fail_in_backward)
    with pytest.raises(RuntimeError, match="injected"):
        ov(x.clone().requires_grad_(True)).backward(g)
    handle.remove()
    assert ov.wgrad_queue.items, "the failed backward must have left deferred dW behind (else no test)"
    for p in twin.parameters():
        p.grad = None
    assert_same_run(run_and_grads(model, model, x, g), run_and_grads(twin, ov, x, g))
    assert not ov.wgrad_queue.items


def test_emulated_link_holds_modeled_time():
    # A 50 ms latency: long enough that a descheduled test process still finds the transfer in flight.
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.001, latency_us=50_000)
    x = torch.randn(40, 25)
    out = torch.empty_like(x)
    work = link.all_to_all(out, x, [10, 10, 10, 10], [10, 10, 10, 10])
    # 30 of 40 rows leave rank 0: 30 * 25 * 4 bytes at 1e6 B/s = 3 ms, plus 50 ms latency.
    assert math.isclose(link.modeled_ms, 53.0, rel_tol=1e-9)
    assert not work.is_completed()
    work.wait()
    assert work.end - work.start >= 0.053 - 1e-4
    assert torch.equal(out, x)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        lancet_rt.EmulatedGroup(2, bandwidth_gbps=0)


def test_trace_records_stages_and_link(tmp_path):
    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=0.1, latency_us=10)
    model = make_model(None, ep_group=link)
    ov = lancet_rt.Overlapped(model, chunks=2, defer_wgrad=True)
    with lancet_rt.tracing() as tr:
        ov(torch.randn(4, 3, D)).sum().backward()
    path = tmp_path / "trace.json"
    tr.save(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = {(e["tid"], e["name"]) for e in events}
    for stage in ("route", "permute", "dispatch", "experts", "combine", "unpermute", "chunk 0", "chunk 1"):
        assert ("compute", stage) in names, stage
    assert ("link", "all_to_all") in names
    routes = [e for e in events if e["name"] == "route"]
    assert {e["args"]["chunk"] for e in routes} == {0, 1}
    assert {e["args"]["layer"] for e in routes} == {"blocks.0.moe", "blocks.1.moe"}
    assert all(e["dur"] >= 0 for e in events)


# ---------------------------------------------------------------- expert parallelism, 2 gloo ranks
def _overlapped_ep(rank, world, chunks, batch):
    """Every (capacity, deferred dW) cell for one chunk count, in one set of processes."""
    import torch.distributed as dist

    cells = []
    for capacity_factor in (None, 0.75):
        for defer_wgrad in (False, True):
            model = make_model(capacity_factor, ep_group=dist.group.WORLD, E=2 * world)
            torch.manual_seed(10 + rank)  # each rank its own experts
            for m in model.moe_layers():
                m.experts.reset_parameters()
            twin = copy.deepcopy(model)
            gen = torch.Generator().manual_seed(rank)
            B = batch[rank]
            x, g = torch.randn(B, 5, D, generator=gen), torch.randn(B, 5, D, generator=gen)
            ref = run_and_grads(model, model, x, g)
            ov = lancet_rt.Overlapped(twin, chunks=chunks, defer_wgrad=defer_wgrad)
            assert_same_run(ref, run_and_grads(twin, ov, x, g))
            cells.append((capacity_factor, defer_wgrad, sum(m.dropped for m in twin.moe_layers())))
    return cells


def _overlapped_ep_chunks(rank, world, batch):
    """Chunks 2, 3 and 4 in one set of processes (a spawn costs seconds of imports)."""
    return [_overlapped_ep(rank, world, chunks, batch) for chunks in (2, 3, 4)]


def test_overlapped_expert_parallel_gloo(execution):
    batch = [5, 2]  # rank 1 has fewer rows than chunks when chunks > 2
    per_rank = assert_all_ok(run_ranks(_overlapped_ep_chunks, 2, batch, timeout=300))
    for chunks, cells in zip((2, 3, 4), zip(*per_rank)):
        assert [c[:2] for c in cells[0]] == [(None, False), (None, True), (0.75, False), (0.75, True)], chunks
        assert sum(c[2] for r in cells for c in r if c[0] == 0.75) > 0, f"chunks={chunks}: the capacity cells must drop"


def test_overlapped_expert_parallel_gloo_four_ranks():
    batch = [5, 2, 0, 3]  # one rank with no rows at all, one with fewer rows than chunks
    assert_all_ok(run_ranks(_overlapped_ep, 4, 3, batch, timeout=300))


def _bad_input_on_one_rank(rank, world, what):
    import torch.distributed as dist

    model = make_model(None, ep_group=dist.group.WORLD, E=4)
    ov = lancet_rt.Overlapped(model, chunks=2, check=what == "check")
    if what == "check":
        # Rank 1's model is not separable along dim 0 (a batch-wide mean); rank 0's is.
        model.blocks[0].attn.register_forward_hook(lambda m, a, y: y - y.mean(0, keepdim=True) if rank == 1 else None)
        x = torch.randn(4, 5, D)
    else:
        ov(torch.randn(4, 5, D))  # a good step first
        x = torch.randn(4, 5, D) if rank == 0 else torch.tensor(1.0)  # rank 1: nothing to cut
    try:
        ov(x)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["input", "check"])
def test_an_error_on_one_rank_raises_on_every_rank(what):
    """A rank that rejects its step still takes part in the first counts exchange, with a failure
    status: its peers raise there instead of waiting for it (a hang fails within the timeout)."""
    errors = assert_all_ok(run_ranks(_bad_input_on_one_rank, 2, what, timeout=90))
    assert all(e != "no error" for e in errors), errors
    assert "rank" in errors[0] or "another" in errors[0] or "peer" in errors[0], errors[0]


def _ddp_with_overlapped(rank, world, defer_wgrad):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(None)
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(rank)
    plain, ov = DDP(model), DDP(lancet_rt.Overlapped(twin, chunks=2, defer_wgrad=defer_wgrad))
    for step in range(2):  # a second step: DDP's reducer must have finished the first
        x = torch.randn(4, 3, D, generator=gen)
        plain(x).sum().backward()
        ov(x).sum().backward()
        ref = dict(model.named_parameters())
        for n, p in twin.named_parameters():
            assert_close(f"step {step} grad {n} under DDP", p.grad, ref[n].grad)
    return True


@pytest.mark.parametrize("defer_wgrad", [False, True])
def test_ddp_around_overlapped(defer_wgrad):
    """DDP all-reduces each gradient from its accumulator's hook: deferred dW reaches the accumulators
    at the flush, once per parameter, so DDP averages complete gradients."""
    assert assert_all_ok(run_ranks(_ddp_with_overlapped, 2, defer_wgrad, timeout=120)) == [True, True]


def _dw_windows_follow_link_model(rank, world):
    """On a real group the backward all-to-alls' windows come from the group's link model."""
    import torch.distributed as dist

    group = lancet_rt.comm.group.as_group(dist.group.WORLD)
    assert group.hold_ms(1000) is None  # no model until one is set (or measured by the autotuner)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        group.set_link(0.0)
    with pytest.raises(ValueError, match="latency_us"):
        group.set_link(1.0, -1.0)
    model = make_model(0.75, ep_group=dist.group.WORLD, E=4)
    twin = copy.deepcopy(model)
    ov = lancet_rt.Overlapped(twin, chunks=2, defer_wgrad=True)
    x, g = torch.randn(4, 5, D), torch.randn(4, 5, D)
    ref = run_and_grads(model, model, x, g)
    ran = {}
    for name, (gbps, latency_us) in {"free": (math.inf, 0.0), "slow": (1e-6, 1e5)}.items():
        group.set_link(gbps, latency_us)  # a window of 0 ms, then of over 100 s
        ov.wgrad_queue.ran_in_windows = 0
        for p in twin.parameters():
            p.grad = None
        assert_same_run(ref, run_and_grads(twin, ov, x, g))
        ran[name] = ov.wgrad_queue.ran_in_windows
    return ran


def test_dw_windows_follow_the_torch_groups_link_model():
    for ran in assert_all_ok(run_ranks(_dw_windows_follow_link_model, 2, timeout=120)):
        assert ran["free"] == 0 and ran["slow"] > 0, ran


@pytest.mark.parametrize("channel", ["shared", "own"])
def test_emulated_counts_channel(channel):
    """A counts exchange behind a 210 ms transfer: "shared" queues it in the tokens' FIFO (it ends
    after the transfer), "own" gives it a channel of its own (it ends after the 10 ms latency, with
    the transfer still in flight). GPU twin: tests/comm/test_gpu_runtime.py::test_emulated_cuda_counts_channel."""
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.0002, latency_us=10_000, counts_channel=channel)
    x = torch.randn(150, 100)  # 100 rows x 400 bytes leave rank 0: 40 KB at 2e5 B/s = 200 ms, + 10 ms
    work = link.all_to_all(torch.empty_like(x), x, [50, 50, 25, 25], [50, 50, 25, 25])
    send = torch.arange(8).view(2, 4)
    t0 = time.perf_counter()
    exchange = link.exchange(send)
    t1 = time.perf_counter()
    planned = exchange._work  # (its planned start, from the link's timeline: no wall-clock assert)
    assert torch.equal(exchange.wait(), send)
    if channel == "shared":
        assert planned.start >= work.end and work.is_completed()
    else:  # started when submitted, not behind the transfer (however long the host took meanwhile)
        assert t0 <= planned.start <= t1 and planned.end == planned.start + planned.hold_s
    assert link.transfers == 2 and math.isclose(link.modeled_ms, 210.0 + 10.0, rel_tol=1e-9)
    with pytest.raises(ValueError, match="counts_channel must be 'own' or 'shared'"):
        lancet_rt.EmulatedGroup(4, counts_channel="separate")


def test_emulated_handshake_delays_a_transfer_on_an_idle_link_only():
    """handshake_us: a transfer submitted to an idle link starts a handshake after its submission;
    one submitted behind a longer transfer starts when that ends, as without one (planned times from
    the link's timeline)."""
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.0002, latency_us=1_000, handshake_us=30_000)
    x = torch.randn(150, 100)  # 100 rows x 400 bytes leave rank 0: 200 ms + 1 ms
    t0 = time.perf_counter()
    first = link.all_to_all(torch.empty_like(x), x, [50, 50, 25, 25], [50, 50, 25, 25])
    t1 = time.perf_counter()
    second = link.all_to_all(torch.empty_like(x), x, [50, 50, 25, 25], [50, 50, 25, 25])
    assert t0 + 0.030 <= first.start <= t1 + 0.030
    assert second.start == first.end  # behind the first: the handshake ran beside it
    exchange = link.exchange(torch.arange(8).view(2, 4))  # (counts on the tokens' FIFO: behind both)
    assert exchange._work.start == second.end
    own = lancet_rt.EmulatedGroup(4, latency_us=1_000, counts_channel="own", handshake_us=30_000)
    t0 = time.perf_counter()
    planned = own.exchange(torch.arange(8).view(2, 4))._work
    assert planned.start >= t0 + 0.030  # its own channel, idle: a handshake late
    link.handshake_us = 0.0
    link.cancel_pending()
    t0 = time.perf_counter()
    third = link.all_to_all(torch.empty_like(x), x, [50, 50, 25, 25], [50, 50, 25, 25])
    assert t0 <= third.start <= time.perf_counter()
    for bad in (-1.0, math.inf, True):
        with pytest.raises(ValueError, match="handshake_us must be a finite number >= 0"):
            lancet_rt.EmulatedGroup(2, handshake_us=bad)


def _first_layer_order(link, device="cpu"):
    """(stage, chunk) of the first MoE layer's route and permute spans, in the order the host ran
    them, in a 3-chunk training step on ``link`` (the schedule's order, not its timing)."""
    model = make_model(None, ep_group=link).to(device)
    with lancet_rt.tracing() as tr:
        lancet_rt.Overlapped(model, chunks=3)(torch.randn(6, 3, D, device=device)).sum().backward()
    return [
        (s.name, s.args["chunk"])
        for s in tr.spans
        if s.name in ("route", "permute") and s.args.get("layer") == "blocks.0.moe"
    ]


def test_cpu_chunk_waits_its_own_channels_counts_instead_of_a_turn():
    """On the CPU the host is the device: with the counts on their own channel a chunk waits for them
    (one latency) and dispatches before the next chunk computes its attention; with the counts on the
    tokens' channel (behind the transfers in flight) it gives the next chunk the turn, as on CUDA.
    GPU twin: tests/comm/test_gpu_runtime.py::test_cuda_chunk_gives_a_turn_while_its_counts_travel."""
    own = _first_layer_order(lancet_rt.EmulatedGroup(2, bandwidth_gbps=0.1, latency_us=10, counts_channel="own"))
    assert own == [("route", 0), ("permute", 0), ("route", 1), ("permute", 1), ("route", 2), ("permute", 2)]
    shared = _first_layer_order(lancet_rt.EmulatedGroup(2, bandwidth_gbps=0.1, latency_us=10))
    assert shared == [("route", 0), ("route", 1), ("permute", 0), ("permute", 1), ("route", 2), ("permute", 2)]


def test_pipeline_fills_alternating_new_and_oldest_chunks():
    """The fill alternates starting a chunk with resuming the oldest started one (0, 1, 0, 2, 1, 3):
    chunk 0's combine goes on the link while chunk 2 computes its prologue, instead of after every
    chunk has started (0, 1, 2, 3, 0, 1 left the link idle when a prologue outlasts a dispatch).
    The order is the schedule's, decided without timing, and the result is exact either way."""
    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=0.1, latency_us=10, counts_channel="own")
    model = make_model(None, ep_group=link)
    twin = copy.deepcopy(model)
    x, g = torch.randn(8, 3, D), torch.randn(8, 3, D)
    with lancet_rt.tracing() as tr:
        got = run_and_grads(twin, lancet_rt.Overlapped(twin, chunks=4), x, g)
    turns = [s.args["chunk"] for s in tr.spans if s.name.startswith("chunk ")]
    assert turns[:6] == [0, 1, 0, 2, 1, 3], turns
    assert_same_run(run_and_grads(model, model, x, g), got)


def test_emulated_all_to_all_stays_in_its_autograd_node():
    # Regression: the CPU link copies on its own thread, where grad mode is on; the copy must not
    # enter the graph (it once rebased the output onto a CopyBackwards that bypassed the collective).
    from lancet_rt.comm import group as comm

    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=1.0)
    x = torch.randn(6, 4, requires_grad=True)
    y = comm.all_to_all(x, link, [3, 3], [3, 3]).wait()
    assert type(y.grad_fn).__name__ == "_AllToAllBackward"
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_overlapped_equals_model_with_triton_kernels(monkeypatch):
    # Carried capacity through the Triton gating kernel (interpreter on CPU) across uneven chunks.
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    model = make_model(0.75)
    twin = copy.deepcopy(model)
    x, g = torch.randn(7, 5, D), torch.randn(7, 5, D)
    ref = run_and_grads(model, model, x, g)
    got = run_and_grads(twin, lancet_rt.Overlapped(twin, chunks=3, defer_wgrad=True), x, g)
    assert_same_run(ref, got)
    assert any(m.dropped > 0 for m in twin.moe_layers())


def test_scheduler_is_deterministic_and_issues_first():
    from lancet_rt.schedule.overlap import next_chunk

    # Not started: chunk order. A chunk whose counts are on their way dispatches as soon as
    # another chunk has had a turn; otherwise the earliest-yielded chunk (round robin).
    waiting = {0: (-3, False), 1: (-2, False), 2: (-1, False)}
    assert next_chunk([0, 1, 2], waiting, None) == 0
    waiting[0] = (1, True)  # chunk 0 yielded after starting its counts exchange
    assert next_chunk([0, 1, 2], waiting, 0) == 1
    waiting[1] = (2, True)
    assert next_chunk([0, 1, 2], waiting, 1) == 0  # 0 dispatches before 2 starts
    waiting[0] = (3, False)  # 0 dispatched and waits for its rows
    assert next_chunk([0, 1, 2], waiting, 0) == 1
    waiting[1] = (4, False)
    assert next_chunk([0, 1, 2], waiting, 1) == 2
    assert next_chunk([2], {2: (5, False)}, 2) == 2  # the last live chunk runs again


def test_best_fit_is_lancets_greedy_rule():
    from lancet_rt.runtime.wgrad import best_fit

    assert best_fit([5.0, 3.0, 9.0], 3.6, 0) == 1  # closest to the time left
    assert best_fit([9.0], 4.0, 0) == 0  # the first item of a window always runs
    assert best_fit([9.0], 4.0, 1) is None  # over twice what is left, after one ran
    assert best_fit([7.0], 4.0, 1) == 0  # within twice: still fits well enough
    assert best_fit([1.0], 0.0, 0) is None  # nothing left
    assert best_fit([], 4.0, 0) is None


def test_torch_modes_stay_with_their_chunk():
    """Grad mode and autocast are thread-local, not per coroutine: a chunk that yields inside
    ``torch.no_grad()`` (here a frozen first layer) must not hand it to the chunk resumed next."""

    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = lancet_rt.MoE(D, 12, 4, 2, ep_group=lancet_rt.EmulatedGroup(2))
            self.b = lancet_rt.MoE(D, 12, 4, 2, ep_group=lancet_rt.EmulatedGroup(2))

        def moe_layers(self):
            return [self.a, self.b]

        def forward(self, x):
            with torch.no_grad():
                h = self.a(x)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
                return self.b(h + x)

    torch.manual_seed(0)
    model = Frozen()
    twin = copy.deepcopy(model)
    x, g = torch.randn(6, 5, D), torch.randn(6, 5, D)
    ref = run_and_grads(model, model, x, g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        got = run_and_grads(twin, lancet_rt.Overlapped(twin, chunks=3), x, g)
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    y0, gx0, grads0, _ = ref
    y1, gx1, grads1, _ = got
    assert_close("y", y1, y0)
    assert_close("grad x", gx1, gx0)
    assert grads0.keys() == grads1.keys() and all(n.startswith("b.") for n in grads0)
    for n in grads0:
        assert_close(f"grad {n}", grads1[n], grads0[n])
