"""DynaPipe-style balanced chunks (lancet_rt.schedule.balance): bounds, and exactness against the unchunked model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks
from lancet_rt.models.varlen import VarlenBlocks, cu_seqlens_of, skewed_lengths
from lancet_rt.schedule.balance import BalancedChunks, balanced_bounds, transformer_costs
from tests.helpers import assert_same_run, run_and_grad

D = 16


def test_balanced_bounds_properties():
    costs = [9.0, 1.0, 1.0, 7.0, 0.0, 2.0, 3.0, 3.0, 1.0]
    for n in (1, 2, 3, 4, 9):
        b = balanced_bounds(costs, n)
        assert len(b) == n + 1 and b[0] == 0 and b[-1] == len(costs)
        assert all(x < y for x, y in zip(b, b[1:])), b  # every chunk gets an item (9 items >= n)
        chunk = [sum(costs[x:y]) for x, y in zip(b, b[1:])]
        assert max(chunk) - sum(costs) / n <= max(costs), (n, chunk)
    assert balanced_bounds([5.0, 5.0, 5.0, 5.0], 2) == [0, 2, 4]
    assert balanced_bounds([1.0, 1.0, 1.0, 100.0], 3) == [0, 2, 3, 4]
    assert balanced_bounds([1.0, 2.0], 4) == [0, 1, 2, 2, 2]  # fewer items than chunks: as tensor_split
    assert balanced_bounds([0.0] * 7, 3) == [0, 3, 5, 7]  # no cost: equal counts
    assert (
        balanced_bounds([0.0, 0.0, 6.0, 1.0, 1.0], 3, nonempty_first=[0, 0, 6, 1, 1])[1] == 3
    )  # chunk 0 holds a token


def test_balanced_chunks_packed_equals_model():
    """Packed sequences of skewed lengths, cut at cost-balanced sequence boundaries: outputs, drops,
    aux/z losses and every gradient equal the unchunked model's (capacity carried across uneven chunks)."""
    torch.manual_seed(0)
    model = VarlenBlocks(
        1, D, 2, dict(d_ffn=12, num_experts=4, top_k=2, capacity_factor=0.75, aux_loss_coef=0.01, z_loss_coef=0.001)
    )
    twin = copy.deepcopy(model)
    lengths = skewed_lengths(9, 24, seed=1)
    cu = cu_seqlens_of(lengths)
    x, g = torch.randn(sum(lengths), D), torch.randn(sum(lengths), D)
    balance = BalancedChunks(cu_seqlens="cu_seqlens", **transformer_costs(D, 12, 2))
    bounds = balanced_bounds(balance.costs(lengths), 3, nonempty_first=lengths)
    assert bounds != [0, 3, 6, 9], "the skewed batch must cut other than equal sequence counts"
    ov = lancet_rt.Overlapped(twin, chunks=3, defer_wgrad=True, balance=balance)
    assert_same_run(run_and_grad(model, model, (x, cu), {}, g), run_and_grad(twin, ov, (x,), dict(cu_seqlens=cu), g))
    assert sum(m.dropped for m in twin.moe_layers()) > 0, "the capacity case must drop"


def test_a_chunk_with_every_assignment_dropped():
    """Uneven chunks make it likelier that capacity is spent before the last chunks: a chunk whose
    every assignment is dropped (no rows at all) equals the unchunked run (the PyTorch references
    once read row 0 of an empty tensor there)."""
    torch.manual_seed(0)
    model = MoEBlocks(1, D, 2, dict(d_ffn=8, num_experts=2, top_k=1, capacity_factor=0.05))
    twin = copy.deepcopy(model)
    x, g = torch.randn(8, 4, D), torch.randn(8, 4, D)
    assert_same_run(
        run_and_grad(model, model, (x,), {}, g), run_and_grad(twin, lancet_rt.Overlapped(twin, chunks=4), (x,), {}, g)
    )
    assert twin.moe_layers()[0].dropped >= 30


class _Masked(nn.Module):
    """A padded batch and its mask (positional): the blocks see the masked tokens."""

    def __init__(self):
        super().__init__()
        self.body = MoEBlocks(1, D, 2, dict(d_ffn=8, num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01))

    def forward(self, x_BSD, mask_BS):
        return self.body(x_BSD * mask_BS.unsqueeze(-1))

    def moe_layers(self):
        return self.body.moe_layers()


@pytest.mark.parametrize("chunks", [2, 5])
def test_balanced_chunks_mask_equals_model(chunks):
    model = _Masked()
    twin = copy.deepcopy(model)
    mask = torch.zeros(6, 7)
    for i, n in enumerate([7, 7, 6, 2, 1, 1]):
        mask[i, :n] = 1
    x, g = torch.randn(6, 7, D), torch.randn(6, 7, D)
    ov = lancet_rt.Overlapped(twin, chunks=chunks, balance=BalancedChunks(mask=1, per_token_pair=1.0))
    assert_same_run(run_and_grad(model, model, (x, mask), {}, g), run_and_grad(twin, ov, (x, mask), {}, g))


def test_balanced_chunks_rejects_bad_arguments():
    with pytest.raises(ValueError, match="exactly one of mask= and cu_seqlens="):
        BalancedChunks()
    with pytest.raises(TypeError, match="mask"):
        BalancedChunks(mask=1.5)
    with pytest.raises(ValueError, match="per_token_pair"):
        BalancedChunks(mask=0, per_token_pair=-1.0)
    with pytest.raises(TypeError, match="balance"):
        lancet_rt.Overlapped(_Masked(), balance="tokens")
    model = _Masked()
    x, mask = torch.randn(4, 3, D), torch.ones(4, 3)
    with pytest.raises(ValueError, match="keyword argument"):
        lancet_rt.Overlapped(model, chunks=2, balance=BalancedChunks(mask="attention_mask"))(x, mask)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        lancet_rt.Overlapped(
            VarlenBlocks(1, D, 2, dict(d_ffn=8, num_experts=4, top_k=2)), chunks=2, balance=BalancedChunks(cu_seqlens=1)
        )(torch.randn(5, D), torch.tensor([0, 2, 4]))
