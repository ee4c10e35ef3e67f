"""Packed variable-length sequences: the model and the batches the balanced-chunks benchmark uses.

:class:`VarlenBlocks` is the benchmark's pre-norm attention + MoE block on a packed batch: the
tokens of all sequences back to back (``x_TD``) and their offsets ``cu_seqlens`` ``[B + 1]``;
attention is causal within each sequence (one ``scaled_dot_product_attention`` per sequence, so its
cost is the sum of the squared lengths), the MoE routes every token. Row t's output depends only on
its own sequence, so it is separable at sequence boundaries, where
:class:`lancet_rt.BalancedChunks` cuts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lancet_rt.moe.layer import MoE


class VarlenAttention(nn.Module):
    """Multi-head causal self-attention within each sequence of a packed ``[T, D]`` batch."""

    def __init__(self, d_model: int, n_heads: int, *, device=None, dtype=None):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        T, D = x_TD.shape
        H = self.n_heads
        qkv = self.qkv(x_TD).view(T, 3, H, D // H)
        cu = cu_seqlens.tolist()
        ys = []
        for a, b in zip(cu, cu[1:]):
            if b > a:
                q, k, v = qkv[a:b].permute(1, 2, 0, 3)  # [H, L, D/H] each
                ys.append(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(b - a, D))
        y = torch.cat(ys) if ys else x_TD.new_zeros(0, D)
        return self.out(y)


class VarlenBlock(nn.Module):
    """x + attn(norm(x)), then x + moe(norm(x)), on a packed batch."""

    def __init__(self, d_model: int, n_heads: int, moe: MoE, *, device=None, dtype=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self.attn = VarlenAttention(d_model, n_heads, device=device, dtype=dtype)
        self.norm2 = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self.moe = moe

    def forward(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x_TD = x_TD + self.attn(self.norm1(x_TD), cu_seqlens)
        return x_TD + self.moe(self.norm2(x_TD))


class VarlenBlocks(nn.Module):
    """``layers`` :class:`VarlenBlock` s; ``forward(x_TD, cu_seqlens)`` on a packed batch.

    Args:
        layers, d_model, heads: the stack's shape.
        moe_kwargs: keyword arguments of every :class:`lancet_rt.MoE`.
    """

    def __init__(self, layers: int, d_model: int, heads: int, moe_kwargs: dict, *, device=None, dtype=None):
        super().__init__()
        self.blocks = nn.ModuleList(
            VarlenBlock(
                d_model,
                heads,
                MoE(d_model, device=device, dtype=dtype, **moe_kwargs),
                device=device,
                dtype=dtype,
            )
            for _ in range(layers)
        )

    def forward(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x_TD = block(x_TD, cu_seqlens)
        return x_TD

    def moe_layers(self) -> list:
        return [b.moe for b in self.blocks]


def skewed_lengths(batch: int, max_len: int, *, skew: float = 2.0, sort: bool = True, seed: int = 0) -> list:
    """Sequence lengths in [1, max_len] with a heavy tail: ``max_len * u**skew``, u uniform.

    ``sort=True`` orders them longest first, as a length-bucketing loader (or packing that fills
    a batch with its longest sequences first) leaves them; equal-row chunks are then most unequal.
    """
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, generator=g, dtype=torch.float64)
    lengths = [max(1, round(max_len * float(v) ** skew)) for v in u]
    return sorted(lengths, reverse=True) if sort else lengths


def cu_seqlens_of(lengths, device=None) -> torch.Tensor:
    """The ``[B + 1]`` int32 offsets of sequences of these lengths packed back to back."""
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
