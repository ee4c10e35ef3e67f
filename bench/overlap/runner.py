"""The model of bench.overlap and its schedules over one emulated link (:class:`Runner`), shared by
bench.overlap and its cross-microbatch part (bench.overlap.accumulation)."""

from __future__ import annotations

import copy
import math
import statistics
from typing import Optional

import torch

import lancet_rt
from bench.common import link_per_step, step_ms, synchronize, time_interleaved
from lancet_rt.models.blocks import MoEBlocks

_NO_MOE = torch.nn.Identity()  # a block's MoE layer, taken out (Runner._eager)


def _lean_applies(layers) -> bool:
    """Whether bench.overlap.yardstick's lean layer computes what every one of ``layers`` does."""
    from bench.overlap.yardstick import LeanMoE

    try:
        for m in layers:
            LeanMoE(m)
    except ValueError:
        return False
    return True


def handshake_us(args, s: dict, device) -> float:
    """The emulated link's control round trip before each transfer (``--handshake-us``; default a round
    trip at the modelled latency, on the CPU link; 0 on CUDA, where it is not modelled)."""
    value = getattr(args, "handshake_us", None)
    if value is not None:
        return value
    return 2 * s["latency_us"] if torch.device(device).type == "cpu" else 0.0


class Runner:
    """One model and its four schedules over one emulated link."""

    def __init__(self, args, s, device):
        self.device = device
        dtype = getattr(torch, s["dtype"])
        group = lancet_rt.EmulatedGroup
        if getattr(args, "routing", None):  # --routing: the asymmetric link (bench.overlap.routing)
            from lancet_rt.comm.emulated_skew import SkewedGroup as group
        self.link = group(
            args.world_size,
            math.inf,
            0.0,
            device=device,
            counts_channel=args.counts_channel,
            handshake_us=handshake_us(args, s, device),
        )
        self.chunks = args.chunks
        self.statistic = args.statistic
        self.steps: dict = {}  # mode -> a whole step of its own (the floor below, add_accumulation)
        self.hf = args.model != "blocks"
        if self.hf:
            self._build_hf(args, s, device, dtype)
            return
        moe_kwargs = dict(
            d_ffn=s["d_ffn"],
            num_experts=s["experts"],
            top_k=args.top_k,
            capacity_factor=args.capacity_factor,
            ep_group=self.link,
            aux_loss_coef=1e-2,
        )
        torch.manual_seed(0)
        self.model = MoEBlocks(s["layers"], s["d_model"], s["heads"], moe_kwargs, device=device, dtype=dtype)
        self.model_dw = copy.deepcopy(self.model)  # the copy shares the link
        self.models = (self.model, self.model_dw)
        self.moe_layers = self.model.moe_layers()
        self.runners = {
            "sequential": self.model,
            "moe_pipelined": self.model,
            "overlapped": lancet_rt.Overlapped(self.model, chunks=args.chunks),
            "overlapped_dw": lancet_rt.Overlapped(self.model_dw, chunks=args.chunks, defer_wgrad=True),
        }
        self.x = torch.randn(s["batch"], s["seq"], s["d_model"], device=device, dtype=dtype)
        self.g = torch.randn_like(self.x)
        self.steps["plain_chunks"] = lambda: self._eager(self.chunks)
        self.steps["dense"] = lambda: self._eager(1, moe=False)
        self.steps["dense_chunks"] = lambda: self._eager(self.chunks, moe=False)
        # The lean floor (bench.overlap.yardstick's lean eager layer in every block, its chunks one batch),
        # where that layer computes what ours does (one local expert, softmax, normalised top-k).
        self.lean = _lean_applies(self.moe_layers)
        if self.lean:
            self.steps["lean"] = lambda: self._lean(1)
            self.steps["lean_chunks"] = lambda: self._lean(self.chunks)

    def _build_hf(self, args, s, device, dtype) -> None:
        """A transformers architecture at the benchmark's sizes, made lancet with from_hf on the link:
        one copy unchunked (sequential, MoE-internal chunking), one chunked, one chunked deferring dW."""
        from lancet_rt.models import hf_models

        size = dict(
            hidden=s["d_model"],
            heads=s["heads"],
            kv=max(1, s["heads"] // 2),
            layers=s["layers"],
            experts=s["experts"],
            top_k=args.top_k,
            ffn=s["d_ffn"],
            vocab=1024,
        )
        base = hf_models.build(args.model, size, seed=0).to(device=device, dtype=dtype)
        fused = dict(
            fused_loss=bool(getattr(args, "fused_loss", False)),
            early_backward=not getattr(args, "no_early_backward", False),
        )
        self.model = lancet_rt.from_hf(copy.deepcopy(base), self.link, **fused)
        overlapped = lancet_rt.from_hf(copy.deepcopy(base), self.link, chunks=args.chunks, **fused)
        self.model_dw = lancet_rt.from_hf(base, self.link, chunks=args.chunks, defer_wgrad=True, **fused)
        self.models = (self.model, overlapped, self.model_dw)
        self.moe_layers = lancet_rt.integrations.hf.moe_layers(self.model)
        self.runners = {
            "sequential": self.model,
            "moe_pipelined": self.model,
            "overlapped": overlapped,
            "overlapped_dw": self.model_dw,
        }
        ids, mask, labels = hf_models.batch(size["vocab"], s["batch"], s["seq"], seed=1, pad_rows=0)
        self.batch = dict(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))

    def _run(self, mode: str, backward: bool = True) -> None:
        for m in self.moe_layers:
            m.pipeline_chunks = self.chunks if mode == "moe_pipelined" else 1
        if self.hf:
            loss = self.runners[mode](**self.batch).loss
            if backward:
                loss.backward()
            return
        x = self.x.detach().requires_grad_(True)
        y = self.runners[mode](x)
        if backward:
            y.backward(self.g)

    def _eager(self, chunks: int, moe: bool = True) -> None:
        """The eager floors of chunking (blocks model; a free link only).

        Mode "plain_chunks": the unchunked model run on the chunks' rows one after another, no
        ``Overlapped``, no overlap, then one backward. Every chunk's activations are alive when the
        backward starts, as in any chunked schedule. What each op costs once more per chunk in plain
        eager PyTorch, before any schedule (each run is a batch of its own to the MoE layers, whose
        capacity it then sizes).

        Modes "dense" and "dense_chunks" (``moe=False``): the same, unchunked and on the chunks' rows,
        with every block's MoE layer taken out (an identity): what chunking costs the model's own dense
        layers (attention, norms, residual adds), a part of the chunking overhead that no MoE layer and
        no schedule can remove.
        """
        blocks = self.model.blocks
        layers = [b.moe for b in blocks]
        if not moe:
            for b in blocks:
                b.moe = _NO_MOE
        try:
            ys = [self.model(x.detach().requires_grad_(True)) for x in self.x.tensor_split(chunks)]
            torch.autograd.backward(ys, list(self.g.tensor_split(chunks)))
        finally:
            for b, layer in zip(blocks, layers):
                b.moe = layer

    def _lean(self, chunks: int) -> None:
        """Mode "lean" / "lean_chunks": the model with each block's MoE layer the lean eager one (on
        the same parameters; tested equal), unchunked or its chunks one after another as one batch
        (as under ``Overlapped``), one backward; no schedule. What an eager MoE layer as cheap as we
        could write it leaves of the chunking overhead (bench.overlap.yardstick --blocks)."""
        from bench.overlap.yardstick import blocks_step

        blocks_step(self.model, self.x.detach().requires_grad_(True), self.g, chunks, "lean eager MoE")

    def step(self, mode: str) -> None:
        if mode in self.steps:  # a whole step of its own (the floor, the cross-microbatch schedules)
            for m in self.moe_layers:
                m.pipeline_chunks = 1
            self.steps[mode]()
        else:
            self._run(mode)
        for model in self.models:
            for p in model.parameters():
                p.grad = None

    def set_link(self, bandwidth_gbps: float, latency_us: float) -> None:
        self.link.bandwidth_gbps, self.link.latency_us = bandwidth_gbps, latency_us

    def time_all(self, modes, steps: int, links: dict, raw: Optional[dict] = None) -> dict:
        """:func:`time_interleaved` of the schedules ``modes``. ``links``: name -> (bandwidth, latency)."""
        return time_interleaved(
            {m: (lambda m=m: self.step(m)) for m in modes}, self.link, links, steps, self.statistic, self.device, raw
        )

    def per_step_link(self, mode: str, forward_only: bool = False):
        run = self.forward if forward_only else self.step
        return link_per_step(self.link, lambda: (run(mode), synchronize(self.device)))

    def forward(self, mode: str) -> None:
        """The forward of one training step (the graph is built, then dropped unused)."""
        self._run(mode, backward=False)

    def forward_ms(self, mode: str, steps: int) -> float:
        """The forward's time on the current link, summarised like :meth:`time_all`."""
        self.forward(mode)
        times = [step_ms(lambda: self.forward(mode), self.device) for _ in range(steps)]
        return (min if self.statistic == "min" else statistics.median)(times)
