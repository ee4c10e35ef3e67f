"""GPU lane for the runtime: the MoE layer, Overlapped and the emulated link on CUDA, NCCL with one rank.

Their CPU twins: tests/test_moe.py (contract), tests/test_overlap.py (Overlapped over the emulated
link), tests/test_moe_distributed.py::test_one_rank_group_runs_the_collectives (gloo, one rank).
"""
from __future__ import annotations

import copy
import os
import socket

import pytest
import torch

import lancet_rt
from autotune.block import MoEBlocks
from tests.helpers import assert_close
from tests.test_moe import build, reference

pytestmark = pytest.mark.gpu


def test_moe_cuda_matches_contract():
    c = dict(T=1024, D=256, F=512, E=16, K=2, capacity_factor=1.0, score_fn="softmax", normalize_topk=True,
             aux_loss_coef=0.01, z_loss_coef=0.001)
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
    model = MoEBlocks(2, 512, 8, dict(d_ffn=1024, num_experts=16, top_k=2, capacity_factor=1.0,
                                      aux_loss_coef=0.01, ep_group=link), device="cuda")
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


def test_overlapped_nccl_one_rank():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        torch.manual_seed(0)
        local = MoEBlocks(2, 256, 4, dict(d_ffn=512, num_experts=8, top_k=2, capacity_factor=1.0), device="cuda")
        grouped = MoEBlocks(2, 256, 4, dict(d_ffn=512, num_experts=8, top_k=2, capacity_factor=1.0,
                                            ep_group=dist.group.WORLD), device="cuda")
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
    finally:
        dist.destroy_process_group()
        os.environ.pop("MASTER_PORT", None)
