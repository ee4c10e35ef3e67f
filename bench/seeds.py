"""The seed systems measured against lancet-rt's default, on the emulated link (``bench.overlap --compare``).

    python -m bench.overlap --device cpu --quick --compare balanced-chunks   # DynaPipe-style chunk boundaries
    python -m bench.overlap --device cpu --quick --compare dispatchers       # PPMoE all-reduce dispatch vs all-to-all
    python -m bench.overlap --device cpu --quick --compare replay            # dPRO-style replay: predicted vs measured

Each prints a table and, with ``--json PATH``, appends rows carrying device, commit and date. The
timing method is bench.overlap's: the schedules run interleaved step by step on a free link (their
computation) and on the calibrated one, each summarised by its fastest step (``--statistic``); the
link's bandwidth is set so that one step's modeled communication is ``--comm-ratio`` x computation.
"""
from __future__ import annotations

import math
import statistics

import torch

import lancet_rt
from bench.common import print_table, run_metadata, synchronize, write_json
from bench.varlen import VarlenBlocks, cu_seqlens_of, skewed_lengths

FREE = (math.inf, 0.0)


def time_interleaved(steps: dict, link, links: dict, reps: int, statistic: str = "min", device=None) -> dict:
    """``{(link name, step name): ms}``: every step on every link, interleaved, after one warm-up each.

    Args:
        steps: name -> a callable running one training step.
        link: the :class:`lancet_rt.EmulatedGroup` whose bandwidth and latency ``links`` set.
        links: link name -> (bandwidth_gbps, latency_us).
        reps: timed rounds.
    """
    from bench.overlap import _wall_ms

    for fn in steps.values():
        fn()
    times = {(lk, s): [] for lk in links for s in steps}
    for _ in range(reps):
        for s, fn in steps.items():
            for lk, (bw, lat) in links.items():
                link.bandwidth_gbps, link.latency_us = bw, lat
                times[(lk, s)].append(_wall_ms(lambda: (fn(), synchronize(device or torch.device("cpu")))))
    reduce = min if statistic == "min" else statistics.median
    return {k: reduce(v) for k, v in times.items()}


def link_per_step(link, step) -> tuple:
    """(modeled ms, off-rank bytes, transfers) of one run of ``step`` on ``link``'s current setting."""
    link.reset()
    step()
    return link.modeled_ms, link.off_rank_bytes, link.transfers


def bandwidth_for_ratio(ratio: float, compute_ms: float, nbytes: int, transfers: int, latency_us: float) -> float:
    """The bandwidth (GB/s) at which ``nbytes`` in ``transfers`` collectives take ``ratio x compute_ms``."""
    budget_ms = ratio * compute_ms - transfers * latency_us * 1e-3
    if budget_ms <= 0:
        raise SystemExit(f"latency {latency_us} us x {transfers} transfers alone exceeds {ratio} x {compute_ms:.2f} ms")
    return nbytes / (budget_ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------ balanced chunks
def balanced_chunks(args, s: dict, device: torch.device) -> list:
    """Equal sequence counts vs balanced chunk boundaries on a packed batch of skewed lengths.

    The model is :class:`bench.varlen.VarlenBlocks` (attention within each sequence, then the MoE),
    fed ``--batch`` x 2 sequences of lengths ``max_len * u**2`` (``max_len = 2 x --seq``), sorted
    longest first (``--balance-order sorted``) or shuffled. Three schedules: sequential, Overlapped
    with equal sequence counts per chunk (``BalancedChunks(per_sequence=1, per_token=0)``: the
    equal-rows cut of a packed batch), and Overlapped with chunks balanced by
    :func:`lancet_rt.balance.transformer_costs`.
    """
    from lancet_rt.balance import BalancedChunks, transformer_costs

    dtype = getattr(torch, s["dtype"])
    link = lancet_rt.EmulatedGroup(args.world_size, math.inf, 0.0, device=device)
    moe_kwargs = dict(d_ffn=s["d_ffn"], num_experts=s["experts"], top_k=args.top_k,
                      capacity_factor=args.capacity_factor, ep_group=link, aux_loss_coef=1e-2)
    torch.manual_seed(0)
    model = VarlenBlocks(s["layers"], s["d_model"], s["heads"], moe_kwargs, device=device, dtype=dtype)
    lengths = skewed_lengths(2 * s["batch"], 2 * s["seq"], sort=args.balance_order == "sorted", seed=1)
    cu = cu_seqlens_of(lengths, device=device)
    T = int(sum(lengths))
    x = torch.randn(T, s["d_model"], device=device, dtype=dtype)
    g = torch.randn_like(x)
    costs = transformer_costs(s["d_model"], s["d_ffn"], args.top_k)
    cuts = {
        "equal_rows": BalancedChunks(cu_seqlens="cu_seqlens", per_token=0.0, per_sequence=1.0),
        "balanced": BalancedChunks(cu_seqlens="cu_seqlens", **costs),
    }
    runners = {"sequential": model}
    runners.update({name: lancet_rt.Overlapped(model, chunks=args.chunks, balance=b) for name, b in cuts.items()})

    def step(name):
        def run():
            xx = x.detach().requires_grad_(True)
            runners[name](xx, cu_seqlens=cu).backward(g)
            for p in model.parameters():
                p.grad = None
        return run

    steps = {name: step(name) for name in runners}
    calib = time_interleaved({"balanced": steps["balanced"]}, link, {"free": FREE}, 3, args.statistic, device)
    _, nbytes, transfers = link_per_step(link, steps["sequential"])
    bw = bandwidth_for_ratio(args.comm_ratio, calib[("free", "balanced")], nbytes, transfers, s["latency_us"])
    t = time_interleaved(steps, link, {"free": FREE, "link": (bw, s["latency_us"])}, s["steps"], args.statistic, device)
    link.bandwidth_gbps, link.latency_us = bw, s["latency_us"]
    comm_ms, _, _ = link_per_step(link, steps["sequential"])

    def chunk_costs(b):  # each cut's chunks priced by the FLOP-based estimate
        bounds = _sequence_bounds(b, lengths, args.chunks)
        return [sum(cuts["balanced"].costs(lengths[i:j])) for i, j in zip(bounds, bounds[1:])]

    spread = {name: _spread(chunk_costs(b)) for name, b in cuts.items()}
    row = dict(bench="overlap.balanced_chunks", **run_metadata(device), **s, world_size=args.world_size,
               chunks=args.chunks, top_k=args.top_k, capacity_factor=args.capacity_factor,
               order=args.balance_order, sequences=len(lengths), tokens=T, max_len=max(lengths),
               min_len=min(lengths), comm_ratio=args.comm_ratio, bandwidth_gbps=bw, comm_ms=comm_ms,
               cost_weights=costs,
               **{f"{n}_ms": t[("link", n)] for n in runners},
               **{f"{n}_compute_ms": t[("free", n)] for n in runners},
               **{f"{n}_chunk_cost_max_over_mean": spread[n] for n in cuts},
               balanced_speedup_vs_equal_rows=t[("link", "equal_rows")] / t[("link", "balanced")],
               balanced_compute_speedup_vs_equal_rows=t[("free", "equal_rows")] / t[("free", "balanced")])
    table = [dict(schedule=n, step_ms=t[("link", n)], compute_ms=t[("free", n)],
                  hidden=1 - (t[("link", n)] - t[("free", n)]) / comm_ms,
                  cost_max_over_mean=spread.get(n, ""))
             for n in runners]
    print_table(table, ["schedule", "step_ms", "compute_ms", "hidden", "cost_max_over_mean"],
                title=f"balanced chunks on {row['device']}: {s['layers']} varlen blocks D={s['d_model']} "
                      f"F={s['d_ffn']} E={s['experts']} K={args.top_k} W={args.world_size}, {len(lengths)} "
                      f"sequences ({args.balance_order}, {min(lengths)}..{max(lengths)} tokens, {T} in all), "
                      f"chunks={args.chunks}, comm {comm_ms:.2f} ms = {args.comm_ratio} x compute ({bw:.3g} GB/s)")
    print(f"balanced vs equal rows: step {row['balanced_speedup_vs_equal_rows']:.3f}x, computation alone "
          f"{row['balanced_compute_speedup_vs_equal_rows']:.3f}x")
    return [row]


def _sequence_bounds(balance, lengths, n) -> list:
    from lancet_rt.balance import balanced_bounds

    return balanced_bounds(balance.costs(lengths), n, nonempty_first=lengths)


def _spread(costs) -> float:
    """Max over mean of the chunks' estimated costs (1.0: perfectly balanced)."""
    return max(costs) / (sum(costs) / len(costs)) if costs and sum(costs) else float("nan")


COMPARISONS = {"balanced-chunks": balanced_chunks}


def main(args, s: dict, device: torch.device) -> list:
    """Run ``args.compare``; print its table, append its rows to ``--json``."""
    rows = COMPARISONS[args.compare](args, s, device)
    if args.json:
        write_json(args.json, rows)
    return rows
