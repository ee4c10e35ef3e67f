"""How much all-to-all time each schedule hides: sequential, MoE-internal chunking (Tutel-style),
Overlapped, and Overlapped with deferred dW, on a stack of pre-norm attention + MoE blocks.

    python -m bench.overlap --device cpu --quick            # emulated link, CPU
    python -m bench.overlap --device cuda --json bench/results/overlap.json --png bench/results/overlap.png

Communication goes over the emulated link (lancet_rt.EmulatedGroup: this process is rank 0 of a
symmetric world of --world-size ranks). ``--comm-ratio R`` sets its bandwidth so that the modeled
communication of one training step (forward + backward) is R x the step's computation:
``compute_ms`` is the Overlapped + deferred-dW schedule timed on a zero-cost link, and the
bandwidth is ``off-rank bytes per step / (R * compute_ms - transfers * latency)``.

Metrics: ``hidden_comm_fraction = 1 - (overlapped_ms - compute_ms) / comm_ms``, with
``overlapped_ms`` lancet-rt's full schedule (Overlapped with deferred dW), and ``bound_ms =
max(compute_ms, comm_ms)``. Note the structural limit: the forward's all-to-alls can only hide
behind forward computation (about a third of the step), so at R = 1 a schedule hides at most
about (forward compute + backward compute) / comm of the communication in each pass.
"""
from __future__ import annotations

import argparse
import copy
import math

import torch

import lancet_rt
from bench.common import bench_ms, print_table, run_metadata, synchronize, write_json
from bench.model import MoEBlocks

MODES = ("sequential", "moe_pipelined", "overlapped", "overlapped_dw")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="small sizes (CPU: well under a minute)")
    p.add_argument("--comm-ratio", type=float, default=1.0)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--latency-us", type=float, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--d-ffn", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=None, help="sequences per step")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--steps", type=int, default=None, help="timed steps per schedule")
    p.add_argument("--json", default=None, help="append a JSON row here")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of one overlapped step")
    p.add_argument("--png", default=None, help="draw the timeline of one sequential and one overlapped step")
    return p.parse_args(argv)


def sizes(args) -> dict:
    cuda = args.device == "cuda"
    if args.quick:
        d = dict(layers=2, d_model=128, d_ffn=256, experts=8, batch=8, seq=64, heads=4,
                 latency_us=20.0, steps=5, dtype="bfloat16" if cuda else "float32")
    elif cuda:
        d = dict(layers=4, d_model=2048, d_ffn=4096, experts=16, batch=16, seq=1024, heads=16,
                 latency_us=20.0, steps=10, dtype="bfloat16")
    else:
        d = dict(layers=2, d_model=256, d_ffn=512, experts=8, batch=8, seq=128, heads=4,
                 latency_us=20.0, steps=5, dtype="float32")
    for k in list(d):
        v = getattr(args, k, None)
        if v is not None:
            d[k] = v
    return d


class Runner:
    """One model and its four schedules over one emulated link."""

    def __init__(self, args, s, device):
        self.device = device
        dtype = getattr(torch, s["dtype"])
        self.link = lancet_rt.EmulatedGroup(args.world_size, math.inf, 0.0, device=device)
        moe_kwargs = dict(d_ffn=s["d_ffn"], num_experts=s["experts"], top_k=args.top_k,
                          capacity_factor=args.capacity_factor, ep_group=self.link, aux_loss_coef=1e-2)
        torch.manual_seed(0)
        self.model = MoEBlocks(s["layers"], s["d_model"], s["heads"], moe_kwargs, device=device, dtype=dtype)
        self.model_dw = copy.deepcopy(self.model)  # the copy shares the link
        self.chunks = args.chunks
        self.runners = {
            "sequential": self.model,
            "moe_pipelined": self.model,
            "overlapped": lancet_rt.Overlapped(self.model, chunks=args.chunks),
            "overlapped_dw": lancet_rt.Overlapped(self.model_dw, chunks=args.chunks, defer_wgrad=True),
        }
        self.x = torch.randn(s["batch"], s["seq"], s["d_model"], device=device, dtype=dtype)
        self.g = torch.randn_like(self.x)

    def step(self, mode: str) -> None:
        for m in self.model.moe_layers():
            m.pipeline_chunks = self.chunks if mode == "moe_pipelined" else 1
        x = self.x.detach().requires_grad_(True)
        self.runners[mode](x).backward(self.g)
        for model in (self.model, self.model_dw):
            for p in model.parameters():
                p.grad = None

    def set_link(self, bandwidth_gbps: float, latency_us: float) -> None:
        self.link.bandwidth_gbps, self.link.latency_us = bandwidth_gbps, latency_us

    def time(self, mode: str, steps: int) -> float:
        return bench_ms(lambda: self.step(mode), self.device, warmup=2, rep=steps)["ms"]

    def per_step_link(self, mode: str):
        self.link.reset()
        self.step(mode)
        synchronize(self.device)
        return self.link.modeled_ms, self.link.off_rank_bytes, self.link.transfers


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    s = sizes(args)
    r = Runner(args, s, device)

    # 1. Computation alone: every schedule on a zero-cost link.
    r.set_link(math.inf, 0.0)
    compute = {m: r.time(m, s["steps"]) for m in MODES}
    compute_ms = compute["overlapped_dw"]
    # 2. The link: bandwidth so that one step's communication is R x compute_ms.
    _, nbytes, transfers = r.per_step_link("sequential")
    lat_ms = s["latency_us"] * 1e-3
    budget_ms = args.comm_ratio * compute_ms - transfers * lat_ms
    if budget_ms <= 0:
        raise SystemExit(f"--latency-us {s['latency_us']} alone exceeds R x compute ({args.comm_ratio} x {compute_ms:.2f} ms)")
    bw = nbytes / (budget_ms * 1e-3) / 1e9
    r.set_link(bw, s["latency_us"])
    comm_ms, _, _ = r.per_step_link("sequential")
    # 3. Every schedule on that link.
    ms = {m: r.time(m, s["steps"]) for m in MODES}

    overlapped_ms = ms["overlapped_dw"]
    row = dict(
        bench="overlap", **run_metadata(device), **{k: v for k, v in s.items()},
        world_size=args.world_size, chunks=args.chunks, top_k=args.top_k, capacity_factor=args.capacity_factor,
        comm_ratio=args.comm_ratio, bandwidth_gbps=bw, transfers_per_step=transfers,
        off_rank_bytes_per_step=nbytes,
        sequential_ms=ms["sequential"], moe_pipelined_ms=ms["moe_pipelined"],
        overlapped_nodw_ms=ms["overlapped"], overlapped_ms=overlapped_ms,
        compute_ms=compute_ms, sequential_compute_ms=compute["sequential"],
        moe_pipelined_compute_ms=compute["moe_pipelined"], overlapped_nodw_compute_ms=compute["overlapped"],
        comm_ms=comm_ms, bound_ms=max(compute_ms, comm_ms),
        hidden_comm_fraction=1 - (overlapped_ms - compute_ms) / comm_ms,
        hidden_comm_fraction_nodw=1 - (ms["overlapped"] - compute["overlapped"]) / comm_ms,
        hidden_comm_fraction_moe_pipelined=1 - (ms["moe_pipelined"] - compute["moe_pipelined"]) / comm_ms,
        speedup_vs_sequential=ms["sequential"] / overlapped_ms,
        speedup_vs_moe_pipelined=ms["moe_pipelined"] / overlapped_ms,
        over_bound=overlapped_ms / max(compute_ms, comm_ms) - 1,
    )
    table = [dict(schedule=m, step_ms=ms[m], compute_ms=compute[m],
                  hidden=1 - (ms[m] - compute[m]) / comm_ms, speedup=ms["sequential"] / ms[m]) for m in MODES]
    print_table(table, ["schedule", "step_ms", "compute_ms", "hidden", "speedup"],
                title=f"bench.overlap on {row['device']}: {s['layers']} blocks D={s['d_model']} F={s['d_ffn']} "
                      f"E={s['experts']} K={args.top_k} W={args.world_size} tokens={s['batch'] * s['seq']} "
                      f"{s['dtype']}, chunks={args.chunks}, comm {comm_ms:.2f} ms = {comm_ms / compute_ms:.2f} x compute "
                      f"({bw:.3g} GB/s, {s['latency_us']} us)")
    print(f"hidden_comm_fraction {row['hidden_comm_fraction']:.3f}  overlapped {overlapped_ms:.2f} ms vs "
          f"bound {row['bound_ms']:.2f} ms ({row['over_bound']:+.1%})  speedup vs sequential "
          f"{row['speedup_vs_sequential']:.2f}x, vs MoE-internal chunking {row['speedup_vs_moe_pipelined']:.2f}x")
    if args.trace or args.png:
        traces = {}
        for mode in ("sequential", "overlapped_dw"):
            with lancet_rt.tracing() as tr:
                r.step(mode)
                synchronize(device)
            traces[mode] = tr
        if args.trace:
            traces["overlapped_dw"].save(args.trace)
        if args.png:
            draw_timeline(traces, args.png, row)
    if args.json:
        write_json(args.json, [row])
    return row


def draw_timeline(traces: dict, path: str, row: dict) -> None:
    """One lane per (schedule, stream): computation by chunk, and the link's transfers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3.2))
    colors = plt.get_cmap("tab10")
    lanes = []
    for mode, tr in traces.items():
        events = tr.events()
        t0 = min((e["ts"] for e in events), default=0.0)
        for track in ("compute", "link"):
            y = len(lanes)
            lanes.append(f"{mode}\n{track}")
            for e in events:
                if e["tid"] != track or (track == "compute" and not e["name"].startswith("chunk") and mode != "sequential"):
                    continue
                if track == "compute" and mode == "sequential" and e["name"] not in ("route", "experts", "permute", "unpermute"):
                    continue
                chunk = e["args"].get("chunk")
                color = colors(chunk % 10) if chunk is not None else ("tab:gray" if track == "compute" else "tab:red")
                ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (y - 0.4, 0.8), facecolors=color,
                               edgecolor="none")
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_xlabel("ms")
    ax.set_title(f"{row['device']}: sequential {row['sequential_ms']:.1f} ms vs overlapped+dW "
                 f"{row['overlapped_ms']:.1f} ms (comm {row['comm_ms']:.1f} ms, compute {row['compute_ms']:.1f} ms); "
                 f"colours: chunks", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
