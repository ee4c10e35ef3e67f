"""Faults on a (dp=2, ep=2) mesh, 4 real gloo ranks, each spawn under the hang guard:

- the MoE layers' expert-parallel group is checked by membership: a model built with
  ``ep_group=mesh["dp"]`` (the transposed group, the same size) is a ValueError naming both rank
  lists on every rank, in replicate, fully_shard, sync_gradients and GradientSync, before anything
  is broadcast or sharded (replicate used to overwrite ranks 2-3's experts with ranks 0-1's);
- messages on a mesh name global ranks: a rank killed before an expert all-reduce over ``dp``
  (group [1, 3]) is "rank 3 (group rank 1)", not "rank 1";
- FSDP2's collectives are bounded: under fully_shard + Overlapped, an out-of-memory raised on one
  rank in the middle of the forward, or a bad batch on another, gives every peer a PeerError naming
  it (from the failure records, not at the timeout) instead of a 30-minute wait in FSDP2's
  all-gather.

``LANCET_TIMEOUT_S`` is 120 s in these ranks: every expected error comes from a failure record or
a closed connection, within a poll, so nothing depends on the machine's speed (a PeerTimeout would
be a failure of the test).
"""

from __future__ import annotations

import os

import pytest
import torch

from lancet_rt import env
from tests.dist import die_reporting, run_ranks, with_the_dead
from tests.distributed import mesh_cases as mc

TIMEOUT_S = 120.0


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))


def _outcome(fn) -> list:
    """[exception type, message, global ranks at fault] of ``fn()``, or ["ok", result, None]."""
    try:
        return ["ok", fn(), None]
    except BaseException as exc:  # what escapes is the outcome
        return [type(exc).__name__, str(exc), getattr(exc, "global_ranks", None)]


def _experts(model) -> list:
    from lancet_rt.parallel import expert_parameters

    return [getattr(p, "_local_tensor", p).detach().clone() for p in expert_parameters(model)]  # (a DTensor: its shard)


def _engine_cases(rank, world, out_dir):
    """Membership refusals, then rank 3 killed before an expert all-reduce over dp (it dies last)."""
    import torch.distributed as dist

    from lancet_rt.parallel import GradientSync, dense_parameters, fully_shard, replicate, sync_gradients

    os.environ[env.TIMEOUT] = str(TIMEOUT_S)
    torch.set_num_threads(1)
    mesh = _mesh()
    res = {}
    for name, call in (
        ("replicate", lambda m: replicate(m, mesh)),
        ("fully_shard", lambda m: fully_shard(m, mesh, blocks=list(m.blocks))),
        ("sync_gradients", lambda m: sync_gradients(m, mesh)),
        ("GradientSync", lambda m: GradientSync(m, mesh)),
    ):
        model = mc.make_blocks(mesh["dp"].get_group())  # the transposed group: same size, other ranks
        with torch.no_grad():  # each rank's own experts: a broadcast over the wrong group would change them
            for p in model.parameters():
                p.add_(rank)
        before = _experts(model)
        res[name] = _outcome(lambda: call(model) and None)
        res[f"{name}: experts unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _experts(model)))
    # Global ranks in a data-parallel group's messages: only expert gradients (dp groups [0, 2] and [1, 3]).
    model = mc.make_blocks(mesh["ep"].get_group())
    for p in dense_parameters(model):
        p.requires_grad_(False)
    x, g = (mc.local(t, rank) for t in mc.global_batch(0, world))
    mc.blocks_loss(model, x, g).backward()
    sync_gradients(model, mesh)  # a first step: the dp groups' monitors know every process
    mc.blocks_loss(model, x, g).backward()
    dist.barrier()
    if rank == 3:
        die_reporting(res, out_dir, rank)
    res["rank 3 killed"] = _outcome(lambda: sync_gradients(model, mesh))
    return res


@pytest.fixture(scope="module")
def engine_cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh_faults")
    return with_the_dead(run_ranks(_engine_cases, 4, str(out), timeout=300, may_die=(3,)), 3, out)


@pytest.mark.parametrize("engine", ["replicate", "fully_shard", "sync_gradients", "GradientSync"])
def test_an_ep_group_of_the_right_size_but_other_ranks_is_refused(engine_cases, engine):
    dp_groups, ep_groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}, {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for r, res in enumerate(engine_cases):
        kind, msg, _ = res[engine]
        assert kind == "ValueError", (r, kind, msg)
        assert "expert-parallel over 2 rank(s), as many as the mesh's 'ep' dimension but not its ranks" in msg, msg
        assert f"over ranks {dp_groups[r]}" in msg and f"'ep' group over ranks {ep_groups[r]}" in msg, msg
        assert res[f"{engine}: experts unchanged"], r


def test_messages_on_a_mesh_name_global_ranks(engine_cases):
    """Rank 1's expert all-reduce runs over dp group [1, 3], where rank 3 is group rank 1."""
    kind, msg, ranks = engine_cases[1]["rank 3 killed"]
    assert kind in ("PeerError", "PeerTimeout") and "gradient all-reduce (experts)" in msg, (kind, msg)
    assert "rank 3 (group rank 1): its process has exited" in msg and ranks == [3], (ranks, msg)
    assert "failed on" in msg and "rank 1 (group rank 0):" in msg, msg  # (the label: the group served as an ep group)
    for r in (0, 2):  # dp group [0, 2]: untouched by rank 3's death
        assert engine_cases[r]["rank 3 killed"][0] == "ok", engine_cases[r]["rank 3 killed"]


def _fsdp_fault(rank, world, case):
    """fully_shard + Overlapped(chunks=2, deferred dW): one healthy step, then a step where one rank
    fails in the middle of its forward; returns what that step raised on this rank."""
    from lancet_rt.parallel import fully_shard

    os.environ[env.TIMEOUT] = str(TIMEOUT_S)
    torch.set_num_threads(1)
    mesh = _mesh()
    model = mc.make_blocks(mesh["ep"].get_group())
    mc.load_from_reference(model, mc.make_blocks(), mesh["ep"].get_local_rank())
    fully_shard(model, mesh, blocks=list(model.blocks))
    run = mc.runner(model, 2, True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i):
        x, g = (mc.local(t, rank) for t in mc.global_batch(i, world))
        if case == "bad batch" and i == 1 and rank == 2:
            x = torch.randn(x.shape[0], x.shape[1], x.shape[2] + 1)
        opt.zero_grad(set_to_none=True)
        mc.blocks_loss(run, x, g).backward()
        opt.step()

    step(0)
    if case == "out of memory" and rank == 1:  # in block 1's attention: after FSDP2 all-gathered blocks 0 and 1

        def oom(module, args):
            raise torch.OutOfMemoryError("injected: out of memory in block 1")

        model.blocks[1].attn.register_forward_pre_hook(oom)
    out = _outcome(lambda: step(1))
    out.append(_outcome(lambda: step(2))[0])  # the step after: the FSDP groups are unusable
    return out


@pytest.mark.parametrize("case, culprit", [("out of memory", 1), ("bad batch", 2)])
def test_an_exception_on_one_rank_under_fully_shard_gives_every_peer_a_named_peer_error(case, culprit):
    results = run_ranks(_fsdp_fault, 4, case, timeout=300)
    for r in range(4):
        assert results[r][0] == "ok", results[r][1]
    kind, msg, _, after = results[culprit][1]
    assert kind == ("OutOfMemoryError" if case == "out of memory" else "RuntimeError"), (kind, msg)
    for r in range(4):
        kind, msg, ranks, after = results[r][1]
        assert after in ("GroupError", "PeerError"), (r, after)  # never a silent pairing with the failed step
        if r == culprit:
            continue
        # a record, within a poll: never the timeout (PeerTimeout), never FSDP2's 30-minute wait
        assert kind == "PeerError", (r, kind, msg)
        assert f"rank(s) [{culprit}" in msg or f"rank {culprit}" in msg, (r, msg)
