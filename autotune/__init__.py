"""lancet-rt's autotuner: which chunk count to give ``lancet_rt.Overlapped``, per GPU, link and shape.

Use it in one of two ways.

**Ahead of time, with the command** (installed as ``lancet-autotune``; also ``python -m lancet_rt.autotune``)::

    lancet-autotune --device cuda --link emulated --world-size 8 --bandwidth-gbps 50 --latency-us 20 \\
        --d-model 2048 --d-ffn 4096 --experts 16 --top-k 2 --capacity-factor 1.25 \\
        --tokens 16384 --seq 1024 --layers 2 --heads 16 --dtype bfloat16 [--defer-wgrad]
    torchrun --nproc-per-node 8 -m lancet_rt.autotune --device cuda --link torch --d-model 2048 ...   # the real group

It builds ``--layers`` blocks of pre-norm causal attention + ``lancet_rt.MoE`` of that shape
(``--tokens`` per rank as ``tokens / seq`` sequences of ``--seq``), measures every candidate chunk
count (1, 2, 3, 4, 6, 8, pruned to at least ``--min-tokens-per-chunk`` tokens per chunk, to no more
chunks than sequences and, on CUDA, to those that fit in memory) as forward + backward on the real
``Overlapped`` block, in interleaved rounds after a warm-up, and prints a table of predicted and
measured step times with the choice (the fastest measured), its distance to the best measured time
and the cost model's prediction error for it. The cost model is Lancet's: stage times profiled on a
zero-cost link plus a fitted model of the link (:mod:`lancet_rt.autotune.profiling`), simulated on one compute
and one communication stream (:mod:`lancet_rt.autotune.cost_model`). The choice is stored in the cache;
running the same command again prints the stored entry and measures nothing (``--force`` re-tunes).
``--link emulated`` makes this process rank 0 of ``--world-size`` symmetric ranks on a link of
``--bandwidth-gbps`` and ``--latency-us`` (``lancet_rt.EmulatedGroup``); ``--link torch`` uses the
default process group of ``torchrun`` (gloo on CPU, NCCL on CUDA) and all ranks agree on one choice.
``--statistic min`` summarises each candidate by its fastest step instead of the median (steadier on a shared CPU).

**At training time, with** ``chunks="auto"``::

    model = lancet_rt.Overlapped(model, chunks="auto", defer_wgrad=True)

On every forward the wrapper asks :class:`AutoChunks` for the count. It derives the cache key from
the model's first MoE layer (D, F, E, K, capacity factor, dtype, expert-parallel world size and its
link), the device and the step's token count (rows x sequence of the first input), and uses, in
order: the cached count (this token bucket or a neighbouring one), the shipped default for this GPU
name, or else it tunes online: the next training steps cycle through the candidates (one warm-up
round, then two timed rounds; a step is timed from one forward to the next, so its backward and
optimizer step count), then it keeps the fastest and writes it to the cache. Chunking never changes
results, so the tuning steps train exactly like any other. With a real process group the ranks
agree on every decision, so they always run the same count.

**The cache** is one JSON file, ``~/.cache/lancet-rt/autotune.json`` by default (under
``$XDG_CACHE_HOME`` when that is set). Set ``LANCET_AUTOTUNE_CACHE=/path/to/autotune.json`` (read by
``lancet_rt.env.autotune_cache_path()``), or pass ``--cache PATH`` to the command, to put it
elsewhere, for example on a shared filesystem so every node finds it. Entries are keyed by the device
identity (NVML: GPU name, memory, SM count, clocks; ``"cpu"`` with the CPU model and cores on CPU), the
expert-parallel world size, the link (backend and configured, or measured and rounded, bandwidth),
dtype, D, F, E, K, capacity factor and the power-of-two token bucket; the value holds the chunk count,
the schedule options it was tuned with (``defer_wgrad``) and the table of predicted and measured
times. Writes are atomic and safe from concurrent processes; a corrupted, foreign or other-version
file is ignored with a warning and replaced on the next write. Shipped defaults live in
``autotune/defaults.json`` (same format, keyed by GPU name); ``--export-defaults PATH`` adds the
command's entry to such a file.

Main pieces: :class:`AutoChunks` (online), :class:`TuneCache`/:class:`CacheKey` (cache),
:func:`device_identity` (GPU identity), :func:`search`/:class:`StepRunner` (measurement),
:class:`CostModel`/:class:`Profiler`/:class:`LinkModel`/:func:`simulate` (cost model).

Imported under another name than ``lancet_rt.autotune`` (this folder found first as the top-level
``autotune``, which is another distribution's), it loads that package instead (``kernels/_aside.py``).
"""

if __name__ != "lancet_rt.autotune":  # the checkout's folder found as the top-level `autotune`: not ours
    import os as _os
    import runpy as _runpy

    _aside = _os.path.join(_os.path.dirname(__file__), _os.pardir, "kernels", "_aside.py")
    _runpy.run_path(_aside)["step_aside"](__name__, __file__)
else:
    from lancet_rt.models.blocks import TuningBlocks

    from .cache import CacheHit, CacheKey, TuneCache, token_bucket
    from .cost_model import CostModel, Prediction, SimOp, simulate
    from .gpu import DeviceIdentity, device_identity
    from .key import LinkInfo, count_tokens, key_for_layers, link_descriptor
    from .online import AutoChunks
    from .profiling import ComputeProfile, LinkModel, Profiler, profile_compute
    from .search import DEFAULT_CANDIDATES, Measurement, SearchResult, StepRunner, candidate_chunks, search

    __all__ = [
        "AutoChunks",
        "TuneCache",
        "CacheKey",
        "CacheHit",
        "token_bucket",
        "device_identity",
        "DeviceIdentity",
        "search",
        "StepRunner",
        "candidate_chunks",
        "Measurement",
        "SearchResult",
        "DEFAULT_CANDIDATES",
        "CostModel",
        "LinkModel",
        "ComputeProfile",
        "Prediction",
        "Profiler",
        "SimOp",
        "profile_compute",
        "simulate",
        "key_for_layers",
        "link_descriptor",
        "LinkInfo",
        "count_tokens",
        "TuningBlocks",
    ]

    # Overlapped(chunks="auto") and from_hf(chunks="auto") build an AutoChunks: the runtime never imports this package.
    from lancet_rt.schedule.policy import register_chunk_policy as _register_chunk_policy

    _register_chunk_policy("auto", AutoChunks)
