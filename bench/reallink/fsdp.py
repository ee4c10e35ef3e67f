"""FSDP2 + expert parallelism over a real link: ``lancet_rt.parallel.parallelize_hf`` on a (dp=2, ep=2)
mesh of 4 ranks, each in its own network namespace (bench.reallink).

    python -m bench.reallink --ranks 4 --rate 450mbit -- -m bench.reallink.fsdp --json bench/results/fsdp_real.json

Every rank builds the same transformers model (``--model``, lancet_rt.models.hf_models at the ``bench`` size, no
load-balancing loss and no padding, so that a (dp, ep) run can equal one process on the global batch)
and makes two copies of it with ``parallelize_hf(..., engine="fully_shard")``: unchunked, and under
``Overlapped(chunks)``. The expert-parallel groups are split (``TorchGroup.split``) unless
``--channels plain``.

1. Exact: one training step of each copy on this rank's rows, its loss and every gradient (whole
   tensors, FSDP's shards gathered; experts: this ep rank's) against the model in one process on the
   global batch, float32 relative RMS error <= 1e-5 (exit status 1 otherwise).
2. Timed: a training step (forward, backward: FSDP's all-gathers and reduce-scatters, our all-to-alls)
   of each copy, rounds alternating the link between unshaped and the launcher's rate and the order of
   the copies; the slowest rank's step, medians. Rank 0 prints them and appends a JSON row.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from bench.common import RowLog, keep_freed_memory, print_table, run_metadata, wall_ms
from bench.reallink import link as reallink

ROWS, SEQ = 8, 128  # per rank
TOLERANCE = 1e-5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_moe", help="a lancet_rt.models.hf_models family")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--rows", type=int, default=ROWS, help="sequences per rank")
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--channels", choices=("split", "plain"), default="split")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _build(family: str):
    from lancet_rt.models.hf_models import build

    return build(family, "bench", output_router_logits=False)


def _batch(family: str, world: int, rows: int, seq: int):
    from lancet_rt.models.hf_models import SIZES, batch

    ids, _, labels = batch(SIZES["bench"]["vocab"], world * rows, seq, seed=7, pad_rows=0)
    return ids, labels


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _exactness(model, ref_grads: dict, ref_loss: float, loss, ep_rank: int) -> float:
    """The worst relative RMS error of ``model``'s loss and gradients (FSDP shards gathered: a
    collective) against one process's; experts are compared on this ep rank's slice."""
    from lancet_rt.parallel import expert_parameters

    experts = {id(p) for p in expert_parameters(model)}
    worst = abs(float(loss) - ref_loss) / max(abs(ref_loss), 1e-30)
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        ref = ref_grads[n]
        if id(p) in experts:
            k = g.shape[0]
            ref = ref[ep_rank * k : (ep_rank + 1) * k]
        worst = max(worst, _rel_rms(g, ref))
    return worst


def _rounds(names: list, links: dict, timed, rounds: int, link, sync) -> dict:
    """{(link, name): median ms}: every name on every link (rate or None: unshaped), rounds alternating
    the links' order and the names', after one warm-up step each."""
    times = {(lk, n): [] for lk in links for n in names}
    for n in names:
        timed(n)
    for rnd in range(rounds):
        for lk in list(links) if rnd % 2 == 0 else list(links)[::-1]:
            if link is not None:
                link.set_rate(links[lk])
            dist.barrier(sync)
            for n in names if rnd % 2 == 0 else names[::-1]:
                times[(lk, n)].append(timed(n))
    return {k: statistics.median(v) for k, v in times.items()}


def _reference(model: str, ids, labels, mine: slice) -> tuple:
    """One process's loss on this rank's rows and its gradients on the global batch: what a step must give."""
    ref = _build(model)
    with torch.no_grad():
        ref_loss = float(ref(input_ids=ids[mine], labels=labels[mine]).loss)  # this rank's rows, one process
    ref(input_ids=ids, labels=labels).loss.backward()  # the global batch: the gradients a step must give
    return ref_loss, {n: p.grad for n, p in ref.named_parameters()}


def _print(args, row: dict, med: dict, errors: dict, rate, ok: bool) -> None:
    """Rank 0's table: each copy's shaped and unshaped step and its error against the reference."""
    load_before = row["load_avg_before"]
    print_table(
        [
            dict(copy=n, shaped_ms=med[("shaped", n)], unshaped_ms=med[("unshaped", n)], max_rel_rms=errors[n])
            for n in errors
        ],
        ["copy", "shaped_ms", "unshaped_ms", "max_rel_rms"],
        title=f"bench.reallink.fsdp: parallelize_hf(fully_shard) {args.model} on (dp=2, ep=2), 4 ranks, "
        f"{'unshaped' if rate is None else f'{rate / 1e6:.0f} Mbit/s'} ports, channels "
        f"{args.channels}; one step against one process on the global batch "
        f"({'exact' if ok else 'NOT exact'}: rel RMS <= {TOLERANCE:g}); medians of {args.rounds} rounds",
    )
    print(
        f"Overlapped(chunks={args.chunks}) vs unchunked on the shaped link: {row['speedup_shaped']:.2f}x; load "
        f"average {' '.join(f'{v:.2f}' for v in load_before)} before"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh

    import lancet_rt
    from lancet_rt.parallel import parallelize_hf

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit(f"bench.reallink.fsdp runs on 4 ranks (a (dp=2, ep=2) mesh), got {world}")
    torch.set_num_threads(1)
    keep_freed_memory()
    link = reallink.rank_link()
    rate = link.shape.rate_bps if link is not None else None
    sync = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ep_rank = mesh["ep"].get_local_rank()
    if args.channels == "split":
        lancet_rt.TorchGroup.split(mesh["ep"].get_group())  # parallelize_hf's layers find it (as_group)
    else:  # (a ProcessGroup given as ep_group is split at its first collective by default)
        os.environ[lancet_rt.env.EP_TRANSPORT] = "plain"

    ids, labels = _batch(args.model, world, args.rows, args.seq)
    mine = slice(rank * args.rows, (rank + 1) * args.rows)
    ref_loss, ref_grads = _reference(args.model, ids, labels, mine)

    models = {
        "sequential": parallelize_hf(_build(args.model), mesh, engine="fully_shard"),
        "overlapped": parallelize_hf(_build(args.model), mesh, engine="fully_shard", chunks=args.chunks),
    }

    def step(name):
        loss = models[name](input_ids=ids[mine], labels=labels[mine]).loss
        loss.backward()
        return loss

    errors = {}
    for name, model in models.items():
        errors[name] = _exactness(model, ref_grads, ref_loss, step(name).detach(), ep_rank)
        model.zero_grad(set_to_none=True)

    def timed(name) -> float:
        dist.barrier(sync)
        ms = wall_ms(lambda: step(name))
        models[name].zero_grad(set_to_none=True)
        t = torch.tensor([ms], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sync)
        return float(t)

    load_before = os.getloadavg()
    links = {"unshaped": None, "shaped": rate}
    med = _rounds(list(models), links, timed, args.rounds, link, sync)
    row = dict(
        bench="fsdp_real",
        **run_metadata(torch.device("cpu")),
        model=args.model,
        mesh="dp=2,ep=2",
        world_size=world,
        channels=args.channels,
        chunks=args.chunks,
        tokens_per_rank=args.rows * args.seq,
        configured_mbit=None if rate is None else rate / 1e6,
        rounds=args.rounds,
        statistic="median",
        load_avg_before=load_before,
        load_avg_after=os.getloadavg(),
        max_rel_rms_sequential=errors["sequential"],
        max_rel_rms_overlapped=errors["overlapped"],
        **{f"{n}_{lk}_ms": med[(lk, n)] for lk in links for n in models},
    )
    row["speedup_shaped"] = med[("shaped", "sequential")] / med[("shaped", "overlapped")]
    ok = max(errors.values()) <= TOLERANCE
    if rank == 0:
        _print(args, row, med, errors, rate, ok)
        RowLog(args.json).add(row)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)
    return row


if __name__ == "__main__":
    main()
