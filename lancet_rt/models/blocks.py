"""The block the ``lancet-autotune`` command measures: pre-norm causal attention + a lancet MoE.

``x + attn(norm(x))``, then ``x + moe(norm(x))``, with RMSNorm; the second norm fuses the residual
add (:func:`lancet_rt.dense.add_rmsnorm`, Triton on CUDA). The one definition of this block: bench.overlap
and the main job (lancet_rt.models.lm) import it from here, so the autotuner tunes exactly the block the
benchmark measures. It is an ordinary eager module: nothing in it knows about chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lancet_rt.dense import RMSNorm
from lancet_rt.moe.layer import MoE


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on [B, S, D] (scaled_dot_product_attention)."""

    def __init__(self, d_model: int, n_heads: int, *, device=None, dtype=None):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(B, S, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    """x + attn(norm(x)), then x + moe(norm(x)); RMSNorm, the add before the second fused into it."""

    def __init__(self, d_model: int, n_heads: int, moe: MoE, *, device=None, dtype=None):
        super().__init__()
        self.norm1 = RMSNorm(d_model, eps=1e-5, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_heads, device=device, dtype=dtype)
        self.norm2 = RMSNorm(d_model, eps=1e-5, device=device, dtype=dtype)
        self.moe = moe

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        h_BSD, x_BSD = self.norm2(self.attn(self.norm1(x_BSD)), x_BSD)  # (norm(x + attn), x + attn)
        return x_BSD + self.moe(h_BSD)


class MoEBlocks(nn.Module):
    """``layers`` pre-norm blocks of causal attention and a :class:`lancet_rt.MoE`, on [B, S, D].

    Args:
        layers: number of blocks, >= 1.
        d_model: D (divisible by ``heads``).
        heads: attention heads.
        moe_kwargs: keyword arguments of every :class:`lancet_rt.MoE` (``d_ffn``, ``num_experts``,
            ``top_k``, ``capacity_factor``, ``ep_group``, ...).
        device, dtype: of the parameters.
    """

    def __init__(self, layers: int, d_model: int, heads: int, moe_kwargs: dict, *, device=None, dtype=None):
        super().__init__()
        for name, v in (("layers", layers), ("d_model", d_model), ("heads", heads)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.blocks = nn.ModuleList(
            Block(
                d_model,
                heads,
                MoE(d_model, device=device, dtype=dtype, **moe_kwargs),
                device=device,
                dtype=dtype,
            )
            for _ in range(layers)
        )

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return x_BSD

    def moe_layers(self) -> list:
        return [b.moe for b in self.blocks]


TuningBlocks = MoEBlocks  # the name the autotuner uses
