"""``lancet-autotune`` / ``python -m lancet_rt.autotune``: tune the chunk count of an MoE block and cache it.

    python -m lancet_rt.autotune --device cpu --link emulated --world-size 4 --bandwidth-gbps 0.05 \\
        --d-model 64 --d-ffn 128 --experts 8 --top-k 2 --tokens 1024 --seq 128 --layers 2 --heads 4
    torchrun --nproc-per-node 2 -m lancet_rt.autotune --device cpu --link torch --d-model 64 ...   # gloo (cpu)
    / nccl (cuda)

It builds ``--layers`` pre-norm attention + MoE blocks with the given shape, profiles them for the
cost model, measures every candidate chunk count (forward + backward on the real ``Overlapped``
block), prints a table of predicted and measured step times and the choice, and stores the choice
in the cache (``--cache``, else ``LANCET_AUTOTUNE_CACHE``, else ``~/.cache/lancet-rt/autotune.json``).
A second run with the same arguments finds the entry and measures nothing (``--force`` re-tunes).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

import torch

import lancet_rt
from lancet_rt.cli import float_in, int_in, list_of, or_word
from lancet_rt.models.blocks import TuningBlocks

from .cache import TuneCache
from .cost_model import CostModel
from .gpu import device_identity
from .key import agree_max, key_for_layers, link_descriptor
from .profiling import LinkModel, Profiler
from .search import DEFAULT_CANDIDATES, DEFAULT_MIN_TOKENS_PER_CHUNK, StepRunner, candidate_chunks, search

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Chunk counts profiled on a zero-cost link to fit the cost model's per-chunk overhead (those kept).
PROFILE_CHUNKS = (1, 2, 4)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lancet-autotune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--link",
        choices=["emulated", "torch"],
        default="emulated",
        help="emulated: this process is rank 0 of --world-size symmetric ranks on a link of "
        "--bandwidth-gbps/--latency-us; torch: the real default process group (run under torchrun)",
    )
    p.add_argument(
        "--world-size", type=int_in(1, 1024), default=None, help="expert-parallel ranks (emulated; default 8)"
    )
    p.add_argument(
        "--bandwidth-gbps", type=float_in(0, above=True), default=None, help="emulated link bandwidth per rank, GB/s"
    )
    p.add_argument("--latency-us", type=float_in(0, 1e6), default=20.0, help="emulated link latency per collective")
    p.add_argument("--d-model", type=int_in(1), default=1024)
    p.add_argument("--d-ffn", type=int_in(1), default=2048)
    p.add_argument("--experts", type=int_in(1), default=16, help="experts over all ranks")
    p.add_argument("--top-k", type=int_in(1), default=2)
    p.add_argument(
        "--capacity-factor",
        type=or_word(float_in(0, above=True), "none", "dropless"),
        default="1.25",
        help="a number > 0, or 'none' (dropless)",
    )
    p.add_argument("--tokens", type=int_in(1), default=16384, help="tokens per step on each rank")
    p.add_argument("--seq", type=int_in(1), default=128, help="sequence length (rows = tokens / seq)")
    p.add_argument("--layers", type=int_in(1), default=2)
    p.add_argument("--heads", type=int_in(1), default=8)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--defer-wgrad", action="store_true", help="tune Overlapped(defer_wgrad=True)")
    p.add_argument("--candidates", type=list_of(int_in(1, 64)), default=",".join(map(str, DEFAULT_CANDIDATES)))
    p.add_argument("--min-tokens-per-chunk", type=int_in(0), default=DEFAULT_MIN_TOKENS_PER_CHUNK)
    p.add_argument("--warmup", type=int_in(0), default=2, help="untimed steps per candidate")
    p.add_argument("--reps", type=int_in(1), default=5, help="timed steps per candidate")
    p.add_argument(
        "--statistic",
        choices=["median", "min"],
        default="median",
        help="summary of each candidate's timed steps (min resists other processes on a shared CPU)",
    )
    p.add_argument(
        "--cache", default=None, help="cache file (default: LANCET_AUTOTUNE_CACHE or ~/.cache/lancet-rt/autotune.json)"
    )
    p.add_argument("--force", action="store_true", help="re-tune even if the cache has an entry")
    p.add_argument(
        "--export-defaults",
        default=None,
        metavar="PATH",
        help="also write the entry, keyed by GPU name, into a shipped-defaults file (autotune/defaults.json)",
    )
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def validate(args: argparse.Namespace) -> None:
    """Check the arguments; raises ValueError naming the offending option."""
    for name in ("d_model", "d_ffn", "experts", "top_k", "tokens", "seq", "layers", "heads", "reps"):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.min_tokens_per_chunk < 0:
        raise ValueError(f"--min-tokens-per-chunk must be >= 0, got {args.min_tokens_per_chunk}")
    if args.top_k > args.experts:
        raise ValueError(f"--top-k ({args.top_k}) must be <= --experts ({args.experts})")
    if args.d_model % args.heads:
        raise ValueError(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})")
    if args.tokens % args.seq:
        raise ValueError(f"--tokens ({args.tokens}) must be a multiple of --seq ({args.seq})")
    cf = str(args.capacity_factor).strip().lower()  # (argparse gives a float or None; callers may give text)
    if cf in ("none", "dropless"):
        args.capacity_factor = None
    else:
        try:
            args.capacity_factor = float(cf)
        except ValueError:
            raise ValueError(
                f"--capacity-factor must be a number > 0 or 'none', got {args.capacity_factor!r}"
            ) from None
        if not args.capacity_factor > 0 or math.isinf(args.capacity_factor):
            raise ValueError(f"--capacity-factor must be a finite number > 0 or 'none', got {args.capacity_factor}")
    try:
        args.candidates = sorted(
            {
                int(c)
                for c in (str(args.candidates).split(",") if isinstance(args.candidates, str) else args.candidates)
                if str(c).strip()
            }
        )
    except ValueError:
        raise ValueError(f"--candidates must be comma-separated ints, got {args.candidates!r}") from None
    if not args.candidates or min(args.candidates) < 1:
        raise ValueError(f"--candidates must be ints >= 1, got {args.candidates}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    if args.link == "emulated":
        if args.world_size is None:
            args.world_size = 8
        if args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        if args.bandwidth_gbps is None:
            raise ValueError("--bandwidth-gbps is required with --link emulated (GB/s per rank)")
        if not args.bandwidth_gbps > 0:
            raise ValueError(f"--bandwidth-gbps must be > 0, got {args.bandwidth_gbps}")
        if not args.latency_us >= 0:
            raise ValueError(f"--latency-us must be >= 0, got {args.latency_us}")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"


class _Env:
    """The process setup: device, link and (with --link torch) the process group."""

    def __init__(self, args):
        self.rank, self.owns_group = 0, False
        if args.link == "torch":
            import torch.distributed as dist

            if not dist.is_initialized():
                if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                    raise ValueError("--link torch needs a process group: run under torchrun (RANK/WORLD_SIZE unset)")
                # Bind this rank's GPU before NCCL starts, so that its communicator never guesses.
                device_id = _bind_local_gpu(int(os.environ["RANK"])) if args.device == "cuda" else None
                dist.init_process_group("nccl" if args.device == "cuda" else "gloo", device_id=device_id)
                self.owns_group = True
            elif args.device == "cuda":
                _bind_local_gpu(dist.get_rank())
            self.rank = dist.get_rank()
            world = dist.get_world_size()
            if args.world_size is not None and args.world_size != world:
                raise ValueError(f"--world-size ({args.world_size}) must equal the process group's size ({world})")
            args.world_size = world
            self.ep_group = dist.group.WORLD
        cuda = args.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if args.link == "emulated":
            self.ep_group = lancet_rt.EmulatedGroup(
                args.world_size, args.bandwidth_gbps, args.latency_us, device=self.device
            )
        if args.experts % args.world_size:
            raise ValueError(f"--experts ({args.experts}) must be divisible by the world size ({args.world_size})")

    def close(self):
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _print(rank: int, *a) -> None:
    if rank == 0:
        print(*a, flush=True)


def _format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    cells = [[fmt(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


_COLUMNS = [
    ("chunks", "chunks"),
    ("predicted_ms", "predicted ms"),
    ("measured_ms", "measured ms"),
    ("measured_q20_ms", "q20"),
    ("measured_q80_ms", "q80"),
    ("vs_best", "vs best"),
    ("status", "status"),
]


def _plural(n: int) -> str:
    return f"{n} chunk{'s' if n > 1 else ''}"


def _summary(value: dict) -> str:
    return (
        f"choice: {_plural(value['chunks'])}, measured {value['chosen_measured_ms']:.2f} ms; best measured "
        f"{value['best_measured_ms']:.2f} ms ({value['within_best']:+.1%} from best); predicted "
        f"{value['predicted_ms']:.2f} ms (prediction error {value['prediction_error']:+.1%})"
    )


def run(argv=None) -> dict:
    """The command, returning what it printed as a dict (``main`` is the console entry point).

    Returns:
        ``cached`` (bool: the entry was found and nothing was measured), ``chunks``, ``key`` (the
        entry's name), ``link_gbps`` (the key's link bandwidth: configured, measured on a real group, or
        None), ``cache_path``, ``table`` (per candidate: ``predicted_ms``, ``measured_ms``,
        quantiles, ``status``), ``chosen_measured_ms``, ``best_measured_ms``, ``within_best``
        (chosen / best - 1), ``predicted_ms``, ``prediction_error`` (predicted / measured - 1 for the
        choice) and, when tuned, ``model`` (the cost model's fitted parameters).
    """
    args = parse_args(argv)
    validate(args)
    env = _Env(args)
    try:
        return _tune(args, env)
    finally:
        env.close()


def _tune(args, env) -> dict:
    """Build the blocks, answer from the cache or measure, model and store; returns what ``run`` returns."""
    device, rank = env.device, env.rank
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(args.seed + rank)
    moe_kwargs = dict(
        d_ffn=args.d_ffn,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        ep_group=env.ep_group,
    )
    model = TuningBlocks(args.layers, args.d_model, args.heads, moe_kwargs, device=device, dtype=dtype)
    overlapped = lancet_rt.Overlapped(model, chunks=1, defer_wgrad=args.defer_wgrad)
    rows = args.tokens // args.seq
    x = torch.randn(rows, args.seq, args.d_model, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    runner = StepRunner(overlapped, (x,), grad_output=grad)
    layers = overlapped.moe_layers()
    group = layers[0].group
    identity = device_identity(device)
    link = link_descriptor(group, device)
    key = key_for_layers(layers, args.tokens, identity=identity, link=link)
    cache = TuneCache(args.cache)
    title = (
        f"lancet-autotune on {identity.name if identity.kind == 'cuda' else identity.key}: {args.layers} "
        f"blocks D={args.d_model} F={args.d_ffn} E={args.experts} K={args.top_k} "
        f"cf={args.capacity_factor} W={args.world_size} tokens={args.tokens} ({rows}x{args.seq}) "
        f"{args.dtype}, link {link}" + (", deferred dW" if args.defer_wgrad else "")
    )
    _print(rank, title)
    _print(rank, f"cache: {cache.path}\nkey:   {key.string()}")

    if not args.force:
        value = _cached(args, rank, group, cache, key)
        if value is not None:
            return dict(cached=True, key=key.string(), link_gbps=link.gbps, cache_path=cache.path, **value)

    result, profile, link_model = _measure(args, rank, device, dtype, runner, overlapped, rows)
    cost = CostModel(
        profile, link_model, defer_wgrad=args.defer_wgrad, counts_channel=getattr(group, "counts_channel", "shared")
    )  # TorchGroup's or EmulatedGroup's
    predicted = {m.chunks: cost.predict(m.chunks, rows).step_ms for m in result.table if m.status == "ok"}
    table, value = _tuned_value(args, result, predicted, profile, link_model, identity)
    _print(rank, _format_table(table, _COLUMNS))
    points = ", ".join(f"C({n}) = {ms:.2f}" for n, ms in profile.points.items())
    _print(
        rank,
        f"cost model: compute-only (zero-cost link) {points} ms -> per-chunk overhead "
        f"{profile.overhead_per_chunk_ms:.2f} ms, "
        f"link {link_model.latency_ms * 1e3:.0f} us + bytes / "
        f"{link_model.gbps:.3g} GB/s" + (f", dW {profile.dw_ms:.2f} ms" if args.defer_wgrad else ""),
    )
    _print(rank, _summary(value))
    try:
        cache.store(key, value)
        _print(rank, f"stored in {cache.path}")
    except OSError as exc:
        print(f"lancet-autotune: could not write the cache {cache.path}: {exc}", file=sys.stderr)
    _export(args, key, value)
    return dict(cached=False, key=key.string(), link_gbps=link.gbps, cache_path=cache.path, **value)


def _cached(args, rank: int, group, cache: TuneCache, key) -> Optional[dict]:
    """The stored entry when every rank has it (printed and exported), else None: then all ranks tune."""
    hit = cache.lookup(key, nearest=False, use_defaults=False)
    everyone = agree_max(group, [0.0 if hit is not None else 1.0])[0] == 0.0  # every rank has it
    if hit is None or not everyone:
        return None
    value = hit.value
    _print(
        rank,
        f"cache hit: {_plural(hit.chunks)} (tuned {value.get('written_at', '?')}, "
        f"source {value.get('source', '?')}); nothing re-measured (--force re-tunes)",
    )
    if value.get("table"):
        _print(rank, _format_table(value["table"], _COLUMNS))
    if "chosen_measured_ms" in value:
        _print(rank, _summary(value))
    _export(args, key, value)
    return value


def _measure(args, rank: int, device, dtype, runner, overlapped, rows: int) -> tuple:
    """Measure the candidates with the compute-only probes in the same rounds, profile the stages and
    the link; returns the search result, the compute profile and the link model."""
    layers = overlapped.moe_layers()
    group = layers[0].group
    if args.link == "torch":  # every kernel compiled and tuned before the search's first collective
        lancet_rt.warmup(overlapped, *runner.args, **runner.kwargs)  # (in --dtype: the steps run no autocast)
    kept, _ = candidate_chunks(args.tokens, rows, args.candidates, args.min_tokens_per_chunk)
    # Compute-only probes for the cost model, timed in the same rounds as the candidates.
    profile_counts = [n for n in PROFILE_CHUNKS if n in kept] or [1]
    total = (args.warmup + args.reps) * (len(kept) + len(profile_counts)) + 1
    bar = _progress(total, disable=args.no_progress or rank != 0)
    profiler = Profiler(runner, layers, wgrad_queue=overlapped.wgrad_queue)
    try:
        bar.set_description("measuring")
        result = search(
            runner,
            candidates=args.candidates,
            tokens=args.tokens,
            min_tokens_per_chunk=args.min_tokens_per_chunk,
            warmup=args.warmup,
            reps=args.reps,
            statistic=args.statistic,
            probes=profiler.probes(profile_counts),
            progress=bar.update,
            agree=lambda xs: agree_max(group, xs),
        )
        bar.set_description("profiling")
        profiler.trace()
        bar.update(1)
        profile = profiler.build(
            {n: result.probes[("compute", n)] for n in profile_counts}, statistic=args.statistic, dw_warmup=args.warmup
        )
        if args.world_size > 1 and group is not None:
            top = int(max(agree_max(group, [float(profile.max_bytes)])[0], 1 << 12))  # same sizes on every rank
            link_model = LinkModel.measure(
                group,
                device=device,
                dtype=dtype,
                row_elems=args.d_model,
                nbytes=(0, top // 4, top),
                reps=3,
                agree=lambda xs: agree_max(group, xs),
            )
            if isinstance(group, lancet_rt.TorchGroup) and not math.isinf(link_model.gbps):
                group.set_link(link_model.gbps, link_model.latency_ms * 1e3)  # dW windows of later steps
        else:
            link_model = LinkModel(0.0, math.inf)
    finally:
        bar.close()
    return result, profile, link_model


def _tuned_value(args, result, predicted: dict, profile, link_model, identity) -> tuple:
    """The table of predicted and measured times and the cache entry for the choice."""
    best = result.best_ms
    table = []
    for m in result.table:
        row = m.as_dict()
        row["predicted_ms"] = predicted.get(m.chunks) if m.status == "ok" else None
        row["vs_best"] = f"{m.ms / best - 1:+.1%}" if m.ms is not None else None
        table.append(row)
    chosen = result.measured(result.choice)
    value = dict(
        chunks=result.choice,
        defer_wgrad=args.defer_wgrad,
        source="cli",
        tokens=args.tokens,
        chosen_measured_ms=chosen.ms,
        best_measured_ms=best,
        within_best=chosen.ms / best - 1,
        predicted_ms=predicted[result.choice],
        prediction_error=predicted[result.choice] / chosen.ms - 1,
        statistic=f"{args.statistic} of {args.reps} interleaved steps after {args.warmup} warm-up rounds",
        table=table,
        model=dict(
            compute_only_ms={str(n): ms for n, ms in profile.points.items()},
            overhead_per_chunk_ms=profile.overhead_per_chunk_ms,
            forward_ms=profile.forward_ms,
            dw_ms=profile.dw_ms,
            link_latency_ms=link_model.latency_ms,
            link_gbps=None if math.isinf(link_model.gbps) else link_model.gbps,
        ),
        device=identity.as_dict(),
    )
    return table, value


def _export(args, key, value) -> None:
    if args.export_defaults:
        TuneCache(args.export_defaults, defaults_path=None).store(key, value, by="device_name")


def _progress(total: int, disable: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: a silent stand-in

        class _Null:
            def update(self, k=1): ...
            def set_description(self, s): ...
            def close(self): ...

        return _Null()
    return tqdm(total=total, disable=disable, unit="step", leave=False, file=sys.stderr)


def _bind_local_gpu(rank: int) -> torch.device:
    """Make this rank's GPU (``LOCAL_RANK``, else rank modulo the GPUs) the current device."""
    local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def main(argv: Optional[list] = None) -> int:
    """Console entry point (``lancet-autotune``); returns the exit status."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
