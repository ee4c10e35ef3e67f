"""How much all-to-all time each schedule hides: sequential, MoE-internal chunking (Tutel-style),
Overlapped, and Overlapped with deferred dW, on a stack of pre-norm attention + MoE blocks.

    python -m bench.overlap --device cpu --quick            # emulated link, CPU
    python -m bench.overlap --device cuda --json bench/results/overlap.json --png bench/results/overlap.png

Communication goes over the emulated link (lancet_rt.EmulatedGroup: this process is rank 0 of a
symmetric world of --world-size ranks). ``--comm-ratio R`` sets its bandwidth so that the modeled
communication of one training step (forward + backward) is R x the step's computation:
``compute_ms`` is the Overlapped schedule timed on a zero-cost link, and the bandwidth is
``off-rank bytes per step / (R * compute_ms - transfers * latency)`` (calibrated on a first short
pass; ``measured_comm_ratio`` reports the ratio against the final measurement).

Every schedule is timed on the free link (its own computation) and on the calibrated link, the
runs interleaved step by step, so that load from elsewhere on a shared machine hits all alike, and
summarised by the fastest step (``--statistic``). If the measured comm/compute ratio misses R by
more than 10%, the bandwidth is rescaled and everything measured again, once.

Metrics: ``hidden_comm_fraction = 1 - (overlapped_ms - compute_ms) / comm_ms`` (Overlapped;
``hidden_comm_fraction_dw`` likewise for Overlapped with deferred dW), and ``bound_ms =
max(compute_ms, comm_ms)``. A structural limit: the forward's all-to-alls (half the bytes) can
hide only behind the forward's computation (about a third of the step), so at R = 1 about a sixth
of the communication stays exposed even for a perfect schedule, and a step takes at least about
1.17 x bound_ms. The row therefore also carries the pass-aware bound, measured in the same run:
``pass_bound_ms = max(forward_compute_ms, forward_comm_ms) + max(backward compute, backward comm)``
(the backward cannot start before the loss has every chunk's output), ``over_pass_bound`` against
it, and ``max_hidden_comm_fraction``, the most any schedule could hide.

The row also carries ``chunking_overhead`` (Overlapped's free-link step over the sequential one,
the "compute overhead of chunking") and, for the blocks model, the eager floor it is bounded
by: ``plain_chunks_compute_ms``, the unchunked model run on the chunks' rows one after another (no
Overlapped, no overlap, one backward), ``plain_chunks_overhead`` (that over the sequential step) and
``overhead_over_floor`` (Overlapped over that), the three timed interleaved on the free link. What the
floor costs above 1 is eager PyTorch running every op once per chunk; what Overlapped costs above the
floor is the schedule's own. The same timing runs the model with each block's MoE layer taken out
(an identity), unchunked and on the chunks' rows (``dense_compute_ms``, ``dense_chunks_compute_ms``), and
cuts the overhead into three parts in units of the unchunked step: ``overhead_dense`` (the model's
dense layers chunked: no MoE layer and no schedule removes it), ``overhead_moe`` (the rest of the
floor: the MoE layers run once per chunk) and ``overhead_schedule`` (Overlapped over the floor).
Where bench.yardstick's lean eager layer computes what ours does (one local expert, softmax), the
same timing also runs the model with it in every block, unchunked and its chunks one after another
as one batch (``lean_compute_ms``, ``lean_chunks_compute_ms``): ``lean_overhead`` is our unchunked
step plus the lean layer's increment, over our unchunked step (what the cheapest eager layer we could
write would leave of the overhead), and ``overhead_over_lean`` is Overlapped's overhead minus that.
Pass-aware fields: ``pass_bound_speedup`` (the speedup of a schedule at the pass-aware bound, at this
overhead), ``pass_bound_speedup_no_overhead`` and ``overhead_for_target`` (see :func:`_ceiling_fields`).
``sequential_excess`` is the sequential step over its compute plus its
communication, minus 1: about 0 on a quiet host at the benchmark's sizes. Above 0.01 (printed as a
warning) the step that sleeps through each transfer came back slower than its link (a busy host, or a
tiny step against how late a sleep returns), so the speedups read high.

``--check`` exits with status 1 unless the CPU acceptance holds: hidden_comm_fraction >= 0.6 and
Overlapped faster than both sequential and MoE-internal chunking.

``--microbatches M`` (M > 1) also times a training step of M microbatches: ``Overlapped.accumulate``
(the backward of microbatch i interleaved with the forward of microbatch i+1; with and without
deferred dW) and the Megatron-style pairing (the same turns on unchunked microbatches). The row
gains ``hidden_comm_fraction_accum`` (1 - exposed / the step's M x communication, the exposed time
being the median over the timed rounds of a round's step on the link minus its step on the free
link, run next to it; ``hidden_comm_fraction_accum_fastest`` is the single-step table's
estimate, from the fastest steps, which on a shared machine may come from different moments), its speedup
against M Overlapped steps one after
the other timed with it (``accumulate_sequential``), against M steps of the other schedules above
scaled by their single-step ratio to Overlapped (``speedup_accum_vs_moe_pipelined``: against the
Tutel-style baseline, whose backward is pipelined too), and ``max_hidden_comm_fraction_accum``, the
cross-microbatch analogue of the
pass-aware bound. With ``--check`` the step must hide >= 0.75 and no less than M Overlapped steps
timed with it (the issue's target, >= 0.9 and above the single-step bound, is printed, met or not).
``--dp-allreduce`` times that step with a data-parallel all-reduce of every gradient on the same
link (``lancet_rt.parallel.GradientSync``): whole buckets in FIFO order (``lina_fifo_ms``) vs Lina's
low-priority pieces (``lina_priority_ms``), and the time the all-to-alls waited behind them.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import lancet_rt
from bench import overlap_real
from bench.accumulation import (
    add_accumulation,
    add_accumulation_args,
    check_accumulation,
    measure_accumulation,
    measure_lina,
)
from bench.common import RowLog, TimeBudget, print_table, run_metadata
from bench.hf_models import FAMILIES as HF_FAMILIES
from bench.routing import add_routing_args
from bench.runner import Runner
from bench.timeline import draw_timeline
from bench.timing import bandwidth_for_ratio, keep_freed_memory, synchronize
from lancet_rt.cli import float_in, int_in

MODES = ("sequential", "moe_pipelined", "overlapped", "overlapped_dw")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--layers", type=int_in(1), default=None)
    p.add_argument("--d-model", type=int_in(1), default=None)
    p.add_argument("--d-ffn", type=int_in(1), default=None)
    p.add_argument("--experts", type=int_in(1), default=None)
    p.add_argument("--top-k", type=int_in(1), default=2)
    p.add_argument("--batch", type=int_in(1), default=None, help="sequences per step")
    p.add_argument("--seq", type=int_in(1), default=None)
    p.add_argument("--capacity-factor", type=float_in(0, above=True), default=1.25)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
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
    p.add_argument(
        "--model",
        default="blocks",
        choices=("blocks",) + HF_FAMILIES,
        help="blocks: pre-norm attention + lancet MoE blocks (bench.model); or a transformers MoE "
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
    p.add_argument(
        "--compare",
        default=None,
        choices=["balanced-chunks", "dispatchers", "replay"],
        help="instead of the four schedules, a seed system against the default (bench/seeds.py)",
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
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless hidden_comm_fraction >= 0.6 and Overlapped beats both baselines "
        "(with --microbatches M > 1, also the cross-microbatch acceptance)",
    )
    add_accumulation_args(p)
    add_routing_args(p)
    overlap_real.add_args(p)
    return p.parse_args(argv)


def sizes(args) -> dict:
    cuda = args.device == "cuda"
    if args.quick:
        d = dict(
            layers=2,
            d_model=128,
            d_ffn=256,
            experts=8,
            batch=16,
            seq=64,
            heads=4,
            latency_us=20.0,
            steps=11,
            dtype="bfloat16" if cuda else "float32",
        )
    elif cuda:
        d = dict(
            layers=4,
            d_model=2048,
            d_ffn=4096,
            experts=16,
            batch=16,
            seq=1024,
            heads=16,
            latency_us=20.0,
            steps=10,
            dtype="bfloat16",
        )
    else:
        d = dict(
            layers=2,
            d_model=256,
            d_ffn=512,
            experts=8,
            batch=8,
            seq=128,
            heads=4,
            latency_us=20.0,
            steps=5,
            dtype="float32",
        )
    for k in list(d):
        v = getattr(args, k, None)
        if v is not None:
            d[k] = v
    return d


def main(argv=None) -> dict:
    """Run the benchmark (see the module docstring); returns the row (or seeds.main's rows with --compare)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.link != "emulated":  # ranks over a real link (bench/overlap_real.py)
        if not any(a == "--world-size" or a.startswith("--world-size=") for a in argv):
            args.world_size = None
        return overlap_real.main(args, argv)
    if args.microbatches < 1:
        raise SystemExit(f"--microbatches must be >= 1, got {args.microbatches}")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
        if args.malloc == "keep":
            keep_freed_memory()
    s = sizes(args)
    if args.model != "blocks" and (args.compare or args.microbatches > 1 or args.dp_allreduce):
        raise SystemExit(f"--model {args.model}: --compare, --microbatches and --dp-allreduce run on --model blocks")
    if args.compare:
        from bench import seeds

        return seeds.main(args, s, device)
    if args.routing:
        from bench import routing

        return routing.run(args, s, device)
    budget = TimeBudget(args.max_seconds)
    r = Runner(args, s, device)
    log = RowLog(args.json)
    # The row is on disk as soon as the two link passes are timed (an interrupt after them keeps it),
    # and rewritten in place as the bound, the floors and the cross-microbatch part add to it.
    m = _measure(r, args, s, budget, on_link=lambda m: log.add(_single_row(r, args, s, device, m)))
    row = _single_row(r, args, s, device, m)
    log.update(row)
    _report(row, args, s, m)
    link = (m["bw"], s["latency_us"])
    extras = args.microbatches > 1 or args.dp_allreduce
    projected = _extras_seconds(row, args, s)
    if extras and (budget.spent() or projected > budget.left()):
        print(
            f"--max-seconds {args.max_seconds:g}: {budget.left():.0f} s left, the cross-microbatch and all-reduce "
            f"parts (about {projected:.0f} s) are left out"
        )
    else:
        if args.microbatches > 1:
            add_accumulation(r, args)
            row.update(measure_accumulation(r, args, s, link, row))
            log.update(row)
        if args.dp_allreduce:
            row.update(measure_lina(r, args, s, link))
    row["complete"] = True
    log.update(row)  # before the optional trace and drawing
    if args.trace or args.png:
        _trace(r, args, row, device)
    if args.check:
        ok = (
            row["hidden_comm_fraction"] >= 0.6
            and row["overlapped_ms"] < row["sequential_ms"]
            and row["overlapped_ms"] < row["moe_pipelined_ms"]
        )
        print(f"check: {'PASS' if ok else 'FAIL'} (hidden >= 0.6, faster than sequential and MoE-internal chunking)")
        if args.microbatches > 1:
            ok = check_accumulation(row) and ok
        if not ok:
            raise SystemExit(1)
    return row


def _measure(r: Runner, args, s: dict, budget: TimeBudget, on_link=None) -> dict:
    """Calibrate the link to --comm-ratio, time every schedule on the free and the calibrated link, and
    measure the forward for the pass-aware bound; the numbers the row is made of. ``on_link`` gets the
    numbers of the first two parts (the link passes) before the rest is measured."""
    # 1. Calibration: the step's computation on a zero-cost link sets the bandwidth so that one
    #    step's communication is R x compute.
    free = (math.inf, 0.0)
    calib = r.time_all(["overlapped"], 5, {"free": free})[("free", "overlapped")]
    _, nbytes, transfers = r.per_step_link("sequential")
    lat_ms = s["latency_us"] * 1e-3
    bw = bandwidth_for_ratio(args.comm_ratio, calib, nbytes, transfers, s["latency_us"])
    # 2. Every schedule on the free link (its computation) and on the real one, interleaved. If the
    #    measured ratio misses R by more than 10% (the calibration pass was short), rescale the
    #    bandwidth and measure again, once (unless --max-seconds is spent).
    for attempt in range(2):
        r.set_link(bw, s["latency_us"])
        comm_ms, _, _ = r.per_step_link("sequential")
        t = r.time_all(MODES, s["steps"], {"free": free, "link": (bw, s["latency_us"])})
        compute = {m: t[("free", m)] for m in MODES}
        ms = {m: t[("link", m)] for m in MODES}
        compute_ms = compute["overlapped"]
        ratio = comm_ms / compute_ms
        if abs(ratio / args.comm_ratio - 1) <= 0.1 or attempt == 1 or budget.spent():
            break
        wire_ms = comm_ms - transfers * lat_ms
        bw *= wire_ms / max(args.comm_ratio * compute_ms - transfers * lat_ms, 1e-9)
        print(
            f"(measured comm/compute {ratio:.2f} vs --comm-ratio {args.comm_ratio}: bandwidth -> {bw:.3g} GB/s, "
            f"measuring again)"
        )
    if on_link is not None:
        on_link(
            dict(
                bw=bw,
                nbytes=nbytes,
                transfers=transfers,
                comm_ms=comm_ms,
                compute=compute,
                ms=ms,
                compute_ms=compute_ms,
            )
        )
    # 3. The pass-aware bound: the backward starts only when the loss has every chunk's output, so
    #    no schedule beats max(forward compute, forward comm) + max(backward compute, backward comm).
    r.set_link(*free)
    forward_compute_ms = r.forward_ms("overlapped", s["steps"])
    r.set_link(bw, s["latency_us"])
    forward_comm_ms, _, _ = r.per_step_link("overlapped", forward_only=True)
    pass_bound_ms = max(forward_compute_ms, forward_comm_ms) + max(
        compute_ms - forward_compute_ms, comm_ms - forward_comm_ms
    )
    # 4. The eager floors (blocks): the model on the chunks' rows one after another, no Overlapped,
    #    and its dense layers alone, unchunked and so; timed interleaved with the unchunked step and
    #    Overlapped on the free link.
    floor = None
    if not r.hf:
        t = r.time_all(
            ["sequential", "plain_chunks", "overlapped", "dense", "dense_chunks"]
            + (["lean", "lean_chunks"] if r.lean else []),
            s["steps"],
            {"free": free},
        )
        floor = {mode: ms for (_, mode), ms in t.items()}
    return dict(
        bw=bw,
        nbytes=nbytes,
        transfers=transfers,
        comm_ms=comm_ms,
        compute=compute,
        ms=ms,
        compute_ms=compute_ms,
        forward_compute_ms=forward_compute_ms,
        forward_comm_ms=forward_comm_ms,
        pass_bound_ms=pass_bound_ms,
        floor=floor,
    )


def _single_row(r: Runner, args, s: dict, device, m: dict) -> dict:
    """The JSON row of the single-step schedules from :func:`_measure`'s numbers; from the link passes'
    alone (``on_link``), the pass-aware bound's and the floors' fields are None. ``complete`` is set
    True once nothing more will be added."""
    return dict(_row(r, args, s, device, m), complete=False, **_bound_fields(m), **_floor_fields(m.get("floor")))


def _bound_fields(m: dict) -> dict:
    """The pass-aware bound's fields and what they imply (:func:`_ceiling_fields`); None before the
    bound is measured."""
    if "pass_bound_ms" not in m:
        return dict(
            forward_compute_ms=None,
            forward_comm_ms=None,
            pass_bound_ms=None,
            over_pass_bound=None,
            max_hidden_comm_fraction=None,
            **dict.fromkeys(_ceiling_fields(1.0, 1.0, 1.0, 1.0)),
        )
    ms, compute, bound = m["ms"], m["compute"], m["pass_bound_ms"]
    return dict(
        forward_compute_ms=m["forward_compute_ms"],
        forward_comm_ms=m["forward_comm_ms"],
        pass_bound_ms=bound,
        over_pass_bound=ms["overlapped"] / bound - 1,
        max_hidden_comm_fraction=1 - (bound - m["compute_ms"]) / m["comm_ms"],
        **_ceiling_fields(ms["sequential"], compute["sequential"], m["compute_ms"], bound),
    )


def _row(r: Runner, args, s: dict, device, m: dict) -> dict:
    """The row's fields from the link passes (the first two parts of :func:`_measure`)."""
    ms, compute, comm_ms, compute_ms = m["ms"], m["compute"], m["comm_ms"], m["compute_ms"]
    overlapped_ms = ms["overlapped"]
    return dict(
        bench="overlap",
        **run_metadata(device),
        **{k: v for k, v in s.items()},
        model=args.model,
        world_size=args.world_size,
        chunks=args.chunks,
        top_k=args.top_k,
        counts_channel=args.counts_channel,
        handshake_us=r.link.handshake_us,
        capacity_factor=None if r.hf else args.capacity_factor,
        fused_loss=bool(getattr(args, "fused_loss", False)) if r.hf else None,
        early_backward=not getattr(args, "no_early_backward", False) if r.hf else None,
        comm_ratio=args.comm_ratio,
        measured_comm_ratio=comm_ms / compute_ms,
        bandwidth_gbps=m["bw"],
        transfers_per_step=m["transfers"],
        off_rank_bytes_per_step=m["nbytes"],
        sequential_ms=ms["sequential"],
        moe_pipelined_ms=ms["moe_pipelined"],
        overlapped_ms=overlapped_ms,
        overlapped_dw_ms=ms["overlapped_dw"],
        compute_ms=compute_ms,
        sequential_compute_ms=compute["sequential"],
        moe_pipelined_compute_ms=compute["moe_pipelined"],
        overlapped_dw_compute_ms=compute["overlapped_dw"],
        comm_ms=comm_ms,
        bound_ms=max(compute_ms, comm_ms),
        hidden_comm_fraction=1 - (overlapped_ms - compute_ms) / comm_ms,
        hidden_comm_fraction_dw=1 - (ms["overlapped_dw"] - compute["overlapped_dw"]) / comm_ms,
        hidden_comm_fraction_moe_pipelined=1 - (ms["moe_pipelined"] - compute["moe_pipelined"]) / comm_ms,
        speedup_vs_sequential=ms["sequential"] / overlapped_ms,
        speedup_vs_moe_pipelined=ms["moe_pipelined"] / overlapped_ms,
        over_bound=overlapped_ms / max(compute_ms, comm_ms) - 1,
        chunking_overhead=compute_ms / compute["sequential"],
        sequential_excess=ms["sequential"] / (compute["sequential"] + comm_ms) - 1,
    )


def _extras_seconds(row: dict, args, s: dict) -> float:
    """About how long the cross-microbatch and all-reduce parts take (0 without them), projected from
    the single-step row: each of their timed rounds runs M microbatches of every schedule on the free
    link and on the calibrated one (bench.accumulation), each microbatch about a single step; x 1.5
    for their warm-up and the host's share."""
    if args.microbatches <= 1 and not args.dp_allreduce:
        return 0.0
    from bench.accumulation import ACCUM_MODES, LINA_MODES

    rounds = (args.accum_steps or min(s["steps"], 5)) + 1
    runs = len(ACCUM_MODES) * 2 + (len(LINA_MODES) + 1 if args.dp_allreduce else 0)
    step_ms = row["overlapped_ms"] + row["compute_ms"]
    return 1.5 * rounds * runs * max(args.microbatches, 1) * step_ms / 2 / 1e3


#: The speedup over sequential that chunking is to reach (CPU, --quick, 4 chunks, comm = 1x compute).
SPEEDUP_TARGET = 1.6


def _ceiling_fields(
    sequential_ms: float,
    sequential_compute_ms: float,
    compute_ms: float,
    pass_bound_ms: float,
    target: float = SPEEDUP_TARGET,
) -> dict:
    """What the speedup over sequential can reach, from one run's numbers (the target: :data:`SPEEDUP_TARGET`).

    A schedule at the pass-aware bound gives ``pass_bound_speedup = sequential_ms / pass_bound_ms``:
    the most any Overlapped schedule gets at this run's chunking overhead. The communication is
    calibrated to Overlapped's own compute (``--comm-ratio`` x ``compute_ms``), so a cheaper chunk
    shrinks the link too; with everything else scaled along (the pass-aware bound in proportion to
    ``compute_ms``, the sequential step's exposed communication to the link),
    ``pass_bound_speedup(o) = (1 / o + e) / p`` at chunking overhead ``o``, where ``p =
    pass_bound_ms / compute_ms`` (how far the forward's communication outlasts its compute) and ``e
    = (sequential_ms - sequential_compute_ms) / compute_ms`` (the sequential step's exposed
    communication). Hence ``pass_bound_speedup_no_overhead``, the same at o = 1 (no per-chunk cost
    at all), and ``overhead_for_target``, the overhead at which a schedule at the pass-aware bound
    reaches ``target`` (None where no overhead >= 1 does, infinity where every overhead does)."""
    p = pass_bound_ms / compute_ms
    e = (sequential_ms - sequential_compute_ms) / compute_ms
    need = target * p - e  # 1 / o
    return dict(
        pass_bound_speedup=sequential_ms / pass_bound_ms,
        pass_bound_speedup_no_overhead=(1 + e) / p,
        speedup_target=target,
        overhead_for_target=math.inf if need <= 0 else 1 / need if need <= 1 else None,
    )


def _floor_fields(floor) -> dict:
    """The eager floors' fields (None for a transformers model), from one interleaved timing on the
    free link: ``plain_chunks_overhead``, the model on the chunks' rows one after another over the
    unchunked step; ``overhead_over_floor``, Overlapped's step over that; and the chunking overhead
    of that timing (Overlapped over the unchunked step, minus 1) cut into three parts, in units of
    the unchunked step: ``overhead_dense`` (the model's dense layers alone, chunked minus unchunked),
    ``overhead_moe`` (the rest of the floor: the MoE layers run once per chunk) and
    ``overhead_schedule`` (Overlapped over the floor); where the lean layer applies, ``lean_overhead``
    and ``overhead_over_lean`` (the module docstring)."""
    lean = dict(lean_compute_ms=None, lean_chunks_compute_ms=None, lean_overhead=None, overhead_over_lean=None)
    if floor is None:
        return dict(
            plain_chunks_compute_ms=None,
            plain_chunks_overhead=None,
            overhead_over_floor=None,
            dense_compute_ms=None,
            dense_chunks_compute_ms=None,
            overhead_dense=None,
            overhead_moe=None,
            overhead_schedule=None,
            **lean,
        )
    seq, plain = floor["sequential"], floor["plain_chunks"]
    dense = (floor["dense_chunks"] - floor["dense"]) / seq
    if "lean" in floor:
        # the lean layer's per-chunk cost added to our unchunked step (its most favourable reading)
        lean_overhead = (seq + floor["lean_chunks"] - floor["lean"]) / seq
        lean = dict(
            lean_compute_ms=floor["lean"],
            lean_chunks_compute_ms=floor["lean_chunks"],
            lean_overhead=lean_overhead,
            overhead_over_lean=floor["overlapped"] / seq - lean_overhead,
        )
    return dict(
        plain_chunks_compute_ms=plain,
        plain_chunks_overhead=plain / seq,
        overhead_over_floor=floor["overlapped"] / plain,
        dense_compute_ms=floor["dense"],
        dense_chunks_compute_ms=floor["dense_chunks"],
        overhead_dense=dense,
        overhead_moe=(plain - seq) / seq - dense,
        overhead_schedule=(floor["overlapped"] - plain) / seq,
        **lean,
    )


def _report(row: dict, args, s: dict, m: dict) -> None:
    """Print the single-step table and its headline line."""
    ms, compute, comm_ms, compute_ms = m["ms"], m["compute"], m["comm_ms"], m["compute_ms"]
    table = [
        dict(
            schedule=k,
            step_ms=ms[k],
            compute_ms=compute[k],
            hidden=1 - (ms[k] - compute[k]) / comm_ms,
            speedup=ms["sequential"] / ms[k],
        )
        for k in MODES
    ]
    print_table(
        table,
        ["schedule", "step_ms", "compute_ms", "hidden", "speedup"],
        title=f"bench.overlap on {row['device']}: {s['layers']} {args.model} layers D={s['d_model']} F={s['d_ffn']} "
        f"E={s['experts']} K={args.top_k} W={args.world_size} tokens={s['batch'] * s['seq']} "
        f"{s['dtype']}, chunks={args.chunks}, comm {comm_ms:.2f} ms = {comm_ms / compute_ms:.2f} x compute "
        f"({m['bw']:.3g} GB/s, {s['latency_us']} us, handshake {row['handshake_us']:g} us, counts on "
        f"{'their own' if args.counts_channel == 'own' else 'the tokens'} channel)",
    )
    print(
        f"hidden_comm_fraction {row['hidden_comm_fraction']:.3f} (with deferred dW "
        f"{row['hidden_comm_fraction_dw']:.3f})  overlapped {row['overlapped_ms']:.2f} ms vs "
        f"bound {row['bound_ms']:.2f} ms ({row['over_bound']:+.1%}), pass-aware bound {row['pass_bound_ms']:.2f} ms "
        f"({row['over_pass_bound']:+.1%}; hides at most {row['max_hidden_comm_fraction']:.3f})  speedup vs sequential "
        f"{row['speedup_vs_sequential']:.2f}x, vs MoE-internal chunking {row['speedup_vs_moe_pipelined']:.2f}x"
    )
    if row["sequential_excess"] > 0.01:
        print(
            f"warning: the sequential step ran {row['sequential_excess']:.1%} over its compute plus its "
            f"communication (a busy host, or a step short against how late a sleep returns); speedups read high"
        )
    reach = (
        f"at the pass-aware bound the speedup would be {row['pass_bound_speedup']:.2f}x at this chunking "
        f"overhead, {row['pass_bound_speedup_no_overhead']:.2f}x with none; {row['speedup_target']}x needs "
    )
    reach += (
        "more than no overhead at all"
        if row["overhead_for_target"] is None
        else f"an overhead <= {row['overhead_for_target']:.3f} there"
    )
    print(reach)
    line = f"chunking overhead (Overlapped's compute / sequential's) {row['chunking_overhead']:.3f}"
    if row["plain_chunks_overhead"] is not None:
        line += (
            f"; eager floor (the model on the {args.chunks} chunks' rows one after another, no overlap) "
            f"{row['plain_chunks_overhead']:.3f}, Overlapped {row['overhead_over_floor']:.3f} x that\n"
            f"  of which (x the sequential step): the model's dense layers chunked {row['overhead_dense']:+.3f}, "
            f"its MoE layers chunked {row['overhead_moe']:+.3f}, the schedule {row['overhead_schedule']:+.3f}"
        )
    if row.get("lean_overhead") is not None:
        line += (
            f"\n  the lean eager MoE layer's chunks (bench.yardstick) on our unchunked step: "
            f"{row['lean_overhead']:.3f}; "
            f"Overlapped {row['overhead_over_lean']:+.3f} over that"
        )
    print(line)


def _trace(r: Runner, args, row: dict, device) -> None:
    """Trace one step of each schedule drawn; save the overlapped trace (--trace) and the timeline (--png)."""
    traces = {}
    for mode in ("sequential", "overlapped") + (("accumulate",) if "accumulate_ms" in row else ()):
        with lancet_rt.tracing() as tr:
            r.step(mode)
            synchronize(device)
        traces[mode] = tr
    if args.trace:
        traces["overlapped"].save(args.trace)
    if args.png:
        draw_timeline(traces, args.png, row)


if __name__ == "__main__":
    main()
