"""What a chunk costs ``lancet_rt.MoE`` against a lean eager layer computing the same thing.

    python -m bench.overlap.yardstick --device cpu                 # bench.overlap --quick's layer
    python -m bench.overlap.yardstick --tokens 2048 --json out.json
    python -m bench.overlap.yardstick --blocks                     # bench.overlap --quick's whole model

Chunking is to cost little. ``bench.overlap`` splits the overhead of a chunked step
into the model's dense layers, its MoE layers and the schedule; at ``--quick`` sizes the MoE
layers take most of it. This bench asks how much of that any eager MoE layer would pay.

:class:`LeanMoE` is the layer at ``bench.overlap --quick``'s configuration, written as plainly as
eager PyTorch allows:
- a softmax router;
- top-k by a stable descending sort (ties to the lower index, as the routing contract says);
- the k weights normalised;
- capacity carried across the chunks of a batch, so assignments past it drop;
- the aux loss statistics, their gradient reaching every chunk through autograd;
- one host read of the kept counts per chunk;
- the two all-to-alls as copies.

``tests/bench/test_yardstick.py`` checks that it computes ``lancet_rt.MoE``'s outputs and gradients
in float64, chunked and not, on the emulated link (rank 0 of a symmetric world applies its local
expert to every kept row). It is a yardstick, not a path:
- no real expert parallelism;
- none of the contract's other options (sigmoid scores, expert groups, expert bias, z loss, ...);
- no asynchronous collectives, so nothing overlaps.

``--blocks`` asks the same of bench.overlap --quick's whole model (:class:`lancet_rt.models.blocks.MoEBlocks`,
2 blocks of attention and a MoE layer, 16 x 64 tokens): its step unchunked and on N chunks one
after another (one batch, one backward; no overlap, no scheduler), with each block's MoE layer
``lancet_rt.MoE``, the lean layer on the same parameters (:class:`LeanBlockMoE`, tested equal), or
none (the dense layers alone). Chunked over unchunked is the chunking overhead of the project's
target (<= 1.10) with that layer and no schedule: with the lean layer, what any eager MoE layer
leaves of it (``overhead_with_lean_chunks`` adds the lean model's per-chunk cost to our unchunked
step, the most favourable reading).

Reported per extra chunk, forward and backward together, for both layers: the ATen ops and host
reads (:class:`bench.host.OpCounter`), and the microseconds of the fastest of ``--reps`` steps
(:func:`bench.common.time_interleaved`: every step in turn each round; the wall clock on CPU).
Each is the step at N chunks minus the unchunked step, over N - 1. ``lancet_rt.MoE`` runs on a free emulated
link, its chunks one batch
as under ``Overlapped`` but with no scheduler (:func:`lancet_step`), so the schedule's cost is not
in its row.
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

import torch
import torch.nn.functional as F

import lancet_rt
from bench.common import RowLog, keep_freed_memory, print_table, run_metadata, time_interleaved
from bench.host import OpCounter
from lancet_rt.runtime import scope as _scope


class _Copy(torch.autograd.Function):
    """An all-to-all on a one-rank link: a copy forward, a copy backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class LeanMoE:
    """The eager MoE of the module docstring, on ``moe``'s parameters (a :class:`lancet_rt.MoE` with
    one local expert, softmax scores, normalised top-k and no z loss)."""

    def __init__(self, moe: lancet_rt.MoE):
        if moe.experts.gate_up_proj.shape[0] != 1 or moe.score_fn != "softmax" or not moe.normalize_topk:
            raise ValueError("LeanMoE needs one local expert, softmax scores and normalised top-k")
        if moe.z_loss_coef or moe.expert_bias or moe.n_group > 1 or moe.routed_scaling_factor != 1.0:
            raise ValueError("LeanMoE has no z loss, expert bias, expert groups or scaling")
        self.moe = moe
        self.E, self.K = moe.num_experts, moe.top_k

    def batch(self, tokens: int) -> dict:
        """The routing state of one batch of ``tokens`` tokens, carried by its chunks."""
        E, K, cf = self.E, self.K, self.moe.capacity_factor
        capacity = math.inf if cf is None else math.ceil(cf * tokens * K / E)
        dev = self.moe.router.weight.device
        return dict(
            tokens=tokens,
            capacity=capacity,
            used=torch.zeros(E, dtype=torch.long, device=dev),
            score_sum=torch.zeros(E, dtype=self.moe.router.weight.dtype, device=dev),
        )

    def __call__(self, x_TD: torch.Tensor, state: dict) -> torch.Tensor:
        m, K = self.moe, self.K
        scores = F.linear(x_TD, m.router.weight).softmax(-1)
        chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K]
        weight = scores.gather(1, chosen)
        weight = weight / weight.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        # slot of each assignment: the expert's claims by earlier chunks + its rank in this chunk
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.E)
        rank = torch.empty_like(flat)
        rank[order] = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
        kept = state["used"][flat] + rank < state["capacity"]
        state["used"] = state["used"] + counts
        state["score_sum"] = state["score_sum"] + scores.sum(0)
        rows = order[kept[order]]  # kept assignments, grouped by expert
        torch.bincount(flat[rows], minlength=self.E).tolist()  # the counts read the all-to-all needs
        token = rows // K
        x_SD = _Copy.apply(x_TD.index_select(0, token))
        gate, up = F.linear(x_SD, m.experts.gate_up_proj[0]).chunk(2, -1)  # (the one local expert)
        y_SD = F.linear(F.silu(gate) * up, m.experts.down_proj[0])
        y_SD = _Copy.apply(y_SD) * weight.reshape(-1)[rows].unsqueeze(1)
        return torch.zeros_like(x_TD).index_add(0, token, y_SD)

    def aux_loss(self, state: dict) -> torch.Tensor:
        """``aux_loss_coef * E * sum_e f_e P_e`` over the whole batch; its gradient reaches the
        scores of every chunk (``lancet_rt.MoE`` adds the same gradient inside its backward)."""
        T = state["tokens"]
        f_E = state["used"].to(state["score_sum"].dtype) / (T * self.K)
        return self.moe.aux_loss_coef * self.E * (f_E * state["score_sum"] / T).sum()


def lean_step(lean: LeanMoE, x_TD: torch.Tensor, grad_TD: torch.Tensor, chunks: int) -> torch.Tensor:
    """Forward of the chunks (capacity carried), then one backward with the aux loss; returns the output."""
    state = lean.batch(x_TD.shape[0])
    ys = [lean(x, state) for x in x_TD.tensor_split(chunks)]
    aux = lean.aux_loss(state)
    torch.autograd.backward(ys + [aux], list(grad_TD.tensor_split(chunks)) + [torch.ones_like(aux)])
    return torch.cat([y.detach() for y in ys])


def lancet_step(moe: torch.nn.Module, x_TD: torch.Tensor, grad_TD: torch.Tensor, chunks: int) -> torch.Tensor:
    """``moe`` (a layer, or a model of them) on each chunk's rows in turn, then one backward; returns the output.

    The chunks are one batch, as under ``Overlapped``: the layer carries its capacity and routing
    state across them and makes its batch statistics once. There is no scheduler: the layer's
    turns (``ChunkScope.switch``) return at once, so the schedule's own cost is not in the step.
    """
    xs = x_TD.tensor_split(chunks)
    prev = _scope.current()
    scope = _scope.ChunkScope([x.shape[0] for x in xs], switch=lambda: None) if chunks > 1 else prev
    _scope.set_current(scope)
    try:
        ys = []
        for c, x in enumerate(xs):
            if scope is not None:
                scope.chunk = c
            ys.append(moe(x))
    finally:
        _scope.set_current(prev)
    torch.autograd.backward(ys, list(grad_TD.tensor_split(chunks)))
    return torch.cat([y.detach() for y in ys])


class LeanBlockMoE(torch.nn.Module):
    """A block's MoE layer as :class:`LeanMoE` on [B, S, D] rows, for the batch :meth:`begin` opened
    (its chunks carry the capacity; the aux loss is the batch's, an extra backward root)."""

    def __init__(self, moe: lancet_rt.MoE):
        super().__init__()
        self.lean = LeanMoE(moe)
        self.state: Optional[dict] = None

    def begin(self, tokens: int) -> None:
        self.state = self.lean.batch(tokens)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.lean(x_BSD.reshape(-1, x_BSD.shape[-1]), self.state).view(x_BSD.shape)


#: The MoE layers bench.overlap.yardstick --blocks puts in every block.
BLOCK_LAYERS = ("lancet_rt.MoE", "lean eager MoE", "none")


def blocks_step(model, x: torch.Tensor, grad: torch.Tensor, chunks: int, layer: str) -> torch.Tensor:
    """One step of the blocks ``model`` on ``chunks`` chunks of its rows one after another (one batch,
    one backward), each block's MoE layer being ``layer``: "lancet_rt.MoE" (as :func:`lancet_step`),
    "lean eager MoE" (:class:`LeanBlockMoE` on the same parameters) or "none" (an identity: the dense
    layers alone). The blocks get their own layers back afterwards. Returns the output."""
    if layer not in BLOCK_LAYERS:
        raise ValueError(f"layer must be one of {BLOCK_LAYERS}, got {layer!r}")
    if layer == "lancet_rt.MoE":
        return lancet_step(model, x, grad, chunks)
    blocks = model.blocks
    layers = [b.moe for b in blocks]
    leans = [] if layer == "none" else [LeanBlockMoE(m) for m in layers]
    for m in leans:
        m.begin(x.shape[0] * x.shape[1])
    try:
        for b, m in zip(blocks, leans or [torch.nn.Identity()] * len(blocks)):
            b.moe = m
        ys = [model(c) for c in x.tensor_split(chunks)]
        aux = [m.lean.aux_loss(m.state) for m in leans]
        torch.autograd.backward(ys + aux, list(grad.tensor_split(chunks)) + [torch.ones_like(a) for a in aux])
    finally:
        for b, m in zip(blocks, layers):
            b.moe = m
    return torch.cat([y.detach() for y in ys])


def measure_blocks(args, device: torch.device) -> list:
    """bench.overlap --quick's model, unchunked and on ``args.chunks`` chunks, with each MoE layer (rows)."""
    from lancet_rt.models.blocks import MoEBlocks

    link = lancet_rt.EmulatedGroup(args.world_size, math.inf, 0.0, device=device)
    torch.manual_seed(0)
    model = MoEBlocks(
        args.layers,
        args.d_model,
        args.heads,
        dict(
            d_ffn=args.d_ffn,
            num_experts=args.experts,
            top_k=args.top_k,
            capacity_factor=args.capacity_factor,
            aux_loss_coef=1e-2,
            ep_group=link,
        ),
        device=device,
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=g).to(device)
    grad = torch.randn(args.batch, args.seq, args.d_model, generator=g).to(device)

    def step(layer, n):
        blocks_step(model, x.detach().requires_grad_(True), grad, n, layer)
        model.zero_grad(set_to_none=True)

    counted, ms = _count_and_time(step, BLOCK_LAYERS, link, args, device)
    ours1, dense1, dense_n = ms["lancet_rt.MoE", 1], ms["none", 1], ms["none", args.chunks]
    rows, extra = [], (args.chunks - 1) * args.layers
    for layer in BLOCK_LAYERS:
        one, n = ms[layer, 1], ms[layer, args.chunks]
        rows.append(
            dict(
                layer=layer,
                chunks=args.chunks,
                layers=args.layers,
                tokens=args.batch * args.seq,
                step_ms_unchunked=one,
                step_ms_chunked=n,
                chunking_overhead=n / one,
                dense_part=(dense_n - dense1) / one,
                moe_part=(n - one - (dense_n - dense1)) / one,
                overhead_with_lean_chunks=(ours1 + n - one) / ours1 if layer == "lean eager MoE" else None,
                ops_per_layer_per_extra_chunk=(counted[layer, args.chunks][0] - counted[layer, 1][0]) / extra,
            )
        )
    return rows


def _count_and_time(step, layers, link, args, device) -> tuple:
    """``step(layer, n)`` for each layer unchunked and at ``args.chunks``: ({key: (ATen ops, host
    reads)} of one run, {key: ms}), every step timed in turn within each round (so that load from
    elsewhere hits all alike), the fastest of ``args.reps`` rounds on the free link."""
    steps = {(layer, n): (lambda layer=layer, n=n: step(layer, n)) for layer in layers for n in (1, args.chunks)}
    counted = {}
    for key, run in steps.items():
        run()  # warm
        with OpCounter() as ops:
            run()
        counted[key] = (ops.total, ops.reads)
    ms = time_interleaved(steps, link, {"free": (math.inf, 0.0)}, args.reps, "min", device)
    return counted, {key: ms["free", key] for key in steps}


def build(args, device: torch.device) -> lancet_rt.MoE:
    link = lancet_rt.EmulatedGroup(args.world_size, math.inf, 0.0, device=device)
    torch.manual_seed(0)
    return lancet_rt.MoE(
        args.d_model,
        d_ffn=args.d_ffn,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        aux_loss_coef=1e-2,
        ep_group=link,
        device=device,
    )


def measure(args, device: torch.device) -> list:
    moe = build(args, device)
    lean = LeanMoE(moe)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.d_model, generator=g).to(device)
    grad = torch.randn(args.tokens, args.d_model, generator=g).to(device)
    layers = {
        "lean eager MoE": lambda n: lean_step(lean, x, grad, n),
        "lancet_rt.MoE": lambda n: lancet_step(moe, x, grad, n),
    }

    def step(layer, n):
        layers[layer](n)
        moe.zero_grad(set_to_none=True)

    counted, ms = _count_and_time(step, layers, moe.group, args, device)
    rows, extra = [], args.chunks - 1
    for layer in layers:
        (ops1, reads1), (opsn, readsn) = counted[layer, 1], counted[layer, args.chunks]
        us1, usn = (ms[layer, n] * 1e3 for n in (1, args.chunks))
        rows.append(
            dict(
                layer=layer,
                chunks=args.chunks,
                tokens=args.tokens,
                step_us_unchunked=us1,
                ops_per_extra_chunk=(opsn - ops1) / extra,
                reads_per_extra_chunk=(readsn - reads1) / extra,
                us_per_extra_chunk=(usn - us1) / extra,
            )
        )
    return rows


def main(argv: Optional[list] = None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the batch (bench.overlap --quick: 1024)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--world-size", type=int, default=8, help="ranks of the emulated link; experts / ranks must be 1")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25, help="0: dropless (no capacity)")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--blocks",
        action="store_true",
        help="the whole blocks model of bench.overlap --quick, with each layer (module docstring)",
    )
    p.add_argument("--layers", type=int, default=2, help="--blocks: blocks")
    p.add_argument("--heads", type=int, default=4, help="--blocks: attention heads")
    p.add_argument("--batch", type=int, default=16, help="--blocks: sequences (cut into the chunks)")
    p.add_argument("--seq", type=int, default=64, help="--blocks: tokens per sequence")
    args = p.parse_args(argv)
    if args.capacity_factor == 0:
        args.capacity_factor = None
    if args.experts != args.world_size:
        raise SystemExit(f"--experts ({args.experts}) must equal --world-size ({args.world_size}): one local expert")
    if args.chunks < 2:
        raise SystemExit(f"--chunks must be >= 2, got {args.chunks}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cpu":
        keep_freed_memory()  # as bench.overlap: no page faults for the activations at every step
    log = RowLog(args.json)
    meta = run_metadata(device)
    if args.blocks:
        return _blocks_report(measure_blocks(args, device), args, log, meta)
    rows = measure(args, device)
    for r in rows:
        log.add(
            dict(
                bench="yardstick",
                **r,
                d_model=args.d_model,
                d_ffn=args.d_ffn,
                experts=args.experts,
                top_k=args.top_k,
                capacity_factor=args.capacity_factor,
                **meta,
            )
        )
    print_table(
        rows,
        [
            "layer",
            "chunks",
            "tokens",
            "step_us_unchunked",
            "ops_per_extra_chunk",
            "reads_per_extra_chunk",
            "us_per_extra_chunk",
        ],
        f"bench.overlap.yardstick on {meta['device']}: per extra chunk, forward and backward (D={args.d_model}, "
        f"F={args.d_ffn}, E={args.experts}, K={args.top_k}, capacity factor {args.capacity_factor})",
    )
    ratio = rows[1]["us_per_extra_chunk"] / rows[0]["us_per_extra_chunk"]
    print(
        f"lancet_rt.MoE costs {ratio:.2f}x the lean layer per extra chunk "
        f"({rows[1]['ops_per_extra_chunk']:.0f} vs {rows[0]['ops_per_extra_chunk']:.0f} ATen ops)"
    )
    return rows


def _blocks_report(rows: list, args, log: RowLog, meta: dict) -> list:
    for r in rows:
        log.add(
            dict(
                bench="yardstick_blocks",
                **r,
                d_model=args.d_model,
                d_ffn=args.d_ffn,
                experts=args.experts,
                top_k=args.top_k,
                capacity_factor=args.capacity_factor,
                **meta,
            )
        )
    print_table(
        rows,
        [
            "layer",
            "chunks",
            "step_ms_unchunked",
            "step_ms_chunked",
            "chunking_overhead",
            "dense_part",
            "moe_part",
            "ops_per_layer_per_extra_chunk",
        ],
        f"bench.overlap.yardstick --blocks on {meta['device']}: {args.layers} blocks D={args.d_model} F={args.d_ffn} "
        f"E={args.experts} K={args.top_k} tokens={args.batch * args.seq}, {args.chunks} chunks one after "
        f"another (one batch, no schedule); parts in units of the unchunked step",
    )
    lean = rows[1]
    print(
        f"with the lean layer the chunking overhead is {lean['chunking_overhead']:.3f} "
        f"({lean['overhead_with_lean_chunks']:.3f} on our unchunked step); lancet_rt.MoE: "
        f"{rows[0]['chunking_overhead']:.3f}"
    )
    return rows


if __name__ == "__main__":
    main()
