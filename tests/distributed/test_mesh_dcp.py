"""DCP checkpoints of a fully_shard model: saved at (dp=2, ep=2) after one step, loaded at (dp=1,
ep=4), at (dp=4, ep=1), on an HSDP mesh (dp_replicate=2, dp=1, ep=2) and in one process, optimizer state
included: the parameters equal the
reference's after its first step and the second step (which reads the momentum) equals its second."""

from __future__ import annotations

import torch

from tests.dist import assert_all_ok, run_ranks
from tests.distributed import mesh_cases as mc


def _step(model, run, rank, world, step, opt):
    x, g = (mc.local(t, rank) for t in mc.global_batch(step, world))
    opt.zero_grad(set_to_none=True)
    loss = mc.blocks_loss(run, x, g)
    loss.backward()
    opt.step()
    return loss


def _sharded(rank, world, shape):
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import fully_shard

    names = ("dp", "ep") if len(shape) == 2 else ("dp_replicate", "dp", "ep")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = mc.make_blocks(mesh["ep"].get_group() if shape[-1] > 1 else None)
    mc.load_from_reference(model, mc.make_blocks(), mesh["ep"].get_local_rank())
    fully_shard(model, mesh, blocks=list(model.blocks))
    return mesh, model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _save_and_load(rank, world, path):
    from lancet_rt.parallel import load_sharded, save_sharded

    expected = mc.reference_steps(mc.make_blocks(), world)
    mesh, model, opt = _sharded(rank, world, (2, 2))
    loss = _step(model, model, rank, world, 0, opt)
    grads, params = mc.full(model)
    mc.compare(model, expected[0], rank, mesh["ep"].get_local_rank(), loss, "before save", grads=grads, params=params)
    save_sharded(model, mesh, path, opt)
    for shape in ((1, 4), (4, 1), (2, 1, 2)):  # the last: HSDP
        mesh, model, opt = _sharded(rank, world, shape)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # the load must write every row
        _step(model, model, rank, world, 0, opt)  # optimizer state exists (and is wrong) before the load
        load_sharded(model, mesh, path, opt)
        ep_rank = mesh["ep"].get_local_rank()
        params = mc.full(model)[1]
        for n, _p in model.named_parameters():
            ref = expected[0][2][n]
            if ".experts." in n:
                k = params[n].shape[0]
                ref = ref[ep_rank * k : (ep_rank + 1) * k]
            mc.assert_close(f"{shape} loaded {n}", params[n], ref)
        loss = _step(model, model, rank, world, 1, opt)
        grads, params = mc.full(model)
        mc.compare(model, expected[1], rank, ep_rank, loss, f"{shape} step after load", grads=grads, params=params)
    return True


def test_fully_shard_checkpoint_across_meshes(tmp_path):
    path = str(tmp_path / "ckpt")
    assert assert_all_ok(run_ranks(_save_and_load, 4, path, timeout=300)) == [True] * 4
    # In one process, no process group: lancet_rt.load_checkpoint reads the same checkpoint.
    import lancet_rt

    expected = mc.reference_steps(mc.make_blocks(), 4)
    model = mc.make_blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    lancet_rt.load_checkpoint(model, path, opt)
    for n, p in model.named_parameters():
        mc.assert_close(f"one process loaded {n}", p.detach(), expected[0][2][n])
    x, g = mc.global_batch(1, 4)
    opt.zero_grad(set_to_none=True)
    mc.blocks_loss(model, x, g).backward()
    opt.step()
    for n, p in model.named_parameters():
        mc.assert_close(f"one process step after load {n}", p.detach(), expected[1][2][n])
