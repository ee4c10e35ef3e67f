"""A transformers family on a (dp=2, ep=2) mesh, 4 gloo ranks: parallelize_hf (fully_shard, replicate)
and from_hf + sync_gradients / GradientSync equal transformers in one process on the global batch
after two optimizer steps, chunks 1 and 2, with deferred dW or not."""

from __future__ import annotations

import pytest
import torch

from tests.dist import assert_all_ok, run_ranks
from tests.distributed import mesh_cases as mc

FAMILY, ROWS, SEQ = "qwen3_moe", 2, 6


def _build():
    from lancet_rt.models.hf_models import build

    # No load-balancing loss: it is a product of local-batch statistics, so no (dp, ep) run equals
    # the global batch with it; no padding, so every rank's loss is a mean over as many tokens.
    return build(FAMILY, output_router_logits=False)


def _batch(step, world):
    from lancet_rt.models.hf_models import batch

    ids, _, labels = batch(96, world * ROWS, SEQ, seed=200 + step, pad_rows=0)
    return ids, labels


def _loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def _cells(rank, world, hows):
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import GradientSync, parallelize_hf, sync_gradients

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    ep_rank = mesh["ep"].get_local_rank()
    expected = mc.reference_steps(_build(), world, batch_fn=_batch, loss_fn=_loss)
    ran = []
    for how in hows:
        for chunks, defer in mc.CELLS:
            engine = how if how in ("fully_shard", "replicate") else None
            model = parallelize_hf(_build(), mesh, engine=engine, chunks=chunks, defer_wgrad=defer)
            sync = GradientSync(model, mesh, bucket_mb=0.01) if how == "GradientSync" else None
            opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
            for step in range(2):
                ids, labels = (mc.local(t, rank, ROWS) for t in _batch(step, world))
                opt.zero_grad(set_to_none=True)
                loss = _loss(model, ids, labels)
                if sync is not None:
                    with sync:
                        loss.backward()
                else:
                    loss.backward()
                if how == "sync_gradients":
                    sync_gradients(model, mesh)
                opt.step()
                grads, params = mc.full(model) if engine == "fully_shard" else (None, None)
                mc.compare(
                    model,
                    expected[step],
                    rank,
                    ep_rank,
                    loss,
                    f"{FAMILY} {how} chunks={chunks} defer_wgrad={defer} step {step}",
                    grads=grads,
                    params=params,
                )
            ran.append((how, chunks, defer))
    return ran


@pytest.mark.parametrize("hows", [("fully_shard", "replicate"), ("sync_gradients", "GradientSync")])
def test_hf_family_on_a_mesh(hows):
    for ran in assert_all_ok(run_ranks(_cells, 4, hows, timeout=500)):
        assert len(ran) == 8, ran
