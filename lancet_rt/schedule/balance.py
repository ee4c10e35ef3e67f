"""Balanced chunks (DynaPipe-style): cut :class:`lancet_rt.Overlapped`'s batch by estimated cost.

``Overlapped`` cuts dim 0 into equal rows. With variable-length sequences equal rows are unequal
work: a chunk of long sequences computes while the link idles, and the pipeline stalls. DynaPipe
(Jiang et al., arXiv 2311.10418) plans micro-batches of variable-length sequences by a cost model;
here the same idea picks the chunk boundaries: every sequence gets a cost from its length,
``per_sequence + per_token * L + per_token_pair * L**2`` (the MoE, projections and norms are linear
in the tokens, attention quadratic), and the boundaries put close to ``1/N`` of the total cost
into each chunk. ``per_sequence=1`` alone gives equal sequence counts, the equal-rows cut.

Two layouts:

- **packed** (``cu_seqlens``): the tensor arguments hold the tokens of all sequences back to back
  along dim 0 (``[T, ...]``) and ``cu_seqlens`` ``[B + 1]`` their offsets. Chunks are cut at
  sequence boundaries (never inside one) and each chunk's call gets its own ``cu_seqlens``, rebased
  to start at 0. This is the layout where lengths change the work of every layer, the MoE included.
- **padded** (``mask``): ``[B, S, ...]`` tensors and a ``[B, S]`` mask (nonzero: a real token);
  rows are cut along dim 0 as usual, at balanced boundaries. Lengths change the work only where the
  model skips padding (variable-length attention kernels); a padded MoE routes every position, so
  for its share of the work ``per_token`` should count the padded length (give ``per_token=0`` and
  let the attention's ``per_token_pair`` decide, or cut equal rows).

Exactness: the boundaries change which tokens share a chunk, never a routing decision. Chunks pass the
gating in order with carried capacity over the whole local batch, whatever their sizes, so drops are
the unchunked model's and outputs, losses and gradients equal it up to float32 rounding
(tests/test_seeds.py). Every rank computes its own boundaries from its own inputs: the chunk count
is the same everywhere (every chunk joins every collective, an empty one included), the boundaries
need not be. Reading the lengths is one host
synchronisation per forward (boundaries are host integers).
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Optional, Sequence, Union

import torch

ArgRef = Union[str, int]


class BalancedChunks:
    """Where ``Overlapped`` finds the sequence lengths, and what a sequence of length L costs.

    Args:
        mask: the padded layout: the name of a keyword argument, or the index of a positional one,
            holding a mask ``[B, S, ...]`` (nonzero = a real token; row b's length is its count).
        cu_seqlens: the packed layout: the name or index of the ``[B + 1]`` integer offsets of the
            sequences in the ``[T, ...]`` tensor arguments (``cu_seqlens[0] == 0``,
            nondecreasing, ``cu_seqlens[-1] == T``). Exactly one of ``mask`` and ``cu_seqlens``.
        per_token: cost of a token (the MoE, projections, norms), >= 0.
        per_token_pair: cost of a pair of tokens of one sequence (attention), >= 0. Only the ratios
            matter; :func:`transformer_costs` gives FLOP-based values.
        per_sequence: a fixed cost per sequence (per-sequence launches), >= 0.

    Use::

        ov = lancet_rt.Overlapped(model, chunks=4,
                                  balance=lancet_rt.BalancedChunks(cu_seqlens="cu_seqlens"))
        y_TD = ov(x_TD, cu_seqlens=cu_B1)
    """

    def __init__(
        self,
        *,
        mask: Optional[ArgRef] = None,
        cu_seqlens: Optional[ArgRef] = None,
        per_token: float = 1.0,
        per_token_pair: float = 0.0,
        per_sequence: float = 0.0,
    ):
        if (mask is None) == (cu_seqlens is None):
            raise ValueError("BalancedChunks needs exactly one of mask= and cu_seqlens= (an argument name or index)")
        for name, ref in (("mask", mask), ("cu_seqlens", cu_seqlens)):
            if ref is not None and (isinstance(ref, bool) or not isinstance(ref, (str, int))):
                raise TypeError(
                    f"{name} must be a keyword argument's name (str) or a positional index (int), "
                    f"got {type(ref).__name__}"
                )
        for name, v in (("per_token", per_token), ("per_token_pair", per_token_pair), ("per_sequence", per_sequence)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if per_token == 0 and per_token_pair == 0 and per_sequence == 0:
            raise ValueError("per_token, per_token_pair and per_sequence must not all be 0")
        self.mask, self.cu_seqlens = mask, cu_seqlens
        self.per_token, self.per_token_pair = float(per_token), float(per_token_pair)
        self.per_sequence = float(per_sequence)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def __repr__(self) -> str:
        where = f"cu_seqlens={self.cu_seqlens!r}" if self.packed else f"mask={self.mask!r}"
        return (
            f"BalancedChunks({where}, per_token={self.per_token}, per_token_pair={self.per_token_pair}, "
            f"per_sequence={self.per_sequence})"
        )

    def costs(self, lengths: Sequence[int]) -> list:
        """The estimated cost of each sequence: ``per_sequence + per_token * L + per_token_pair * L**2``."""
        return [self.per_sequence + self.per_token * n + self.per_token_pair * n * n for n in lengths]

    # ------------------------------------------------------------------ Overlapped's hooks
    def _find(self, args: tuple, kwargs: dict) -> torch.Tensor:
        ref = self.cu_seqlens if self.packed else self.mask
        name = "cu_seqlens" if self.packed else "mask"
        if isinstance(ref, str):
            if ref not in kwargs:
                raise ValueError(
                    f"BalancedChunks: {name}={ref!r} names a keyword argument the model was not "
                    f"called with (got {sorted(kwargs)})"
                )
            t = kwargs[ref]
        else:
            if not -len(args) <= ref < len(args):
                raise ValueError(
                    f"BalancedChunks: {name}={ref} is not a positional argument index (the model got {len(args)})"
                )
            t = args[ref]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"BalancedChunks: the {name} argument must be a tensor, got {type(t).__name__}")
        return t

    def lengths_leaf(self, leaves: list, args: tuple, kwargs: dict) -> Optional[int]:
        """The index among ``leaves`` of ``cu_seqlens`` (cut by sequence, not along dim 0), or None."""
        if not self.packed:
            return None
        cu = self._find(args, kwargs)
        return next(i for i, v in enumerate(leaves) if v is cu)

    def cut(self, leaves: list, cut: list, n: int, args: tuple, kwargs: dict) -> dict:
        """Split every leaf in ``cut`` along dim 0 into ``n`` pieces at balanced boundaries.

        Returns ``{leaf index: n pieces}``; with ``cu_seqlens``, its leaf too (each chunk's rebased
        offsets). Raises ValueError/TypeError naming the argument on inconsistent inputs.
        """
        t = self._find(args, kwargs)
        rows = leaves[cut[0]].shape[0]
        if self.packed:
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool or t.numel() < 1:
                raise ValueError(
                    f"BalancedChunks: cu_seqlens must be a 1-D integer tensor [B + 1], got "
                    f"{t.dtype} of shape {tuple(t.shape)}"
                )
            cu = t.tolist()  # host sync: the boundaries are host integers
            if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != rows:
                raise ValueError(
                    f"BalancedChunks: cu_seqlens must start at 0, never decrease and end at the "
                    f"tokens along dim 0 of the other tensor arguments ({rows}); got "
                    f"{cu[:4]}{'...' if len(cu) > 4 else ''} ending at {cu[-1]}"
                )
            lengths = [b - a for a, b in zip(cu, cu[1:])]
            seq_bounds = balanced_bounds(self.costs(lengths), n, nonempty_first=lengths)
            token_bounds = [cu[b] for b in seq_bounds]
            pieces = {i: leaves[i].tensor_split(token_bounds[1:-1]) for i in cut}
            base = t.new_tensor(token_bounds)
            ci = next(i for i, v in enumerate(leaves) if v is t)
            pieces[ci] = tuple(t[a : b + 1] - base[c] for c, (a, b) in enumerate(zip(seq_bounds, seq_bounds[1:])))
            return pieces
        if t.dim() < 2 or t.shape[0] != rows:
            raise ValueError(
                f"BalancedChunks: mask must be [B, S, ...] with B = {rows} rows (dim 0 of the "
                f"tensor arguments), got shape {tuple(t.shape)}"
            )
        lengths = (t != 0).reshape(rows, -1).sum(1).tolist()  # host sync
        bounds = balanced_bounds(self.costs(lengths), n)
        return {i: leaves[i].tensor_split(bounds[1:-1]) for i in cut}


def balanced_bounds(costs: Sequence[float], n: int, *, nonempty_first: Optional[Sequence[int]] = None) -> list:
    """Contiguous boundaries that put close to ``1/n`` of the total cost into each of ``n`` chunks.

    Boundary c is the prefix closest to ``c/n`` of the total (ties to the earlier one), so every
    chunk's cost is within one item's cost of the mean. With at least ``n`` items every chunk gets
    one; with fewer, the first chunks get one each and the rest none (as ``tensor_split``). All
    costs 0: equal item counts. Deterministic, O(items).

    Args:
        costs: per item (sequence), >= 0.
        n: chunk count >= 1.
        nonempty_first: optional sizes (tokens) per item; chunk 0 then gets items until it holds
            at least one token, since the MoE layer reads the batch's tokens per row from chunk 0.

    Returns:
        ``n + 1`` nondecreasing offsets from 0 to ``len(costs)``.
    """
    B = len(costs)
    if B <= n:
        return list(range(B + 1)) + [B] * (n - B)
    prefix = list(itertools.accumulate(costs, initial=0.0))
    total = prefix[-1]
    if total <= 0:  # as tensor_split: the first B % n chunks one item more
        return list(itertools.accumulate((B // n + (c < B % n) for c in range(n)), initial=0))
    first = 1
    if nonempty_first is not None and any(nonempty_first):
        first = next(i for i, s in enumerate(nonempty_first) if s) + 1
    bounds = [0]
    for c in range(1, n):
        lo = min(first if c == 1 else bounds[-1] + 1, B)
        hi = min(max(B - (n - c), lo), B)  # leave an item for each later chunk, unless chunk 0 took them
        target = total * c / n
        j = bisect.bisect_left(prefix, target, lo, hi + 1)
        best = min((k for k in (j - 1, j) if lo <= k <= hi), key=lambda k: (abs(prefix[k] - target), k))
        bounds.append(best)
    bounds.append(B)
    return bounds


def transformer_costs(d_model: int, d_ffn: int, top_k: int, *, causal: bool = True) -> dict:
    """FLOP-based ``per_token`` / ``per_token_pair`` for pre-norm attention + MoE blocks.

    Per token: the attention projections (``8 D^2``: Q, K, V and out) and the K experts' SwiGLU
    (``6 K D F``); per pair of tokens of one sequence: ``QK^T`` and ``PV`` (``4 D``), half of
    the pairs when causal. Forward FLOPs; the backward scales both alike.

    Returns:
        ``dict(per_token=..., per_token_pair=...)`` for :class:`BalancedChunks`.
    """
    for name, v in (("d_model", d_model), ("d_ffn", d_ffn), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return dict(
        per_token=float(8 * d_model * d_model + 6 * top_k * d_model * d_ffn),
        per_token_pair=float(4 * d_model) * (0.5 if causal else 1.0),
    )
