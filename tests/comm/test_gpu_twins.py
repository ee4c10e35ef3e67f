"""GPU twins of CPU-tested behaviour that CUDA runs differently (the GPU lane's P4; skipped on the CPU
lane, except the stream-priority check, which runs on both):

- ``Overlapped.accumulate`` on CUDA, then ``torch.autograd.grad`` through the first block's input: on
  CUDA the backward runs on autograd's device thread, so a backward the schedule left parked there would
  make the second call wait forever. It must finish (the per-test timeout, thread method) and equal
  plain sequential steps.
- The fused Hugging Face loss (``from_hf(..., fused_loss=True)``) makes at most the one host read its
  code documents per step (the batch's count of valid labels, ``lancet_rt.dense``), by caller.
- The router's logits are the same bits whether a batch is routed whole or in 1..8 chunks
  (``lancet_rt.routing.router_logits``): chunking must not change which experts a token gets.
- The emulated link's CUDA streams have NCCL's priority (``lancet_rt.comm.emulated_cuda``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from tests.helpers import assert_close

D = 64
#: Host reads per step of the fused Hugging Face loss: the whole batch's count of valid labels.
FUSED_LOSS_HOST_READS = 1


def _blocks(link, device):
    torch.manual_seed(0)
    return MoEBlocks(
        2,
        D,
        4,
        dict(
            d_ffn=96, num_experts=8, top_k=2, capacity_factor=None, aux_loss_coef=0.01, z_loss_coef=0.001, ep_group=link
        ),
        device=device,
    )


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize("defer_wgrad", [False, True])
def test_accumulate_then_autograd_grad_through_the_first_block_cuda(defer_wgrad):
    link = lancet_rt.EmulatedGroup(4, bandwidth_gbps=1.0, latency_us=50, device="cuda")
    model = _blocks(link, "cuda")
    twin = copy.deepcopy(model)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(rows, 16, D, device="cuda", generator=gen) for rows in (6, 5, 6)]
    gs = [torch.randn(x.shape, device="cuda", generator=gen) for x in xs]

    ref_x = [x.clone().requires_grad_(True) for x in xs]
    ref_losses = []
    for x, g in zip(ref_x, gs):
        loss = (model(x) * g).sum()
        loss.backward()
        ref_losses.append(loss.detach())
    got_x = [x.clone().requires_grad_(True) for x in xs]
    ov = lancet_rt.Overlapped(twin, chunks=2, defer_wgrad=defer_wgrad)
    losses = ov.accumulate(got_x, lambda out, i: (out * gs[i]).sum())
    torch.cuda.synchronize()
    assert_close("losses", losses, torch.stack(ref_losses))
    for i, (a, b) in enumerate(zip(got_x, ref_x)):
        assert_close(f"grad of microbatch {i}'s input", a.grad, b.grad)
    ref = dict(model.named_parameters())
    for n, p in twin.named_parameters():
        assert_close(f"grad {n}", p.grad, ref[n].grad)

    # then a gradient through the first block's input alone (no .grad accumulated): it must finish
    x = xs[0].clone().requires_grad_(True)
    (got,) = torch.autograd.grad((ov(x) * gs[0]).sum(), x)
    x_ref = xs[0].clone().requires_grad_(True)
    (want,) = torch.autograd.grad((model(x_ref) * gs[0]).sum(), x_ref)
    torch.cuda.synchronize()
    assert_close("grad through the first block's input", got, want)


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_fused_hf_loss_step_host_reads_cuda():
    from lancet_rt.models.hf_models import batch, build
    from tests.host_sync import record_syncs, report

    hf = build("qwen3_moe").cuda()
    lm = lancet_rt.from_hf(hf, chunks=2, fused_loss=True)
    ids, mask, labels = (t.cuda() for t in batch(hf.config.vocab_size, 4, 32))

    def step():
        lm.zero_grad(set_to_none=True)
        lm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    step()  # warm-up: kernels compiled and tuned
    torch.cuda.synchronize()
    with record_syncs() as sites:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    loss_files = ("lancet_rt/dense.py", "lancet_rt/integrations/hf_dense.py")
    in_loss = [s for s in sites if any(f.filename.replace("\\", "/").endswith(loss_files) for f in s.stack)]
    if sites:
        print(report(sites))  # every sync of the step, by caller (the loss's and the model's)
    assert len(in_loss) <= FUSED_LOSS_HOST_READS, (
        f"{len(in_loss)} host syncs in the fused loss of one step (documented: {FUSED_LOSS_HOST_READS}):\n"
        + report(in_loss)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_chunked_equal_unchunked_cuda(dtype):
    from lancet_rt.routing.router import router_logits

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4096, 2048, device="cuda", generator=gen).to(dtype)
    w = torch.randn(128, 2048, device="cuda", generator=gen) * 0.02
    b = torch.randn(128, device="cuda", generator=gen)
    whole = router_logits(x, w, b)
    for n in range(1, 9):
        pieces = torch.cat([router_logits(c, w, b) for c in x.chunk(n)])
        assert torch.equal(pieces, whole), (
            f"{n} chunks: router logits differ from the unchunked ones "
            f"(max |diff| {(pieces - whole).abs().max().item():.3g}): routing would depend on chunking"
        )


def test_emulated_link_streams_have_nccls_priority(monkeypatch):
    """CPU lane: the streams the CUDA link asks for have NCCL's (default) priority, not a higher one."""
    from lancet_rt.comm import emulated_cuda

    asked = []

    class _Stream:
        def __init__(self, device=None, priority=0):
            asked.append(priority)

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=1.0, latency_us=1, counts_channel="own")
    link.device = torch.device("cuda", 0)  # (only the stream's creation is exercised)
    link._comm_stream("all_to_all")
    link._comm_stream("exchange")
    assert asked == [emulated_cuda.LINK_STREAM_PRIORITY] * 2 == [0, 0]


@pytest.mark.gpu
def test_emulated_link_streams_have_nccls_priority_cuda():
    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=1.0, latency_us=1, device="cuda", counts_channel="own")
    default = torch.cuda.Stream().priority  # what ProcessGroupNCCL's streams get without is_high_priority_stream
    assert link._comm_stream("all_to_all").priority == default
    assert link._comm_stream("exchange").priority == default
