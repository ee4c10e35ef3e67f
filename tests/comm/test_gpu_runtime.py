"""GPU lane for the runtime: the MoE layer, Overlapped and the emulated link on CUDA, NCCL with one rank.

Their CPU twins: tests/moe/test_moe.py (contract), tests/schedule/test_overlap.py (Overlapped over the emulated
link), tests/distributed/test_moe_distributed.py::test_one_rank_group_runs_the_collectives (gloo, one rank).
"""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from tests.dist import nccl_one_rank
from tests.helpers import assert_close
from tests.moe.test_moe import build, reference

pytestmark = pytest.mark.gpu


def test_moe_cuda_matches_contract():
    c = dict(
        T=1024,
        D=256,
        F=512,
        E=16,
        K=2,
        capacity_factor=1.0,
        score_fn="softmax",
        normalize_topk=True,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
    )
    torch.manual_seed(0)
    moe = build(c).cuda()
    x = torch.randn(c["T"], c["D"], device="cuda", requires_grad=True)
    g = torch.randn_like(x)
    y = moe(x)
    y.backward(g)
    cpu = copy.deepcopy(moe).cpu()
    y_ref, aux, z, counts, dropped, grads = reference(cpu, x.detach().cpu(), g.cpu(), c)
    assert_close("y", y.cpu(), y_ref, rel_rms=1e-4)
    assert_close("grad x", x.grad.cpu(), grads[0], rel_rms=1e-4)
    assert_close("grad router", moe.router.weight.grad.cpu(), grads[1], rel_rms=1e-4)
    assert_close("grad gate_up", moe.experts.gate_up_proj.grad.cpu(), grads[2], rel_rms=1e-4)
    assert moe.dropped == dropped


@pytest.mark.parametrize("defer_wgrad", [False, True])
def test_overlapped_cuda_emulated_link_equals_model(defer_wgrad):
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=50.0, latency_us=20, device="cuda")
    torch.manual_seed(0)
    model = MoEBlocks(
        2,
        512,
        8,
        dict(d_ffn=1024, num_experts=16, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01, ep_group=link),
        device="cuda",
    )
    twin = copy.deepcopy(model)
    x = torch.randn(8, 256, 512, device="cuda")
    g = torch.randn_like(x)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    model(x1).backward(g)
    lancet_rt.Overlapped(twin, chunks=4, defer_wgrad=defer_wgrad)(x2).backward(g)
    torch.cuda.synchronize()
    assert_close("grad x", x2.grad, x1.grad)
    for (n, p1), (_, p2) in zip(model.named_parameters(), twin.named_parameters()):
        assert_close(f"grad {n}", p2.grad, p1.grad)


def test_early_backward_on_cuda_equals_the_backward_issuing_it():
    """GPU twin of tests/integrations/test_hf_dense.py::
    test_early_backward_issues_each_chunks_dual_in_the_forward_exactly: a fused-loss Mixtral on an
    emulated 2-rank CUDA link, 3 chunks, its last combine's duals issued from the forward (the
    partial backward runs on the engine's device thread) against issued by the backward."""
    pytest.importorskip("transformers")
    from lancet_rt.comm import faults
    from lancet_rt.models.hf_models import batch, build

    hf = build("mixtral", "bench").cuda()
    ids, mask, labels = (t.cuda() for t in batch(hf.config.vocab_size, 6, 64))
    runs = []
    for early in (True, False):
        link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=50.0, latency_us=20, device="cuda")
        lm = lancet_rt.from_hf(copy.deepcopy(hf), link, chunks=3, fused_loss=True, early_backward=early)
        out = lm(input_ids=ids, attention_mask=mask, labels=labels)
        duals = faults.backward_state(link).duals
        (out.loss * 2).backward()
        torch.cuda.synchronize()
        runs.append((duals, out.loss.detach(), dict(lm.named_parameters())))
    (d1, l1, p1), (d2, l2, p2) = runs
    assert (d1, d2) == (3, 0)
    assert_close("loss", l1.reshape(1), l2.reshape(1), rel_rms=1e-6)
    for n, p in p1.items():
        assert_close(f"grad {n}", p.grad, p2[n].grad, rel_rms=1e-6)


def test_emulated_cuda_link_holds_modeled_time_without_blocking_the_host():
    """The timed kernel holds the link for the modeled time (torch.cuda._sleep counts SM clock
    cycles; a wrong cycles-per-ms calibration shows here), the host does not wait for it, and the
    data arrives. CPU twin: tests/schedule/test_overlap.py::test_emulated_link_holds_modeled_time."""
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=10.0, latency_us=50, device="cuda")
    x = torch.randn(4096, 1024, device="cuda")
    out = torch.empty_like(x)
    splits = [1024] * 4
    link.all_to_all(out, x, splits, splits).wait()  # first use: the stream and the calibration
    torch.cuda.synchronize()
    expected = link.hold_ms(3 * 1024 * 1024 * 4)  # 3 of 4 row blocks leave rank 0: 12.6 MB at 10 GB/s + 50 us
    out.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    link.all_to_all(out, x, splits, splits).wait()  # wait(): the current stream waits, not the host
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    device_ms = start.elapsed_time(end)
    assert 0.75 * expected <= device_ms <= 1.5 * expected + 0.1, (
        f"link held {device_ms:.3f} ms, modeled {expected:.3f} ms"
    )
    assert host_ms < 0.5 * expected, f"issuing and waiting took {host_ms:.3f} ms on the host (a host sync?)"
    assert torch.equal(out, x)
    send = torch.arange(20, device="cuda").view(4, 5)
    assert torch.equal(link.exchange(send).wait(), send.cpu())  # the counts land on the host


@pytest.mark.parametrize("channel", ["shared", "own"])
def test_emulated_cuda_counts_channel(channel):
    """CPU twin: tests/schedule/test_overlap.py::test_emulated_counts_channel. Behind a 20 ms transfer the
    counts arrive after it ("shared") or after the latency, the transfer still in flight ("own")."""
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=1.0, latency_us=100, device="cuda", counts_channel=channel)
    x = torch.randn(4096, 1600, device="cuda")  # 3/4 of 26 MB leave rank 0: about 19.7 ms at 1 GB/s
    splits = [1024] * 4
    link.all_to_all(torch.empty_like(x), x, splits, splits).wait()  # the streams and the calibration
    torch.cuda.synchronize()
    work = link.all_to_all(torch.empty_like(x), x, splits, splits)
    send = torch.arange(8, device="cuda").view(2, 4)
    t0 = time.perf_counter()
    assert torch.equal(link.exchange(send).wait(), send.cpu())
    waited_ms = (time.perf_counter() - t0) * 1e3
    if channel == "shared":
        assert waited_ms >= 15, waited_ms
    else:
        assert waited_ms < 10 and not work.is_completed(), waited_ms
    torch.cuda.synchronize()


def test_cuda_chunk_gives_a_turn_while_its_counts_travel():
    """CPU twin: tests/schedule/test_overlap.py::test_cpu_chunk_waits_its_own_channels_counts_instead_of_a_turn.
    On CUDA the host only enqueues, so even with the counts on their own channel the next chunk
    takes its turn while they reach the host."""
    from tests.schedule.test_overlap import _first_layer_order

    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=0.1, latency_us=10, device="cuda", counts_channel="own")
    order = _first_layer_order(link, "cuda")
    assert order == [("route", 0), ("route", 1), ("permute", 0), ("permute", 1), ("route", 2), ("permute", 2)]


def test_trace_on_cuda_records_stages_and_link(tmp_path):
    """CUDA-event spans resolve (both events recorded, synchronized) and the link spans last at
    least the modeled time. CPU twin: tests/schedule/test_overlap.py::test_trace_records_stages_and_link."""
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=50.0, latency_us=20, device="cuda")
    torch.manual_seed(0)
    model = MoEBlocks(
        2, 256, 4, dict(d_ffn=512, num_experts=8, top_k=2, capacity_factor=1.0, ep_group=link), device="cuda"
    )
    ov = lancet_rt.Overlapped(model, chunks=2, defer_wgrad=True)
    x = torch.randn(4, 128, 256, device="cuda")
    ov(x).sum().backward()  # warm-up: Triton autotuning, calibrations
    with lancet_rt.tracing() as tr:
        ov(x).sum().backward()
    path = tmp_path / "trace.json"
    tr.save(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = {(e["tid"], e["name"]) for e in events}
    for stage in ("route", "permute", "dispatch", "experts", "combine", "unpermute", "chunk 0", "chunk 1"):
        assert ("compute", stage) in names, stage
    links = [e for e in events if e["tid"] == "link" and e["name"] == "all_to_all"]
    assert links
    for e in links:
        assert e["dur"] >= 0.75 * link.hold_ms(e["args"]["bytes"]) * 1e3, e
    assert all(e["dur"] >= 0 for e in events)


def test_overlapped_cuda_steady_state_has_no_host_sync():
    """A steady-state step of Overlapped on the CUDA emulated link under
    torch.cuda.set_sync_debug_mode("warn"). The layer's one intended host wait per chunk and layer
    (the counts exchange, an Event.synchronize) is not reported by that mode; anything it reports
    (a pageable host-to-device copy, .item(), .tolist() of a CUDA tensor, torch.cuda.synchronize(), ...)
    stalls the host and drains the compute queue (the runtime's rule: no device-wide synchronisation in the
    steady state). The failure names each sync's CALLER with its full Python stack (tests/host_sync.py), not
    torch's frame that issued the warning, so one run tells what to fix."""
    from tests.host_sync import record_syncs, report

    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=50.0, latency_us=20, device="cuda")
    torch.manual_seed(0)
    model = MoEBlocks(
        2,
        512,
        8,
        dict(
            d_ffn=1024,
            num_experts=16,
            top_k=2,
            capacity_factor=1.0,
            aux_loss_coef=0.01,
            z_loss_coef=0.001,
            ep_group=link,
        ),
        device="cuda",
    )
    ov = lancet_rt.Overlapped(model, chunks=4, defer_wgrad=True)
    x = torch.randn(8, 256, 512, device="cuda")
    g = torch.randn_like(x)
    ov(x).backward(g)  # warm-up: Triton autotuning, calibrations, pinned-memory pool
    torch.cuda.synchronize()
    with record_syncs() as sites:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ov(x).backward(g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if sites:
        print(report(sites))  # (shown with the failure; the lane keeps the log)
    assert not sites, f"{len(sites)} host sync(s) in a steady-state Overlapped step on CUDA, by caller:\n" + report(
        sites
    )


def test_overlapped_nccl_one_rank():
    import torch.distributed as dist

    with nccl_one_rank():
        torch.manual_seed(0)
        local = MoEBlocks(2, 256, 4, dict(d_ffn=512, num_experts=8, top_k=2, capacity_factor=1.0), device="cuda")
        grouped = MoEBlocks(
            2,
            256,
            4,
            dict(d_ffn=512, num_experts=8, top_k=2, capacity_factor=1.0, ep_group=dist.group.WORLD),
            device="cuda",
        )
        grouped.load_state_dict(local.state_dict())
        x = torch.randn(6, 128, 256, device="cuda")
        g = torch.randn_like(x)
        x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        local(x1).backward(g)
        lancet_rt.Overlapped(grouped, chunks=3, defer_wgrad=True)(x2).backward(g)
        torch.cuda.synchronize()
        assert_close("grad x", x2.grad, x1.grad)
        for (n, p1), (_, p2) in zip(local.named_parameters(), grouped.named_parameters()):
            assert_close(f"grad {n}", p2.grad, p1.grad)
