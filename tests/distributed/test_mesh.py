"""Data parallelism beside expert parallelism on a (dp=2, ep=2) mesh, 4 gloo ranks: sync_gradients,
GradientSync, replicate and fully_shard equal one process on the global batch after two optimizer
steps, chunked or not, with deferred dW or not; the collective order never follows dW timing."""

from __future__ import annotations

import time

import pytest
import torch

from tests import cuda_semantics  # noqa: F401 - the execution modes, in the ranks too
from tests.dist import assert_all_ok, run_ranks
from tests.distributed import mesh_cases as mc


def _mesh(world, shape=None):
    """(dp=2, ep=world/2), or the shape given: 3 dimensions are HSDP's ("dp_replicate", "dp", "ep")."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = shape or (2, world // 2)
    names = ("dp", "ep") if len(shape) == 2 else ("dp_replicate", "dp", "ep")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def issued_in_index_order(sync) -> bool:
    """On each communicator the buckets went out in index order, all of them."""
    for q in sync._queues.values():
        mine = [b.index for b in q.buckets]
        if [i for i in sync.order if i in mine] != mine:
            return False
    return True


def _explicit_steps(model, run, mesh, how, expected, rank, ep_rank, what):
    """Two steps with sync_gradients (after backward) or GradientSync (during backward)."""
    from lancet_rt.parallel import GradientSync, sync_gradients

    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sync = GradientSync(model, mesh, bucket_mb=0.0008, piece_mb=0.0003) if how == "GradientSync" else None
    for step in range(2):
        x, g = (mc.local(t, rank) for t in mc.global_batch(step, mesh.size()))
        opt.zero_grad(set_to_none=True)
        loss = mc.blocks_loss(run, x, g)
        if how == "replicate":
            loss.backward()
        elif sync is None:
            loss.backward()
            sync_gradients(model, mesh)
        else:
            with sync:
                loss.backward()
            assert issued_in_index_order(sync), sync.order
        opt.step()
        mc.compare(model, expected[step], rank, ep_rank, loss, f"{what} step {step}")
    return None if sync is None else len(sync._buckets)


def _replicate_perturbed(model, mesh):
    """replicate() from a state where every dp rank but the first holds other weights: the broadcast
    must restore the reference, and copy no expert across ep ranks (the ep ranks differ)."""
    from lancet_rt.parallel import replicate
    from lancet_rt.parallel.mesh import expert_dp_mesh

    if expert_dp_mesh(mesh).get_local_rank() > 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape))
    assert replicate(model, mesh) is model
    with pytest.raises(ValueError, match="already replicated"):
        replicate(model, mesh)


def _explicit(rank, world, hows, shape=None, cells=mc.CELLS):
    mesh = _mesh(world, shape)
    ep_rank = mesh["ep"].get_local_rank()
    expected = mc.reference_steps(mc.make_blocks(), world)
    out = []
    for how in hows:
        for chunks, defer in cells:
            model = mc.make_blocks(mesh["ep"].get_group())
            mc.load_from_reference(model, mc.make_blocks(), ep_rank)
            if how == "replicate":
                _replicate_perturbed(model, mesh)
            what = f"{how} chunks={chunks} defer_wgrad={defer}"
            out.append(
                _explicit_steps(model, mc.runner(model, chunks, defer), mesh, how, expected, rank, ep_rank, what)
            )
    return out


def test_sync_gradients_and_gradient_sync_on_a_mesh():
    buckets = assert_all_ok(run_ranks(_explicit, 4, ("sync_gradients", "GradientSync"), timeout=400))
    assert all(b[4] > 2 for b in buckets), buckets  # several buckets per GradientSync: the order is tested


def _skewed(rank, world):
    """Deferred dW delivered in a different order on every rank, rank 0 slow: the buckets still go
    out in index order everywhere and the step is exact."""
    from lancet_rt.parallel import GradientSync, replicate
    from lancet_rt.runtime import wgrad

    mesh = _mesh(world)
    ep_rank = mesh["ep"].get_local_rank()
    expected = mc.reference_steps(mc.make_blocks(), world, steps=1)
    flush, run_item = wgrad.WGradQueue.flush, wgrad.WGradQueue._run

    def skewed_flush(self):  # each rank delivers the summed dW in its own order
        items = list(self._sums.items())
        self._sums = dict(items[rank:] + items[:rank] if rank % 2 else list(reversed(items)))
        flush(self)

    def slow_run(self, item):
        if rank == 0:
            time.sleep(0.02)
        return run_item(self, item)

    wgrad.WGradQueue.flush, wgrad.WGradQueue._run = skewed_flush, slow_run
    out = []
    for how in ("GradientSync", "replicate"):
        model = mc.make_blocks(mesh["ep"].get_group())
        mc.load_from_reference(model, mc.make_blocks(), ep_rank)
        arrivals = []
        for n, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=n: arrivals.append(n))
        sync = GradientSync(model, mesh, bucket_mb=0.0008) if how == "GradientSync" else None
        if sync is None:
            sync = replicate(model, mesh, bucket_mb=0.0008).lancet_replicated
        run = mc.runner(model, 2, True)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        x, g = (mc.local(t, rank) for t in mc.global_batch(0, world))
        loss = mc.blocks_loss(run, x, g)
        if how == "GradientSync":
            with sync:
                loss.backward()
        else:
            loss.backward()
        opt.step()
        mc.compare(model, expected[0], rank, ep_rank, loss, f"{how} skewed dW")
        assert issued_in_index_order(sync), sync.order
        out.append((arrivals, [[b.index for b in q.buckets] for q in sync._queues.values()]))
    return out


def test_replicate_on_a_mesh():
    assert_all_ok(run_ranks(_explicit, 4, ("replicate",), timeout=400))


def _fsdp(rank, world, shape=None, cells=mc.CELLS):
    from lancet_rt.parallel import fully_shard

    mesh = _mesh(world, shape)
    ep_rank = mesh["ep"].get_local_rank()
    expected = mc.reference_steps(mc.make_blocks(), world)
    flushed = []
    for chunks, defer in cells:
        model = mc.make_blocks(mesh["ep"].get_group())
        mc.load_from_reference(model, mc.make_blocks(), ep_rank)
        assert fully_shard(model, mesh, blocks=list(model.blocks), reshard_after_forward=chunks == 1) is model
        run = mc.runner(model, chunks, defer)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        for step in range(2):
            x, g = (mc.local(t, rank) for t in mc.global_batch(step, world))
            opt.zero_grad(set_to_none=True)
            loss = mc.blocks_loss(run, x, g)
            loss.backward()
            opt.step()
            grads, params = mc.full(model)
            mc.compare(
                model,
                expected[step],
                rank,
                ep_rank,
                loss,
                f"fully_shard chunks={chunks} defer_wgrad={defer} step {step}",
                grads=grads,
                params=params,
            )
            if defer:
                flushed.append(run.wgrad_queue.flushed + run.wgrad_queue.ran_in_windows)
    return flushed


def test_fully_shard_on_a_mesh():
    """Experts sharded over dp (divide factor dp x ep), the rest over dp x ep: exact, deferred dW
    flushed into each unit before FSDP2 reduce-scatters it."""
    for flushed in assert_all_ok(run_ranks(_fsdp, 4, timeout=400)):
        assert len(flushed) == 4 and all(n > 0 for n in flushed), flushed  # dW really was deferred


def _accumulated(rank, world, hows):
    """Overlapped.accumulate over two microbatches (each half of the rank's rows, loss / 2), chunks 2,
    deferred dW: two steps equal the reference on the global batch (fully_shard: interleave=False)."""
    from lancet_rt.parallel import GradientSync, fully_shard, replicate, sync_gradients

    mesh = _mesh(world)
    ep_rank = mesh["ep"].get_local_rank()
    expected = mc.reference_steps(mc.make_blocks(z_loss_coef=0.0), world)
    for how in hows:
        model = mc.make_blocks(mesh["ep"].get_group(), z_loss_coef=0.0)
        mc.load_from_reference(model, mc.make_blocks(), ep_rank)
        sync = GradientSync(model, mesh, bucket_mb=0.0008) if how == "GradientSync" else None
        if how == "replicate":
            replicate(model, mesh)
        elif how == "fully_shard":
            fully_shard(model, mesh, blocks=list(model.blocks))
        ov = mc.runner(model, 2, True)
        if how == "fully_shard":  # refused before any collective: FSDP2 cannot take a forward beside a backward
            with pytest.raises(ValueError, match="interleave=False"):
                ov.accumulate([torch.randn(1, mc.SEQ, mc.D)], lambda out, i: out.sum())
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        for step in range(2):
            x, g = (mc.local(t, rank) for t in mc.global_batch(step, world))
            micro = list(x.split(1))
            opt.zero_grad(set_to_none=True)
            losses = ov.accumulate(
                micro,
                lambda out, i: mc.blocks_loss(lambda _: out, None, g[i : i + 1]) / len(micro),
                grad_sync=sync,
                interleave=how != "fully_shard",
            )
            if how == "sync_gradients":
                sync_gradients(model, mesh)
            opt.step()
            grads, params = mc.full(model) if how == "fully_shard" else (None, None)
            mc.compare(
                model,
                expected[step],
                rank,
                ep_rank,
                losses.sum(),
                f"accumulate {how} step {step}",
                grads=grads,
                params=params,
            )
    return True


def test_accumulate_on_a_mesh(execution):
    assert_all_ok(
        run_ranks(_accumulated, 4, ("sync_gradients", "GradientSync", "replicate", "fully_shard"), timeout=400)
    )


def _hsdp(rank, world, shape):
    cells = [(1, False), (2, True)]
    return _explicit(rank, world, ("sync_gradients", "GradientSync", "replicate"), shape, cells), _fsdp(
        rank, world, shape, cells
    )


@pytest.mark.parametrize("shape", [(2, 1, 2), (2, 2, 1)])
def test_hsdp_mesh(shape):
    """("dp_replicate", "dp", "ep"): experts replicated over dp_replicate and sharded over dp (FSDP2
    HSDP), reduced over dp_replicate x dp by the other engines: exact."""
    for _, flushed in assert_all_ok(run_ranks(_hsdp, 4, shape, timeout=400)):
        assert len(flushed) == 2 and all(n > 0 for n in flushed), flushed


def test_collective_order_does_not_follow_dw_timing(execution):
    results = assert_all_ok(run_ranks(_skewed, 4, timeout=300))
    for i in range(2):  # GradientSync, replicate
        arrivals = [r[i][0] for r in results]
        assert len({tuple(a) for a in arrivals}) > 1, "the test must make the gradients arrive in different orders"
        queues = [r[i][1] for r in results]  # the same buckets per communicator on every rank, issued in this order
        assert all(q == queues[0] for q in queues) and len(queues[0]) == 2, queues


def _refusals(rank, world):
    """Bad arguments raise on every rank, naming the argument, before any collective."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import GradientSync, fully_shard, parallelize_hf, replicate, sync_gradients
    from lancet_rt.parallel.mesh import reduce_op

    assert reduce_op(dist.group.WORLD, 4) == (dist.ReduceOp.SUM, 4)  # gloo: SUM, then divide
    mesh = _mesh(world)
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    wrong_ep = mc.make_blocks(dist.group.WORLD)  # expert-parallel over 4 ranks, the mesh's ep has 2
    errors = []
    for call in (
        lambda: fully_shard(mc.make_blocks(), flat),
        lambda: replicate(mc.make_blocks(), "mesh"),
        lambda: sync_gradients(wrong_ep, mesh),
        lambda: GradientSync(wrong_ep, mesh),
        lambda: fully_shard(wrong_ep, mesh),
        lambda: replicate(torch.ones(1), mesh),
        lambda: parallelize_hf(mc.make_blocks(), mesh, engine="ddp"),
        # the silent error: the dp group alone, beside an ep group
        lambda: sync_gradients(mc.make_blocks(mesh["ep"].get_group()), mesh["dp"].get_group()),
        lambda: GradientSync(mc.make_blocks(mesh["ep"].get_group()), mesh["dp"].get_group()),
    ):
        try:
            call()
            errors.append("no error")
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_bad_arguments_are_refused_on_every_rank():
    results = assert_all_ok(run_ranks(_refusals, 4, timeout=200))
    same = [[m.split(" over ranks ")[0] for m in r] for r in results]  # the ranks named differ per rank
    assert all(r == same[0] for r in same), results
    e = results[0]
    assert e[0].startswith("ValueError: mesh must have the dimensions ('dp', 'ep')"), e[0]
    assert e[1].startswith("TypeError: mesh must be a torch.distributed DeviceMesh"), e[1]
    for m in e[2:5]:
        assert m.startswith("ValueError:") and "expert-parallel over 4 rank(s)" in m and "ep_group=mesh['ep']" in m, m
    assert e[5].startswith("TypeError: model must be an nn.Module"), e[5]
    assert e[6].startswith("ValueError: engine must be one of"), e[6]
    for m in e[7:9]:
        assert m.startswith("ValueError: group: MoE layer blocks.0.moe is expert-parallel over ranks"), m
        assert "pass the ('dp', 'ep') DeviceMesh" in m, m
