"""``bench.overlap --link real[:RATE]``: the schedules over a real rate-limited link (bench.reallink).

    python -m bench.overlap --link real --world-size 2 --json bench/results/overlap_real.json     # root
    python -m bench.overlap --link real:450mbit --model mixtral
    python -m bench.overlap --link loopback --world-size 2      # the same ranks on loopback (no root, no shaping)

The command (as root) makes a link of ``--world-size`` ranks (default 2), each in its own network
namespace, every port token-bucket limited (bench.reallink), and runs one rank of this benchmark in
each; rank 0 prints the table and appends the JSON row. Each rank runs one CPU thread.

Every rank builds the same model (the blocks model: 2 attention + MoE blocks, D=256, F=512, E=8, K=2,
2048 tokens per rank, float32, dropless; or ``--model mixtral|qwen3_moe|deepseek_v3`` via from_hf) and
times one training step of each schedule: ``sequential``; ``moe_pipelined`` (MoE-internal pipelining,
``pipeline_chunks``, Tutel-style); ``overlapped`` (``Overlapped(chunks)``); ``overlapped_dw`` (with
deferred dW); ``accumulate`` (``Overlapped.accumulate`` over M = max(2, --microbatches) microbatches,
reported per microbatch); and the peers' schedules where bench.peers provides them.

The peers' all-to-alls run on the plain gloo group (``dist.all_to_all_single``, :data:`PEER_TRANSPORT`);
ours, by default, on a split group's lanes (``--channels split``). So that the peer ratio measures the
schedules and not the transport, a run that times the peers also times ``overlapped@plain`` (Overlapped on
a plain group, as ``--channels plain``) in the same rounds: ``overlapped_over_peer_<name>`` is that over
the peer's step (the headline), ``overlapped_split_over_peer_<name>`` ours on its lanes over theirs (both
in the table, :func:`peer_ratios`).

Timing: every step starts at a barrier and its time is the slowest rank's. Rounds alternate the link
between *unshaped* (no rate limit: what each schedule computes, its communication nearly free) and
*shaped* (the calibrated rate) and the order of the schedules, so that load from elsewhere hits all
alike; each figure is the median over ``--rounds``. The rate is calibrated (unless given as
``real:RATE``) so that the sequential step's communication, its shaped step minus its unshaped step,
is ``--comm-ratio`` x its unshaped step.

Metrics: ``comm_ms = sequential shaped - sequential unshaped``; for each schedule ``hidden = 1 -
(shaped - unshaped) / comm_ms`` (what of the sequential step's communication it does not add to
its own computation) and ``speedup = sequential shaped / its shaped``. The row carries the
configured rate, the achieved per-rank rate and all-to-all latency measured on the link at that
rate after the timing (bench.reallink.probe.probe), W, the load average before and after, device, commit
and date. ``--trace PATH`` writes one overlapped step of every rank (one process per rank) as a
Chrome trace, with each transfer's issue, start and end on the link tracks.

What each step computed and what it waited for (every timed step, bench.overlap.real_waits): the step's time
outside the layers' waits for collectives is its computation as it ran, on the link (``<n>_computing_ms``, the
CPU the bytes' transfer took from it included) and off it (``<n>_computing_unshaped_ms``), and the waits on
the link split into the counts' and the rows', in the forward and in all. ``--loaded`` adds a third link to the
rounds: unshaped for the steps' own bytes while traffic of no dependency on them (bench.reallink.traffic, a
process per rank) fills every port at the rate both ways, so ``<n>_computing_loaded_ms`` is the computation
while a link's worth of bytes flows beside it. Each schedule's bounds (bench.overlap.real_bounds) are stated
with its unshaped computation and with its computation on the link.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from bench.common import RowLog, keep_freed_memory, print_table, run_metadata
from bench.overlap.real_bounds import link_bound, pass_bound, report_bounds, report_computing
from bench.overlap.real_fill import fill_and_drain
from bench.overlap.real_rank import Rank, step_bytes, timing_fields
from bench.overlap.real_runner import RealRunner, peer_schedules
from bench.reallink import link as reallink
from bench.reallink import probe as reallink_probe


def add_args(p) -> None:
    p.add_argument(
        "--link",
        default="emulated",
        help="emulated (default: lancet_rt.EmulatedGroup in one process), real[:RATE] (root: W ranks over "
        "a rate-limited link, bench.reallink; RATE tc-style, e.g. 450mbit, else calibrated to "
        "--comm-ratio) or loopback (the same ranks over loopback, unshaped)",
    )
    p.add_argument("--delay-ms", type=float, default=0.0, help="--link real: netem delay on every port")
    p.add_argument(
        "--queue-ms",
        type=float,
        default=reallink.QUEUE_MS,
        help="--link real: the token bucket's queue, ms at the rate",
    )
    p.add_argument("--rounds", type=int, default=None, help="--link real: timed rounds (default 15; --quick 5)")
    p.add_argument(
        "--channels",
        default="split",
        help="--link real: the expert-parallel group's channels: split (counts and checks on a group of "
        "their own, each direction of the tokens on its own, TorchGroup.split), counts (only the counts "
        "on their own group), plain (one process group for everything); a comma-separated list times "
        "each schedule on each, interleaved (the first is the row's; the others' schedules are named "
        "schedule@channels)",
    )
    p.add_argument("--schedules", default=None, help="--link real: comma-separated schedules (default: all)")
    p.add_argument(
        "--loaded",
        action="store_true",
        help="--link real: also time every schedule unshaped while traffic of no dependency fills the link at "
        "the rate both ways (bench.reallink.traffic): the computation with the bytes flowing",
    )
    p.add_argument("--link-timeout", type=float, default=3600.0, help="--link real: seconds the ranks may run")
    p.add_argument("--dump", default=None, help=argparse_suppress())


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def link_kind(args) -> tuple[str, Optional[int]]:
    """("real", rate or None) or ("loopback", None) from ``--link``; ValueError naming it otherwise."""
    kind, _, rate = args.link.partition(":")
    if kind == "real":
        return kind, reallink.parse_rate(rate) if rate else None
    if kind == "loopback" and not rate:
        return kind, None
    raise ValueError(f"--link must be emulated, real, real:RATE or loopback, got {args.link!r}")


def main(args, argv: list) -> Optional[dict]:
    """The parent (makes the link and launches the ranks with ``argv``) or, inside a rank, the rank."""
    kind, rate = link_kind(args)
    if args.world_size is None:
        args.world_size = 2
    for bad, why in ((args.compare, "--compare"), (args.dp_allreduce, "--dp-allreduce")):
        if bad:
            raise SystemExit(f"--link {args.link}: {why} runs on the emulated link only")
    if args.loaded and (kind != "real" or args.delay_ms > 0):
        raise SystemExit("--loaded: on --link real without --delay-ms (the traffic's own shaping takes no delay)")
    if args.routing and "," in args.routing:
        raise SystemExit("--link real: one --routing per run")
    if "RANK" in os.environ:
        return _rank(args, kind, rate)
    cmd = ["-m", "bench.overlap", *argv]
    if kind == "loopback":
        rc = reallink.launch_loopback(args.world_size, cmd, args.link_timeout)
    else:
        try:
            reallink.require_tools()
        except reallink.LinkError as exc:
            raise SystemExit(f"bench.overlap --link real (bench.reallink): {exc}") from None
        reallink.signals_raise()  # (SIGTERM/SIGHUP end the with block: the link is torn down)
        with reallink.real_link(args.world_size, rate or 450_000_000, args.delay_ms, queue_ms=args.queue_ms) as link:
            rc = link.launch(cmd, args.link_timeout)
    if rc:
        raise SystemExit(rc)
    return None


# ------------------------------------------------------------------------------ inside a rank
CHANNELS = ("split", "counts", "plain")
#: The channels the peers' all-to-alls run on: ``dist.all_to_all_single`` on the plain gloo group
#: (bench.overlap.real_runner.peer_schedules), as ours on ``--channels plain``.
PEER_TRANSPORT = "plain"


def ep_group(channels: str):
    """The expert-parallel group of every rank, with ``channels`` as ``--channels`` describes."""
    import lancet_rt

    world = dist.group.WORLD
    if channels == "plain":
        return lancet_rt.TorchGroup(world)
    if channels == "counts":
        return lancet_rt.TorchGroup(world, counts_group=dist.new_group(backend="gloo"))
    return lancet_rt.TorchGroup.split(world)


def _sizes(args) -> dict:
    from bench.overlap.shapes import sizes

    if args.batch is None and not args.quick:
        args.batch = 16  # 2048 tokens per rank (seq 128)
    return sizes(args)


def _rank(args, kind: str, rate: Optional[int]) -> Optional[dict]:
    from lancet_rt.routing.traces import bias_routers, parse_routing

    me = Rank(args)
    torch.set_num_threads(args.threads)
    if args.malloc == "keep":
        keep_freed_memory()
    s = _sizes(args)
    variants = [c.strip() for c in args.channels.split(",") if c.strip()]
    bad = [c for c in variants if c not in CHANNELS]
    if bad or not variants:
        raise SystemExit(f"--channels must be a comma-separated list of {CHANNELS}, got {args.channels!r}")
    group = ep_group(variants[0])
    runner = RealRunner(args, s, group, me.rank)
    if kind == "real":  # the same model on one chunk's rows: each pass's fill and drain (bench.overlap.real_fill)
        runner.one_chunk = RealRunner(args, dict(s, batch=max(1, s["batch"] // args.chunks)), group, me.rank)
        runner.moe_layers = list(runner.moe_layers) + list(runner.one_chunk.moe_layers)
    asked = args.schedules.split(",") if args.schedules else None
    peers = {}
    if asked is None or any(n.startswith("peer_") for n in asked):  # (the peers are built and checked only if timed)
        peers = peer_schedules(runner)
        for name, step in peers.items():
            runner.add_schedule(name, step)
    wanted = asked or list(runner.steps)
    names = [n for n in wanted if n in runner.steps]
    for variant in variants[1:]:  # the same model and schedules on another group, timed in the same rounds
        names += _add_variant(runner, args, s, me.rank, variant, wanted)
    if any(n in peers for n in names) and PEER_TRANSPORT not in variants:
        # Overlapped on the peers' transport too, in the same rounds: the headline ratio compares like with like
        names += _add_variant(runner, args, s, me.rank, PEER_TRANSPORT, ["overlapped"])
    source = parse_routing(args.routing) if args.routing else None
    try:
        with bias_routers(runner.moe_layers, source) if source else _null():
            if args.dump:
                return _dump(runner, names, me, args.dump)
            return _measure(runner, names, me, args, s, kind, rate, group)
    finally:
        if me.load is not None:
            me.load.close()
        dist.destroy_process_group()


def _add_variant(runner: RealRunner, args, s: dict, rank: int, variant: str, wanted: list) -> list:
    """The same model and the ``wanted`` schedules on a group with ``variant`` channels, added to ``runner`` as
    ``<schedule>@<variant>`` (timed in the same rounds); returns their names."""
    other = RealRunner(args, s, ep_group(variant), rank)
    other.forward_done = runner.forward_done  # (its steps mark the forward's end where the timing reads it)
    runner.extra_models += other.models
    runner.moe_layers = list(runner.moe_layers) + list(other.moe_layers)
    names = []
    for n in [n for n in wanted if n in other.steps]:
        runner.add_schedule(f"{n}@{variant}", other.steps[n], other.per_step[n])
        names.append(f"{n}@{variant}")
    return names


def peer_ratios(shaped: dict, primary: str) -> dict:
    """Overlapped's step over each peer's on the shaped link (``shaped``: schedule -> ms), both ways: on the
    peers' transport (``overlapped_over_peer_<name>``, the headline: the peers' all-to-alls run on the plain
    gloo group, :data:`PEER_TRANSPORT`, and so does ``overlapped@plain``) and, when ours runs on other
    channels, on ours (``overlapped_<channels>_over_peer_<name>``: what the transport adds)."""
    same = "overlapped" if primary == PEER_TRANSPORT else f"overlapped@{PEER_TRANSPORT}"
    out = {}
    for n in shaped:
        if not n.startswith("peer_") or "@" in n:
            continue
        if same in shaped:
            out[f"overlapped_over_{n}"] = shaped[same] / shaped[n]
        if primary != PEER_TRANSPORT and "overlapped" in shaped:
            out[f"overlapped_{primary}_over_{n}"] = shaped["overlapped"] / shaped[n]
    if out:
        out["peer_transport"] = PEER_TRANSPORT
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()


def _dump(runner: RealRunner, names: list, me: Rank, path: str) -> None:
    """``--dump PATH``: every schedule's gradients after one step, saved per rank (the equality test)."""
    torch.save({n: runner.outputs(n) for n in names}, f"{path}.rank{me.rank}")
    dist.barrier(me.sync)


def _measure(runner: RealRunner, names: list, me: Rank, args, s: dict, kind: str, rate: Optional[int], group) -> dict:
    load_before = os.getloadavg()
    rounds = args.rounds or (5 if args.quick else 15)
    me.set_rate(None)
    for n in names:  # warm-up: every shape compiled, every connection made
        me.timed(runner, n)
    rate = rate if kind == "loopback" or rate else _calibrate(runner, me, args.comm_ratio)
    links = {"unshaped": (None, False), "shaped": (rate, False)}
    if me.load is not None:
        links["loaded"] = (rate, True)  # (unshaped, while the traffic beside fills the link at the rate)
    runs = {(lk, n): [] for lk in links for n in names}  # each timed step's Timing
    start = time.perf_counter()
    for rnd in range(rounds):
        for lk in list(links) if rnd % 2 == 0 else list(links)[::-1]:
            me.set_rate(*links[lk])
            for n in names if rnd % 2 == 0 else names[::-1]:
                runs[(lk, n)].append(me.step(runner, n))
        if me.rank == 0:  # a round takes tens of seconds on the link: say where the run is
            done = time.perf_counter() - start
            print(
                f"round {rnd + 1}/{rounds} ({len(names)} schedules, on and off the link): {done:.0f} s, about "
                f"{done / (rnd + 1) * (rounds - rnd - 1):.0f} s to go",
                flush=True,
            )
    me.set_rate(rate)
    step_tx, fwd_tx = step_bytes(runner, me) if kind == "real" else (None, None)
    link_numbers = reallink_probe.probe() if kind == "real" else {}
    if getattr(group, "channels", None) is not None and kind == "real":
        link_numbers["lanes_a2a_mbit"] = _lanes_rate(group, me)
    fill = fill_and_drain(runner.one_chunk, me, rate) if kind == "real" else None
    if args.trace:
        _trace(runner, me, args.trace)
    med = {k: statistics.median(t.ms for t in v) for k, v in runs.items()}
    skew = _max_over_mean(runner, me)
    comm_ms = med[("shaped", "sequential")] - med[("unshaped", "sequential")]
    row = dict(
        bench="overlap_real",
        **run_metadata(torch.device("cpu")),
        link=kind,
        world_size=me.world,
        channels=args.channels,
        model=args.model,
        routing=args.routing,
        **s,
        chunks=args.chunks,
        top_k=args.top_k,
        microbatches=runner.microbatches,
        comm_ratio=args.comm_ratio,
        configured_mbit=None if rate is None else rate / 1e6,
        delay_ms=args.delay_ms,
        queue_ms=args.queue_ms,
        rounds=rounds,
        statistic="median",
        load_avg_before=load_before,
        load_avg_after=os.getloadavg(),
        threads=args.threads,
        max_over_mean=skew,
        comm_ms=comm_ms,
        measured_comm_ratio=comm_ms / med[("unshaped", "sequential")],
        **{f"{k}": v for k, v in link_numbers.items()},
        **(fill or {}),
    )
    for n in names:
        row.update(timing_fields(n, {lk: runs[(lk, n)] for lk in links}))
        row[f"{n}_min_ms"] = min(t.ms for t in runs[("shaped", n)])
        row[f"hidden_{n}"] = 1 - (med[("shaped", n)] - med[("unshaped", n)]) / comm_ms if comm_ms > 0 else None
        row[f"speedup_{n}"] = med[("shaped", "sequential")] / med[("shaped", n)]
    if "loaded" in links:  # the traffic beside's rate, per rank
        row["load_mbit"] = statistics.median(
            t.load_mb * 8 / t.ms * 1e3 for lk, n in runs if lk == "loaded" for t in runs[(lk, n)]
        )
    # the peers (bench.peers): Overlapped's step over theirs, in the same run, on their transport and on ours
    row.update(peer_ratios({n: med[("shaped", n)] for n in names}, args.channels.split(",")[0].strip()))
    row["hidden_comm_fraction"] = row.get("hidden_overlapped")
    row["speedup_vs_sequential"] = row.get("speedup_overlapped")
    _add_bounds(row, step_tx, fwd_tx, names, fill)
    if me.rank == 0:
        _report(row, names)
        RowLog(args.json).add(row)
    return row


def _add_bounds(row: dict, step_tx, fwd_tx, names: list, fill: Optional[dict]) -> None:
    """The link's whole-step bound and each schedule's own (bench.overlap.real_bounds), with its unshaped
    computation and with its computation on the link, each also with the passes' fill and drain where measured."""
    row.update(link_bound(row, step_tx))
    for f in (None, fill) if fill is not None else (None,):
        row.update(pass_bound(row, step_tx, fwd_tx, names, fill=f))
        row.update(pass_bound(row, step_tx, fwd_tx, names, compute="on_link", fill=f))


def _report_peers(row: dict) -> None:
    """Overlapped's step over the peers', on their transport (the headline) and on ours."""
    same = {k[len("overlapped_over_peer_") :]: v for k, v in row.items() if k.startswith("overlapped_over_peer_")}
    if not same:
        return
    transport = row.get("peer_transport", PEER_TRANSPORT)
    print(
        f"Overlapped's step over the peers' (same link, same run, the same transport: a {transport} gloo group): "
        + ", ".join(f"{peer} {v:.2f}x" for peer, v in same.items())
    )
    primary = row["channels"].split(",")[0].strip()
    ours = {peer: row.get(f"overlapped_{primary}_over_peer_{peer}") for peer in same}
    if primary != transport and all(v is not None for v in ours.values()):
        print(
            f"  ours on its {primary} channels, theirs on the {transport} group: "
            + ", ".join(f"{peer} {v:.2f}x" for peer, v in ours.items())
        )


def _max_over_mean(runner: RealRunner, me: Rank) -> float:
    """The busiest expert's load over the mean, summed over the ranks, averaged over the primary model's
    MoE layers after the last step (``--routing`` skews it)."""
    import lancet_rt

    layers = lancet_rt.integrations.hf.moe_layers(runner.model) if runner.hf else runner.model.moe_layers()
    vals = []
    for moe in layers:
        load = moe.tokens_per_expert.detach().to(torch.float64).clone()
        dist.all_reduce(load, group=me.sync)
        vals.append(float(load.max() / load.mean().clamp_min(1e-9)))
    return sum(vals) / max(len(vals), 1)


def _calibrate(runner: RealRunner, me: Rank, ratio: float) -> int:
    """The rate at which the sequential step's communication is ``ratio`` x its unshaped step."""
    me.set_rate(None)
    compute = statistics.median(me.timed(runner, "sequential") for _ in range(3))
    before = me.tx_bytes()
    me.timed(runner, "sequential")
    nbytes = me.slowest(me.tx_bytes() - before)
    rate = nbytes * 8 / (ratio * compute * 1e-3) / 0.9  # (TCP's goodput is about 0.9-0.95 of the rate)
    tried: list = []  # (rate, got): once one try is above the target and one below, interpolate in log-log
    for _ in range(6):
        me.set_rate(int(rate))
        shaped = statistics.median(me.timed(runner, "sequential") for _ in range(3))
        me.set_rate(None)
        compute = statistics.median(me.timed(runner, "sequential") for _ in range(2))
        got = (shaped - compute) / (ratio * compute)
        if me.rank == 0:
            print(
                f"calibration: {rate / 1e6:.0f} Mbit/s: sequential {shaped:.0f} ms shaped, {compute:.0f} ms unshaped "
                f"(comm = {got * ratio:.2f} x compute)",
                flush=True,
            )
        if abs(got - 1) <= 0.08:
            break
        tried.append((rate, got))
        rate = me.slowest(next_rate(tried))  # (every rank the same number)
    else:
        if me.rank == 0:
            print(
                f"calibration: not within 8% in 6 tries; timing at {rate / 1e6:.0f} Mbit/s, the last one's "
                f"correction (the row's measured_comm_ratio says what it gave)",
                flush=True,
            )
    return int(rate)


def next_rate(tried: list) -> float:
    """The calibration's next rate from its tries ``(rate, got)`` (``got``: comm over the wanted comm; it falls
    as the rate rises): between the closest tries on either side of 1, interpolated in log-log (with four
    time-sliced ranks ``got`` is far from proportional to 1 / rate); else the last rate scaled by ``got``,
    at most 2x either way."""
    above = [t for t in tried if t[1] > 1]
    below = [t for t in tried if t[1] < 1]
    if above and below:
        (r1, g1), (r2, g2) = min(above, key=lambda t: t[1]), max(below, key=lambda t: t[1])
        return math.exp(math.log(r1) + math.log(g1) * (math.log(r2) - math.log(r1)) / (math.log(g1) - math.log(g2)))
    rate, got = tried[-1]
    return rate * max(0.5, min(2.0, got))


def _lanes_rate(group, me: Rank, nbytes: int = 8 << 20) -> float:
    """Per-rank Mbit/s of one all-to-all of ``nbytes`` to each peer through ``group`` (its lanes)."""
    splits = [nbytes // 4] * me.world
    return reallink_probe.a2a_mbit(lambda y, x: group.all_to_all(y, x, splits, splits).wait(), nbytes, me.sync)


def _trace(runner: RealRunner, me: Rank, path: str) -> None:
    """One overlapped step of every rank as one Chrome trace (a process per rank) at ``path``."""
    import json

    import lancet_rt

    runner.step("overlapped")
    dist.barrier(me.sync)
    with lancet_rt.tracing() as tr:
        runner.step("overlapped")
    events = tr.events()
    every: list = [None] * me.world
    dist.all_gather_object(every, events, group=me.sync)
    if me.rank == 0:
        out = []
        for r, evs in enumerate(every):
            out.append(dict(name="process_name", ph="M", pid=r, args=dict(name=f"rank {r}")))
            out += [dict(e, pid=r) for e in evs]
        with open(path, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
        print(f"trace of one overlapped step per rank: {path}")


def _report(row: dict, names: list) -> None:
    table = [
        dict(
            schedule=n,
            step_ms=row[f"{n}_ms"],
            compute_ms=row[f"{n}_compute_ms"],
            hidden=row[f"hidden_{n}"],
            speedup=row[f"speedup_{n}"],
        )
        for n in names
    ]
    rate = row["configured_mbit"]
    print_table(
        table,
        ["schedule", "step_ms", "compute_ms", "hidden", "speedup"],
        title=f"bench.overlap --link {row['link']} on {row['device']}: W={row['world_size']}, {row['layers']} "
        f"{row['model']} layers D={row['d_model']} F={row['d_ffn']} E={row['experts']} K={row['top_k']} "
        f"tokens/rank={row['batch'] * row['seq']} {row['dtype']}, chunks={row['chunks']}, channels "
        f"{row['channels']}, routing {row['routing'] or 'balanced'} (max/mean load "
        f"{row['max_over_mean']:.2f}); rate {'-' if rate is None else f'{rate:.0f} Mbit/s'}, comm "
        f"{row['comm_ms']:.0f} ms "
        f"= {row['measured_comm_ratio']:.2f} x compute; medians of {row['rounds']} rounds, the slowest "
        f"rank's step; step_ms per microbatch",
    )
    print(
        "hidden: 1 - (the schedule's step on the link - its step off it) / the sequential step's link time; "
        "below 0, a schedule pays more link time than the sequential step (a peer's all-to-alls on a slower "
        "transport, or none of its communication overlapped)"
    )
    _report_peers(row)
    if "socket_mbit" in row:
        print(
            f"link achieved per rank: {row['socket_mbit']:.0f} Mbit/s (sockets), {row['gloo_a2a_mbit']:.0f} Mbit/s "
            f"(one gloo all-to-all)"
            + (f", {row['lanes_a2a_mbit']:.0f} Mbit/s (our lanes)" if "lanes_a2a_mbit" in row else "")
            + f"; small all-to-all {row['a2a_latency_us']:.0f} us"
        )
    if row.get("link_time_ms") is not None:
        print(
            f"link bound: the busiest port sends {row['step_tx_mb']:.1f} MB per sequential step, "
            f"{row['link_time_ms']:.0f} ms at the configured rate; no step is shorter, so at Overlapped's own "
            f"compute ({row['overlapped_compute_ms']:.0f} ms) the best is {row['bound_speedup']:.2f}x, hidden "
            + ("-" if row["bound_hidden"] is None else f"{row['bound_hidden']:.2f}"),  # (None: no comm measured)
            flush=True,
        )
    report_computing(row, names)
    report_bounds(row, names)
    print(
        f"load average {' '.join(f'{v:.2f}' for v in row['load_avg_before'])} before, "
        f"{' '.join(f'{v:.2f}' for v in row['load_avg_after'])} after",
        flush=True,
    )
