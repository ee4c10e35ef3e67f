"""A cluster simulator on the replay model: one GPU's training step at N GPUs, balanced and skewed routing.

    python -m lancet_rt.autotune.simulate --model mixtral --gpus 64
    python -m lancet_rt.autotune.simulate --model deepseek_v3 --gpus 256 --ep 64 --link ib --routing balanced,zipf
    python -m lancet_rt.autotune.simulate --table 8,64,256 --json bench/results/simulate.json

A MODEL, not a measurement. Per step of one GPU it predicts computation, communication (the link's busy
time), exposed communication (step - computation), the hidden fraction and the chunk count Overlapped
would choose, for three schedules (and with ``--shadow-experts N`` a fourth, ``shadowed``: Overlapped with hot-expert
shadowing, :func:`lancet_rt.autotune.simulate_model.shadow_skew_for`):

* ``sequential``: the replay at one chunk (:func:`lancet_rt.autotune.replay_sim.replay`, the plain model);
* ``tutel``: chunking inside each MoE layer only (:func:`lancet_rt.autotune.simulate_model.tutel_step`, on the
  cost model's two-stream simulation), best of the candidate chunk counts;
* ``overlapped``: the replay of :class:`lancet_rt.Overlapped` at each candidate chunk count, the fastest kept.

The profile is built from FLOP and byte counts of the model's public shape and H100 constants
(:mod:`lancet_rt.autotune.simulate_model`: grouped GEMM speed measured on the GPU lane, the rest
datasheet values). Skewed routing (``--routing zipf``: the preset, max/mean expert load 3; ``zipf:S``;
``trace:FILE``) enters as the replay's :class:`~lancet_rt.autotune.replay_sim.Skew`: the busiest port
moves more bytes, and a returning all-to-all waits for the hot rank's experts (experts placed on the EP
ranks in contiguous blocks, the layers' skews averaged). Not modelled: the data-parallel gradient
all-reduce (with EP capped at E, Mixtral's 64 and 256 GPUs are 8-way EP times data parallelism),
pipeline parallelism (every MoE layer is on the GPU), memory, NCCL's deviations from a linear link.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

from lancet_rt.routing.traces import parse_routing

from .replay_sim import replay
from .simulate_model import SHAPES, build_profile, link_for, shadow_skew_for, skew_for, tutel_step

SCHEDULES = ("sequential", "tutel", "overlapped")


def simulate_step(
    model: str,
    gpus: int,
    ep: Optional[int] = None,
    link: Optional[str] = None,
    routing: str = "balanced",
    tokens: int = 8192,
    seq: int = 4096,
    chunks=(1, 2, 4, 8),
    deferred: bool = False,
    shadow: int = 0,
) -> dict:
    """One row: the three schedules' predicted step at this scale and routing (module docstring); with
    ``shadow`` > 0 also Overlapped with ``MoE(shadow_experts=shadow)`` (``shadowed_ms``)."""

    if model not in SHAPES:
        raise ValueError(f"model must be one of {sorted(SHAPES)}, got {model!r}")
    shape = SHAPES[model]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be an int >= 1, got {gpus!r}")
    ep = min(gpus, shape.experts) if ep is None else ep
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or gpus % ep or shape.experts % ep:
        raise ValueError(f"ep must be an int >= 1 dividing gpus={gpus} and experts={shape.experts}, got {ep!r}")
    if link not in (None, "nvlink", "ib"):
        raise ValueError(f"link must be 'nvlink' or 'ib', got {link!r}")
    link_name, gbps, lat, share = link_for(ep, link)
    source = parse_routing(routing)
    profile = build_profile(shape, tokens, seq, ep, gbps, lat, share, deferred)
    skew = skew_for(source, shape, ep)
    seq_pred = replay(profile, 1, skew=skew)
    comm = seq_pred.comm_ms + seq_pred.straggler_ms  # the collective time a rank sees when nothing overlaps
    row = dict(
        model=model,
        gpus=gpus,
        ep=ep,
        dp=gpus // ep,
        link=link_name,
        link_gbps=gbps,
        routing=routing,
        tokens=tokens,
        hot=skew.hot,
        port=skew.port,
        comm_ms=comm,
        link_busy_ms=seq_pred.comm_ms,
        straggler_ms=seq_pred.straggler_ms,
    )
    best = {"sequential": (seq_pred.step_ms, seq_pred.compute_ms, 1)}
    preds = [replay(profile, n, skew=skew) for n in chunks]
    q = min(preds, key=lambda p: p.step_ms)
    best["overlapped"] = (q.step_ms, q.compute_ms, q.chunks)
    best["tutel"] = min((tutel_step(profile, n, skew) + (n,) for n in chunks), key=lambda t: t[0])
    for name, (step, compute, n) in best.items():
        exposed = max(step - compute, 0.0)
        row.update(
            {
                f"{name}_ms": step,
                f"{name}_compute_ms": compute,
                f"{name}_exposed_ms": exposed,
                f"{name}_hidden": 1 - exposed / comm if comm > 0 else 1.0,
                f"{name}_chunks": n,
            }
        )
    row["overlapped_vs_sequential"] = 1 - row["overlapped_ms"] / row["sequential_ms"]
    if shadow:  # Overlapped with hot-expert shadowing (MoE(shadow_experts=N)), the same profile
        sh_skew, k = shadow_skew_for(source, shape, ep, tokens, shadow)
        q = min((replay(profile, n, skew=sh_skew) for n in chunks), key=lambda p: p.step_ms)
        row.update(
            shadowed_ms=q.step_ms,
            shadowed_chunks=q.chunks,
            shadowed_experts=k,
            shadowed_port=sh_skew.port,
            shadowed_hot=sh_skew.hot,
            shadowed_hidden=1 - max(q.step_ms - q.compute_ms, 0.0) / comm if comm > 0 else 1.0,
        )
    return row


def _print(rows: list) -> None:
    cols = [
        "model",
        "gpus",
        "ep",
        "link",
        "routing",
        "hot",
        "compute_ms",
        "comm_ms",
        "seq_ms",
        "tutel_ms",
        "ovl_ms",
        "chunks",
        "exposed_ms",
        "hidden",
        "tutel_hid",
        "step_vs_seq",
        "shadowed_ms",
    ]
    cells = [
        [
            r["model"],
            r["gpus"],
            r["ep"],
            r["link"],
            r["routing"],
            f"{r['hot']:.2f}",
            f"{r['overlapped_compute_ms']:.1f}",
            f"{r['comm_ms']:.1f}",
            f"{r['sequential_ms']:.1f}",
            f"{r['tutel_ms']:.1f}",
            f"{r['overlapped_ms']:.1f}",
            r["overlapped_chunks"],
            f"{r['overlapped_exposed_ms']:.1f}",
            f"{r['overlapped_hidden']:.2f}",
            f"{r['tutel_hidden']:.2f}",
            f"{-r['overlapped_vs_sequential']:+.1%}",
            f"{r['shadowed_ms']:.1f} ({r['shadowed_experts']:.1f})" if "shadowed_ms" in r else "-",
        ]
        for r in rows
    ]
    widths = [max(len(str(c)), *(len(str(row[i])) for row in cells)) for i, c in enumerate(cols)]
    print("MODEL, not a measurement: one H100's training step (ms), lancet_rt.autotune.simulate")
    print("  ".join(str(c).rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))


def main(argv=None) -> list:
    """The command (module docstring); returns the rows."""
    p = argparse.ArgumentParser(
        prog="python -m lancet_rt.autotune.simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=sorted(SHAPES), default=None, help="required unless --table")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the job (required unless --table)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default min(gpus, experts))")
    p.add_argument(
        "--link",
        choices=("nvlink", "ib"),
        default=None,
        help="default: NVLink within a node (ep <= 8), else IB for the inter-node bytes",
    )
    p.add_argument("--routing", default="balanced,zipf", help="comma-separated: balanced, zipf, zipf:S, trace:FILE")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step (default 8192)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--chunks", default="1,2,4,8", help="candidate chunk counts (default 1,2,4,8)")
    p.add_argument("--defer-wgrad", action="store_true", help="Overlapped(defer_wgrad=True)")
    p.add_argument("--table", default=None, help="GPU counts: every model at each, balanced and skewed (e.g. 8,64,256)")
    p.add_argument(
        "--shadow-experts",
        type=int,
        default=0,
        help="also Overlapped with MoE(shadow_experts=N): hot-expert shadowing (shadowed_ms; experts per layer)",
    )
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    chunks = tuple(int(v) for v in args.chunks.split(","))
    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    if args.table:
        cases = [(m, int(g), None) for m in sorted(SHAPES) for g in args.table.split(",")]
    elif args.model is None or args.gpus is None:
        p.error("--model and --gpus are required (or --table)")
    else:
        cases = [(args.model, args.gpus, args.ep)]
    try:
        rows = [
            simulate_step(m, g, ep, args.link, r, args.tokens, args.seq, chunks, args.defer_wgrad, args.shadow_experts)
            for m, g, ep in cases
            for r in routings
        ]
    except (OSError, ValueError) as exc:
        p.exit(2, f"simulate: {exc}\n")
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(note="a model, not a measurement (lancet_rt.autotune.simulate)", rows=rows), f, indent=1)
    return rows
