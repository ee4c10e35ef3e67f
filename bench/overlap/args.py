"""``python -m bench.overlap``'s command line, in groups by concept (the command: :mod:`bench.overlap`)."""

from __future__ import annotations

import argparse

import torch

import bench.overlap
from bench.overlap import real
from bench.overlap.accumulation import add_accumulation_args
from bench.overlap.routing import add_routing_args
from lancet_rt.cli import float_in, int_in
from lancet_rt.models.hf_models import FAMILIES as HF_FAMILIES


def _link_args(p: argparse.ArgumentParser) -> None:
    """The emulated link and the world on it."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="small sizes (CPU: well under a minute)")
    p.add_argument("--comm-ratio", type=float_in(0, 1e3, above=True), default=1.0)
    p.add_argument("--chunks", type=int_in(1, 64), default=4)
    p.add_argument("--world-size", type=int_in(1, 1024), default=8)
    p.add_argument("--latency-us", type=float_in(0, 1e6), default=None)
    p.add_argument(
        "--handshake-us",
        type=float_in(0, 1e6),
        default=None,
        help="CPU: the control round trip before each transfer may start, beside the transfers in flight "
        "(EmulatedGroup(handshake_us); a split gloo group's header check on a real link). Default: "
        "2 x --latency-us. The real link's small all-to-all time (bench.reallink, the row's "
        "a2a_latency_us) makes the emulated link pay what the real one pays per collective",
    )
    p.add_argument(
        "--counts-channel",
        choices=("own", "shared"),
        default="own",
        help="the counts exchanges on a channel of their own (default; TorchGroup(counts_group=...)) or "
        "queued behind the tokens on theirs (one communicator for both)",
    )


def _shape_args(p: argparse.ArgumentParser) -> None:
    """The model's and the batch's sizes (default: bench.overlap.shapes)."""
    p.add_argument("--layers", type=int_in(1), default=None)
    p.add_argument("--d-model", type=int_in(1), default=None)
    p.add_argument("--d-ffn", type=int_in(1), default=None)
    p.add_argument("--experts", type=int_in(1), default=None)
    p.add_argument("--top-k", type=int_in(1), default=2)
    p.add_argument("--batch", type=int_in(1), default=None, help="sequences per step")
    p.add_argument("--seq", type=int_in(1), default=None)
    p.add_argument("--capacity-factor", type=float_in(0, above=True), default=1.25)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])


def _timing_args(p: argparse.ArgumentParser) -> None:
    """How the steps are timed and summarised."""
    p.add_argument("--steps", type=int_in(1), default=None, help="timed steps per schedule")
    p.add_argument(
        "--statistic",
        choices=["min", "median"],
        default="min",
        help="summary of each schedule's interleaved steps (default min: load from elsewhere "
        "only ever slows a step, so the fastest is the steadiest estimate)",
    )
    p.add_argument(
        "--threads",
        type=int_in(1, 1024),
        default=1,
        help="CPU intra-op threads (default 1: the host is one device, and OpenMP spin-waits "
        "under oversubscription do not distort the timings)",
    )
    p.add_argument(
        "--malloc",
        choices=["keep", "default"],
        default="keep",
        help="CPU, glibc: keep freed memory in the process (default; see keep_freed_memory) or "
        "leave the allocator as it is",
    )


def _output_args(p: argparse.ArgumentParser) -> None:
    """Where the row, the trace and the drawing go, and the wall-clock allowance before the row is written."""
    p.add_argument(
        "--json", default=None, help="append a JSON row here (as soon as it is measured, before any drawing)"
    )
    p.add_argument(
        "--max-seconds",
        type=float_in(0, 1e7, above=True),
        default=None,
        help="wall-clock allowance: once spent, the calibration is not repeated and the cross-microbatch "
        "and all-reduce parts are left out, so the row is written before a hard time limit",
    )
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of one overlapped step")
    p.add_argument("--png", default=None, help="draw the timeline of one sequential and one overlapped step")


def _model_args(p: argparse.ArgumentParser) -> None:
    """Which model: the blocks or a transformers family through from_hf."""
    p.add_argument(
        "--model",
        default="blocks",
        choices=("blocks",) + HF_FAMILIES,
        help="blocks: pre-norm attention + lancet MoE blocks (lancet_rt.models.lm); or a transformers MoE "
        "architecture built from its config at these sizes and made lancet by lancet_rt.from_hf "
        "(its own attention, norms and router; dropless, as transformers computes), in training "
        "with from_hf(fused_loss=True): each chunk ends with its loss term",
    )
    p.add_argument(
        "--transformers-loss",
        dest="fused_loss",
        action="store_false",
        help="--model <family>: transformers' own loss on the whole batch's logits (from_hf's default, "
        "fused_loss=False) instead of the chunked linear cross-entropy per chunk",
    )
    p.add_argument(
        "--fused-loss",
        dest="fused_loss",
        action="store_true",
        default=True,
        help="--model <family>: the chunked linear cross-entropy per chunk (the default)",
    )
    p.add_argument(
        "--no-early-backward",
        action="store_true",
        help="fused loss: from_hf(early_backward=False): every backward all-to-all issued by the backward",
    )


def _compare_args(p: argparse.ArgumentParser) -> None:
    """A seed system against the default instead of the schedules (bench.overlap.seeds)."""
    p.add_argument(
        "--compare",
        default=None,
        choices=["balanced-chunks", "dispatchers", "replay"],
        help="instead of the four schedules, a seed system against the default (bench/overlap/seeds.py)",
    )
    p.add_argument(
        "--balance-order",
        default="sorted",
        choices=["sorted", "shuffled"],
        help="--compare balanced-chunks: the packed sequences longest first, or shuffled",
    )
    p.add_argument(
        "--replay-from",
        default="2,8",
        help="--compare replay: chunk counts to trace (the first alone, then all, predict; far "
        "apart, so that noise weighs little on the per-chunk overhead they fit)",
    )
    p.add_argument(
        "--replay-traces",
        type=int_in(1),
        default=20,
        help="--compare replay: traced steps per chunk count (the fastest is kept)",
    )
    p.add_argument("--replay-defer-wgrad", action="store_true", help="--compare replay: Overlapped(defer_wgrad=True)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=bench.overlap.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _link_args(p)
    _shape_args(p)
    _timing_args(p)
    _output_args(p)
    _model_args(p)
    _compare_args(p)
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless hidden_comm_fraction >= 0.6 and Overlapped beats both baselines "
        "(with --microbatches M > 1, also the cross-microbatch acceptance)",
    )
    add_accumulation_args(p)
    add_routing_args(p)
    real.add_args(p)
    return p.parse_args(argv)
