"""A small GPT-style MoE language model: pre-norm blocks of causal attention and a lancet MoE.

Used by the main job (bench.train_lm) and the overlap benchmark (bench.overlap). The model is an
ordinary eager PyTorch module: nothing in it knows about chunks or streams.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lancet_rt


class CausalSelfAttention(nn.Module):
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
    """x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, d_model: int, n_heads: int, moe: lancet_rt.MoE, *, device=None, dtype=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_heads, device=device, dtype=dtype)
        self.norm2 = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self.moe = moe

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.attn(self.norm1(x_BSD))
        return x_BSD + self.moe(self.norm2(x_BSD))


class MoEBlocks(nn.Module):
    """A stack of :class:`Block` on hidden states [B, S, D] (bench.overlap's block)."""

    def __init__(self, n_layers: int, d_model: int, n_heads: int, moe_kwargs: dict, *, device=None, dtype=None):
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, lancet_rt.MoE(d_model, device=device, dtype=dtype, **moe_kwargs),
                  device=device, dtype=dtype)
            for _ in range(n_layers))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return x_BSD

    def moe_layers(self) -> list:
        return [b.moe for b in self.blocks]


class MoELanguageModel(nn.Module):
    """Token + position embeddings, :class:`MoEBlocks`, final norm and LM head."""

    def __init__(self, vocab: int, seq_len: int, n_layers: int, d_model: int, n_heads: int, moe_kwargs: dict,
                 *, device=None, dtype=None):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model, device=device, dtype=dtype)
        self.pos = nn.Embedding(seq_len, d_model, device=device, dtype=dtype)
        self.body = MoEBlocks(n_layers, d_model, n_heads, moe_kwargs, device=device, dtype=dtype)
        self.norm = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self.head = nn.Linear(d_model, vocab, bias=False, device=device, dtype=dtype)
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        S = tokens_BS.shape[1]
        h = self.tok(tokens_BS) + self.pos(torch.arange(S, device=tokens_BS.device))
        return self.head(self.norm(self.body(h)))

    def moe_layers(self) -> list:
        return self.body.moe_layers()
