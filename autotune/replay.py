"""dPRO-style replay: predict a step at other chunk counts and link bandwidths from a recorded trace.

    python -m lancet_rt.autotune.replay trace.json --chunks 1,2,4,8 --bandwidth-gbps 0.05,0.1,0.2

dPRO (Hu et al., MLSys 2022) replays a profiled step's operators along their dependencies to predict
the step under other configurations. Here the trace is one training step of
:class:`lancet_rt.Overlapped` recorded with :func:`lancet_rt.tracing` (on the emulated link, whose
transfers the trace records), and the replay rebuilds the step at N chunks on a link of bandwidth B:

1. **Parse** (:func:`lancet_rt.autotune.replay_trace.parse_trace`). The forward's host time is
   attributed, chunk segment by chunk segment (the ``chunk c`` spans), to each MoE layer's stages:
   ``pre`` (attention, norms: up to the router), ``route`` (router and gating), ``permute`` (counts
   exchange hand-off, permute), ``issue`` (starting the dispatch), ``experts`` (experts and starting the
   combine), ``post`` (unpermute, residual) and the chunk's ``tail``; waits on the link are not work.
   The backward's host time is split into the traced ``unpermute bwd``, ``experts bwd`` and deferred dW
   (``dW``, ``dW flush``) and the untraced rest. The link's transfers give each layer's bytes per token
   and the link model (``latency + bytes / bandwidth``, least squares).
2. **Scale** (:func:`lancet_rt.autotune.replay_profile.build_profile`). Each stage's time summed over
   the chunks is known at the traced chunk count(s); at others it is interpolated piecewise-linearly
   between traced counts (the nearest two's line beyond them), and with a single trace it stays the
   traced total (per-chunk overheads are not seen). A chunk gets the share of its tokens. Backward work
   is each stage's forward time times the ratio measured for its kind (experts, post, the rest),
   deferred dW likewise.
3. **Replay** (:func:`lancet_rt.autotune.replay_sim.replay`). The forward runs Overlapped's own
   scheduling rules (:func:`lancet_rt.schedule.overlap.next_chunk` from
   :func:`~lancet_rt.schedule.overlap.not_started`, and the CPU's counts rule,
   :func:`lancet_rt.moe.dispatch.common.gives_counts_turn`, all imported, with the gating-in-order
   wait of :meth:`lancet_rt.MoE._routing_state`) over each chunk's stage program on two resources: the
   host (computation) and the link, a FIFO. The backward runs the forward's creation order in reverse
   (the autograd engine's order on one device): each backward all-to-all is issued by its gradient's
   producer (the unpermute's backward, the experts' after their dX) and waited by its own node, which
   drains deferred dW meanwhile by the queue's own rule (:func:`lancet_rt.runtime.wgrad.best_fit` over
   whole items, one per stage holding weights); what is left is flushed at the end.

What it cannot see: contention for the CPU and the GIL between the link's thread and the
computation (and other processes), the link thread's wake-up delay, the expert load of other ranks
(a real collective ends with its slowest peer), and on a GPU the host's launch overheads and
host-boundness (the host time of a CUDA trace is taken as the compute stream's time), kernels of two
streams sharing the SMs, and NCCL's deviations from a linear link model. Traces on a real group carry
no link transfers (no bytes), so only traces on the emulated link replay.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterable, Optional, Sequence

from lancet_rt.cli import float_in, int_in, list_of

from .replay_profile import ReplayProfile, build_profile
from .replay_sim import EXPERTS_DW_SHARE, ReplayPrediction, replay
from .replay_trace import STAGES, TracedStep, load_events, parse_trace

__all__ = [
    "STAGES",
    "EXPERTS_DW_SHARE",
    "TracedStep",
    "ReplayProfile",
    "ReplayPrediction",
    "load_events",
    "parse_trace",
    "build_profile",
    "replay",
    "replay_traces",
    "main",
]


def replay_traces(
    traces: Iterable,
    chunks: Sequence[int],
    bandwidths: Sequence[Optional[float]] = (None,),
    latency_ms: Optional[float] = None,
    counts_channel: str = "shared",
) -> list:
    """Parse ``traces`` (paths or Trace objects), fit the profile and replay every (chunks, bandwidth)."""
    profile = build_profile([parse_trace(t) for t in traces])
    return [replay(profile, n, b, latency_ms, counts_channel) for b in bandwidths for n in chunks]


def main(argv=None) -> list:
    """The command (module docstring): replay the traces at every chunk count and bandwidth, print a table.

    Args:
        argv: the command's arguments (default ``sys.argv[1:]``).

    Returns:
        The :class:`ReplayPrediction` of every (bandwidth, chunks), bandwidth-major.
    """
    p = argparse.ArgumentParser(
        prog="python -m lancet_rt.autotune.replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "traces",
        nargs="+",
        help="trace JSON of one step each (lancet_rt.tracing(); two or more chunk "
        "counts of the same batch also fit the per-chunk overhead)",
    )
    p.add_argument(
        "--chunks", type=list_of(int_in(1, 64)), default=[1, 2, 4], help="chunk counts to predict (default 1,2,4)"
    )
    p.add_argument(
        "--bandwidth-gbps",
        type=list_of(float_in(0, above=True)),
        default=None,
        help="link bandwidths to predict, GB/s (default: the traced link's)",
    )
    p.add_argument(
        "--latency-us", type=float_in(0, 1e6), default=None, help="link latency (default: the traced link's)"
    )
    p.add_argument(
        "--counts-channel",
        choices=("shared", "own"),
        default="shared",
        help="the counts exchanges in the link's FIFO (default) or on a channel of their own",
    )
    p.add_argument("--json", default=None, help="write the predictions here (a JSON list)")
    args = p.parse_args(argv)
    try:
        profile = build_profile([parse_trace(t) for t in args.traces])
    except (OSError, ValueError) as exc:
        p.exit(2, f"replay: {exc}\n")
    lat = None if args.latency_us is None else args.latency_us * 1e-3
    preds = [
        replay(profile, n, b, lat, args.counts_channel) for b in (args.bandwidth_gbps or [None]) for n in args.chunks
    ]
    print(
        f"replay of {len(args.traces)} trace(s): {len(profile.layers)} MoE layers, {profile.tokens} tokens, traced "
        + ", ".join(f"{n} chunk(s) {ms:.2f} ms" for n, ms in sorted(profile.traced.items()))
        + f"; link {profile.link.latency_ms * 1e3:.0f} us + bytes / {profile.link.gbps:.3g} GB/s"
        + (", deferred dW" if profile.deferred else "")
    )
    print(f"{'chunks':>6} {'GB/s':>9} {'step ms':>9} {'forward':>9} {'compute':>9} {'comm':>9}")
    for q in preds:
        print(
            f"{q.chunks:>6} {q.gbps:>9.3g} {q.step_ms:>9.2f} {q.forward_ms:>9.2f} {q.compute_ms:>9.2f} "
            f"{q.comm_ms:>9.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([q.__dict__ for q in preds], f, indent=1)
    return preds


if __name__ == "__main__":
    main(sys.argv[1:])
