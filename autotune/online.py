"""``chunks="auto"``: the cached chunk count, or one tuned online over the first training steps.

:class:`lancet_rt.Overlapped` creates one :class:`AutoChunks` on its first ``chunks="auto"`` forward
and asks it for the chunk count on every forward. For the key of the model (its MoE layers' shape and
link, the device, the tokens of this step) it returns, in order of preference:

1. the user's cache entry (exact token bucket, or one within ``max_bucket_distance`` buckets);
2. the shipped defaults for this GPU name;
3. otherwise it tunes online: the next steps run the candidates in interleaved rounds (a warm-up
   round, then ``timed_rounds`` timed ones), each step timed from one ``next_chunks`` call to the next
   (the backward of a step runs after its forward returns; on CUDA the device is synchronized at each
   call while tuning), then keeps the fastest and writes it to the cache.

Chunking changes no number, so switching the count between steps is free of side effects on the
training itself. With a real process group every rank must use the same count (else the all-to-alls
would not match): the ranks agree on the token count, on the cache entry and on the timings (their
maximum) with one small all-gather each, so they always decide alike.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.utils import _pytree as pytree

import lancet_rt

from .cache import CacheHit, CacheKey, TuneCache
from .gpu import device_identity
from .key import agree_max, count_tokens, key_for_layers, link_descriptor
from .search import DEFAULT_CANDIDATES, DEFAULT_MIN_TOKENS_PER_CHUNK, candidate_chunks

log = logging.getLogger("autotune")


@dataclass
class _Tuning:
    """The state of one cache key: its decision, or the online tuning in progress."""

    key: CacheKey
    tokens: int
    schedule: list
    warmup_steps: int
    pos: int = 0
    samples: dict = field(default_factory=dict)
    choice: Optional[int] = None
    source: str = "tuning"

    def next(self) -> tuple[int, Optional[int]]:
        """(chunk count for this step, its schedule index or None when not tuning)."""
        if self.choice is not None:
            return self.choice, None
        i = self.pos
        self.pos += 1
        return self.schedule[i], i

    def record(self, index: int, ms: float) -> None:
        if index >= self.warmup_steps:
            self.samples.setdefault(self.schedule[index], []).append(ms)

    @property
    def complete(self) -> bool:
        return self.choice is None and self.pos >= len(self.schedule)


class AutoChunks:
    """Chunk counts for an :class:`lancet_rt.Overlapped` with ``chunks="auto"``.

    Args:
        overlapped: the wrapped model.
        cache: the :class:`autotune.cache.TuneCache` to read and write (default: the file named by
            ``LANCET_AUTOTUNE_CACHE``, else ``~/.cache/lancet-rt/autotune.json``, plus the shipped defaults).
        candidates: chunk counts to try when tuning.
        min_tokens_per_chunk: prune candidates that would give a chunk fewer tokens.
        warmup_rounds: untimed rounds over the candidates before timing.
        timed_rounds: timed rounds; each candidate keeps its fastest step.
        max_bucket_distance: accept a cache entry this many power-of-two token buckets away.

    Attributes:
        last_chunks: the count returned by the latest call.
        last_source: where it came from: ``"cache"``, ``"defaults"``, ``"tuning"`` (a step of the
            online search), ``"tuned"`` (the online choice), ``"single"`` (one candidate only) or
            ``"no-moe"`` (the model has no lancet MoE layer: 1 chunk).
        last_key: the :class:`CacheKey` of the latest call (None without MoE layers).
        tuning_steps: steps run as part of an online search so far.
    """

    def __init__(
        self,
        overlapped,
        *,
        cache: Optional[TuneCache] = None,
        candidates: Sequence[int] = DEFAULT_CANDIDATES,
        min_tokens_per_chunk: int = DEFAULT_MIN_TOKENS_PER_CHUNK,
        warmup_rounds: int = 1,
        timed_rounds: int = 2,
        max_bucket_distance: float = 1.0,
    ):
        if not isinstance(overlapped, lancet_rt.Overlapped):
            raise TypeError(f"overlapped must be a lancet_rt.Overlapped, got {type(overlapped).__name__}")
        if cache is not None and not isinstance(cache, TuneCache):
            raise TypeError(f"cache must be a TuneCache or None, got {type(cache).__name__}")
        for name, v, lo in (("warmup_rounds", warmup_rounds, 0), ("timed_rounds", timed_rounds, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        self.overlapped = overlapped
        self.cache = cache if cache is not None else TuneCache()
        self.candidates = tuple(candidates)
        self.min_tokens_per_chunk = min_tokens_per_chunk
        self.warmup_rounds, self.timed_rounds = warmup_rounds, timed_rounds
        self.max_bucket_distance = max_bucket_distance
        self.layers = overlapped.moe_layers()
        self._group = self.layers[0].group if self.layers else None
        self._link = None
        self._identity = None
        self._states: dict[str, _Tuning] = {}
        self._pending: Optional[tuple] = None  # (state, schedule index, start time)
        self.last_chunks: Optional[int] = None
        self.last_source: Optional[str] = None
        self.last_key: Optional[CacheKey] = None
        self.tuning_steps = 0

    # ------------------------------------------------------------------ the one entry point
    def next_chunks(self, args: tuple, kwargs: dict) -> int:
        """The chunk count for this forward (called by ``Overlapped`` on every forward).

        Args:
            args, kwargs: the model's inputs for this step (their first tensor gives the token count).

        Returns:
            The chunk count, >= 1.
        """
        if not self.layers:
            self.last_chunks, self.last_source = 1, "no-moe"
            return 1
        now = self._clock(sync=self._pending is not None)
        if self._pending is not None:
            state, index, t0 = self._pending
            self._pending = None
            state.record(index, (now - t0) * 1e3)
            if state.complete:
                self._decide(state)
        tokens, rows = self._agreed_shape(args, kwargs)
        state = self._state(tokens, rows)
        if not torch.is_grad_enabled():  # an evaluation forward: not a training step, not timed
            if state.choice is not None:
                n = state.choice
            else:
                n = state.schedule[min(state.pos, len(state.schedule) - 1)]
            self._remember(state, n, state.source)
            return n
        n, index = state.next()
        if index is not None:
            self.tuning_steps += 1
            self._pending = (state, index, self._clock(sync=True))
        self._remember(state, n, "tuning" if index is not None else state.source)
        return n

    # ------------------------------------------------------------------ internals
    def _remember(self, state, n, source):
        self.last_chunks, self.last_source, self.last_key = n, source, state.key

    def _device(self) -> torch.device:
        return self.layers[0].router.weight.device

    def _clock(self, sync: bool) -> float:
        """Wall clock; while tuning, after the device has finished the previous step's work."""
        dev = self._device()
        if sync and dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    def _real_group(self) -> bool:
        g = self._group
        return g is not None and not isinstance(g, lancet_rt.EmulatedGroup) and g.size > 1

    def _agreed_shape(self, args, kwargs) -> tuple[int, int]:
        """Tokens and rows of this step; with a real group, the same on every rank (max tokens, min rows)."""
        tokens = count_tokens(args, kwargs, self.layers[0].d_model)
        rows = next(
            (
                int(v.shape[0])
                for v in pytree.tree_leaves((args, kwargs))
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ),
            1,
        )
        if self._real_group():
            got = self._group.all_gather(torch.tensor([tokens, rows], dtype=torch.int64))
            tokens, rows = int(got[:, 0].max()), int(got[:, 1].min())
        return tokens, rows

    def _state(self, tokens: int, rows: int) -> _Tuning:
        if self._link is None:
            self._identity = device_identity(self._device())
            self._link = link_descriptor(self._group, self._device())
        key = key_for_layers(self.layers, tokens, identity=self._identity, link=self._link)
        name = key.string()
        state = self._states.get(name)
        if state is not None:
            return state
        hit = self._lookup(key)
        kept, _ = candidate_chunks(tokens, max(rows, 1), self.candidates, self.min_tokens_per_chunk)
        state = _Tuning(
            key=key,
            tokens=tokens,
            schedule=(kept * (self.warmup_rounds + self.timed_rounds)),
            warmup_steps=len(kept) * self.warmup_rounds,
        )
        if hit is not None:
            state.choice, state.source = hit.chunks, hit.source
            log.info("chunks='auto': %d chunks from the %s (%s)", hit.chunks, hit.source, hit.path)
        elif len(kept) == 1:
            state.choice, state.source = kept[0], "single"
        else:
            log.info(
                "chunks='auto': no cache entry for %s; tuning over the next %d steps (candidates %s)",
                name,
                len(state.schedule),
                kept,
            )
        self._states[name] = state
        return state

    def _lookup(self, key: CacheKey) -> Optional[CacheHit]:
        hit = self.cache.lookup(key, nearest=True, max_bucket_distance=self.max_bucket_distance)
        if not self._real_group():
            return hit
        # Every rank must use the same count: take the entry of the lowest rank that has one.
        got = self._group.all_gather(torch.tensor([hit.chunks if hit is not None else 0], dtype=torch.int64))
        found = [int(v) for v in got[:, 0].tolist() if v > 0]
        if not found:
            return None
        if hit is not None and hit.chunks == found[0]:
            return hit
        return CacheHit(key=key, value={"chunks": found[0]}, exact=False, source="cache", path="(another rank)")

    def _decide(self, state: _Tuning) -> None:
        measured = sorted(state.samples)
        fastest = [min(state.samples[n]) for n in measured]
        fastest = agree_max(self._group, fastest)
        table = [dict(chunks=n, measured_ms=ms) for n, ms in zip(measured, fastest)]
        state.choice = min(zip(fastest, measured))[1]
        state.source = "tuned"
        log.info(
            "chunks='auto': tuned %s -> %d chunks (%s)",
            state.key.string(),
            state.choice,
            ", ".join(f"{r['chunks']}: {r['measured_ms']:.2f} ms" for r in table),
        )
        value = dict(
            chunks=state.choice,
            defer_wgrad=self.overlapped.defer_wgrad,
            source="online",
            tokens=state.tokens,
            statistic="fastest of timed steps",
            table=table,
        )
        try:
            self.cache.store(state.key, value)
        except OSError as exc:
            warnings.warn(
                f"lancet-rt: could not write the autotune cache {self.cache.path} ({exc}); "
                f"keeping {state.choice} chunks for this run only",
                RuntimeWarning,
                stacklevel=2,
            )
