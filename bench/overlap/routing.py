"""bench.overlap --routing: the four schedules under several routings, side by side, on the asymmetric link.

    python -m bench.overlap --device cpu --quick --routing balanced,zipf
    python -m bench.overlap --device cpu --routing balanced,zipf,trace:bench/results/routing_trace.json

Every routing runs on one :class:`lancet_rt.comm.emulated_skew.SkewedGroup` (every emulated rank routes
like rank 0; the busiest port holds the link; a returning all-to-all waits for the hot rank's experts,
``expert_ms_per_row`` timed here on this model's experts). The routing source is replayed as router
logit biases (:func:`lancet_rt.routing.traces.bias_routers`), their strength bisected so that the model's
measured max/mean expert load is the source's (``zipf``: the preset's 3.0; a trace: its own; ``zipf:S``:
strength 1); the row reports the measured ``max_over_mean``. The layers are dropless (a capacity would cut
the hot expert's rows, and the clusters the issue cites are dropless).

The bandwidth is calibrated once, on the first routing (``--comm-ratio`` as in bench.overlap), and kept
for the others: the same cluster, different routing. Per routing: ``comm_ms`` is the collective time
a rank sees when nothing overlaps, the link's modelled time plus the sequential schedule's wait for
the hot rank's experts (``straggler_ms``); ``hidden = 1 - (step_ms - compute_ms) / comm_ms`` for
every schedule (compute_ms: the same schedule on a free link; Overlapped and ``mitigated`` share the
smaller of their two, the same computation), and the speedups against sequential.
The fifth schedule, ``mitigated``, is Overlapped on the link in ``order="ready"`` (the first mitigation
tried, :class:`lancet_rt.comm.emulated_skew.SkewedGroup`): a return held back for the hot rank no longer
blocks the transfers whose data is ready. The sixth, ``shadowed``, is Overlapped on a copy of the model
(same seed, same weights) whose layers shadow hot experts (``MoE(shadow_experts=N)``, ``--shadow-experts``,
:mod:`lancet_rt.moe.dispatch.shadow`): the hot experts' weights travel instead of their rows.
``recovered`` / ``recovered_shadowed`` (per routing after the first) are the shares of the drop in
Overlapped's hidden fraction, against the first routing, that each wins back (``hidden`` is over the
unmitigated ``comm_ms``, so a mitigation that removes communication can pass 100%; ``hidden_shadowed_own``
is over the shadowed step's own link time and straggler wait); ``recovered_step`` /
``recovered_step_shadowed`` the shares of the step-time loss.
"""

from __future__ import annotations

import math
import statistics

import torch

from bench.common import RowLog, bandwidth_for_ratio, print_table, run_metadata, step_ms
from lancet_rt import ops as _ops
from lancet_rt.cli import int_in
from lancet_rt.routing.traces import ZIPF_PRESET_MAX_OVER_MEAN, bias_routers, parse_routing

MODES = ("sequential", "moe_pipelined", "overlapped", "overlapped_dw", "mitigated", "shadowed")


def add_routing_args(p) -> None:
    p.add_argument(
        "--routing",
        default=None,
        help="comma-separated routings run side by side on the asymmetric link: balanced, zipf (the preset, "
        "max/mean expert load ~3), zipf:S (Zipf exponent S), trace:FILE (a lancet_rt routing trace)",
    )
    p.add_argument(
        "--shadow-experts",
        type=int_in(0),
        default=2,
        help="--routing: the 'shadowed' schedule's MoE(shadow_experts=N) (hot-expert shadowing; 0: leave it out)",
    )


def expert_ms_per_row(r, s: dict, top_k: int, device) -> float:
    """The first MoE layer's experts' forward time per row, on a step's rows (no grad; fastest of 5)."""
    moe = r.moe_layers[0]
    rows = s["batch"] * s["seq"] * top_k
    dtype = getattr(torch, s["dtype"])
    experts = moe.experts
    n = experts.num_local_experts
    x = torch.randn(rows, s["d_model"], device=device, dtype=dtype)
    offsets = torch.tensor([rows * e // n for e in range(n + 1)], device=device, dtype=torch.int64)
    ops = _ops.get_ops(device, dtype)
    with torch.no_grad():
        times = [step_ms(lambda: experts(x, offsets, ops), device) for _ in range(6)][1:]
    return min(times) / rows


def _all_moe(r) -> list:
    """The MoE layers of every model copy the runner holds (each schedule's routers are biased)."""
    if r.hf:
        import lancet_rt.integrations.hf as hf

        return [m for model in r.models for m in hf.moe_layers(model)]
    return [m for model in r.models for m in model.moe_layers()]


def _loads(r) -> float:
    """Max/mean expert load of the last forward, averaged over the MoE layers."""
    vals = []
    for moe in r.moe_layers:
        load = moe.tokens_per_expert.tolist()
        vals.append(max(load) * len(load) / max(sum(load), 1))
    return sum(vals) / len(vals)


def _strength(r, src) -> float:
    """The router-bias strength at which the model's measured max/mean load meets the source's: the
    ``zipf`` preset's 3.0, a trace's own; 1 for ``zipf:S`` (the exponent is the user's) and balanced."""
    if src.kind == "balanced" or (src.kind == "zipf" and src.exponent is not None):
        return 1.0
    target = ZIPF_PRESET_MAX_OVER_MEAN if src.kind == "zipf" else src.trace.max_over_mean()
    lo, hi = 0.0, 4.0
    for _ in range(10):
        mid = (lo + hi) / 2
        with bias_routers(r.moe_layers, src, mid), torch.no_grad():
            r.forward("sequential")
        lo, hi = (mid, hi) if _loads(r) < target else (lo, mid)
    return (lo + hi) / 2


def _measure_routing(r, args, s: dict, bw: float, modes) -> dict:
    """Every schedule on the free and the calibrated link under the current routing; the row's numbers."""
    lat = s["latency_us"]
    raw: dict = {}
    t = r.time_all(modes, s["steps"], {"free": (math.inf, 0.0), "link": (bw, lat)}, raw)
    r.set_link(bw, lat)
    r.link.reset()
    r.step("sequential")
    link_ms, straggler_ms, skew_ms = r.link.modeled_ms, r.link.straggler_ms, r.link.skew_ms
    comm_ms = link_ms + straggler_ms
    out = dict(
        max_over_mean=_loads(r), link_ms=link_ms, straggler_ms=straggler_ms, skew_link_ms=skew_ms, comm_ms=comm_ms
    )
    if "shadowed" in modes:  # the shadowed step's own link time (fewer bytes on the hot port, plus the fetches)
        r.link.reset()
        r.step("shadowed")
        out.update(
            shadowed_link_ms=r.link.modeled_ms,
            shadowed_straggler_ms=r.link.straggler_ms,
            shadowed_experts=[list(m.shadowed) for m in r.models[-1].moe_layers()],
        )
    if "mitigated" in modes:  # the same computation as Overlapped (only the link's order differs): one estimate
        t[("free", "overlapped")] = t[("free", "mitigated")] = min(t[("free", "overlapped")], t[("free", "mitigated")])
    for m in modes:
        out[f"{m}_ms"] = t[("link", m)]
        out[f"{m}_compute_ms"] = t[("free", m)]
        out[f"{m}_median_ms"] = statistics.median(raw[("link", m)])
        out[f"hidden_{m}"] = 1 - (t[("link", m)] - t[("free", m)]) / comm_ms
        out[f"speedup_{m}"] = t[("link", "sequential")] / t[("link", m)]
    if "shadowed" in modes:  # of its own (smaller) communication
        own = out["shadowed_link_ms"] + out["shadowed_straggler_ms"]
        out["hidden_shadowed_own"] = 1 - (out["shadowed_ms"] - out["shadowed_compute_ms"]) / own if own > 0 else 1.0
    return out


def _add_shadowed(r, args, s: dict, device) -> None:
    """The ``shadowed`` schedule: Overlapped on a copy of the model (the same seed, so the same weights)
    whose layers shadow hot experts (``MoE(shadow_experts=N)``, :mod:`lancet_rt.moe.dispatch.shadow`)."""
    import lancet_rt
    from lancet_rt.models.blocks import MoEBlocks

    moe_kwargs = dict(
        d_ffn=s["d_ffn"],
        num_experts=s["experts"],
        top_k=args.top_k,
        capacity_factor=None,
        ep_group=r.link,
        aux_loss_coef=1e-2,
        shadow_experts=args.shadow_experts,
    )
    torch.manual_seed(0)  # as bench.overlap.runner.Runner builds its models
    model = MoEBlocks(
        s["layers"], s["d_model"], s["heads"], moe_kwargs, device=device, dtype=getattr(torch, s["dtype"])
    )
    r.models = tuple(r.models) + (model,)
    r.runners["shadowed"] = lancet_rt.Overlapped(model, chunks=args.chunks)


def run(args, s: dict, device) -> list:
    """The --routing benchmark (module docstring); returns one row per routing."""
    from bench.overlap.runner import Runner

    sources = [parse_routing(t.strip()) for t in args.routing.split(",") if t.strip()]
    args.capacity_factor = None  # dropless, as the clusters measured are: a capacity would cut the hot expert's rows
    r = Runner(args, s, device)
    modes = MODES

    def mitigated():
        r.link.order = "ready"
        try:
            r._run("overlapped")
        finally:
            r.link.order = "fifo"

    r.steps["mitigated"] = mitigated
    if args.shadow_experts and not r.hf:
        _add_shadowed(r, args, s, device)
    else:
        modes = tuple(m for m in MODES if m != "shadowed")
    r.link.expert_ms_per_row = per_row = expert_ms_per_row(r, s, args.top_k, device)
    rows, bw = [], None
    for src in sources:
        strength = _strength(r, src)
        with bias_routers(_all_moe(r), src, strength):
            if bw is None:  # calibrated on the first routing, kept for the others
                calib = r.time_all(["overlapped"], 5, {"free": (math.inf, 0.0)})[("free", "overlapped")]
                _, nbytes, transfers = r.per_step_link("sequential")
                bw = bandwidth_for_ratio(args.comm_ratio, calib, nbytes, transfers, s["latency_us"])
            m = _measure_routing(r, args, s, bw, modes)
        row = dict(
            bench="overlap_routing",
            **run_metadata(device),
            **s,
            model=args.model,
            routing=src.name,
            world_size=args.world_size,
            chunks=args.chunks,
            top_k=args.top_k,
            comm_ratio=args.comm_ratio,
            bandwidth_gbps=bw,
            expert_ms_per_row=per_row,
            bias_strength=strength,
            **m,
        )
        rows.append(row)
    for row in rows[1:]:
        drop = rows[0]["hidden_overlapped"] - row["hidden_overlapped"]
        row["recovered"] = (row["hidden_mitigated"] - row["hidden_overlapped"]) / drop if drop > 0 else None
        loss = row["overlapped_ms"] - rows[0]["overlapped_ms"]
        row["recovered_step"] = (row["overlapped_ms"] - row["mitigated_ms"]) / loss if loss > 0 else None
        if "shadowed" in modes:
            row["recovered_shadowed"] = (row["hidden_shadowed"] - row["hidden_overlapped"]) / drop if drop > 0 else None
            row["recovered_step_shadowed"] = (row["overlapped_ms"] - row["shadowed_ms"]) / loss if loss > 0 else None
    log = RowLog(args.json)
    for row in rows:
        log.add(row)
    _report(rows, modes, s, args)
    return rows


def _report(rows, modes, s: dict, args) -> None:
    table = [
        dict(
            routing=row["routing"],
            schedule=m,
            step_ms=row[f"{m}_ms"],
            compute_ms=row[f"{m}_compute_ms"],
            comm_ms=row["comm_ms"],
            hidden=row[f"hidden_{m}"],
            speedup=row[f"speedup_{m}"],
            max_over_mean=row["max_over_mean"],
        )
        for row in rows
        for m in modes
    ]
    print_table(
        table,
        ["routing", "schedule", "step_ms", "compute_ms", "comm_ms", "hidden", "speedup", "max_over_mean"],
        title=f"bench.overlap --routing on {rows[0]['device']}: {s['layers']} layers D={s['d_model']} "
        f"E={s['experts']} K={args.top_k} W={args.world_size} chunks={args.chunks}, "
        f"{rows[0]['bandwidth_gbps']:.3g} GB/s (comm = {args.comm_ratio} x compute on {rows[0]['routing']})",
    )
    for row in rows:
        rec = row.get("recovered")
        print(
            f"{row['routing']}: max/mean load {row['max_over_mean']:.2f}, hidden (Overlapped) "
            f"{row['hidden_overlapped']:.3f}, mitigated {row['hidden_mitigated']:.3f}, straggler wait "
            f"{row['straggler_ms']:.2f} ms of comm {row['comm_ms']:.2f} ms"
            + ("" if rec is None else f", mitigation recovers {rec:.0%} of the hidden-fraction drop")
        )
        if "hidden_shadowed" in row:
            rs, rt = row.get("recovered_shadowed"), row.get("recovered_step_shadowed")
            print(
                f"  shadowed (shadow_experts={args.shadow_experts}): hidden {row['hidden_shadowed']:.3f}, step "
                f"{row['shadowed_ms']:.1f} ms (Overlapped {row['overlapped_ms']:.1f}), link "
                f"{row['shadowed_link_ms']:.1f} ms "
                f"(sequential's {row['link_ms']:.1f}), shadowed experts per layer {row['shadowed_experts']}"
                + ("" if rs is None else f", recovers {rs:.0%} of the hidden-fraction drop")
                + ("" if rt is None else f" and {rt:.0%} of the step-time loss")
            )
