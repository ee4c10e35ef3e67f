"""Hot-expert shadowing (MoE(shadow_experts=N)) over real gloo processes equals the unshadowed layer.

Tolerance: rel RMS 1e-6 (float32) on the output, the input's and every parameter's gradient. Every
row meets the same weights and kernels either way, so the outputs and the input's and router's
gradients differ only where the grouped GEMM's row count changes a BLAS blocking (as chunking does);
a shadowed expert's weight gradient is one reassociated float32 sum (each rank's partial dW, then
the all-reduce), whose error is ~1e-7 relative: 1e-6 is ten times that and ten times tighter than
the float32 row of tests/helpers.TOLERANCES.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import assert_all_ok, run_ranks

D, F, E = 12, 10, 8
REL = 1e-6


def _tokens(rank, world):
    return [37, 0, 19, 44][rank] if world == 4 else [41, 23][rank]  # a rank without tokens at 4


def _layers(world, rank, layout, rooted=True):
    import torch.distributed as dist

    import lancet_rt
    from lancet_rt.comm.group import TorchGroup

    class AllReduceOnly(TorchGroup):  # a group without rooted collectives: the fetch falls back to all-reduces
        broadcast = reduce = None

    L = E // world
    torch.manual_seed(0)  # the same weights on every rank, then this rank's slice in both layers
    full = lancet_rt.MoE(D, F, E, 2, aux_loss_coef=0.01, experts=lancet_rt.Experts(E, D, F, layout=layout))
    with torch.no_grad():
        full.router.weight[5] += 0.8  # expert 5 hot, expert 1 warm
        full.router.weight[1] += 0.4
        for p in full.experts.parameters():
            p.add_(0.01 * torch.randn_like(p))  # biases (GPT-OSS layout) not zero
    out = []
    for shadow in (0, 2):
        group = dist.group.WORLD if rooted else AllReduceOnly(dist.group.WORLD)
        ep = lancet_rt.MoE(
            D,
            F,
            E,
            2,
            aux_loss_coef=0.01,
            ep_group=group,
            shadow_experts=shadow,
            experts=lancet_rt.Experts(L, D, F, layout=layout),
        )
        with torch.no_grad():
            for name, p in ep.named_parameters():
                src = dict(full.named_parameters())[name]
                p.copy_(src[rank * L : (rank + 1) * L] if name.startswith("experts.") else src)
        out.append(ep)
    return out


def _run(moe, x, g, chunks, defer):
    import lancet_rt

    x = x.clone().requires_grad_(True)
    runner = lancet_rt.Overlapped(moe, chunks=chunks, defer_wgrad=defer) if chunks > 1 else moe
    y = runner(x)
    y.backward(g)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}


def _shadow_matches_plain(rank, world):
    from tests.helpers import assert_close

    seen = []
    cases = (
        (1, False, "lancet", True),
        (3, False, "lancet", True),
        (2, True, "gpt_oss", True),
        (3, False, "lancet", False),
    )
    for chunks, defer, layout, rooted in cases:
        plain, shadowed = _layers(world, rank, layout, rooted)
        gen = torch.Generator().manual_seed(100 + rank)
        T = _tokens(rank, world)
        x, g = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
        a = _run(plain, x, g, chunks, defer)
        b = _run(shadowed, x, g, chunks, defer)
        case = f"chunks={chunks} defer_wgrad={defer} layout={layout} rooted={rooted}"
        assert_close(f"{case} y", b[0], a[0], rel_rms=REL)
        assert_close(f"{case} grad x", b[1], a[1], rel_rms=REL)
        assert sorted(b[2]) == sorted(a[2]), case
        for name in a[2]:
            assert_close(f"{case} grad {name}", b[2][name], a[2][name], rel_rms=REL)
        assert shadowed.tokens_per_expert.tolist() == plain.tokens_per_expert.tolist()
        seen.append(list(shadowed.shadowed))
    return seen


@pytest.mark.parametrize("world", [2, 4])
def test_shadowing_equals_the_unshadowed_layer(world):
    seen = assert_all_ok(run_ranks(_shadow_matches_plain, world, timeout=300))
    assert all(s == seen[0] for s in seen), f"ranks shadowed different experts: {seen}"
    assert all(5 in case for case in seen[0]), f"the hot expert 5 was not shadowed: {seen[0]}"


def _bad_option(rank, world):
    import torch.distributed as dist

    import lancet_rt

    out = []
    for bad, exc in ((-1, ValueError), (E + 1, ValueError), (1.0, TypeError)):
        try:
            lancet_rt.MoE(D, F, E, 2, ep_group=dist.group.WORLD, shadow_experts=bad)
            out.append("no error")
        except exc as e:
            out.append(str(e))
    ep = lancet_rt.MoE(D, F, E, 2, ep_group=dist.group.WORLD, shadow_experts=1 if rank == 0 else 0)
    try:
        ep(torch.randn(4, D))
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    ep = lancet_rt.MoE(D, F, E, 2, ep_group=dist.group.WORLD, shadow_experts=1)  # the group still works
    out.append(list(ep(torch.randn(4, D)).shape))
    return out


def test_bad_option_raises_on_every_rank_before_any_collective():
    for msgs in assert_all_ok(run_ranks(_bad_option, 2, timeout=120)):
        assert all("shadow_experts" in m for m in msgs[:4]), msgs
        assert "differs across expert-parallel ranks" in msgs[3]
        assert msgs[4] == [4, D]


def test_option_checks():
    import lancet_rt

    with pytest.raises(ValueError, match="shadow_experts.*allreduce"):
        lancet_rt.MoE(D, F, E, 2, dispatcher="allreduce", shadow_experts=1)
    with pytest.raises(TypeError, match="shadow_experts"):
        lancet_rt.MoE(D, F, E, 2, shadow_experts=True)

    class NoAllReduce:
        size, rank = 2, 0

        def all_to_all(self, *a):
            raise AssertionError

        def exchange(self, *a):
            raise AssertionError

        def all_gather(self, *a):
            raise AssertionError

    with pytest.raises(ValueError, match="shadow_experts needs an ep_group with all_reduce"):
        lancet_rt.MoE(D, F, E, 2, ep_group=NoAllReduce(), shadow_experts=1)


def _accumulate_matches_plain(rank, world):
    """Cross-microbatch interleaving (Overlapped.accumulate): microbatch i's backward, with its shadowed
    experts' gradient reduce, runs beside microbatch i+1's forward, with its fetches; every rank must issue
    them in the same order."""
    import lancet_rt
    from tests.helpers import assert_close

    plain, shadowed = _layers(world, rank, "lancet")
    gen = torch.Generator().manual_seed(300 + rank)
    micro = [torch.randn(80 + 8 * i, D, generator=gen) for i in range(3)]
    grads, seen = [], []
    for moe in (plain, shadowed):
        losses = lancet_rt.Overlapped(moe, chunks=2).accumulate(micro, lambda out, i: (out * out).sum() / 3)
        grads.append(({n: p.grad.clone() for n, p in moe.named_parameters()}, losses))
        seen.append(list(moe.shadowed))
    assert_close("losses", grads[1][1], grads[0][1], rel_rms=REL)
    for name in grads[0][0]:
        assert_close(f"accumulate grad {name}", grads[1][0][name], grads[0][0][name], rel_rms=REL)
    return seen[1]


def test_shadowing_with_cross_microbatch_interleaving():
    seen = assert_all_ok(run_ranks(_accumulate_matches_plain, 2, timeout=300))
    assert seen[0] == seen[1] and 5 in seen[0], seen


def _replicated_matches_global(rank, world):
    """Shadowing under lancet_rt.parallel.replicate on a (dp=2, ep=2) mesh: two SGD steps equal one
    process on the global batch (tests/distributed/mesh_cases.py), chunked or not."""
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.models.blocks import MoEBlocks
    from lancet_rt.parallel import replicate
    from tests.distributed import mesh_cases as mc

    rows = 48  # per rank: enough tokens that fetching the hot expert pays

    def blocks(ep_group=None, shadow=0):
        torch.manual_seed(0)
        model = MoEBlocks(
            1,
            mc.D,
            2,
            dict(d_ffn=6, num_experts=mc.E, top_k=2, z_loss_coef=0.01, ep_group=ep_group, shadow_experts=shadow),
        )
        with torch.no_grad():
            model.blocks[0].moe.router.weight[3] += 3.0  # expert 3 hot
        return model

    def batch(step, world):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(world * rows, mc.SEQ, mc.D, generator=gen)
        return x, torch.randn(x.shape, generator=gen)

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    ep_rank = mesh["ep"].get_local_rank()
    expected = mc.reference_steps(blocks(), world, batch_fn=batch)
    seen = []
    for chunks in (1, 2):
        model = blocks(mesh["ep"].get_group(), shadow=2)
        mc.load_from_reference(model, blocks(), ep_rank)
        replicate(model, mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        run = mc.runner(model, chunks, False)
        for step in range(2):
            x, g = (mc.local(t, rank, rows) for t in batch(step, world))
            opt.zero_grad(set_to_none=True)
            loss = mc.blocks_loss(run, x, g)
            loss.backward()
            opt.step()
            mc.compare(model, expected[step], rank, ep_rank, loss, f"replicate shadowed chunks={chunks} step {step}")
            seen.append(list(model.blocks[0].moe.shadowed))
    return seen


def test_shadowing_under_replicate_on_a_mesh():
    """A supported combination (the engines refuse the unsupported ones:
    tests/distributed/test_unsupported.py): replicate's hooks see the shadowed experts' reduced gradients
    as any gradient."""
    seen = assert_all_ok(run_ranks(_replicated_matches_global, 4, timeout=400))
    assert all(3 in s for r in seen for s in r), f"the hot expert 3 was not shadowed: {seen}"
