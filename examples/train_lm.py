"""The main job: train a small GPT-style MoE language model with expert parallelism.

    torchrun --standalone --nproc-per-node 2 examples/train_lm.py   # or: make train
    make train-link      # (root) the same on 2 ranks over a real rate-limited link (bench.reallink), split group

Each rank holds E / W experts and its own data shard; tokens reach their experts through the
all-to-alls (gloo on CPU, NCCL when every rank has a GPU). The data is an order-2 Markov language
generated here (each pair of tokens has three possible successors with probabilities 0.75 / 0.2 /
0.05, see MarkovLanguage), so the loss has a known floor: its entropy. The model runs under ``lancet_rt.Overlapped``;
at the end the same training step is timed sequentially and overlapped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lancet_rt
from lancet_rt.cli import float_in, int_in
from lancet_rt.models.lm import MoELanguageModel
from lancet_rt.parallel import dense_parameters, sync_gradients


class MarkovLanguage:
    """Order-2 Markov token streams with three successors per context.

    The successors of (a, b) are those of b, shifted by one when a is odd: a bigram model gets
    part of the way, attention to the token before the last gets to the floor.
    """

    PROBS = torch.tensor([0.75, 0.2, 0.05])

    def __init__(self, vocab: int, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        base = torch.randint(vocab, (vocab, 3), generator=g)
        shift = (torch.arange(vocab) % 2).view(vocab, 1, 1)
        self.successors = (base.unsqueeze(0) + shift) % vocab  # [a, b, 3]

    @property
    def entropy(self) -> float:
        p = self.PROBS
        return float(-(p * p.log()).sum())

    def batch(self, batch: int, seq: int, g: torch.Generator):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, :2] = torch.randint(self.vocab, (batch, 2), generator=g)
        for s in range(2, seq + 1):
            choice = torch.multinomial(self.PROBS, batch, replacement=True, generator=g)
            x[:, s] = self.successors[x[:, s - 2], x[:, s - 1], choice]
        return x[:, :-1], x[:, 1:]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int_in(1), default=300)
    p.add_argument("--log-every", type=int_in(1), default=25)
    p.add_argument("--batch", type=int_in(1), default=16, help="sequences per rank per step")
    p.add_argument("--seq", type=int_in(1), default=64)
    p.add_argument("--vocab", type=int_in(2), default=64)
    p.add_argument("--d-model", type=int_in(1), default=64)
    p.add_argument("--d-ffn", type=int_in(1), default=128)
    p.add_argument("--layers", type=int_in(1), default=2)
    p.add_argument("--heads", type=int_in(1), default=4)
    p.add_argument("--experts", type=int_in(1), default=4)
    p.add_argument("--top-k", type=int_in(1), default=2)
    p.add_argument("--capacity-factor", type=float_in(), default=1.25, help="<= 0 for dropless")
    p.add_argument("--aux-loss-coef", type=float_in(0), default=0.01)
    p.add_argument("--lr", type=float_in(0, above=True), default=3e-3)
    p.add_argument("--chunks", type=int_in(1, 64), default=2, help="Overlapped chunk count (1: sequential)")
    p.add_argument(
        "--autocast",
        choices=("none", "bf16"),
        default="none",
        help="run every step, and the warm-up before the first, under torch.autocast in bfloat16",
    )
    p.add_argument("--timing-steps", type=int_in(0), default=8, help="steps timed each way at the end")
    p.add_argument(
        "--channels",
        choices=("plain", "split"),
        default="plain",
        help="gloo: the expert-parallel group as it is (plain) or split (lancet_rt.TorchGroup.split: the "
        "counts and checks on a group of their own, each direction of the tokens on its own; what a "
        "real link wants, make train-link)",
    )
    p.add_argument("--json", default=None, help="write the summary as JSON here")
    p.add_argument(
        "--routing-trace",
        default=None,
        help="record every step's per-layer expert loads (rank 0's) as a lancet_rt routing trace JSON here",
    )
    return p.parse_args(argv)


def _precision(args, device: torch.device):
    """The autocast every step computes in (and the warm-up warms): ``--autocast``."""
    if args.autocast == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _warm_up(args, runners: tuple, example: torch.Tensor, device: torch.device) -> None:
    """Every kernel compiled and tuned before the first collective, in the dtype the steps compute in
    (the sequential runner too: the timing at the end runs it)."""
    with _precision(args, device):
        for runner in dict.fromkeys(runners):
            lancet_rt.warmup(runner, example)


def _save_routing_trace(args, loads: list, world: int) -> None:
    """--routing-trace: rank 0's per-step, per-layer expert loads as a lancet_rt routing trace."""
    from lancet_rt.routing.traces import RoutingTrace

    meta = dict(
        source="examples.train_lm (make train)",
        world_size=world,
        rank=0,
        **{k: v for k, v in vars(args).items() if k != "routing_trace"},
    )
    RoutingTrace(loads, meta).save(args.routing_trace)


def _init_ranks() -> tuple:
    """This process's rank, the world, its device and the expert-parallel group (gloo on CPU, NCCL when
    every rank has a GPU; None on one rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = dist.group.WORLD if world > 1 else None
    return world, rank, device, group


def _make_step(args, model, opt, data: "MarkovLanguage", gen: torch.Generator, device, group):
    """One training step of ``runner`` (the model or its Overlapped) on a fresh batch; returns the loss."""

    def step(runner):
        x, y = data.batch(args.batch, args.seq, gen)
        x, y = x.to(device), y.to(device)
        with _precision(args, device):
            logits = runner(x)
            loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(), y.reshape(-1))
        loss.backward()
        sync_gradients(model, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _train(args, step, overlapped, model, world: int, tokens_per_step: int, main_rank: bool) -> tuple:
    """``--steps`` steps of ``overlapped``, a progress row every ``--log-every``; returns the rows and the
    seconds (and saves ``--routing-trace``)."""
    history, losses, loads = [], [], []
    moes = [m for m in model.modules() if isinstance(m, lancet_rt.MoE)]
    t0 = t_int = time.perf_counter()
    for it in range(1, args.steps + 1):
        losses.append(step(overlapped))
        if args.routing_trace:
            loads.append([m.tokens_per_expert.tolist() for m in moes])
        if it % args.log_every == 0 or it == args.steps:
            row, now = _progress_row(model, losses, world, it, tokens_per_step * len(losses), t_int)
            history.append(row)
            if main_rank:
                print(
                    f"step {it:4d}  loss {row['loss']:.3f}  {row['tokens_per_s']:8.0f} tok/s  expert load "
                    f"{' '.join(f'{v:.2f}' for v in row['load'])}  dropped {row['dropped_fraction']:.1%}",
                    flush=True,
                )
            losses, t_int = [], now
    train_s = time.perf_counter() - t0
    if args.routing_trace and main_rank:
        _save_routing_trace(args, loads, world)
    return history, train_s


def _timed(args, step, runner, world: int, device: torch.device) -> float:
    """ms per step of ``runner`` over ``--timing-steps`` steps after one warm-up step (nan: none)."""
    if not args.timing_steps:
        return math.nan
    step(runner)  # warm-up
    if world > 1:
        dist.barrier()
    t = _clock(device)
    for _ in range(args.timing_steps):
        step(runner)
    return (_clock(device) - t) / args.timing_steps * 1e3


def main(argv=None) -> dict:
    args = parse_args(argv)
    world, rank, device, group = _init_ranks()
    main_rank = rank == 0
    model = _build_model(args, device, group, rank, world)
    overlapped = lancet_rt.Overlapped(model, chunks=args.chunks) if args.chunks > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = MarkovLanguage(args.vocab)
    step = _make_step(args, model, opt, data, torch.Generator().manual_seed(rank), device, group)
    tokens_per_step = args.batch * args.seq * world
    if main_rank:
        print(
            f"lancet-rt main job: {world} rank(s) on {device.type}, {args.layers} MoE layers, "
            f"E={args.experts} K={args.top_k} cf={args.capacity_factor}, D={args.d_model}, "
            f"chunks={args.chunks}; loss floor (entropy) {data.entropy:.3f} nats"
        )
    _warm_up(args, (overlapped, model), data.batch(args.batch, args.seq, torch.Generator())[0].to(device), device)
    history, train_s = _train(args, step, overlapped, model, world, tokens_per_step, main_rank)
    seq_ms = _timed(args, step, model, world, device)
    ovl_ms = _timed(args, step, overlapped, world, device)
    summary = dict(
        world=world,
        device=device.type,
        steps=args.steps,
        chunks=args.chunks,
        first_loss=history[0]["loss"],
        final_loss=history[-1]["loss"],
        entropy=data.entropy,
        train_s=train_s,
        sequential_step_ms=seq_ms,
        overlapped_step_ms=ovl_ms,
        channels=args.channels,
        sequential_tokens_per_s=tokens_per_step / seq_ms * 1e3,
        overlapped_tokens_per_s=tokens_per_step / ovl_ms * 1e3,
        history=history,
    )
    if main_rank:
        _report(summary, args)
    if world > 1:
        dist.destroy_process_group()
    return summary


def _clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device``'s queued work has finished (a CUDA step returns to the
    host before its kernels end: unsynchronized, a step time is the host's issue time)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _report(summary: dict, args) -> None:
    """Print the summary line (and write ``--json``)."""
    seq_ms, ovl_ms = summary["sequential_step_ms"], summary["overlapped_step_ms"]
    print(
        f"summary: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} "
        f"(floor {summary['entropy']:.3f}) in {args.steps} steps, {summary['train_s']:.1f} s; step time "
        f"sequential {seq_ms:.1f} ms, overlapped ({args.chunks} chunks) {ovl_ms:.1f} ms "
        f"({seq_ms / ovl_ms:.2f}x); tokens/s sequential {summary['sequential_tokens_per_s']:.0f}, overlapped "
        f"{summary['overlapped_tokens_per_s']:.0f}"
    )
    print(_link_note(summary, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


def _link_note(summary: dict, args) -> str:
    """What the link under the step times was, and where to see the overlap: on loopback (or one
    process) the all-to-alls cost almost nothing, so the ratio is chunking's own cost, not a result."""
    rate = os.environ.get("LANCET_REALLINK_RATE_BPS")
    if rate:
        return (
            f"link: the real link of bench.reallink, {float(rate) / 1e6:.0f} Mbit/s per port: the overlapped "
            f"step hides what it can of that link's all-to-alls"
        )
    if summary["device"] == "cuda" and summary["world"] > 1:
        return "link: NCCL between this node's GPUs (the overlap hides what of it the step's computation covers)"
    where = "one process: no all-to-all" if summary["world"] == 1 else "gloo ranks on loopback"
    return (
        f"link: {where}, so there is (almost) nothing to hide and the ratio above is what chunking costs "
        f"(about 1x, either way by noise). To see the overlap: `make train-link` (root: a real link limited "
        f"per port) or `python -m bench.overlap --device cpu --quick` (an emulated link); docs/benchmarks.md"
    )


def _build_model(args, device, group, rank: int, world: int) -> MoELanguageModel:
    """The model with the same dense weights on every rank and each rank's own experts (``--channels
    split``: on the split group of ``group``, which the layers and the gradient sync find by as_group)."""
    if group is not None and args.channels == "split" and device.type == "cpu":
        lancet_rt.TorchGroup.split(group)
    elif group is not None:  # (a ProcessGroup given as ep_group is split at its first collective by default)
        os.environ[lancet_rt.env.EP_TRANSPORT] = "plain"
    torch.manual_seed(0)
    moe_kwargs = dict(
        d_ffn=args.d_ffn,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor if args.capacity_factor > 0 else None,
        aux_loss_coef=args.aux_loss_coef,
        ep_group=group,
    )
    model = MoELanguageModel(args.vocab, args.seq, args.layers, args.d_model, args.heads, moe_kwargs, device=device)
    torch.manual_seed(1000 + rank)  # each rank's experts get their own initialisation
    for moe in model.moe_layers():
        moe.experts.reset_parameters()
    if world > 1:
        for p in dense_parameters(model):
            dist.broadcast(p.data, 0)
    return model


def _progress_row(model, losses: list, world: int, it: int, tokens: int, t_int: float) -> tuple:
    """A log row (the mean loss since the last one, tokens/s since ``t_int``, the experts' load summed
    over the ranks) and the time it was taken."""
    loss = torch.stack(losses).mean()
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
    load = sum(m.tokens_per_expert.float() for m in model.moe_layers())
    dropped = sum(m.dropped for m in model.moe_layers())
    routed = float(load.sum())
    if world > 1:
        stats = torch.cat([load, torch.tensor([float(dropped)], device=load.device)])
        dist.all_reduce(stats)
        load, dropped, routed = stats[:-1], float(stats[-1]), float(stats[:-1].sum())
    now = time.perf_counter()
    return dict(
        step=it,
        loss=float(loss),
        tokens_per_s=tokens / (now - t_int),
        load=[round(float(v) / max(routed, 1), 3) for v in load],
        dropped_fraction=dropped / max(routed, 1),
    ), now


if __name__ == "__main__":
    main()
