"""The NCCL path of the mesh engines, on one rank (the GPU lane): the divide runs inside the collective
(PREMUL_SUM), and GradientSync, replicate and fully_shard on a (1, 1) CUDA mesh with deferred dW equal
the plain model. The gloo path (SUM, then divide) runs in test_mesh.py."""

from __future__ import annotations

import copy

import pytest
import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from tests import dist as dist_helpers
from tests.helpers import assert_close

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_one_rank():
    with dist_helpers.nccl_one_rank():
        yield


def test_nccl_divides_inside_the_collective(nccl_one_rank):
    import torch.distributed as dist

    from lancet_rt.parallel.mesh import reduce_op

    op, post = reduce_op(dist.group.WORLD, 4)
    assert post == 1 and op != dist.ReduceOp.SUM
    t = torch.randn(1000, device="cuda")
    out = t.clone()
    dist.all_reduce(out, op=op)
    assert_close("PREMUL_SUM(1/4) on one rank", out, t / 4)


def test_engines_on_a_cuda_mesh(nccl_one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import GradientSync, fully_shard, replicate

    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    plain = MoEBlocks(2, 128, 4, dict(d_ffn=256, num_experts=8, top_k=2), device="cuda")
    x = torch.randn(4, 64, 128, device="cuda")
    g = torch.randn_like(x)
    (plain(x) * g).sum().backward()
    for how in ("GradientSync", "replicate", "fully_shard"):
        model = copy.deepcopy(plain)
        model.zero_grad(set_to_none=True)
        sync = GradientSync(model, mesh) if how == "GradientSync" else None
        if how == "replicate":
            replicate(model, mesh)
        elif how == "fully_shard":
            fully_shard(model, mesh, blocks=list(model.blocks))
        ov = lancet_rt.Overlapped(model, chunks=2, defer_wgrad=True)
        if sync is not None:
            with sync:
                (ov(x) * g).sum().backward()
        else:
            (ov(x) * g).sum().backward()
        torch.cuda.synchronize()
        for (n, p), q in zip(plain.named_parameters(), model.parameters()):
            got = q.grad.full_tensor() if how == "fully_shard" else q.grad
            assert_close(f"{how} grad {n}", got, p.grad)
