"""bench.overlap.yardstick: the lean eager layer computes lancet_rt.MoE's outputs and gradients (float64), so
the per-chunk costs it reports compare the same computation (no timing asserted)."""

import math

import pytest
import torch

import lancet_rt
from bench.overlap import yardstick


def _layer(capacity_factor):
    link = lancet_rt.EmulatedGroup(8, math.inf, 0.0, device=torch.device("cpu"))
    torch.manual_seed(0)
    return lancet_rt.MoE(
        16,
        d_ffn=24,
        num_experts=8,
        top_k=2,
        capacity_factor=capacity_factor,
        aux_loss_coef=1e-2,
        ep_group=link,
        dtype=torch.float64,
    )


@pytest.mark.parametrize("capacity_factor", [None, 1.25, 0.75])
@pytest.mark.parametrize("chunks", [1, 3])
def test_lean_layer_equals_lancet_moe(capacity_factor, chunks):
    moe = _layer(capacity_factor)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(61, 16, generator=g, dtype=torch.float64)  # (61: chunks of 21, 20, 20 rows)
    grad = torch.randn(61, 16, generator=g, dtype=torch.float64)

    x_ref = x.clone().requires_grad_(True)
    y_ref = moe(x_ref)
    y_ref.backward(grad)
    dropped = int(moe._dropped)
    ref = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad(set_to_none=True)

    x_lean = x.clone().requires_grad_(True)
    y_lean = yardstick.lean_step(yardstick.LeanMoE(moe), x_lean, grad, chunks)
    if capacity_factor is None:
        assert dropped == 0
    elif capacity_factor < 1:
        assert dropped > 0  # the carried capacity is exercised
    torch.testing.assert_close(y_lean, y_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_lean.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for n, p in moe.named_parameters():  # the router's includes the aux loss's gradient
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-12, atol=1e-12, msg=n)


def test_lean_layer_refuses_what_it_does_not_compute():
    link = lancet_rt.EmulatedGroup(4, math.inf, 0.0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="one local expert"):
        yardstick.LeanMoE(lancet_rt.MoE(16, d_ffn=24, num_experts=8, top_k=2, ep_group=link))
    link8 = lancet_rt.EmulatedGroup(8, math.inf, 0.0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="z loss"):
        yardstick.LeanMoE(lancet_rt.MoE(16, d_ffn=24, num_experts=8, top_k=2, ep_group=link8, z_loss_coef=1e-3))


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_lancet_step_runs_the_chunks_as_one_batch(capacity_factor):
    """The bench's lancet_rt.MoE step carries the batch across its chunks, as Overlapped does: the
    same drops, outputs and gradients as unchunked (the routing contract), so its per-chunk cost
    holds no per-batch work."""
    moe = _layer(capacity_factor)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(61, 16, generator=g, dtype=torch.float64)
    grad = torch.randn(61, 16, generator=g, dtype=torch.float64)
    out = {}
    for chunks in (1, 3):
        x_in = x.clone().requires_grad_(True)
        y = yardstick.lancet_step(moe, x_in, grad, chunks)
        out[chunks] = (y, x_in.grad, [p.grad.clone() for p in moe.parameters()], int(moe._dropped))
        moe.zero_grad(set_to_none=True)
    assert out[1][3] == out[3][3] and (out[3][3] > 0) == (capacity_factor is not None)
    torch.testing.assert_close(out[3][0], out[1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[3][1], out[1][1], rtol=1e-12, atol=1e-12)
    for a, b in zip(out[3][2], out[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert lancet_rt.runtime.scope.current() is None  # the scope is put back


def test_rows(tmp_path):
    rows = yardstick.main(
        ["--tokens", "64", "--d-model", "32", "--d-ffn", "32", "--reps", "1", "--json", str(tmp_path / "rows.json")]
    )
    assert [r["layer"] for r in rows] == ["lean eager MoE", "lancet_rt.MoE"]
    for r in rows:
        assert r["chunks"] == 4 and r["step_us_unchunked"] > 0
        assert r["ops_per_extra_chunk"] > 0  # every chunk runs the layer's ops again
        assert r["reads_per_extra_chunk"] == 1  # and reads its counts once


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_blocks_with_the_lean_layer_equal_the_blocks_with_lancet_moe(capacity_factor):
    """bench.overlap.yardstick --blocks compares the same computation: the blocks model with each MoE layer
    replaced by the lean one (on its parameters) gives the same outputs and every gradient, chunked
    or not, and the blocks get their own layers back."""
    from lancet_rt.models.blocks import MoEBlocks

    link = lancet_rt.EmulatedGroup(8, math.inf, 0.0, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = MoEBlocks(
        2,
        16,
        2,
        dict(d_ffn=24, num_experts=8, top_k=2, capacity_factor=capacity_factor, aux_loss_coef=1e-2, ep_group=link),
        dtype=torch.float64,
    )
    layers = list(model.moe_layers())
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 5, 16, generator=g, dtype=torch.float64)  # 7 rows: chunks of 3, 2, 2
    grad = torch.randn(7, 5, 16, generator=g, dtype=torch.float64)
    out = {}
    for layer in ("lancet_rt.MoE", "lean eager MoE"):
        for chunks in (1, 3):
            x_in = x.clone().requires_grad_(True)
            y = yardstick.blocks_step(model, x_in, grad, chunks, layer)
            out[layer, chunks] = (y, x_in.grad, {n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
            assert list(model.moe_layers()) == layers
    ref = out["lancet_rt.MoE", 1]
    for key, (y, gx, grads) in out.items():
        torch.testing.assert_close(y, ref[0], rtol=1e-12, atol=1e-12, msg=str(key))
        torch.testing.assert_close(gx, ref[1], rtol=1e-12, atol=1e-12, msg=str(key))
        for n, gp in grads.items():
            torch.testing.assert_close(gp, ref[2][n], rtol=1e-12, atol=1e-12, msg=f"{key} {n}")
    x_in = x.clone().requires_grad_(True)
    dense = yardstick.blocks_step(model, x_in, grad, 3, "none")  # the dense layers alone
    assert all(p.grad is None for m in layers for p in m.parameters())  # no MoE layer ran
    assert not torch.equal(dense, ref[0])
    assert list(model.moe_layers()) == layers


def test_blocks_rows(tmp_path):
    rows = yardstick.main(
        [
            "--blocks",
            "--layers",
            "1",
            "--batch",
            "4",
            "--seq",
            "8",
            "--d-model",
            "32",
            "--d-ffn",
            "32",
            "--reps",
            "1",
            "--json",
            str(tmp_path / "rows.json"),
        ]
    )
    assert [r["layer"] for r in rows] == list(yardstick.BLOCK_LAYERS)
    by = {r["layer"]: r for r in rows}
    for r in rows:
        assert r["chunking_overhead"] == r["step_ms_chunked"] / r["step_ms_unchunked"]
        assert r["ops_per_layer_per_extra_chunk"] > 0  # every chunk runs the model's ops again
    assert by["none"]["moe_part"] == 0  # (the dense layers' own increment is the dense part)
    ours, lean = by["lancet_rt.MoE"], by["lean eager MoE"]
    assert (
        lean["overhead_with_lean_chunks"]
        == (ours["step_ms_unchunked"] + lean["step_ms_chunked"] - lean["step_ms_unchunked"]) / ours["step_ms_unchunked"]
    )
    assert ours["ops_per_layer_per_extra_chunk"] > by["none"]["ops_per_layer_per_extra_chunk"]
