"""replicate's reducer finds a backward that raised by its state, not by the thread that ran its hooks.

On CUDA the gradient hooks run on the engine's device thread, never on the thread that called
``backward()`` and runs the next forward. A backward that raises inside replicate's gradient sync
(an out-of-memory error, a KeyboardInterrupt) and is caught must still be found by the next forward:
the peers, waiting in the step's bucket all-reduces, are told at once (a ``PeerError`` naming the
rank), and the reducer starts its next backward afresh. 2 gloo ranks on a (dp=1, ep=2) mesh, in both
execution modes (tests/cuda_semantics.py; the CUDA-semantics one without gloo's header check, as on
NCCL), ``LANCET_TIMEOUT_S=60`` so that finding it by the timeout fails the test. On one rank, a
second backward with no forward between finds the first one's state stale (its graph task is gone).
"""

from __future__ import annotations

import os

import torch

from lancet_rt import env
from tests import cuda_semantics  # noqa: F401 - the mode, in the ranks too
from tests.dist import outcome, run_ranks
from tests.distributed import mesh_cases as mc

TIMEOUT_S = 60.0
#: Its gradient is ready after every backward all-to-all (block 0's MoE input), before the last
#: dense buckets: rank 1 raises with the expert-parallel collectives done and some buckets not issued.
RAISES_AFTER = "blocks.0.norm2.weight"


def _step(model, step: int, rank: int):
    x, g = (mc.local(t, rank) for t in mc.global_batch(step, 2))
    loss = mc.blocks_loss(model, x, g)
    loss.backward()
    return float(loss.detach())


def _raised_and_caught(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import replicate

    os.environ[env.TIMEOUT] = str(TIMEOUT_S)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    model = mc.make_blocks(mesh["ep"].get_group())
    replicate(model, mesh, bucket_mb=0.0002)
    res = {"a healthy step": outcome(lambda: _step(model, 0, rank))}
    if rank == 1:
        raised = []

        def once(p):
            if not raised:
                raised.append(1)
                raise RuntimeError("injected out of memory in backward")

        dict(model.named_parameters())[RAISES_AFTER].register_post_accumulate_grad_hook(once)

    def caught():  # the training loop catches it (and would skip the batch)
        try:
            _step(model, 1, rank)
        except RuntimeError as exc:
            if "injected" not in str(exc):
                raise
            return "caught"

    res["the step that raises on rank 1"] = outcome(caught)
    res["the next step"] = outcome(lambda: _step(model, 2, rank))
    res["buckets"] = len(model.lancet_replicated._buckets)
    return res


def test_a_backward_raised_and_caught_under_replicate_is_named_to_every_peer(execution):
    results = run_ranks(_raised_and_caught, 2, timeout=240)
    res = []
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
        res.append(results[r][1])
    for r in (0, 1):
        assert res[r]["a healthy step"][0] == "ok", res[r]["a healthy step"]
        assert res[r]["buckets"] > 4, res[r]["buckets"]  # some buckets left unissued by the raise
    assert res[1]["the step that raises on rank 1"] == ["ok", "caught", None]
    # Rank 0 waited in the step's bucket all-reduces: told by rank 1's next forward, not by the timeout.
    kind, msg, ranks = res[0]["the step that raises on rank 1"]
    assert kind == "PeerError" and ranks == [1], (kind, ranks, msg)
    assert "raised in backward inside its gradient sync" in msg, msg
    for r in (0, 1):  # then the group is unusable, on both ranks, naming rank 1
        kind, msg, ranks = res[r]["the next step"]
        assert kind in ("GroupError", "PeerError") and ranks == [1], (r, kind, ranks, msg)
        assert "PeerTimeout" not in msg and "timeout" not in msg.lower(), msg


def _backward_after_a_raised_backward(rank, world):
    """Two losses built before either backward; the first backward raises inside the gradient sync
    and is caught, the second runs with no forward between: it must start a fresh sync."""
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import replicate

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    model = mc.make_blocks(mesh["ep"].get_group())
    reference = mc.make_blocks()
    replicate(model, mesh, bucket_mb=0.0002)
    reducer = model.lancet_replicated
    x, g = mc.global_batch(0, 1)
    first, second = mc.blocks_loss(model, x, g), mc.blocks_loss(model, x, g)
    raised = []

    def once(p):
        if not raised:
            raised.append(1)
            raise RuntimeError("injected out of memory in backward")

    handle = dict(model.named_parameters())[RAISES_AFTER].register_post_accumulate_grad_hook(once)
    res = {"first": outcome(first.backward), "left begun": reducer._in_backward}
    handle.remove()
    model.zero_grad(set_to_none=True)
    second.backward()
    mc.blocks_loss(reference, x, g).backward()
    grads = dict(reference.named_parameters())
    res["finished"] = not reducer._in_backward
    res["every bucket, in order"] = reducer.order == list(range(len(reducer._buckets)))
    res["exact"] = all(torch.equal(p.grad, grads[n].grad) for n, p in model.named_parameters())
    return res


def test_the_next_backward_after_one_that_raised_starts_a_fresh_sync(execution):
    """One rank (no peer to tell): the reducer's state, found stale by the next backward because the
    first one's graph task is gone, whichever thread ran the hooks."""
    status, res = run_ranks(_backward_after_a_raised_backward, 1, timeout=120)[0]
    assert status == "ok", res
    assert res["first"][0] == "RuntimeError" and res["left begun"], res
    assert res["finished"] and res["every bucket, in order"] and res["exact"], res
