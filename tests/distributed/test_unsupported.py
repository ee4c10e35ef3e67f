"""Combinations of the MoE layer's options and the engines that are not supported are refused up
front, on every rank, naming both, instead of silently doing something else or failing
later with an unclear error:

- ``shadow_experts`` with ``pipeline_chunks > 1`` (shadowed nothing), at construction and when the
  attribute changes later (at the forward, through the layer's status exchange);
- ``shadow_experts`` with FSDP2: lancet's ``fully_shard`` (refused before any collective) and torch's
  ``fully_shard`` on the experts (a misleading PeerError at the first hot-expert step before: a
  broadcast of a DTensor; now a ValueError at the forward);
- ``shadow_experts`` with activation checkpointing under an Overlapped of 2 chunks (a CheckpointError
  in backward before: the recomputation saved other tensors);
- ``dispatcher="allreduce"`` with replicate, fully_shard, sync_gradients and GradientSync (expert
  gradients silently ep times too small before: the tokens are the same on the ep ranks);
- a forward on the meta device (failed inside autocast before).

Real gloo processes, 2 and 4 ranks; the engines' refusals issue no collective at all (every
torch.distributed collective is counted while they run), and the group works afterwards.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import assert_all_ok, run_ranks

D, E = 8, 8
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "new_group",
)


def _blocks(ep_group, **moe):
    from lancet_rt.models.blocks import MoEBlocks

    torch.manual_seed(0)
    return MoEBlocks(1, D, 2, dict(d_ffn=6, num_experts=E, top_k=2, ep_group=ep_group, **moe))


def _outcome(fn) -> str:
    try:
        fn()
        return "no error"
    except Exception as e:  # the outcome is what is compared
        return f"{type(e).__name__}: {e}"


class _CountCollectives:
    """Counts every torch.distributed collective called while open (module attributes wrapped)."""

    def __enter__(self):
        import torch.distributed as dist

        self.calls, self._saved = [], {}
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (self.calls.append(_n), _f(*a, **k))[1])
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _engine_refusals(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import GradientSync, fully_shard, replicate, sync_gradients

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    ep = mesh["ep"].get_group()
    shadowed, allreduce = _blocks(ep, shadow_experts=1), _blocks(ep, dispatcher="allreduce")
    with _CountCollectives() as counted:
        out = [
            _outcome(call)
            for call in (
                lambda: fully_shard(shadowed, mesh),
                lambda: replicate(allreduce, mesh),
                lambda: fully_shard(allreduce, mesh),
                lambda: sync_gradients(allreduce, mesh),
                lambda: GradientSync(allreduce, mesh),
            )
        ]
    out.append(counted.calls)
    # torch's own fully_shard on the experts, beside shadowing: refused at the forward, on every rank
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = _blocks(ep, shadow_experts=1)
    torch_fully_shard(model.blocks[0].moe.experts, mesh=mesh["dp"])
    x = torch.randn(4, 3, D, generator=torch.Generator().manual_seed(rank))
    x[..., 0] = 5.0  # (skewed: a hot expert)
    out.append(_outcome(lambda: model(x).sum().backward()))
    t = torch.ones(1)
    dist.all_reduce(t)  # the default group still answers
    out.append(t.item())
    return out


def test_engines_refuse_unsupported_layers_before_any_collective():
    results = assert_all_ok(run_ranks(_engine_refusals, 4, timeout=300))
    assert all(r[:-1] == results[0][:-1] for r in results), results
    out = results[0]
    assert out[0].startswith(
        "ValueError: lancet_rt.parallel.fully_shard: MoE layer blocks.0.moe has shadow_experts=1"
    ), out[0]
    for m, engine in zip(out[1:5], ("replicate", "fully_shard", "sync_gradients", "GradientSync")):
        assert (
            m.startswith(f"ValueError: lancet_rt.parallel.{engine}: MoE layer blocks.0.moe has dispatcher='allreduce'")
            and "2x too small" in m
        ), m
    assert out[5] == [], f"collectives issued before the refusals: {out[5]}"
    assert out[6].startswith("ValueError:") and "shadow_experts=1" in out[6] and "FSDP2" in out[6], out[6]
    assert all(r[-1] == 4.0 for r in results)


def _forward_refusals(rank, world):
    import torch.distributed as dist

    import lancet_rt

    group = dist.group.WORLD
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(rank))
    out = [_outcome(lambda: lancet_rt.MoE(D, 6, E, 2, ep_group=group, shadow_experts=1, pipeline_chunks=2))]
    moe = lancet_rt.MoE(D, 6, E, 2, ep_group=group, shadow_experts=1)
    moe.pipeline_chunks = 2  # changed after construction
    out.append(_outcome(lambda: moe(x)))
    moe.pipeline_chunks = 1
    out.append(list(moe(x).shape))  # the layer and the group work on

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = lancet_rt.MoE(D, 6, E, 2, ep_group=group, shadow_experts=2)

        def forward(self, h):
            return lancet_rt.checkpoint(self.moe, h)

    runner = lancet_rt.Overlapped(Checkpointed(), chunks=2)
    out.append(_outcome(lambda: runner(x.clone().requires_grad_(True)).sum().backward()))
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(D, D), lancet_rt.MoE(D, 6, E, 2, ep_group=group))
    out.append(_outcome(lambda: meta(torch.randn(6, D, device="meta"))))
    y = lancet_rt.Overlapped(Checkpointed(), chunks=1)(x.clone().requires_grad_(True))  # chunks=1: supported
    y.sum().backward()
    out.append(list(y.shape))
    return out


def test_layer_refuses_unsupported_combinations_on_every_rank(monkeypatch):
    monkeypatch.setenv("LANCET_TIMEOUT_S", "60")  # (a rank left waiting would fail, not hang)
    results = assert_all_ok(run_ranks(_forward_refusals, 2, timeout=300))
    assert results[0] == results[1], results
    out = results[0]
    assert out[0].startswith("ValueError: shadow_experts must be 0 with pipeline_chunks=2"), out[0]
    assert out[1].startswith("ValueError: shadow_experts=1 cannot be combined with pipeline_chunks=2"), out[1]
    assert out[2] == [6, D]
    assert out[3].startswith("ValueError: shadow_experts=2 cannot be combined with activation checkpointing"), out[3]
    assert out[4].startswith("ValueError: MoE layer 'moe': a forward on the meta device"), out[4]
    assert out[5] == [6, D]


def test_meta_forward_names_the_layer_and_the_device():
    import lancet_rt

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(D, D), lancet_rt.MoE(D, 6, E, 2))
    with pytest.raises(
        ValueError, match=r"MoE layer '1': a forward on the meta device .*x on meta, parameters on meta"
    ):
        lancet_rt.Overlapped(model, chunks=2)(torch.randn(4, D, device="meta"))
    moe = lancet_rt.MoE(D, 6, E, 2)
    with pytest.raises(ValueError, match=r"meta device .*x on meta, parameters on cpu"):
        moe(torch.randn(4, D, device="meta"))
