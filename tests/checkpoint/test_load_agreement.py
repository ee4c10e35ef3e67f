"""Loads whose ranks name different checkpoints (a "latest" link resolved per rank while a save lands):
``load_checkpoint``, ``load_hf`` and ``load_sharded`` on 2 and 4 gloo ranks, one rank passing another
valid checkpoint (directly, or through a link to it). Before, every rank reported success and the
ranks held different dense weights; now the ranks agree on the resolved path and the checkpoint's
identity (the SHA-256 of DCP's ``.metadata``, of the safetensors index and headers) before anything is
read, and every rank raises a ValueError naming the ranks and the paths, every model unchanged."""

from __future__ import annotations

import os

import pytest
import torch

import lancet_rt
from tests.dist import assert_all_ok, outcome, run_ranks

D, E = 8, 4
TIMEOUT_S = 300.0


def _model(seed, ep_group=None):
    torch.manual_seed(seed)
    return torch.nn.Sequential(lancet_rt.MoE(D, 6, E, 2, ep_group=ep_group), torch.nn.LayerNorm(D))


def _snapshot(model) -> list:
    return [v.detach().clone() for v in model.state_dict().values()]


def _two_then_load(rank, world, base, save, load, odd):
    """Save checkpoints a (seed 0) and b (seed 1) together, then load with rank ``world - 1`` passing
    ``odd`` (b, or a link to b), the others a."""
    import torch.distributed as dist

    for seed in (0, 1):
        save(_model(seed, dist.group.WORLD), f"{base}/{'ab'[seed]}")
    if rank == 0 and odd == "link":
        os.symlink(f"{base}/b", f"{base}/latest")
    dist.barrier()
    model = _model(2, dist.group.WORLD)
    before = _snapshot(model)
    path = f"{base}/a" if rank != world - 1 else f"{base}/{'b' if odd == 'b' else 'latest'}"
    got = outcome(lambda: load(model, path))
    unchanged = all(torch.equal(x, y) for x, y in zip(before, _snapshot(model)))
    return got, unchanged


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt, odd", [("dcp", "b"), ("hf", "b"), ("dcp", "link")])
def test_ranks_loading_different_checkpoints_refuse_on_every_rank(tmp_path, world, fmt, odd):
    save, load = {
        "dcp": (lancet_rt.save_checkpoint, lancet_rt.load_checkpoint),
        "hf": (lancet_rt.save_hf, lancet_rt.load_hf),
    }[fmt]
    results = assert_all_ok(run_ranks(_two_then_load, world, str(tmp_path), save, load, odd, timeout=TIMEOUT_S))
    name = "path" if fmt == "dcp" else "directory"
    for r, ((kind, msg, _), unchanged) in enumerate(results):
        assert kind == "ValueError", (r, kind, msg)
        assert msg.startswith(f"{name}: the ranks load different checkpoints (different directories)"), msg
        assert f"rank {world - 1}: {str(tmp_path / 'b')!r}" in msg and f"rank 0: {str(tmp_path / 'a')!r}" in msg
        assert unchanged, f"rank {r}'s model changed"


def _same_checkpoint_two_names(rank, world, base):
    import torch.distributed as dist

    model = _model(0, dist.group.WORLD)
    lancet_rt.save_checkpoint(model, f"{base}/step1")
    if rank == 0:
        os.symlink(f"{base}/step1", f"{base}/latest")
    dist.barrier()
    fresh = _model(2, dist.group.WORLD)
    lancet_rt.load_checkpoint(fresh, f"{base}/latest" if rank == 1 else f"{base}/step1")
    return all(torch.equal(x, y) for x, y in zip(_snapshot(model), _snapshot(fresh)))


def test_a_link_and_its_target_are_one_checkpoint(tmp_path):
    assert assert_all_ok(run_ranks(_same_checkpoint_two_names, 2, str(tmp_path), timeout=TIMEOUT_S)) == [True] * 2


def _sharded(rank, world, base, step):
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import fully_shard, load_sharded, save_sharded
    from tests.distributed import mesh_cases as mc

    shape = (world // 2, 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "ep"))
    models = []
    for seed in (0, 1):
        model = mc.make_blocks(mesh["ep"].get_group())
        mc.load_from_reference(model, mc.make_blocks(), mesh["ep"].get_local_rank())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(seed)
        fully_shard(model, mesh, blocks=list(model.blocks))
        save_sharded(model, mesh, f"{base}/{'ab'[seed]}")
        models.append(model)
    target = models[0]
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    before = [p.detach().to_local().clone() for p in target.parameters()]
    got = outcome(lambda: load_sharded(target, mesh, f"{base}/{'b' if rank == world - 1 else 'a'}"))
    unchanged = all(torch.equal(x, p.detach().to_local()) for x, p in zip(before, target.parameters()))
    return got, unchanged


@pytest.mark.parametrize("world", [2, 4])
def test_load_sharded_ranks_loading_different_checkpoints_refuse(tmp_path, world):
    results = assert_all_ok(run_ranks(_sharded, world, str(tmp_path), 0, timeout=TIMEOUT_S))
    for r, ((kind, msg, _), unchanged) in enumerate(results):
        assert kind == "ValueError" and "the ranks load different checkpoints" in msg, (r, kind, msg)
        assert unchanged, f"rank {r}'s model changed"
