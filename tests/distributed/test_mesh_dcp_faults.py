"""save_sharded / load_sharded under the checkpoint safety layer, 4 gloo ranks on a
(dp=2, ep=2) mesh, each spawn under the hang guard:

- ranks passing different paths: a ValueError on every rank naming each path, nothing written;
- a truncated ``.distcp``, and one bit flipped inside a tensor's bytes: a ValueError naming the file,
  the key and the rank (the flip: by the CRC-32 in the metadata), and no parameter changed on any rank;
- ``save_checkpoint`` / ``load_checkpoint`` on a fully_shard model: a ValueError on every rank
  pointing to ``save_sharded`` / ``load_sharded``;
- a rank that does not call ``save_sharded``: its peers raise PeerTimeout naming it (4 s here);
- a rank SIGKILLed in the middle of ``save_sharded``'s write: its peers raise PeerError naming it
  ("its process has exited") and the previous checkpoint loads, equal to a copy saved beside it.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from lancet_rt import env
from tests.checkpoint.test_checksums import flip_bit, tensor_bytes_at
from tests.dist import run_ranks
from tests.distributed import mesh_cases as mc

TIMEOUT_S = 120.0
SKIP_TIMEOUT_S = 4.0


def _outcome(fn) -> list:
    try:
        return ["ok", fn(), None]
    except BaseException as exc:  # what escapes is the outcome
        return [type(exc).__name__, str(exc), getattr(exc, "global_ranks", None)]


def _sharded(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = mc.make_blocks(mesh["ep"].get_group())
    mc.load_from_reference(model, mc.make_blocks(), mesh["ep"].get_local_rank())
    fully_shard(model, mesh, blocks=list(model.blocks))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, g = (mc.local(t, rank) for t in mc.global_batch(0, world))
    mc.blocks_loss(model, x, g).backward()
    opt.step()
    return mesh, model, opt


def _local_state(model, opt) -> list:
    """This rank's shards of every parameter and momentum buffer."""
    out = [p.detach().to_local().clone() for p in model.parameters()]
    return out + [s["momentum_buffer"].to_local().clone() for s in opt.state.values()]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _until_given_up(ranks):
    import time

    import torch.distributed as dist

    store = dist.distributed_c10d._get_process_group_store(dist.group.WORLD)
    deadline = time.monotonic() + 120
    while not store.check([f"lancet_rt/fail/{r}" for r in ranks]) and time.monotonic() < deadline:
        time.sleep(0.05)


EXPERT_KEY = "model.blocks.1.moe.experts.down_proj"


def _cases(rank, world, root):
    import torch.distributed as dist

    import lancet_rt
    from lancet_rt.comm.group import as_group
    from lancet_rt.parallel import load_sharded, save_sharded

    os.environ[env.TIMEOUT] = str(TIMEOUT_S)
    torch.set_num_threads(1)
    mesh, model, opt = _sharded(rank, world)
    path = os.path.join(root, "ckpt")
    save_sharded(model, mesh, path, opt)
    res = {}
    mine = os.path.join(root, f"rank{rank}")
    res["different paths"] = _outcome(lambda: save_sharded(model, mesh, mine, opt))
    res["nothing written"] = not os.path.exists(mine)
    res["save_checkpoint"] = _outcome(lambda: lancet_rt.save_checkpoint(model, os.path.join(root, "never")))
    res["load_checkpoint"] = _outcome(lambda: lancet_rt.load_checkpoint(model, path))
    res["never written"] = not os.path.exists(os.path.join(root, "never"))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    before = _local_state(model, opt)
    for damage in ("truncated", "bit flip"):
        if rank == 0:
            if damage == "truncated":
                file = os.path.join(path, "__1_0.distcp")
                data = open(file, "rb").read()
                open(file, "wb").write(data[: len(data) // 2])
            else:
                open(file, "wb").write(data)  # the truncated file back, then one bit of a tensor flipped
                flip_bit(*tensor_bytes_at(path, EXPERT_KEY))
        dist.barrier()
        res[damage] = _outcome(lambda: load_sharded(model, mesh, path, opt))
        res[f"{damage}: unchanged"] = _same(_local_state(model, opt), before)
    # Last, the group breaks: rank 3 does not call, its peers time out naming it.
    as_group(dist.group.WORLD).set_timeout(SKIP_TIMEOUT_S)
    skipped = os.path.join(root, "skipped")
    if rank == 3:
        _until_given_up([0, 1, 2])
    else:
        res["a rank does not call"] = _outcome(lambda: save_sharded(model, mesh, skipped, opt))
    res["skipped: nothing written"] = not os.path.exists(skipped)
    return res


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    results = run_ranks(_cases, 4, str(root), timeout=300)
    for r in range(4):
        assert results[r][0] == "ok", results[r][1]
    return [results[r][1] for r in range(4)]


def test_ranks_passing_different_paths_raise_before_writing(cases):
    for res in cases:
        kind, msg, _ = res["different paths"]
        assert kind == "ValueError" and "path: the ranks passed different values" in msg, (kind, msg)
        assert all(f"rank{q}'" in msg for q in range(4)), msg
        assert res["nothing written"]


def test_save_checkpoint_on_a_fully_shard_model_points_to_save_sharded(cases):
    for res in cases:
        kind, msg, _ = res["save_checkpoint"]
        assert kind == "ValueError" and "fully_shard" in msg and "lancet_rt.parallel.save_sharded" in msg, (kind, msg)
        kind, msg, _ = res["load_checkpoint"]
        assert kind == "ValueError" and "lancet_rt.parallel.load_sharded" in msg, (kind, msg)
        assert res["never written"]


@pytest.mark.parametrize(
    "damage, words",
    [
        ("truncated", ["__1_0.distcp", "is truncated", "its data for key "]),
        ("bit flip", ["checksum mismatch", f"key {EXPERT_KEY}", "could not be read on rank"]),
    ],
)
def test_a_damaged_file_raises_a_named_value_error_and_changes_no_parameter(cases, damage, words):
    for r, res in enumerate(cases):
        kind, msg, _ = res[damage]
        assert kind == "ValueError" and all(w in msg for w in words), (r, kind, msg)
        assert ".distcp" in msg, msg
        assert res[f"{damage}: unchanged"], r


def test_a_rank_that_does_not_call_save_sharded_is_named_by_its_peers(cases):
    for r in (0, 1, 2):
        # PeerTimeout where the monitor's timeout ended the wait; PeerError where gloo's own (set to the
        # same) ended it first; rank 3 named by the roll call (a loaded machine may add a slow live peer)
        kind, msg, ranks = cases[r]["a rank does not call"]
        assert kind in ("PeerTimeout", "PeerError") and 3 in ranks, (r, kind, ranks, msg)
        assert "rank 3 has not reached collective" in msg and "checkpoint agreement" in msg, msg
    assert any(res["a rank does not call"][0] == "PeerTimeout" for res in cases[:3]), cases[:3]
    assert all(res["skipped: nothing written"] for res in cases)


def _killed_in_save(rank, world, root):
    from torch.distributed.checkpoint import FileSystemWriter

    from lancet_rt.parallel import save_sharded

    os.environ[env.TIMEOUT] = str(TIMEOUT_S)
    torch.set_num_threads(1)
    mesh, model, opt = _sharded(rank, world)
    path, ref = os.path.join(root, "ckpt"), os.path.join(root, "ref")
    save_sharded(model, mesh, path, opt)
    save_sharded(model, mesh, ref, opt)  # the same state, to compare with after the kill
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    if rank == 3:
        real = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            real(self, plan, planner).wait()  # this rank's new data is on disk, its metadata not yet anywhere
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    out = _outcome(lambda: save_sharded(model, mesh, path, opt))
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return out


def test_a_rank_killed_during_save_sharded_leaves_the_previous_checkpoint(tmp_path):
    import lancet_rt

    results = run_ranks(_killed_in_save, 4, str(tmp_path), timeout=300, may_die=(3,))
    assert 3 not in results, "rank 3 killed itself"
    for r in (0, 1, 2):
        assert results[r][0] == "ok", results[r][1]
        kind, msg, ranks = results[r][1]
        assert kind in ("PeerError", "PeerTimeout") and 3 in ranks, (r, kind, ranks, msg)
        assert "rank 3: its process has exited" in msg, msg
    got, want = mc.make_blocks(), mc.make_blocks()
    with torch.no_grad():
        for p in got.parameters():
            p.zero_()
    lancet_rt.load_checkpoint(got, tmp_path / "ckpt")
    lancet_rt.load_checkpoint(want, tmp_path / "ref")
    for (n, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        assert torch.equal(a, b), n
