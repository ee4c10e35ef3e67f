"""Expert parallelism over real gloo processes equals the single-process layer with all experts."""

from __future__ import annotations

import pytest
import torch

from tests.dist import assert_all_ok, run_ranks

D, F, E = 10, 6, 8


def _tokens(rank, world):
    # Uneven token counts; the last rank of a 4-rank world has none.
    return [13, 0, 7, 21][rank] if world == 4 else [19, 6][rank]


def _inputs(rank, world):
    g = torch.Generator().manual_seed(100 + rank)
    T = _tokens(rank, world)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _ep_matches_single(rank, world, K, capacity_factor, score_fn, aux):
    import torch.distributed as dist

    import lancet_rt
    from tests.helpers import assert_close

    kw = dict(capacity_factor=capacity_factor, score_fn=score_fn, aux_loss_coef=aux, z_loss_coef=aux / 10)
    torch.manual_seed(0)
    full = lancet_rt.MoE(D, F, E, K, **kw)  # identical on every rank (same seed)
    ep = lancet_rt.MoE(D, F, E, K, ep_group=dist.group.WORLD, **kw)
    L = E // world
    with torch.no_grad():
        ep.router.weight.copy_(full.router.weight)
        ep.experts.gate_up_proj.copy_(full.experts.gate_up_proj[rank * L : (rank + 1) * L])
        ep.experts.down_proj.copy_(full.experts.down_proj[rank * L : (rank + 1) * L])

    x, g = _inputs(rank, world)
    x_ep = x.clone().requires_grad_(True)
    y = ep(x_ep)
    y.backward(g)

    # The single-process layer on every rank's batch separately: this rank's outputs and router
    # gradient come from its own batch; expert gradients sum over all ranks' batches.
    for r in range(world):
        xr, gr = _inputs(r, world)
        xr = xr.clone().requires_grad_(True)
        full.router.weight.grad = None
        yr = full(xr)
        yr.backward(gr)
        if r == rank:
            assert_close("y", y, yr.detach())
            assert_close("grad x", x_ep.grad, xr.grad)
            assert_close("grad router", ep.router.weight.grad, full.router.weight.grad)
            assert ep.tokens_per_expert.tolist() == full.tokens_per_expert.tolist()
            assert ep.dropped == full.dropped
            if xr.shape[0]:
                assert_close("aux", ep.aux_loss.reshape(1), full.aux_loss.reshape(1))
    assert_close(
        "grad gate_up", ep.experts.gate_up_proj.grad, full.experts.gate_up_proj.grad[rank * L : (rank + 1) * L]
    )
    assert_close("grad down", ep.experts.down_proj.grad, full.experts.down_proj.grad[rank * L : (rank + 1) * L])
    return y.shape[0]


CONFIGS = [  # K, capacity_factor, score_fn, aux
    (2, None, "softmax", 0.0),
    (2, 0.75, "sigmoid", 0.01),
    (1, 1.25, "softmax", 0.1),
]


def _ep_matches_single_all(rank, world):
    """Every configuration in one spawn (a spawn costs seconds of imports; the checks milliseconds)."""
    rows = []
    for config in CONFIGS:
        try:
            rows.append(_ep_matches_single(rank, world, *config))
        except AssertionError as e:
            raise AssertionError(f"K, capacity_factor, score_fn, aux = {config}: {e}") from e
    return rows


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_single_process(world):
    rows = assert_all_ok(run_ranks(_ep_matches_single_all, world, timeout=240))
    assert rows == [[_tokens(r, world)] * len(CONFIGS) for r in range(world)]


def _bad_input_on_one_rank(rank, world):
    import torch.distributed as dist

    import lancet_rt

    ep = lancet_rt.MoE(D, F, E, 2, ep_group=dist.group.WORLD)
    ep(torch.randn(4, D))  # a good step first: the later check rides on the counts exchange
    x = torch.randn(4, D + 1 if rank == 1 else D)
    try:
        ep(x)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _config_differs(rank, world):
    import torch.distributed as dist

    import lancet_rt

    ep = lancet_rt.MoE(D, F, E, 2 if rank == 0 else 1, ep_group=dist.group.WORLD)
    try:
        ep(torch.randn(4, D))
    except ValueError as exc:
        return str(exc)
    return "no error"


def _first_input_bad(rank, world):
    import torch.distributed as dist

    import lancet_rt

    ep = lancet_rt.MoE(D, F, E, 2, ep_group=dist.group.WORLD)
    x = torch.randn(4, D) if rank else torch.randint(0, 2, (4, D))
    try:
        ep(x)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _every_bad_case(rank, world):
    """The three bad cases one after the other in one set of processes: each raises on every rank
    before any row moves, and the group stays usable for the next."""
    return _bad_input_on_one_rank(rank, world), _first_input_bad(rank, world), _config_differs(rank, world)


def test_bad_input_and_config_raise_on_every_rank():
    (bad0, first0, config0), (bad1, first1, config1) = assert_all_ok(run_ranks(_every_bad_case, 2, timeout=120))
    # A bad input on rank 1 after a good step.
    assert "d_model=10" in bad1
    assert "rank(s) [1]" in bad0
    # A bad very first input on rank 0 (it meets the peers' configuration check).
    assert first0.startswith("TypeError") and "floating" in first0
    assert first1.startswith("ValueError") and "rank(s) [0]" in first1
    # Configurations that differ.
    for m in (config0, config1):
        assert "differs across expert-parallel ranks" in m and "top_k" in m


def test_experts_not_divisible_by_world():
    import lancet_rt

    with pytest.raises(ValueError, match="divisible"):
        lancet_rt.MoE(D, F, 6, 2, ep_group=lancet_rt.EmulatedGroup(world_size=4))


def _one_rank_group_takes_the_collective_path(rank, world):
    import torch.distributed as dist

    import lancet_rt
    from lancet_rt.comm import group as comm
    from tests.helpers import assert_close

    calls = []
    original = comm.TorchGroup.all_to_all
    comm.TorchGroup.all_to_all = lambda self, *a: calls.append(1) or original(self, *a)
    torch.manual_seed(0)
    local = lancet_rt.MoE(D, F, E, 2, capacity_factor=1.0)
    grouped = lancet_rt.MoE(D, F, E, 2, capacity_factor=1.0, ep_group=dist.group.WORLD)
    grouped.load_state_dict(local.state_dict())
    x1 = torch.randn(9, D, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    y1, y2 = local(x1), grouped(x2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert_close("y", y2, y1)
    assert_close("grad x", x2.grad, x1.grad)
    assert_close("grad down", grouped.experts.down_proj.grad, local.experts.down_proj.grad)
    return len(calls)


def test_one_rank_group_runs_the_collectives():
    # The CPU twin of the GPU lane's "NCCL with one rank": a group of size 1 still dispatches and
    # combines through the process group (forward and backward all-to-alls).
    (n_calls,) = assert_all_ok(run_ranks(_one_rank_group_takes_the_collective_path, 1, timeout=120))
    assert n_calls == 4
