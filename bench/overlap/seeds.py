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
from bench.common import (
    bandwidth_for_ratio,
    link_per_step,
    print_table,
    run_metadata,
    synchronize,
    time_interleaved,
    wall_ms,
    write_json,
)
from lancet_rt.models.varlen import VarlenBlocks, cu_seqlens_of, skewed_lengths

FREE = (math.inf, 0.0)


def _blocks_on_link(cls, args, s: dict, device):
    """(a free emulated link of ``--world-size``, ``cls(layers, d_model, heads, moe_kwargs)`` on it)."""
    link = lancet_rt.EmulatedGroup(
        args.world_size, math.inf, 0.0, device=device
    )  # counts in the FIFO: the replay models that
    moe_kwargs = dict(
        d_ffn=s["d_ffn"],
        num_experts=s["experts"],
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        ep_group=link,
        aux_loss_coef=1e-2,
    )
    torch.manual_seed(0)
    return link, cls(s["layers"], s["d_model"], s["heads"], moe_kwargs, device=device, dtype=getattr(torch, s["dtype"]))


# ------------------------------------------------------------------------------ balanced chunks
def balanced_chunks(args, s: dict, device: torch.device) -> list:
    """Equal sequence counts vs balanced chunk boundaries on a packed batch of skewed lengths.

    The model is :class:`lancet_rt.models.varlen.VarlenBlocks` (attention within each sequence, then the MoE),
    fed ``--batch`` x 2 sequences of lengths ``max_len * u**2`` (``max_len = 2 x --seq``), sorted
    longest first (``--balance-order sorted``) or shuffled. Three schedules: sequential, Overlapped
    with equal sequence counts per chunk (``BalancedChunks(per_sequence=1, per_token=0)``: the
    equal-rows cut of a packed batch), and Overlapped with chunks balanced by
    :func:`lancet_rt.schedule.balance.transformer_costs`.
    """
    from lancet_rt.schedule.balance import BalancedChunks, transformer_costs

    dtype = getattr(torch, s["dtype"])
    link, model = _blocks_on_link(VarlenBlocks, args, s, device)
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
    row = dict(
        bench="overlap.balanced_chunks",
        **run_metadata(device),
        **s,
        world_size=args.world_size,
        chunks=args.chunks,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        order=args.balance_order,
        sequences=len(lengths),
        tokens=T,
        max_len=max(lengths),
        min_len=min(lengths),
        comm_ratio=args.comm_ratio,
        bandwidth_gbps=bw,
        comm_ms=comm_ms,
        cost_weights=costs,
        **{f"{n}_ms": t[("link", n)] for n in runners},
        **{f"{n}_compute_ms": t[("free", n)] for n in runners},
        **{f"{n}_chunk_cost_max_over_mean": spread[n] for n in cuts},
        balanced_speedup_vs_equal_rows=t[("link", "equal_rows")] / t[("link", "balanced")],
        balanced_compute_speedup_vs_equal_rows=t[("free", "equal_rows")] / t[("free", "balanced")],
    )
    table = [
        dict(
            schedule=n,
            step_ms=t[("link", n)],
            compute_ms=t[("free", n)],
            hidden=1 - (t[("link", n)] - t[("free", n)]) / comm_ms,
            cost_max_over_mean=spread.get(n, ""),
        )
        for n in runners
    ]
    print_table(
        table,
        ["schedule", "step_ms", "compute_ms", "hidden", "cost_max_over_mean"],
        title=f"balanced chunks on {row['device']}: {s['layers']} varlen blocks D={s['d_model']} "
        f"F={s['d_ffn']} E={s['experts']} K={args.top_k} W={args.world_size}, {len(lengths)} "
        f"sequences ({args.balance_order}, {min(lengths)}..{max(lengths)} tokens, {T} in all), "
        f"chunks={args.chunks}, comm {comm_ms:.2f} ms = {args.comm_ratio} x compute ({bw:.3g} GB/s)",
    )
    print(
        f"balanced vs equal rows: step {row['balanced_speedup_vs_equal_rows']:.3f}x, computation alone "
        f"{row['balanced_compute_speedup_vs_equal_rows']:.3f}x"
    )
    return [row]


def _sequence_bounds(balance, lengths, n) -> list:
    from lancet_rt.schedule.balance import balanced_bounds

    return balanced_bounds(balance.costs(lengths), n, nonempty_first=lengths)


def _spread(costs) -> float:
    """Max over mean of the chunks' estimated costs (1.0: perfectly balanced)."""
    return max(costs) / (sum(costs) / len(costs)) if costs and sum(costs) else float("nan")


# -------------------------------------------------------------------------------------- dispatchers
class MoEOnlyBlocks(torch.nn.Module):
    """``x + moe(norm(x))`` x layers: the layers where the dispatchers differ, nothing else."""

    def __init__(self, layers: int, d_model: int, moe_kwargs: dict, *, device=None, dtype=None):
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d_model, device=device, dtype=dtype) for _ in range(layers))
        self.moes = torch.nn.ModuleList(
            lancet_rt.MoE(d_model, device=device, dtype=dtype, **moe_kwargs) for _ in range(layers)
        )

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x

    def moe_layers(self) -> list:
        return list(self.moes)


DISPATCH_CELLS = ((2, 4), (2, 2), (4, 2), (8, 2))  # (W, K): the all-reduce moves W/K x the all-to-all's bytes


def dispatchers(args, s: dict, device: torch.device) -> list:
    """PPMoE's all-reduce dispatch against the all-to-all path, at equal work, on the emulated link.

    Per cell (W ranks, top-K): ``--layers`` blocks of norm + MoE. The all-to-all path gets
    ``--batch`` x ``--seq`` tokens per rank (expert parallelism: W batches); the all-reduce path gets
    W times as many, the same on every rank (one tensor-parallel group's batch), so each rank computes
    as many expert rows and the group as many tokens. The link's bandwidth is set so that the
    all-to-all path's step communicates ``--comm-ratio`` x its computation (Overlapped, ``--chunks``);
    both paths then run sequential and Overlapped on that link and on a free one.
    """
    dtype = getattr(torch, s["dtype"])
    return [_dispatch_cell(args, s, device, W, K, dtype) for W, K in DISPATCH_CELLS]


def _dispatch_models(args, s: dict, device, link, E: int, K: int, W: int, dtype) -> tuple:
    """Both paths' models (seed 0) and their inputs: ``--batch`` sequences per rank for the all-to-all
    path, W times as many for the all-reduce path."""
    models, xs = {}, {}
    for d, batch in (("alltoall", s["batch"]), ("allreduce", W * s["batch"])):
        torch.manual_seed(0)
        models[d] = MoEOnlyBlocks(
            s["layers"],
            s["d_model"],
            dict(
                d_ffn=s["d_ffn"],
                num_experts=E,
                top_k=K,
                capacity_factor=args.capacity_factor,
                ep_group=link,
                aux_loss_coef=1e-2,
                dispatcher=d,
            ),
            device=device,
            dtype=dtype,
        )
        xs[d] = torch.randn(batch, s["seq"], s["d_model"], device=device, dtype=dtype)
    return models, xs


def _dispatch_report(row: dict, t: dict, comm: dict, runners: list, args, s: dict, T: int, bw: float) -> None:
    """One cell's table and its bytes and speedups."""
    W, K, E = row["world_size"], row["top_k"], row["experts"]
    print_table(
        [
            dict(
                dispatcher=d,
                schedule=sch,
                step_ms=t[("link", (d, sch))],
                compute_ms=t[("free", (d, sch))],
                comm_ms=comm[d][0],
                off_rank_MB=comm[d][1] / 1e6,
            )
            for d, sch in runners
        ],
        ["dispatcher", "schedule", "step_ms", "compute_ms", "comm_ms", "off_rank_MB"],
        title=f"dispatchers on {row['device']}: W={W} K={K} E={E}, {s['layers']} x (norm + MoE) "
        f"D={s['d_model']} F={s['d_ffn']}, {T} tokens per rank (all-to-all) / {W * T} replicated "
        f"(all-reduce), {bw:.3g} GB/s ({args.comm_ratio} x the all-to-all path's compute)",
    )
    print(
        f"all-reduce / all-to-all bytes {row['allreduce_over_alltoall_bytes']:.2f} (W/K = {W / K:.2f}); "
        f"all-reduce speedup: sequential {row['allreduce_speedup_sequential']:.2f}x, overlapped "
        f"{row['allreduce_speedup_overlapped']:.2f}x\n"
    )


def _dispatch_cell(args, s: dict, device: torch.device, W: int, K: int, dtype) -> dict:
    """One (W, K) cell of :func:`dispatchers`: its row."""
    from lancet_rt.moe.dispatch.allreduce import modeled_bytes

    E = max(s["experts"], W)
    link = lancet_rt.EmulatedGroup(W, math.inf, 0.0, device=device)
    T = s["batch"] * s["seq"]
    models, xs = _dispatch_models(args, s, device, link, E, K, W, dtype)
    runners = {}
    for d, m in models.items():
        runners[(d, "sequential")] = m
        runners[(d, "overlapped")] = lancet_rt.Overlapped(m, chunks=args.chunks)

    def step(key):
        d = key[0]

        def run():
            x = xs[d].detach().requires_grad_(True)
            runners[key](x).backward(torch.ones_like(x))
            for p in models[d].parameters():
                p.grad = None

        return run

    steps = {key: step(key) for key in runners}
    calib = time_interleaved({0: steps[("alltoall", "overlapped")]}, link, {"free": FREE}, 3, args.statistic, device)[
        ("free", 0)
    ]
    _, nbytes, transfers = link_per_step(link, steps[("alltoall", "sequential")])
    bw = bandwidth_for_ratio(args.comm_ratio, calib, nbytes, transfers, s["latency_us"])
    t = time_interleaved(steps, link, {"free": FREE, "link": (bw, s["latency_us"])}, s["steps"], args.statistic, device)
    link.bandwidth_gbps, link.latency_us = bw, s["latency_us"]
    comm = {d: link_per_step(link, steps[(d, "sequential")]) for d in models}
    model_bytes = modeled_bytes(T, s["d_model"], K, W, torch.empty((), dtype=dtype).element_size())
    model_bytes["allreduce"] = modeled_bytes(W * T, s["d_model"], K, W, torch.empty((), dtype=dtype).element_size())[
        "allreduce"
    ]
    row = dict(
        bench="overlap.dispatchers",
        **run_metadata(device),
        **{**s, "experts": E},
        world_size=W,
        top_k=K,
        chunks=args.chunks,
        capacity_factor=args.capacity_factor,
        comm_ratio=args.comm_ratio,
        bandwidth_gbps=bw,
        tokens_per_rank_alltoall=T,
        tokens_per_rank_allreduce=W * T,
        **{f"{d}_{sch}_ms": t[("link", (d, sch))] for d, sch in runners},
        **{f"{d}_{sch}_compute_ms": t[("free", (d, sch))] for d, sch in runners},
        **{f"{d}_comm_ms": comm[d][0] for d in models},
        **{f"{d}_off_rank_bytes": comm[d][1] for d in models},
        **{f"{d}_modeled_bytes_per_layer": model_bytes[d] for d in models},
        allreduce_over_alltoall_bytes=comm["allreduce"][1] / comm["alltoall"][1],
        allreduce_speedup_sequential=t[("link", ("alltoall", "sequential"))] / t[("link", ("allreduce", "sequential"))],
        allreduce_speedup_overlapped=t[("link", ("alltoall", "overlapped"))] / t[("link", ("allreduce", "overlapped"))],
    )
    _dispatch_report(row, t, comm, list(runners), args, s, T, bw)
    return row


# ------------------------------------------------------------------------------------------ replay
REPLAY_CHUNKS = (1, 2, 4, 8)
REPLAY_RATIOS = (0.5, 1.0, 2.0)


def _replay_rounds(args, s: dict, device, link, steps: dict, bws: dict, traced_at: list) -> tuple:
    """Every cell's measured steps and the traced steps, in the same rounds (module docstring)."""
    from lancet_rt.autotune.replay import parse_trace

    # The traced steps are recorded in the same rounds as the measured ones, so that load from
    # elsewhere weighs on both alike: each round measures every cell once and traces each count once.
    for fn in steps.values():
        fn()
    times = {(r, n): [] for r in REPLAY_RATIOS for n in REPLAY_CHUNKS}
    traces = {n: [] for n in traced_at}
    for rnd in range(max(s["steps"], args.replay_traces)):
        if rnd < s["steps"]:
            for n in REPLAY_CHUNKS:
                for r in REPLAY_RATIOS:
                    link.bandwidth_gbps, link.latency_us = bws[r], s["latency_us"]
                    times[(r, n)].append(wall_ms(lambda: (steps[n](), synchronize(device))))
        if rnd < args.replay_traces:
            link.bandwidth_gbps, link.latency_us = bws[1.0], s["latency_us"]
            for n in traced_at:
                with lancet_rt.tracing() as tr:
                    steps[n]()
                    synchronize(device)
                traces[n].append(parse_trace(tr))
    return times, traces


def _replay_cells(profiles: dict, bws: dict, t: dict, s: dict) -> list:
    """Per (comm ratio, chunks): the measured step and each profile's prediction and its error."""
    from lancet_rt.autotune.replay import replay

    cells = []
    for r in REPLAY_RATIOS:
        for n in REPLAY_CHUNKS:
            cell = dict(chunks=n, comm_ratio=r, bandwidth_gbps=bws[r], measured_ms=t[(r, n)])
            for name, prof in profiles.items():
                q = replay(prof, n, bws[r], s["latency_us"] * 1e-3)
                cell[f"{name}_ms"] = q.step_ms
                cell[f"{name}_error"] = q.step_ms / t[(r, n)] - 1
            cells.append(cell)
    return cells


def replay_check(args, s: dict, device: torch.device) -> list:
    """dPRO-style replay against measurement: traces at ``--replay-from`` chunk counts (several steps
    each, merged by their fastest parts) at comm ratio 1, replayed at chunks {1, 2, 4, 8} x comm
    ratios {0.5, 1, 2}, each cell measured (interleaved, fastest step). Two predictions per cell:
    from the first traced chunk count alone (no per-chunk overhead) and from all of them
    (interpolated between them)."""
    from lancet_rt.autotune.replay import build_profile

    from lancet_rt.models.blocks import MoEBlocks

    dtype = getattr(torch, s["dtype"])
    link, model = _blocks_on_link(MoEBlocks, args, s, device)
    x = torch.randn(s["batch"], s["seq"], s["d_model"], device=device, dtype=dtype)
    g = torch.randn_like(x)
    traced_at = [int(v) for v in args.replay_from.split(",")]
    counts = sorted(set(REPLAY_CHUNKS) | set(traced_at))
    runners = {n: lancet_rt.Overlapped(model, chunks=n, defer_wgrad=args.replay_defer_wgrad) for n in counts}

    def step(n):
        def run():
            runners[n](x.detach().requires_grad_(True)).backward(g)
            for p in model.parameters():
                p.grad = None

        return run

    steps = {n: step(n) for n in counts}
    calib = time_interleaved({4: steps[4]}, link, {"free": FREE}, 3, args.statistic, device)[("free", 4)]
    _, nbytes, transfers = link_per_step(link, steps[1])
    bws = {r: bandwidth_for_ratio(r, calib, nbytes, transfers, s["latency_us"]) for r in REPLAY_RATIOS}
    times, traces = _replay_rounds(args, s, device, link, steps, bws, traced_at)
    reduce = min if args.statistic == "min" else statistics.median
    t = {k: reduce(v) for k, v in times.items()}
    profiles = {
        "one_trace": build_profile(traces[traced_at[0]]),
        "all_traces": build_profile([tr for n in traced_at for tr in traces[n]]),
    }
    cells = _replay_cells(profiles, bws, t, s)
    summary = {
        f"{name}_{k}": f(abs(c[f"{name}_error"]) for c in cells)
        for name in profiles
        for k, f in (("max_abs_error", max), ("mean_abs_error", statistics.fmean))
    }
    row = dict(
        bench="overlap.replay",
        **run_metadata(device),
        **s,
        world_size=args.world_size,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        defer_wgrad=args.replay_defer_wgrad,
        traced_chunks=traced_at,
        traces_per_count=args.replay_traces,
        traced_bandwidth_gbps=bws[1.0],
        traced_step_ms={str(n): min(tr.step_ms for tr in traces[n]) for n in traced_at},
        forward_compute_ms_at={str(n): sum(v[n] for v in profiles["all_traces"].totals.values()) for n in traced_at},
        cells=cells,
        **summary,
    )
    print_table(
        cells,
        ["chunks", "comm_ratio", "measured_ms", "one_trace_ms", "one_trace_error", "all_traces_ms", "all_traces_error"],
        title=f"replay on {row['device']}: {s['layers']} blocks D={s['d_model']} E={s['experts']} "
        f"K={args.top_k} W={args.world_size} tokens={s['batch'] * s['seq']}, traced at chunks "
        f"{traced_at} (comm ratio 1, {bws[1.0]:.3g} GB/s)" + (", deferred dW" if args.replay_defer_wgrad else ""),
    )
    print(
        "prediction error |predicted / measured - 1|: "
        + ", ".join(
            f"{name} max {summary[name + '_max_abs_error']:.1%} mean {summary[name + '_mean_abs_error']:.1%}"
            for name in profiles
        )
    )
    return [row]


COMPARISONS = {"balanced-chunks": balanced_chunks, "dispatchers": dispatchers, "replay": replay_check}


def main(args, s: dict, device: torch.device) -> list:
    """Run ``args.compare``; print its table, append its rows to ``--json``."""
    rows = COMPARISONS[args.compare](args, s, device)
    if args.json:
        write_json(args.json, rows)
    return rows
