"""Cross-microbatch overlap (Overlapped.accumulate), the Tutel-style baseline's pipelined
backward, and Lina's all-reduce behind the all-to-alls (EmulatedGroup.all_reduce, GradientSync)."""

from __future__ import annotations

import copy
import math
import os
import threading

import pytest
import torch

import lancet_rt
from lancet_rt.parallel import GradientSync, sync_gradients
from tests import cuda_semantics  # noqa: F401 - the execution modes, in the ranks too
from tests.dist import assert_all_ok, run_ranks
from tests.helpers import assert_close
from tests.schedule import test_overlap as overlap_tests

D = 16


def make_model(capacity_factor, ep_group=None, E=8):
    return overlap_tests.make_model(capacity_factor, ep_group, E=E)


def ep_model(capacity_factor, rank, world):
    """The model on a real expert-parallel group, each rank its own experts."""
    import torch.distributed as dist

    model = make_model(capacity_factor, ep_group=dist.group.WORLD, E=2 * world)
    torch.manual_seed(10 + rank)
    for m in model.moe_layers():
        m.experts.reset_parameters()
    return model


def microbatches(M, rows, gen=None):
    xs = [torch.randn(rows[i % len(rows)], 5, D, generator=gen) for i in range(M)]
    gs = [torch.randn(x.shape, generator=gen) for x in xs]
    return xs, gs


def sequential_reference(model, xs, gs):
    """M plain steps of the unwrapped model, gradients accumulated: what accumulate must equal."""
    losses, stats = [], []
    for i, x in enumerate(xs):
        loss = (model(x) * gs[i]).sum()
        loss.backward()
        losses.append(loss.detach())
        stats.append([(m.aux_loss.clone(), m.dropped) for m in model.moe_layers()])
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()}, stats


def assert_same_step(ref, model, losses, stats=None):
    ref_losses, ref_grads, ref_stats = ref
    assert_close("losses", losses, ref_losses)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert_close(f"grad {n}", grads[n], ref_grads[n])
    last = [(m.aux_loss, m.dropped) for m in model.moe_layers()]  # the last microbatch's, as sequential
    for (a0, d0), (a1, d1) in zip(ref_stats[-1], last):
        assert_close("aux_loss", a1.reshape(1), a0.reshape(1))
        assert d0 == d1


# ---------------------------------------------------------------- one process, emulated link
@pytest.mark.parametrize(
    "chunks, capacity_factor, defer_wgrad",
    [
        (2, None, False),
        (3, 0.75, True),
        (1, 0.75, False),
        (2, None, True),
    ],
)
def test_accumulate_equals_sequential_microbatches(chunks, capacity_factor, defer_wgrad):
    """M microbatches under the cross-microbatch schedule: losses, per-microbatch capacity and aux
    loss, and every gradient equal M plain steps; and the passes really took turns."""
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.05, latency_us=500)
    model = make_model(capacity_factor, link)
    twin = copy.deepcopy(model)
    xs, gs = microbatches(3, [6, 5])
    ref = sequential_reference(model, xs, gs)
    ov = lancet_rt.Overlapped(twin, chunks=chunks, defer_wgrad=defer_wgrad)
    with lancet_rt.tracing() as tr:
        losses = ov.accumulate(xs, lambda out, i: (out * gs[i]).sum())
    assert_same_step(ref, twin, losses)
    if capacity_factor is not None:
        assert any(m.dropped > 0 for m in twin.moe_layers()), "the capacity case must drop something"
    spans = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in tr.events() if e["tid"] == "compute"]
    for i in (0, 1):  # backward i ran in turns inside forward i + 1 (and the rest after it)
        ((_, f0, f1),) = [s for s in spans if s[0] == f"forward {i + 1}"]
        inside = [s for s in spans if s[0] == f"backward {i}" and f0 <= s[1] and s[2] <= f1]
        assert len(inside) >= 4, (i, len(inside))
    if defer_wgrad:
        assert not ov.wgrad_queue.items


def test_accumulate_issues_collectives_in_schedule_order():
    """The turns are decided from the schedule, never from completion timing: on a free link and on
    a slow one, the same collectives are issued in the same order."""
    orders = []
    for gbps, latency_us in ((math.inf, 0.0), (0.01, 3000)):
        link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=gbps, latency_us=latency_us)
        log = []
        a2a, exchange = link.all_to_all, link.exchange
        link.all_to_all = lambda out, x, o, i: log.append(("a2a", x.shape[0])) or a2a(out, x, o, i)
        link.exchange = lambda send: log.append(("counts", int(send.sum()))) or exchange(send)
        model = make_model(0.75, link)
        xs, gs = microbatches(3, [4])
        lancet_rt.Overlapped(model, chunks=2, defer_wgrad=True).accumulate(xs, lambda out, i: (out * gs[i]).sum())
        orders.append(log)
    assert len(orders[0]) == 3 * 2 * 2 * (1 + 2 + 2)  # microbatches x layers x chunks x (counts + 2 fwd + 2 bwd)
    assert orders[0] == orders[1]


def test_interleaved_passes_share_the_host_core_on_cpu():
    """On CPU the interleaved passes run on one core, the host's (lancet_rt.schedule.accumulate._OneCore):
    the forwards beside a backward and those backwards see the same single-CPU mask; the first
    forward and the last backward (alone) and both threads after the step see their own masks."""
    host_mask = os.sched_getaffinity(0)
    helper = lancet_rt.schedule.accumulate._worker()
    helper_mask = os.sched_getaffinity(helper.native_id)
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.05, latency_us=100)
    ov = lancet_rt.Overlapped(make_model(None, link), chunks=2)
    xs, gs = microbatches(3, [4])
    seen = {}

    def loss_fn(out, i):
        seen[("forward", i)] = os.sched_getaffinity(0)
        out.register_hook(
            lambda g: seen.setdefault(("backward", i), (threading.get_native_id(), os.sched_getaffinity(0))) and None
        )
        return (out * gs[i]).sum()

    ov.accumulate(xs, loss_fn)
    assert seen[("backward", 0)][0] == seen[("backward", 1)][0] == helper.native_id
    assert seen[("backward", 2)][0] == threading.get_native_id()  # the last backward runs on the host
    assert seen[("forward", 0)] == seen[("backward", 2)][1] == host_mask
    if len(host_mask) > 1:
        pinned = seen[("forward", 1)]
        assert len(pinned) == 1 and pinned <= host_mask, pinned
        assert seen[("forward", 2)] == seen[("backward", 0)][1] == seen[("backward", 1)][1] == pinned
    else:  # nothing to choose: nothing pinned
        assert seen[("forward", 1)] == seen[("backward", 0)][1] == host_mask
    assert os.sched_getaffinity(0) == host_mask
    assert os.sched_getaffinity(helper.native_id) == helper_mask
    # A step with no backward beside a forward (interleave=False) pins nothing.
    ov.accumulate(xs, loss_fn, interleave=False)
    assert seen[("forward", 1)] == host_mask


def test_accumulate_rejects_bad_arguments():
    ov = lancet_rt.Overlapped(make_model(None), chunks=2)
    loss = lambda out, i: out.sum()
    x = torch.randn(4, 3, D)
    with pytest.raises(ValueError, match="at least one"):
        ov.accumulate([], loss)
    with pytest.raises(TypeError, match="microbatches must be a sequence"):
        ov.accumulate(x, loss)
    with pytest.raises(TypeError, match=r"microbatches\[1\]"):
        ov.accumulate([x, 3], loss)
    with pytest.raises(TypeError, match="loss_fn"):
        ov.accumulate([x], "sum")
    with pytest.raises(TypeError, match="interleave"):
        ov.accumulate([x], loss, interleave=1)
    with pytest.raises(TypeError, match="grad_sync"):
        ov.accumulate([x], loss, grad_sync=object())
    with pytest.raises(ValueError, match="one-element"):
        ov.accumulate([x, x], lambda out, i: out.sum(0))


def test_failure_in_a_forward_beside_a_backward(execution):
    """A forward that raises while the previous microbatch's backward is suspended: the error
    reaches the caller, the backward's thread ends, and the next step is exact."""
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.1, latency_us=100)
    model = make_model(None, link)
    twin = copy.deepcopy(model)
    ov = lancet_rt.Overlapped(twin, chunks=2, defer_wgrad=True)
    xs, gs = microbatches(2, [4])
    calls = []
    host_mask = os.sched_getaffinity(0)

    def fail_in_microbatch_1(module, args, out):  # blocks[1] runs twice (2 chunks) per microbatch
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected forward failure")

    handle = twin.blocks[1].attn.register_forward_hook(fail_in_microbatch_1)
    with lancet_rt.tracing() as tr:
        with pytest.raises(RuntimeError, match="injected"):
            ov.accumulate(xs, lambda out, i: (out * gs[i]).sum())
    handle.remove()
    assert any(e["name"] == "backward 0" for e in tr.events()), "backward 0 must have been suspended"
    assert os.sched_getaffinity(0) == host_mask  # the step gave the host its CPUs back
    # The suspended backward was unwound: nothing waits for a turn, the helper thread is free.
    assert lancet_rt.runtime.scope.PROCESS.beside is None
    worker = lancet_rt.schedule.accumulate._worker()
    done = threading.Event()
    worker.submit(done.set)
    assert done.wait(10)
    for p in twin.parameters():
        p.grad = None
    ref = sequential_reference(model, xs, gs)
    assert_same_step(ref, twin, ov.accumulate(xs, lambda out, i: (out * gs[i]).sum()))
    assert not ov.wgrad_queue.items


# ---------------------------------------------------------------- 2 gloo ranks
def _accumulate_gloo(rank, world):
    """Every (capacity, deferred dW) cell, then data-parallel gradients with GradientSync, in one set
    of processes. Rank 1 has fewer rows than chunks in one microbatch."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(rank)
    drops = 0
    for capacity_factor in (None, 0.75):
        for defer_wgrad in (False, True):
            model = ep_model(capacity_factor, rank, world)
            twin = copy.deepcopy(model)
            xs, gs = microbatches(3, [5, 2] if rank else [4, 6], gen)
            ref = sequential_reference(model, xs, gs)
            ov = lancet_rt.Overlapped(twin, chunks=3, defer_wgrad=defer_wgrad)
            assert_same_step(ref, twin, ov.accumulate(xs, lambda out, i: (out * gs[i]).sum()))
            drops += sum(m.dropped for m in twin.moe_layers())
    # Data + expert parallelism over one group: GradientSync during the last backward (buckets and
    # pieces of all-reduce) equals sync_gradients after it.
    model = ep_model(None, rank, world)
    twin = copy.deepcopy(model)
    xs, gs = microbatches(2, [4], gen)
    for i, x in enumerate(xs):
        (model(x) * gs[i]).sum().backward()
    sync_gradients(model)
    sync = GradientSync(twin, bucket_mb=0.002, piece_mb=0.0005)
    lancet_rt.Overlapped(twin, chunks=2).accumulate(xs, lambda out, i: (out * gs[i]).sum(), grad_sync=sync)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(f"synced grad {n}", q.grad, p.grad)
    # The counts on a group of their own (TorchGroup(counts_group=)): the same step, exactly; a
    # counts group of other ranks or of the wrong type is refused on every rank before any collective.
    from lancet_rt.comm.group import TorchGroup

    counts = dist.new_group(list(range(world)))
    group = TorchGroup(dist.group.WORLD, counts_group=counts)
    assert group.counts_channel == "own" and TorchGroup(dist.group.WORLD).counts_channel == "shared"
    model = ep_model(None, rank, world)
    twin = copy.deepcopy(model)
    for m in twin.moe_layers():
        m.group = group
    xs, gs = microbatches(2, [3, 5], gen)
    ref = sequential_reference(model, xs, gs)
    a2a, on = dist.all_to_all_single, []

    def recording(out, x, *args, group=None, **kwargs):
        on.append(
            ("counts" if group is counts else "world" if group is dist.group.WORLD else "?", x.dtype == torch.int64)
        )
        return a2a(out, x, *args, group=group, **kwargs)

    dist.all_to_all_single = recording
    try:
        losses = lancet_rt.Overlapped(twin, chunks=2).accumulate(xs, lambda out, i: (out * gs[i]).sum())
    finally:
        dist.all_to_all_single = a2a
    assert_same_step(ref, twin, losses)
    assert sorted(set(on)) == [("counts", True), ("world", False)], set(on)  # counts alone on their group
    refused = []
    for bad in (dist.new_group([1, 0], sort_ranks=False), "own"):
        try:
            TorchGroup(dist.group.WORLD, counts_group=bad)
        except (TypeError, ValueError) as e:
            refused.append(f"{type(e).__name__}: {e}")
    dist.barrier()  # (no rank exits while a peer still connects the group above: gloo's "connection closed")
    return drops, sync.issued, len(sync._buckets), group.monitor.exchanges, refused


def test_accumulate_expert_parallel_gloo(execution):
    results = assert_all_ok(run_ranks(_accumulate_gloo, 2, timeout=240))
    assert sum(r[0] for r in results) > 0, "the capacity cells must drop"
    for r in results:
        assert r[3] == 2 * 2 * 2, r[3]  # microbatches x layers x chunks counts exchanges on the counts group
        assert len(r[4]) == 2 and r[4][0].startswith("ValueError: counts_group must have the ranks of group")
        assert r[4][1].startswith("TypeError: counts_group must be None or a torch.distributed ProcessGroup")
    for _, issued, buckets, _, _ in results:
        assert issued > buckets > 1  # buckets during backward, cut into pieces


# ---------------------------------------------------------------- the Tutel-style baseline's backward
def test_moe_pipelined_backward_is_pipelined():
    """MoE(pipeline_chunks=P) pipelines its backward as Tutel does: every piece's combine gradient
    leaves before the first expert backward, and each piece's dispatch gradient leaves before the
    next piece's expert backward runs. Exactness: tests/schedule/test_overlap.py."""
    from lancet_rt.moe import experts as experts_mod

    link = lancet_rt.EmulatedGroup(2)
    log = []
    a2a = link.all_to_all
    link.all_to_all = lambda out, x, o, i: log.append(("a2a", x.shape[0])) or a2a(out, x, o, i)
    moe = lancet_rt.MoE(D, 12, 4, 2, ep_group=link, pipeline_chunks=3)
    y = moe(torch.randn(30, D, requires_grad=True))
    sizes = [n for _, n in log[:3]]  # the pieces' rows, as dispatched
    assert log == [("a2a", n) for n in sizes * 2] and len(set(sizes)) == 3
    log.clear()
    backward = experts_mod._ExpertsFn.backward
    try:
        experts_mod._ExpertsFn.backward = staticmethod(
            lambda ctx, dy: log.append(("experts bwd", dy.shape[0])) or backward(ctx, dy)
        )
        y.backward(torch.randn_like(y))
    finally:
        experts_mod._ExpertsFn.backward = backward
    last_first = sizes[::-1]
    assert log == ([("a2a", n) for n in last_first] + [e for n in last_first for e in (("experts bwd", n), ("a2a", n))])


# ---------------------------------------------------------------- Lina: all-reduce behind the all-to-alls
def test_emulated_all_reduce():
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.001, latency_us=1000)
    x = torch.randn(250)
    for op, expected in (("sum", 4 * x), ("avg", x), (torch.distributed.ReduceOp.MAX, x), ("product", x**4)):
        t = x.clone()
        link.reset()
        link.all_reduce(t, op).wait()
        assert_close(f"all_reduce {op}", t, expected)
        # a ring all-reduce: each rank sends 2 (W - 1) / W of the 1000 bytes; at 1e6 B/s, + 1 ms
        assert math.isclose(link.modeled_ms, 1.0 + 1.5, rel_tol=1e-9)
    with pytest.raises(ValueError, match="op"):
        link.all_reduce(x, "mean")
    with pytest.raises(TypeError, match="tensor"):
        link.all_reduce([1.0])


@pytest.mark.parametrize("low_priority", [False, True])
def test_all_reduce_priority(low_priority):
    """Lina's rule: a low-priority all-reduce waits while an all-to-all is queued, and one already
    on the link is not preempted; in FIFO order the all-to-all waits behind it."""
    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=1e-3, latency_us=0)
    rows = torch.randn(2, 100_000 // 4)  # one row off rank: 100 ms
    first = link.all_to_all(torch.empty_like(rows), rows, [1, 1], [1, 1])
    ar = link.all_reduce(torch.randn(50_000 // 4), low_priority=low_priority)  # 2 (W-1)/W: 50 ms
    second = link.all_to_all(torch.empty_like(rows), rows, [1, 1], [1, 1])
    for w in (first, ar, second):
        w.wait()
    if low_priority:
        assert first.end <= second.start and second.end <= ar.start
        assert link.behind_all_reduce_ms == 0.0
    else:
        assert first.end <= ar.start and ar.end <= second.start
        assert link.behind_all_reduce_ms == pytest.approx(50.0, abs=1.0)


def test_gradient_sync_on_the_emulated_link():
    """GradientSync averages every gradient ('all') over the emulated world: by symmetry each rank
    holds the same gradient, so it comes back unchanged; buckets are cut into pieces."""
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.1, latency_us=50)
    model = make_model(None, link)
    twin = copy.deepcopy(model)
    xs, gs = microbatches(2, [4])
    ref = sequential_reference(model, xs, gs)
    with pytest.raises(ValueError, match="params"):
        GradientSync(twin, link, params="experts")
    with pytest.raises(ValueError, match="piece_mb"):
        GradientSync(twin, link, piece_mb=0)
    with pytest.raises(TypeError, match="group"):
        GradientSync(twin, "world")
    sync = GradientSync(twin, link, params="all", bucket_mb=0.004, piece_mb=0.001)
    twin.blocks[0].moe(torch.randn(3, D)).sum().backward()  # outside the with: no all-reduce
    assert sync.issued == 0
    for p in twin.parameters():
        p.grad = None
    link.reset()
    losses = lancet_rt.Overlapped(twin, chunks=2).accumulate(xs, lambda out, i: (out * gs[i]).sum(), grad_sync=sync)
    assert_same_step(ref, twin, losses)
    grad_bytes = sum(p.numel() * 4 for p in twin.parameters())
    assert sync.issued >= grad_bytes / 1000 and len(sync._buckets) >= grad_bytes / 4000
    transfers = link.transfers
    sync.remove()
    assert transfers == 2 * 2 * 2 * 5 + sync.issued  # 2 microbatches x 2 layers x 2 chunks x 5, + pieces


class _CountsCopy:
    """A stand-in for the counts copy's CUDA event: ``query()`` only, done after ``after`` polls."""

    def __init__(self, after: int):
        self.polls, self.after = 0, after

    def query(self) -> bool:
        self.polls += 1
        return self.polls > self.after


def test_a_forward_waiting_on_its_counts_fills_the_wait_with_dw():
    """The host's wait for a counts copy (on CUDA an event, with ``query`` only) runs the backward's
    deferred dW until the copy is done, as the CPU link's work does (the CUDA path used to skip it)."""
    from types import SimpleNamespace

    from lancet_rt.runtime import wgrad
    from lancet_rt.runtime.beside import BackwardBeside

    q = wgrad.WGradQueue(max_deferred_bytes=float("inf"))
    p = torch.nn.Parameter(torch.zeros(3))
    ran = []
    q._callback_queued = True  # (as inside a backward: no engine callback to queue here)
    for i in range(5):
        q.push((p,), (True,), lambda i=i: (ran.append(i) or torch.ones(3),), 1, 0)
    backward = SimpleNamespace(queue=q, done=False, index=0)
    BackwardBeside.fill(backward, _CountsCopy(after=3))
    assert ran == [0, 1, 2]  # one item per poll while the copy was pending, in order
    assert len(q.items) == 2 and q.ran_in_windows == 3


@pytest.mark.gpu
def test_a_forward_waiting_on_its_counts_fills_the_wait_with_dw_cuda():
    """GPU twin: a real event behind queued work."""
    from types import SimpleNamespace

    from lancet_rt.runtime import wgrad
    from lancet_rt.runtime.beside import BackwardBeside

    q = wgrad.WGradQueue(max_deferred_bytes=float("inf"))
    p = torch.nn.Parameter(torch.zeros(3, device="cuda"))
    q._callback_queued = True
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a.t() / 4096
    event = torch.cuda.Event()
    event.record()
    ran = []
    for i in range(4):
        q.push((p,), (True,), lambda i=i: (ran.append(i) or torch.ones(3, device="cuda"),), 1, 0)
    BackwardBeside.fill(SimpleNamespace(queue=q, done=False, index=0), event)
    event.synchronize()
    assert ran == list(range(len(ran))) and q.ran_in_windows == len(ran)


class _Penalised(torch.nn.Module):
    """Calls autograd inside its forward (a gradient penalty on its output, as some models do)."""

    def __init__(self, body, record):
        super().__init__()
        self.body, self.record = body, record

    def forward(self, x):
        from lancet_rt.schedule import accumulate as accumulate_mod

        first, *rest = self.body.blocks  # the penalty between two MoE blocks
        y = first(x)
        if torch.is_grad_enabled():
            parked = any(b.turns and not b.done for b in accumulate_mod._live)
            (g,) = torch.autograd.grad(y.square().sum(), y, create_graph=True)
            self.record.append((parked, all(b.done for b in accumulate_mod._live)))
            y = y + 1e-3 * g
        for block in rest:
            y = block(y)
        return y

    def moe_layers(self):
        return self.body.moe_layers()


def _penalised_step(device):
    """accumulate over a model that calls autograd in its forward: exact against sequential steps,
    and a backward parked beside the forward had ended before the call (on CUDA it holds the
    engine's device thread: the call would wait for it forever)."""
    from lancet_rt.schedule import accumulate as accumulate_mod

    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=0.05, latency_us=500, device=device)
    model = _Penalised(make_model(None, link, E=8), []).to(device)
    twin = copy.deepcopy(model)
    parked = twin.record
    xs, gs = microbatches(3, [6, 5])
    xs, gs = [x.to(device) for x in xs], [g.to(device) for g in gs]
    ref = sequential_reference(model, xs, gs)
    ov = lancet_rt.Overlapped(twin, chunks=2)
    losses = ov.accumulate(xs, lambda out, i: (out * gs[i]).sum())
    assert any(p for p, _ in parked), "a backward must have been parked beside some forward's autograd call"
    assert all(done for _, done in parked), "the autograd call must end the parked backward first"
    assert not accumulate_mod._live
    assert_same_step(ref, twin, losses)


def test_autograd_from_a_forward_beside_a_parked_backward(execution):
    _penalised_step("cpu")


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_autograd_from_a_forward_beside_a_parked_backward_cuda():
    """GPU twin: without the fix this call waits forever for the engine's CUDA thread."""
    _penalised_step("cuda")
