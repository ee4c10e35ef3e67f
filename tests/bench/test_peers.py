"""bench.peers: torchtitan's and DeepSpeed's MoE layers on our weights compute our outputs and gradients
(float32, dropless), alone and in the blocks model, in one process and on 2 gloo ranks (expert-parallel)."""

from __future__ import annotations

import pytest
import torch

import lancet_rt
from tests.dist import run_ranks

peers = pytest.importorskip("bench.peers.layers")
for _name in ("torchtitan", "deepspeed"):
    pytest.importorskip(_name, reason=f"{_name} is a bench extra: make peers")

D, F, E, K = 32, 48, 8, 2


def _models(group=None, rank=0):
    from lancet_rt.models.blocks import MoEBlocks

    torch.manual_seed(0)
    layer = lancet_rt.MoE(D, F, E, K, ep_group=group)
    torch.manual_seed(0)
    blocks = MoEBlocks(2, D, 4, dict(d_ffn=F, num_experts=E, top_k=K, ep_group=group))
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
    return layer, blocks, torch.randn(96, D, generator=g), torch.randn(3, 32, D, generator=g)


def _check_all(group=None, rank=0) -> dict:
    layer, blocks, x, xb = _models(group, rank)
    out = {}
    for peer in peers.PEERS:
        out[peer, "layer"] = peers.check_equal(layer, peers.peer_layer(layer, peer, group), x)
        out[peer, "blocks"] = peers.check_equal(blocks, peers.peer_blocks(blocks, peer, group), xb)
    return {k: (r["ok"], r["worst"], r["rtol"], len(r["rows"])) for k, r in out.items()}


def _assert_all(results: dict) -> None:
    for (peer, model), (ok, worst, rtol, rows) in results.items():
        assert ok, f"{peer} {model}: {worst[0]} rel RMS {worst[1]:.2e} > {rtol}"
        # output, input grad, router + 2 expert weights per layer (+ 2 norms, qkv and out per block)
        assert rows == (5 if model == "layer" else 2 + 2 * 7), (peer, model, rows)
        if peer != "torchtitan":  # float32 experts on both sides
            assert worst[1] < 1e-5 and rtol == 1e-5


def test_peers_equal_ours_one_process():
    _assert_all(_check_all())


def _ranks(rank, world):
    import torch.distributed as dist

    return _check_all(dist.group.WORLD, rank)


def test_peers_equal_ours_expert_parallel_two_ranks():
    res = run_ranks(_ranks, 2, timeout=300)
    for rank, (status, result) in res.items():
        assert status == "ok", f"rank {rank}: {result}"
        _assert_all(result)


def test_peers_tell_a_wrong_weight():
    """The check can fail: one expert's weights perturbed in the peer give a large error."""
    layer, _, x, _ = _models()
    for peer in ("torchtitan_fp32", "deepspeed"):
        theirs = peers.peer_layer(layer, peer)
        with torch.no_grad():
            next(p for n, p in theirs.named_parameters() if "gate_up" in n or "w1" in n).mul_(1.01)
        r = peers.check_equal(layer, theirs, x)
        assert not r["ok"] and r["worst"][1] > 1e-4, (peer, r["worst"])


def test_peers_refuse_what_has_no_equal():
    layer = lancet_rt.MoE(D, F, E, K)
    with pytest.raises(ValueError, match="peer must be one of"):
        peers.peer_layer(layer, "megatron")
    with pytest.raises(ValueError, match="dropless"):
        peers.peer_layer(lancet_rt.MoE(D, F, E, K, capacity_factor=1.25), "torchtitan")
    with pytest.raises(ValueError, match="dropless"):
        peers.peer_layer(lancet_rt.MoE(D, F, E, 1), "deepspeed")
    with pytest.raises(TypeError, match="moe must be a lancet_rt.MoE"):
        peers.peer_layer(torch.nn.Linear(D, D), "deepspeed")
