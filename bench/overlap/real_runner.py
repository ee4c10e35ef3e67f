"""The models and schedules of ``bench.overlap --link real`` inside one rank (:class:`RealRunner`).

Every rank builds the same model from the same seeds (its own experts, the dense weights shared),
its own batch, and one step callable per schedule; a step leaves no gradient behind. Other
systems plug in as extra schedules: :meth:`RealRunner.add_schedule` takes any callable running one
training step of a model built from this runner's weights (``bench.peers.layers.real_link_schedules``, if
present, is asked for them, see :func:`peer_schedules`).
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Optional

import torch

import lancet_rt
from lancet_rt.models.blocks import MoEBlocks

#: The schedules every real-link run times (``accumulate``: blocks model only).
SCHEDULES = ("sequential", "moe_pipelined", "overlapped", "overlapped_dw", "accumulate")


class RealRunner:
    """One rank's models and their schedules over an expert-parallel group.

    Args:
        args: bench.overlap's arguments (model, chunks, top_k, microbatches, routing).
        s: the sizes (bench.overlap.shapes.sizes).
        group: the expert-parallel group (a ProcessGroup or a :class:`lancet_rt.TorchGroup`).
        rank: this rank (its experts' and its batch's seeds).
    """

    def __init__(self, args, s: dict, group, rank: int):
        self.args, self.s, self.group, self.rank = args, s, group, rank
        self.chunks = args.chunks
        self.dtype = getattr(torch, s["dtype"])
        self.hf = args.model != "blocks"
        self.steps: dict[str, Callable[[], None]] = {}
        self.per_step: dict[str, int] = {}  # microbatches per step of each schedule
        self.extra_models: list = []  # the peers' models (their gradients dropped after each step)
        #: The same model on one chunk's rows (bench.overlap.real: each pass's fill and drain), where built.
        self.one_chunk: Optional["RealRunner"] = None
        #: When the last step's forward ended (``time.perf_counter``), for the schedules that run one forward
        #: then one backward (not ``accumulate``, whose passes interleave): None until then.
        self.forward_end: Optional[float] = None
        #: Called at that moment, if set (the bytes the port sent in the forward, bench.overlap.real).
        self.on_forward_end: Optional[Callable[[], None]] = None
        if self.hf:
            self._build_hf()
        else:
            self._build_blocks()

    # ------------------------------------------------------------------ models
    def _build_blocks(self) -> None:
        s, args = self.s, self.args
        # Dropless and no load-balancing loss: the step the peers (bench.peers) compute too, checked equal.
        moe_kwargs = dict(
            d_ffn=s["d_ffn"],
            num_experts=s["experts"],
            top_k=args.top_k,
            capacity_factor=None,
            ep_group=self.group,
            aux_loss_coef=0.0,
        )
        self.model = self.blocks(moe_kwargs)
        self.model_dw = copy.deepcopy(self.model)  # (the copy shares the group)
        self.models = [self.model, self.model_dw]
        self.moe_layers = self.model.moe_layers() + self.model_dw.moe_layers()
        ov = lancet_rt.Overlapped(self.model, chunks=self.chunks)
        ov_dw = lancet_rt.Overlapped(self.model_dw, chunks=self.chunks, defer_wgrad=True)
        gen = torch.Generator().manual_seed(100 + self.rank)
        shape = (s["batch"], s["seq"], s["d_model"])
        self.x = torch.randn(shape, generator=gen).to(self.dtype)
        self.g = torch.randn(shape, generator=gen).to(self.dtype)
        self.add_schedule("sequential", lambda: self._blocks_step(self.model))
        self.add_schedule("moe_pipelined", lambda: self._blocks_step(self.model, pipeline=True))
        self.add_schedule("overlapped", lambda: self._blocks_step(ov))
        self.add_schedule("overlapped_dw", lambda: self._blocks_step(ov_dw))
        M = max(2, args.microbatches)
        self.microbatches = M
        xs = [torch.randn(shape, generator=gen).to(self.dtype) for _ in range(M)]
        gs = [torch.randn(shape, generator=gen).to(self.dtype) for _ in range(M)]

        def accumulate():
            inputs = [x.detach().requires_grad_(True) for x in xs]
            ov.accumulate(inputs, lambda out, i: (out * gs[i]).sum())

        self.add_schedule("accumulate", accumulate, per_step=M)

    def blocks(self, moe_kwargs: dict) -> MoEBlocks:
        """The benchmark's blocks model with this run's weights: the dense layers from seed 0 on every
        rank, each rank's experts from seed 1000 + rank (a peer schedule builds its copy from these)."""
        s = self.s
        torch.manual_seed(0)
        model = MoEBlocks(s["layers"], s["d_model"], s["heads"], moe_kwargs, dtype=self.dtype)
        torch.manual_seed(1000 + self.rank)
        for moe in model.moe_layers():
            moe.experts.reset_parameters()
        return model

    def _build_hf(self) -> None:
        from lancet_rt.models import hf_models

        s, args = self.s, self.args
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
        base = hf_models.build(args.model, size, seed=0).to(dtype=self.dtype)
        fused = dict(
            fused_loss=bool(getattr(args, "fused_loss", True)),
            early_backward=not getattr(args, "no_early_backward", False),
        )
        self.model = lancet_rt.from_hf(copy.deepcopy(base), self.group, **fused)
        overlapped = lancet_rt.from_hf(copy.deepcopy(base), self.group, chunks=self.chunks, **fused)
        self.model_dw = lancet_rt.from_hf(base, self.group, chunks=self.chunks, defer_wgrad=True, **fused)
        self.models = [self.model, overlapped, self.model_dw]
        self.moe_layers = [m for model in self.models for m in lancet_rt.integrations.hf.moe_layers(model)]
        ids, mask, labels = hf_models.batch(size["vocab"], s["batch"], s["seq"], seed=1 + self.rank, pad_rows=0)
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
        self.microbatches = None

        def step(model, pipeline=False):
            self._pipeline(pipeline)
            loss = model(**batch).loss
            self.forward_done()
            loss.backward()

        self.add_schedule("sequential", lambda: step(self.model))
        self.add_schedule("moe_pipelined", lambda: step(self.model, True))
        self.add_schedule("overlapped", lambda: step(overlapped))
        self.add_schedule("overlapped_dw", lambda: step(self.model_dw))

    # ------------------------------------------------------------------ steps
    def _pipeline(self, on: bool) -> None:
        for m in self.moe_layers:
            m.pipeline_chunks = self.chunks if on else 1

    def _blocks_step(self, runner, pipeline: bool = False) -> None:
        self._pipeline(pipeline)
        x = self.x.detach().requires_grad_(True)
        out = runner(x)
        self.forward_done()
        out.backward(self.g)

    def forward_done(self) -> None:
        """Mark the end of a step's forward (:attr:`forward_end`; a peer's step calls it too)."""
        self.forward_end = time.perf_counter()
        if self.on_forward_end is not None:
            self.on_forward_end()

    def add_schedule(self, name: str, step: Callable[[], None], per_step: int = 1) -> None:
        """Time ``step`` (one training step of ``per_step`` microbatches) as schedule ``name``."""
        self.steps[name] = step
        self.per_step[name] = per_step

    def step(self, name: str) -> None:
        """One step of schedule ``name``; its gradients are dropped."""
        self.forward_end = None
        self.steps[name]()
        for model in self.models + self.extra_models:
            for p in model.parameters():
                p.grad = None

    def outputs(self, name: str) -> list:
        """Every gradient one step of ``name`` leaves (the equality test compares them across links,
        bitwise); dropped afterwards as by :meth:`step`."""
        self.steps[name]()
        out = [p.grad.detach().clone() for m in self.models for p in m.parameters() if p.grad is not None]
        for m in self.models:
            for p in m.parameters():
                p.grad = None
        return out


def peer_schedules(runner: RealRunner) -> dict:
    """The other systems' schedules on the same link (``bench.peers``, from the branch that adds the
    peers; empty without it, or for a transformers model): for each peer that imports here, a copy
    of the blocks model with every MoE layer the peer's own, on our weights, expert-parallel over the
    same process group, checked equal to ours (``peers.check_equal``, forward and backward) before it
    is timed; its step is one training step as ours (``peer_<name>``). A module that defines
    ``real_link_schedules(runner)`` gives them itself."""
    if runner.hf:
        return {}
    try:
        from bench.peers import layers as peers
    except ImportError:
        return {}
    hook = getattr(peers, "real_link_schedules", None)
    if hook is not None:
        return dict(hook(runner))
    pg = getattr(runner.group, "group", runner.group)  # (a TorchGroup's process group)
    out = {}
    for peer in getattr(peers, "PEERS", ()):
        if not peers.available(peer):
            continue
        theirs = peers.peer_blocks(runner.model, peer, group=pg)
        check = peers.check_equal(runner.model, theirs, runner.x)
        if not check["ok"]:
            raise RuntimeError(f"{peer} differs from ours on this rank ({check['worst']}): not timed")
        runner.extra_models.append(theirs)
        out[f"peer_{peer}"] = lambda m=theirs: runner._blocks_step(m)
    for m in runner.models + runner.extra_models:
        m.zero_grad(set_to_none=True)
    return out
