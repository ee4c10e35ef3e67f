"""The cross-microbatch part of ``bench.overlap``: ``--microbatches M`` and ``--dp-allreduce``.

A training step of M microbatches: Overlapped.accumulate interleaves the backward of microbatch i
with the forward of microbatch i+1 (lancet_rt.schedule.accumulate). Its baselines are the single-step
schedules of bench.overlap run M times over (a step of M microbatches one after the other takes M
single steps) and the Megatron-style pairing: the same cross-microbatch interleaving on unchunked
microbatches (chunks=1: the passes take turns layer by layer, as Megatron-Core's
--overlap-moe-expert-parallel-comm pairs them, with no chunking inside a microbatch).
"""

from __future__ import annotations

import math
import statistics

import torch

import lancet_rt
from bench.common import print_table
from bench.runner import Runner
from lancet_rt.cli import float_in, int_in

ACCUM_MODES = ("accumulate_sequential", "accumulate", "accumulate_dw", "accumulate_megatron")
LINA_MODES = ("lina_fifo", "lina_priority")


def add_accumulation_args(p) -> None:
    p.add_argument(
        "--microbatches",
        type=int_in(1),
        default=1,
        help="M > 1: also time a training step of M microbatches under the cross-microbatch "
        "schedule (Overlapped.accumulate) and the Megatron-style pairing",
    )
    p.add_argument(
        "--accum-chunks",
        type=int_in(1, 64),
        default=None,
        help="chunks per microbatch in the cross-microbatch schedules (default: --chunks; the "
        "pass beside a forward already overlaps it, so fewer chunks may do)",
    )
    p.add_argument(
        "--accum-steps",
        type=int_in(1),
        default=None,
        help="timed steps per cross-microbatch schedule (default: --steps, at most 5)",
    )
    p.add_argument(
        "--dp-allreduce",
        action="store_true",
        help="also time the step with a data-parallel all-reduce of every gradient on the same link "
        "(lancet_rt.parallel.GradientSync): whole buckets in FIFO order vs Lina's pieces at low priority",
    )
    p.add_argument(
        "--bucket-mb",
        type=float_in(0, 1e6, above=True),
        default=None,
        help="--dp-allreduce bucket size (default: a quarter of the gradients, so buckets start during backward)",
    )
    p.add_argument(
        "--piece-mb",
        type=float_in(0, 1e6, above=True),
        default=None,
        help="--dp-allreduce piece size with priority (default: an eighth of a bucket)",
    )


def add_accumulation(r: Runner, args) -> None:
    """The cross-microbatch schedules as whole steps of ``r``: M microbatches of ``r.x``'s shape."""
    M = args.microbatches
    gen = torch.Generator().manual_seed(1)
    r.xs = [torch.randn(r.x.shape, generator=gen).to(r.x.device, r.x.dtype).requires_grad_(True) for _ in range(M)]
    r.gs = [torch.randn(r.x.shape, generator=gen).to(r.x.device, r.x.dtype) for _ in range(M)]
    n = args.accum_chunks or args.chunks
    ov, ov_dw = r.runners["overlapped"], r.runners["overlapped_dw"]
    if n != args.chunks:
        ov = lancet_rt.Overlapped(r.model, chunks=n)
        ov_dw = lancet_rt.Overlapped(r.model_dw, chunks=n, defer_wgrad=True)
    r.accumulate = ov
    megatron = lancet_rt.Overlapped(r.model, chunks=1)
    for mode, o in (("accumulate", ov), ("accumulate_dw", ov_dw), ("accumulate_megatron", megatron)):
        r.steps[mode] = lambda o=o: _accumulate_step(r, o, None)
    # M Overlapped steps one after the other, timed with the others (the same period of a shared machine)
    r.steps["accumulate_sequential"] = lambda: _accumulate_step(r, r.runners["overlapped"], None, interleave=False)


def _accumulate_step(r: Runner, ov, sync, interleave: bool = True) -> None:
    ov.accumulate(r.xs, lambda out, i: (out * r.gs[i]).sum(), grad_sync=sync, interleave=interleave)
    for x in r.xs:
        x.grad = None


def measure_accumulation(r: Runner, args, s: dict, link: tuple, single: dict) -> dict:
    """Time the cross-microbatch schedules (free link and ``link``); ``single``: the single-step row.

    The step of M microbatches is timed in a period of its own, so the baseline it is compared with
    directly is timed with it: M Overlapped steps one after the other (``accumulate_sequential``).
    The other baselines are scaled from the single-step table by their ratio to Overlapped there.
    """
    M = args.microbatches
    steps = args.accum_steps or min(s["steps"], 5)
    free = (math.inf, 0.0)
    raw: dict = {}
    t = r.time_all(ACCUM_MODES, steps, {"free": free, "link": link}, raw)
    r.set_link(*link)
    comm_ms, _, transfers = r.per_step_link("accumulate")
    ms = {m: t[("link", m)] for m in ACCUM_MODES}
    compute = {m: t[("free", m)] for m in ACCUM_MODES}
    # The exposed communication of each round, its link step minus its free-link step run next to
    # it (the same period of a shared machine), and the median over the rounds. The difference of
    # the two fastest steps (the single-step table's estimate) takes them from different moments.
    exposed = {m: statistics.median(a - b for a, b in zip(raw[("link", m)], raw[("free", m)])) for m in ACCUM_MODES}
    hidden = {m: 1 - exposed[m] / comm_ms for m in ACCUM_MODES}
    hidden_fastest = {m: 1 - (ms[m] - compute[m]) / comm_ms for m in ACCUM_MODES}
    # The cross-microbatch analogue of the pass-aware bound: the first forward and the last backward
    # run alone, every other forward pairs with the previous microbatch's backward.
    fc, fm = single["forward_compute_ms"], single["forward_comm_ms"]
    bc, bm = single["compute_ms"] - fc, single["comm_ms"] - fm
    bound = max(fc, fm) + (M - 1) * max(fc + bc, fm + bm) + max(bc, bm)
    vs_overlapped = ms["accumulate_sequential"] / ms["accumulate"]
    out = dict(
        microbatches=M,
        accum_chunks=args.accum_chunks or args.chunks,
        accum_steps=steps,
        accum_comm_ms=comm_ms,
        accum_transfers_per_step=transfers,
        **{f"{m}_ms": ms[m] for m in ACCUM_MODES},
        **{f"{m}_compute_ms": compute[m] for m in ACCUM_MODES},
        hidden_comm_fraction_accum=hidden["accumulate"],
        hidden_comm_fraction_accum_dw=hidden["accumulate_dw"],
        hidden_comm_fraction_accum_megatron=hidden["accumulate_megatron"],
        hidden_comm_fraction_accum_sequential=hidden["accumulate_sequential"],
        accum_hidden_estimator="median over rounds of (link step - free-link step)",
        hidden_comm_fraction_accum_fastest=hidden_fastest["accumulate"],
        hidden_comm_fraction_accum_sequential_fastest=hidden_fastest["accumulate_sequential"],
        speedup_accum_vs_overlapped=vs_overlapped,
        speedup_accum_vs_moe_pipelined=single["moe_pipelined_ms"] / single["overlapped_ms"] * vs_overlapped,
        speedup_accum_vs_sequential=single["sequential_ms"] / single["overlapped_ms"] * vs_overlapped,
        speedup_accum_vs_megatron=ms["accumulate_megatron"] / ms["accumulate"],
        accum_pass_bound_ms=bound,
        max_hidden_comm_fraction_accum=1 - (bound - M * single["compute_ms"]) / (M * single["comm_ms"]),
    )
    names = {"accumulate_sequential": f"{M} x overlapped, one after the other"}
    table = [
        dict(
            schedule=names.get(m, m),
            step_ms=ms[m],
            compute_ms=compute[m],
            exposed_ms=exposed[m],
            hidden=hidden[m],
            hidden_fastest=hidden_fastest[m],
            speedup=ms["accumulate_sequential"] / ms[m],
        )
        for m in ACCUM_MODES
    ]
    print_table(
        table,
        ["schedule", "step_ms", "compute_ms", "exposed_ms", "hidden", "hidden_fastest", "speedup"],
        title=f"a step of {M} microbatches: comm {comm_ms:.2f} ms = {comm_ms / compute['accumulate']:.2f} x compute",
    )
    print(
        f"hidden_comm_fraction_accum {out['hidden_comm_fraction_accum']:.3f} (paired; from the fastest steps "
        f"{out['hidden_comm_fraction_accum_fastest']:.3f}) (with deferred dW "
        f"{out['hidden_comm_fraction_accum_dw']:.3f}, Megatron-style {out['hidden_comm_fraction_accum_megatron']:.3f}, "
        f"{M} x Overlapped {out['hidden_comm_fraction_accum_sequential']:.3f}; single-step pass-aware bound "
        f"{single['max_hidden_comm_fraction']:.3f}, cross-microbatch bound "
        f"{out['max_hidden_comm_fraction_accum']:.3f})  "
        f"speedup vs {M} x Overlapped {vs_overlapped:.2f}x, vs {M} x MoE-internal chunking "
        f"{out['speedup_accum_vs_moe_pipelined']:.2f}x, vs Megatron-style {out['speedup_accum_vs_megatron']:.2f}x"
    )
    return out


def check_accumulation(row: dict) -> bool:
    """CI's check of the cross-microbatch schedule: it hides >= 0.75 of the step's communication and
    no less than M Overlapped steps one after the other timed in the same period (0.05 of noise
    allowed: on a shared 2-core machine the difference between the two, 0.03-0.07 in quiet runs, is
    within a run's noise). The issue's CPU target (>= 0.9, and above the single-step pass-aware
    bound) is printed beside it, met or missed, not enforced (README, Cross-microbatch overlap)."""
    hidden, seq = row["hidden_comm_fraction_accum"], row["hidden_comm_fraction_accum_sequential"]
    ok = hidden >= 0.75 and hidden >= seq - 0.05
    target = hidden >= 0.9 and hidden > row["max_hidden_comm_fraction"]
    print(
        f"check accumulate: {'PASS' if ok else 'FAIL'} (hidden {hidden:.3f} >= 0.75 and not below {seq:.3f}, "
        f"{row['microbatches']} x Overlapped, by more than 0.05); issue target {'met' if target else 'missed'} "
        f"(>= 0.9 and above the single-step pass-aware bound {row['max_hidden_comm_fraction']:.3f})"
    )
    return ok


def measure_lina(r: Runner, args, s: dict, link: tuple) -> dict:
    """The step (M microbatches, Overlapped.accumulate) with a data-parallel all-reduce of every
    gradient during the last backward, on the all-to-alls' link: whole buckets in FIFO order (as DDP
    issues them), then Lina's rule (pieces that start only when no all-to-all waits)."""
    from lancet_rt.parallel import GradientSync

    if "accumulate" not in r.steps:
        add_accumulation(r, args)
    grad_bytes = sum(p.numel() * p.element_size() for p in r.model.parameters())
    bucket_mb = args.bucket_mb or grad_bytes / 4 / 1e6
    piece_mb = args.piece_mb or bucket_mb / 8
    syncs = {
        "lina_fifo": GradientSync(r.model, r.link, params="all", bucket_mb=bucket_mb, low_priority=False),
        "lina_priority": GradientSync(
            r.model, r.link, params="all", bucket_mb=bucket_mb, piece_mb=piece_mb, low_priority=True
        ),
    }
    for mode, sync in syncs.items():
        r.steps[mode] = lambda sync=sync: _accumulate_step(r, r.accumulate, sync)
    steps = args.accum_steps or min(s["steps"], 5)
    t = r.time_all(("accumulate",) + LINA_MODES, steps, {"link": link})
    r.set_link(*link)
    comm_ms, _, _ = r.per_step_link("accumulate")
    out = dict(
        dp_bucket_mb=bucket_mb,
        dp_piece_mb=piece_mb,
        dp_grad_mb=grad_bytes / 1e6,
        lina_no_allreduce_ms=t[("link", "accumulate")],
    )
    for mode in LINA_MODES:
        total, _, _ = r.per_step_link(mode)
        out[f"{mode}_ms"] = t[("link", mode)]
        out[f"{mode}_behind_allreduce_ms"] = r.link.behind_all_reduce_ms  # of that one step
        out["dp_allreduce_comm_ms"] = total - comm_ms
        out[f"{mode}_allreduces"] = syncs[mode].issued
    for sync in syncs.values():
        sync.remove()
    out["lina_speedup"] = out["lina_fifo_ms"] / out["lina_priority_ms"]
    print(
        f"data-parallel all-reduce ({out['dp_grad_mb']:.2f} MB of gradients, {out['dp_allreduce_comm_ms']:.1f} ms "
        f"on the link; the step without it {out['lina_no_allreduce_ms']:.1f} ms): "
        f"{out['lina_fifo_ms']:.1f} ms with {out['lina_fifo_allreduces']} buckets in FIFO order "
        f"(all-to-alls waited {out['lina_fifo_behind_allreduce_ms']:.1f} ms behind them), "
        f"{out['lina_priority_ms']:.1f} ms with {out['lina_priority_allreduces']} pieces behind the all-to-alls "
        f"(waited {out['lina_priority_behind_allreduce_ms']:.1f} ms): {out['lina_speedup']:.3f}x"
    )
    return out
