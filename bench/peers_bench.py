"""``python -m bench.peers``: our layer's step against the real peers', unchunked, no link.

    python -m bench.peers                              # 1 process and 2 gloo ranks, layer and blocks, float32 and bf16
    python -m bench.peers --world-sizes 2 --models blocks --modes float32 --rounds 21
    python -m bench.peers --json bench/results/peers_cpu.json

For each world size (1: this process; W > 1: W processes on gloo over loopback, one expert-parallel
group), model (``layer``: one MoE layer on [T, D]; ``blocks``: two attention + MoE blocks,
:class:`lancet_rt.models.blocks.MoEBlocks`) and mode (``float32``; ``bf16``: under
``torch.autocast(cpu, bfloat16)``), every variant is built on the same weights and checked equal to
ours first (:func:`bench.peers.check_equal`: outputs and every gradient; the run stops if one is
not), then timed in interleaved rounds (each round runs every variant once, the order rotating), a
step being zero_grad, forward, backward; with W ranks a step's time is the slowest rank's (a barrier
before, an all-reduce of the times after). Reported: the median step, ours over each peer's median,
the same for the process's CPU time per step (``cpu_ms``, ``lancet_over_cpu``: what a shared machine's
other load inflates least),
and per step the minor page faults and system CPU time (``getrusage``, the slowest rank's; for ours
also the faults inside the experts' backward, ``experts_bwd_minflt``, and their mean: a step now and
then faults in a freshly returned gradient's pages). Variants:
float32: lancet_rt.MoE, torchtitan_fp32 (its layer with float32 experts), deepspeed; bf16: lancet_rt.MoE,
torchtitan (as shipped: bfloat16 experts).

Unchunked and without a link, this is the layer's own cost: no overlap, nothing to hide.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import tempfile
import time
from typing import Optional

import torch

import lancet_rt
from bench import peers
from bench.common import RowLog, print_table, run_metadata
from lancet_rt.cli import float_in, int_in, list_of

MODELS = ("layer", "blocks")
MODES = ("float32", "bf16")
VARIANTS = {"float32": ("lancet", "torchtitan_fp32", "deepspeed"), "bf16": ("lancet", "torchtitan")}


def _usage() -> tuple:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_stime


class _ExpertsFaults:
    """Counts the minor page faults inside our experts' backward (the bound the real-link work set: < 500 per step): a
    wrapper around ``_ExpertsFn._backward`` while active."""

    def __init__(self):
        self.faults = 0

    def __enter__(self):
        from lancet_rt.moe import experts

        self._fn = experts._ExpertsFn
        original = self._original = self._fn._backward

        def counted(ctx, dy):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            try:
                return original(ctx, dy)
            finally:
                self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

        self._fn._backward = staticmethod(counted)
        return self

    def __exit__(self, *exc):
        self._fn._backward = staticmethod(self._original)


def _build(args, model: str, group, rank: int) -> tuple:
    """Ours (seeded: the same weights on every rank) and this rank's input and output gradient."""
    moe = dict(d_ffn=args.d_ffn, num_experts=args.experts, top_k=args.top_k, ep_group=group)
    torch.manual_seed(0)
    if model == "layer":
        ours = lancet_rt.MoE(args.d_model, **moe)
        shape = (args.batch * args.seq, args.d_model)
    else:
        from lancet_rt.models.blocks import MoEBlocks

        ours = MoEBlocks(args.layers, args.d_model, args.heads, moe)
        shape = (args.batch, args.seq, args.d_model)
    g = torch.Generator().manual_seed(1000 + rank)
    return ours, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _peer(ours, model: str, peer: str, group):
    return peers.peer_layer(ours, peer, group) if model == "layer" else peers.peer_blocks(ours, peer, group)


def _step(module, x, dy, autocast) -> None:
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.float().backward(dy)


def _timed(fn, group, experts: _ExpertsFaults) -> tuple:
    """(ms, minor faults, system ms, faults in our experts' backward, CPU ms) of one run of ``fn``:
    the slowest rank's of each."""
    gc.collect()
    if group is not None:
        torch.distributed.barrier(group)
    gc.disable()
    try:
        e0 = experts.faults
        f0, s0 = _usage()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        f1, s1 = _usage()
    finally:
        gc.enable()
    out = torch.tensor([ms, f1 - f0, (s1 - s0) * 1e3, experts.faults - e0, cpu_ms], dtype=torch.float64)
    if group is not None:
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=group)
    return tuple(out.tolist())


def measure(args, group=None, rank: int = 0) -> list:
    """Every (model, mode, variant) row on this rank's group (None: one process)."""
    world = 1 if group is None else torch.distributed.get_world_size(group)
    rows = []
    for model in args.models:
        ours, x, dy = _build(args, model, group, rank)
        for mode in args.modes:
            autocast = mode == "bf16"
            variants = {"lancet": ours}
            checks = {}
            for name in VARIANTS[mode][1:]:
                variants[name] = theirs = _peer(ours, model, name, group)
                report = peers.check_equal(ours, theirs, x, autocast=torch.bfloat16 if autocast else None)
                if not report["ok"]:
                    raise SystemExit(
                        f"{name} {model} {mode} W={world}: not equal to ours "
                        f"({report['worst'][0]} rel RMS {report['worst'][1]:.2e} > {report['rtol']}); not timed"
                    )
                checks[name] = report["worst"][1]
            steps = {name: (lambda m=m: _step(m, x, dy, autocast)) for name, m in variants.items()}
            for fn in steps.values():
                for _ in range(args.warmup):
                    fn()
            times = {name: [] for name in steps}
            names = list(steps)
            load = [os.getloadavg()]
            with _ExpertsFaults() as counter:
                for r in range(args.rounds):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        times[name].append(_timed(steps[name], group, counter))
            load.append(os.getloadavg())
            med = {name: statistics.median(t[0] for t in ts) for name, ts in times.items()}
            cpu = {name: statistics.median(t[4] for t in ts) for name, ts in times.items()}
            for name, ts in times.items():
                rows.append(
                    dict(
                        model=model,
                        mode=mode,
                        world_size=world,
                        variant=name,
                        step_ms=med[name],
                        step_ms_min=min(t[0] for t in ts),
                        lancet_over=med["lancet"] / med[name] if name != "lancet" else None,
                        cpu_ms=cpu[name],
                        lancet_over_cpu=cpu["lancet"] / cpu[name] if name != "lancet" else None,
                        minflt_per_step=statistics.median(t[1] for t in ts),
                        sys_ms_per_step=statistics.median(t[2] for t in ts),
                        experts_bwd_minflt=statistics.median(t[3] for t in ts) if name == "lancet" else None,
                        experts_bwd_minflt_mean=statistics.mean(t[3] for t in ts) if name == "lancet" else None,
                        check_rel_rms=checks.get(name),
                        check_rtol=None
                        if name == "lancet"
                        else (peers.RTOL_BFLOAT16 if autocast else peers.RTOL_FLOAT32),
                        loadavg_start=load[0][0],
                        loadavg_end=load[1][0],
                        rounds=args.rounds,
                    )
                )
            del variants, steps
    return rows


def _rank_entry(rank: int, world: int, init_file: str, args, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = measure(args, dist.group.WORLD, rank)
        if rank == 0:
            queue.put(("ok", rows))
    except BaseException as exc:  # the parent reports it
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def _run_ranks(args, world: int) -> list:
    """``measure`` on ``world`` spawned gloo ranks (loopback); rank 0's rows. Bounded: ``--timeout``."""
    import queue as queue_mod

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank_entry, args=(r, world, init, args, q), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        try:
            status, result = q.get(timeout=args.timeout)
        except queue_mod.Empty:
            status, result = "error", f"no result within {args.timeout} s"
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    if status != "ok":
        raise SystemExit(f"bench.peers W={world}: {result}")
    return result


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torchtitan", "deepspeed"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv: Optional[list] = None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=list_of(int_in(1, 64)), default=[1, 2])
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    p.add_argument("--d-model", type=int_in(1), default=256)
    p.add_argument("--d-ffn", type=int_in(1), default=512)
    p.add_argument("--experts", type=int_in(1), default=8)
    p.add_argument("--top-k", type=int_in(1), default=2)
    p.add_argument("--layers", type=int_in(1), default=2, help="blocks")
    p.add_argument("--heads", type=int_in(1), default=4, help="blocks")
    p.add_argument("--batch", type=int_in(1), default=8, help="sequences per rank (the layer: batch x seq tokens)")
    p.add_argument("--seq", type=int_in(1), default=256)
    p.add_argument("--rounds", type=int_in(1), default=15)
    p.add_argument("--warmup", type=int_in(0), default=2)
    p.add_argument("--threads", type=int_in(1, 1024), default=1, help="torch threads per process")
    p.add_argument(
        "--timeout", type=float_in(0, 1e7, above=True), default=1800.0, help="seconds a multi-rank run may take"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name, values, allowed in (("--models", args.models, MODELS), ("--modes", args.modes, MODES)):
        if not values or any(v not in allowed for v in values):
            raise SystemExit(f"{name} must be a comma list of {allowed}, got {values}")
    if any(w < 1 or args.experts % w for w in args.world_sizes):
        raise SystemExit(f"--world-sizes must divide --experts ({args.experts}), got {args.world_sizes}")
    missing = [x for x in peers.PEERS if not peers.available(x)]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not installed: {peers.INSTALL}")
    torch.set_num_threads(args.threads)
    log = RowLog(args.json)
    meta = dict(run_metadata(torch.device("cpu")), **_versions())
    shape = dict(
        d_model=args.d_model,
        d_ffn=args.d_ffn,
        experts=args.experts,
        top_k=args.top_k,
        tokens_per_rank=args.batch * args.seq,
        layers=args.layers,
        threads=args.threads,
    )
    rows = []
    for world in args.world_sizes:
        for r in measure(args) if world == 1 else _run_ranks(args, world):
            row = dict(bench="peers", **r, **shape, **meta)
            rows.append(row)
            log.add(row)
    print_table(
        rows,
        [
            "model",
            "mode",
            "world_size",
            "variant",
            "step_ms",
            "lancet_over",
            "cpu_ms",
            "lancet_over_cpu",
            "minflt_per_step",
            "experts_bwd_minflt",
            "experts_bwd_minflt_mean",
            "sys_ms_per_step",
            "check_rel_rms",
            "loadavg_start",
        ],
        f"bench.peers on {meta['device']} ({meta['date']}): unchunked, no link; D={args.d_model} "
        f"F={args.d_ffn} E={args.experts} K={args.top_k}, {args.batch * args.seq} tokens per rank, dropless; "
        f"median of {args.rounds} interleaved rounds; lancet_over = our step / the variant's",
    )
    return rows
