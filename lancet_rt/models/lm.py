"""A small GPT-style MoE language model around the pre-norm attention + MoE blocks.

The blocks (:class:`MoEBlocks`) are defined once, in ``lancet_rt.models.blocks``, so the main job
(examples.train_lm), the overlap benchmark (bench.overlap) and the autotuner use the same block.
The model is an ordinary eager PyTorch module: nothing in it knows about chunks or streams.
"""

from __future__ import annotations

import torch
from torch import nn

from lancet_rt.models.blocks import MoEBlocks


class MoELanguageModel(nn.Module):
    """Token + position embeddings, :class:`MoEBlocks`, final norm and LM head."""

    def __init__(
        self,
        vocab: int,
        seq_len: int,
        n_layers: int,
        d_model: int,
        n_heads: int,
        moe_kwargs: dict,
        *,
        device=None,
        dtype=None,
    ):
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
