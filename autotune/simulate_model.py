"""The cluster simulator's inputs: model shapes, H100 constants, the replay profile they give, the skew
a routing gives, and the Tutel-style schedule on the cost model's two-stream simulation.

Everything here is a model, not a measurement. The per-GPU step is the replay's
(:func:`lancet_rt.autotune.replay_sim.replay`) on a :class:`~lancet_rt.autotune.replay_profile.ReplayProfile`
built from FLOP and byte counts instead of a trace; the Tutel-style baseline (chunking inside each MoE
layer, nothing across layers) runs on :func:`lancet_rt.autotune.cost_model.simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lancet_rt.moe.dispatch.shadow import hot_experts

from .cost_model import SimOp, simulate
from .profiling import LinkModel
from .replay_profile import ReplayProfile
from .replay_sim import EXPERTS_DW_SHARE, Skew

# H100 SXM constants (bf16, TFLOP/s and GB/s). EXPERTS_TFLOPS and DENSE_TFLOPS: the GPU lane's rates of
# the experts' grouped GEMMs (median over fwd/bwd ops, balanced, D=4096) and of a dense GEMM, rounded
# (bench/results/experts.json, 2026-11-24; bench/results/HISTORY.md). Datasheet (not measured here):
# attention (FlashAttention-class kernels), HBM for the memory-bound stages (0.8 of its peak), NVLink 4
# per direction per GPU, InfiniBand NDR per GPU, and each link's latency per collective.
EXPERTS_TFLOPS = 600.0
DENSE_TFLOPS = 700.0
ATTENTION_TFLOPS = 450.0
HBM_GBPS = 3350.0 * 0.8
LINKS = {"nvlink": (450.0, 0.010), "ib": (50.0, 0.020)}  # GB/s per GPU, latency ms
GPUS_PER_NODE = 8
#: Launch and tail cost per stage per extra chunk (ms): what makes more chunks cost something (estimate).
CHUNK_OVERHEAD_MS = 0.02
#: Backward over forward: GEMMs twice (dX, dW), attention more (FlashAttention's backward), so the rest 2.2.
BACKWARD = dict(experts=2.0, post=1.0, rest=2.2)


@dataclass(frozen=True)
class Shape:
    """A MoE transformer's per-layer shape (the public configs)."""

    name: str
    layers: int  # MoE layers
    d_model: int
    d_ffn: int  # per routed expert
    experts: int
    top_k: int
    attn_proj_params: int  # parameters of the attention projections per layer
    attn_dim: int  # heads x (qk dim + v dim) / 2, for the score and value FLOPs
    shared_ffn: int = 0  # shared experts' intermediate size (DeepSeek-V3: 1 x 2048)


SHAPES = {
    # Mixtral-8x7B: 32 layers, D 4096, F 14336, 8 experts top-2, GQA 32/8 heads of 128.
    "mixtral": Shape("mixtral", 32, 4096, 14336, 8, 2, 4096 * (4096 + 2 * 1024) + 4096 * 4096, 32 * 128),
    # Qwen3-30B-A3B: 48 layers, D 2048, expert F 768, 128 experts top-8, GQA 32/4 heads of 128.
    "qwen3_moe": Shape("qwen3_moe", 48, 2048, 768, 128, 8, 2048 * (4096 + 2 * 512) + 4096 * 2048, 32 * 128),
    # DeepSeek-V3: 58 MoE layers, D 7168, expert F 2048, 256 experts top-8 + 1 shared; MLA (128 heads,
    # q_lora 1536, kv_lora 512, qk 128+64, v 128).
    "deepseek_v3": Shape(
        "deepseek_v3",
        58,
        7168,
        2048,
        256,
        8,
        7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168,
        128 * (192 + 128) // 2,
        shared_ffn=2048,
    ),
}


def link_for(ep: int, link: Optional[str]) -> tuple:
    """(GB/s, latency ms, share of off-rank bytes on that link) for an EP group of ``ep`` ranks: NVLink
    within a node; beyond a node (or ``link="ib"``) the inter-node bytes, (ep - 8) / (ep - 1) of them, bound
    the transfer at IB speed."""
    name = link or ("nvlink" if ep <= GPUS_PER_NODE else "ib")
    gbps, lat = LINKS[name]
    share = 1.0 if name == "nvlink" or ep <= GPUS_PER_NODE else (ep - GPUS_PER_NODE) / (ep - 1)
    return name, gbps, lat, share


def build_profile(
    shape: Shape,
    tokens: int,
    seq: int,
    ep: int,
    gbps: float,
    latency_ms: float,
    byte_share: float = 1.0,
    deferred: bool = False,
) -> ReplayProfile:
    """The replay's profile of one GPU's step from FLOP and byte counts (two chunk counts, so the replay
    interpolates the per-chunk overhead)."""
    T, D, K = tokens, shape.d_model, shape.top_k
    gemm = lambda flops, tf: flops / (tf * 1e12) * 1e3
    mem = lambda nbytes: nbytes / (HBM_GBPS * 1e9) * 1e3
    pre = (
        gemm(2 * T * shape.attn_proj_params, DENSE_TFLOPS)
        + gemm(2 * 2 * T * seq * shape.attn_dim / 2, ATTENTION_TFLOPS)
        + mem(6 * T * D * 2)
    )
    stages = dict(
        pre=pre,
        route=gemm(2 * T * D * shape.experts, DENSE_TFLOPS) + mem(T * shape.experts * 4 * 3),
        permute=mem(2 * T * K * D * 2),
        issue=0.01,
        experts=gemm(2 * 3 * T * K * D * shape.d_ffn, EXPERTS_TFLOPS)
        + gemm(2 * 3 * T * D * shape.shared_ffn, DENSE_TFLOPS),
        post=mem(3 * T * K * D * 2),
    )
    totals = {}
    for l in range(shape.layers):
        for st, ms in stages.items():
            totals[(l, st)] = {1: ms, 2: ms + CHUNK_OVERHEAD_MS}
    totals[(-1, "tail")] = {1: 0.0, 2: 0.0}
    off_rank = K * D * 2 * (ep - 1) / ep * byte_share  # bf16 rows, the share not addressed to this rank
    bpt = {(l, w): off_rank for l in range(shape.layers) for w in ("dispatch", "combine")}
    ratios = {k: {1: v} for k, v in BACKWARD.items()}
    return ReplayProfile(
        layers=[f"L{l}" for l in range(shape.layers)],
        tokens=T,
        totals=totals,
        glue_per_segment_ms=0.005,
        ratios=ratios,
        dw_ratio={1: 1.0},
        bytes_per_token=bpt,
        link=LinkModel(latency_ms, gbps),
        deferred=deferred,
    )


def rank_shares(expert_shares, ep: int) -> list:
    """Each rank's share of the rows, experts placed in contiguous blocks of E / ep."""
    E = len(expert_shares)
    per = E // ep
    return [sum(expert_shares[r * per : (r + 1) * per]) for r in range(ep)]


def skew_for(source, shape: Shape, ep: int) -> Skew:
    """The replay's :class:`Skew` of a routing source, averaged over the layers (each layer its own shares)."""
    if ep == 1 or source.kind == "balanced":
        return Skew()
    ports, hots = [], []
    for l in range(shape.layers):
        s = rank_shares(source.shares(l, shape.experts), ep)
        ports.append(max(max(1 - v, (ep - 1) * v) for v in s) / ((ep - 1) / ep))
        hots.append(ep * max(s))
    return Skew(port=sum(ports) / len(ports), hot=sum(hots) / len(hots))


def shadow_skew_for(source, shape: Shape, ep: int, tokens: int, limit: int) -> tuple:
    """(Skew, experts shadowed per layer) with ``MoE(shadow_experts=limit)`` (lancet_rt.moe.dispatch.shadow),
    every rank routing like the shares, bf16: the shadowed experts' rows stay home (the busiest port and the
    hot rank's rows shrink; each rank computes its own rows of them), and each fetched expert's weights
    (a broadcast, and the gradients' reduce in backward) are added to the port's bytes, spread over the
    layer's all-to-alls of the pass (the replay has no such transfer of its own)."""

    if ep == 1 or source.kind == "balanced":
        return Skew(), 0.0
    E, L, D, K = shape.experts, shape.experts // ep, shape.d_model, shape.top_k
    weight_bytes = 3 * D * shape.d_ffn * 2
    a2a_bytes = 2 * tokens * K * D * 2 * (ep - 1) / ep  # rank 0's dispatch and combine bytes per pass
    ports, hots, ks = [], [], []
    for l in range(shape.layers):
        shares = source.shares(l, E)
        rows = [v * tokens * K for v in shares]
        hot = hot_experts([rows] * ep, limit, L, D * 2, weight_bytes, 1)
        kept = [0.0 if e in hot else v for e, v in enumerate(shares)]
        r = rank_shares(kept, ep)
        port = max(max(sum(kept) - v, (ep - 1) * v) for v in r) / ((ep - 1) / ep)
        ports.append(port + len(hot) * weight_bytes / a2a_bytes)
        hots.append(ep * max(r) + sum(shares) - sum(kept))
        ks.append(len(hot))
    return Skew(port=sum(ports) / len(ports), hot=sum(hots) / len(hots)), sum(ks) / len(ks)


def tutel_step(profile: ReplayProfile, chunks: int, skew: Skew) -> tuple:
    """Tutel-style chunking inside each MoE layer, nothing across layers, on the cost model's simulation:
    returns (step ms, compute ms). The hot rank's experts run on the ``counts`` stream (unused here) so a
    chunk's return waits for them, as in the replay's :class:`Skew`."""
    ops: list = []
    link = profile.link
    nb = lambda l, w: profile.bytes_per_token[(l, w)] * profile.tokens / chunks * skew.port
    ms = lambda l, st: profile.stage_ms((l, st), chunks, profile.tokens)
    add = lambda name, stream, t, deps=(): ops.append(SimOp(name, stream, t, tuple(deps))) or len(ops) - 1
    hot = skew.hot if (skew.hot != 1.0 or skew.port != 1.0) else 0.0
    L = len(profile.layers)
    last = None
    for l in range(L):  # forward
        a = add("pre", "compute", ms(l, "pre") + ms(l, "route"), [] if last is None else [last])
        x = add("counts", "comm", link.latency_ms, [a])
        p = add("permute", "compute", ms(l, "permute") + ms(l, "issue"), [x])
        ends = []
        sent = [add("dispatch", "comm", link.time_ms(nb(l, "dispatch")), [p]) for _ in range(chunks)]
        for d in sent:  # every chunk's dispatch in flight, then each chunk's experts and combine
            e = add("experts", "compute", ms(l, "experts") / chunks, [d])
            deps = [e] + ([add("hot", "counts", hot * ms(l, "experts") / chunks, [d])] if hot else [])
            ends.append(add("combine", "comm", link.time_ms(nb(l, "combine")), deps))
        last = add("post", "compute", ms(l, "post"), ends)
    for l in reversed(range(L)):  # backward
        b = add("post bwd", "compute", ms(l, "post") * profile.ratio("post", chunks), [last])
        ends = []
        sent = [add("combine bwd", "comm", link.time_ms(nb(l, "combine")), [b]) for _ in range(chunks)]
        for g in sent:
            back = ms(l, "experts") / chunks * profile.ratio("experts", chunks)
            dx = back if profile.deferred else back * (1 - EXPERTS_DW_SHARE)
            e = add("experts dX", "compute", dx, [g])
            deps = [e] + ([add("hot bwd", "counts", hot * dx, [g])] if hot else [])
            ends.append(add("dispatch bwd", "comm", link.time_ms(nb(l, "dispatch")), deps))
            add("experts dW", "compute", back - dx, [e])
        rest = sum(ms(l, st) for st in ("pre", "route", "permute", "issue")) * profile.ratio("rest", chunks)
        last = add("rest bwd", "compute", rest, ends)
    step = simulate(ops)
    compute = sum(op.ms for op in ops if op.stream == "compute")
    return step, compute
