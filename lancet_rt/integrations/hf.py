"""Hugging Face transformers MoE models under lancet-rt: :func:`from_hf`.

``from_hf(model)`` patches a transformers ``*ForCausalLM`` (or its base model) in place: every sparse
MoE block becomes a :class:`lancet_rt.MoE` holding the block's own weights (only this rank's experts
with expert parallelism), under the block's own parameter names, so the model's ``state_dict`` keys,
``named_parameters`` and ``save_pretrained`` layout do not change. The model's ``forward`` keeps its
signature and returns the same logits and loss.

With ``chunks > 1`` (or ``defer_wgrad``) the base model (embeddings, masks, rotary embeddings, the
decoder layers, the final norm: everything separable along the batch) runs under
:class:`lancet_rt.Overlapped`, and so does a ``*ForCausalLM``'s LM head when the model wants the
logits of every position (training, ``logits_to_keep=0``): each chunk ends with its own rows of the
logits, so the head's matmul, forward and backward, hides other chunks' all-to-alls; the loss sees
the whole batch. Masks and position embeddings built for a batch of one ([1, S, ...]) pass to every
chunk whole.

Router logits and the auxiliary loss: the router modules stay the model's own (their class is
swapped for a subclass whose forward returns the float32 logits), so transformers'
``output_router_logits`` records them as before and the model's own load-balancing loss is computed
and added to the loss exactly as transformers does, with its gradient. lancet's built-in aux/z losses
are off for converted models.

Supported blocks (``SUPPORTED``): Mixtral, Qwen3-MoE, OLMoE (softmax top-k, optional
renormalisation), Qwen2-MoE (plus a sigmoid-gated shared expert), DeepSeek-V3 and GLM-4.5 (sigmoid
scores, selection bias, group-limited top-k, routed scaling factor, shared experts), GPT-OSS
(router bias, softmax over the chosen logits, expert biases and the clamped SwiGLU).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lancet_rt.comm import group as comm
from lancet_rt.integrations import hf_dense as _dense
from lancet_rt.moe.experts import Experts
from lancet_rt.moe.layer import MoE
from lancet_rt.routing.router import router_logits
from lancet_rt.runtime import recompute as _recompute
from lancet_rt.runtime import scope as _scope
from lancet_rt.schedule import policy as _policy
from lancet_rt.schedule.overlap import Overlapped


class HFMoE(MoE):
    """A :class:`lancet_rt.MoE` standing in for a transformers sparse MoE block.

    Attributes:
        hf_block_class: the name of the block class it replaced.
        tuple_output: the replaced block returned ``(hidden_states, router_scores)`` (GPT-OSS); the
            second element is None here.
    """

    hf_block_class: str = ""
    tuple_output: bool = False

    def forward(self, hidden_states: torch.Tensor):
        scope = _scope.current()
        if scope is not None and scope.rows[scope.chunk] == 0 and hidden_states.shape[0] > 0:
            # A stand-in row of an empty chunk (see _BaseModelRunner): the layer takes part in the
            # step's collectives with no tokens, as in plain Overlapped; the row's output is dropped.
            y = super().forward(hidden_states[:0])
            y = torch.cat([y, hidden_states.new_zeros(hidden_states.shape)], dim=0)
        else:
            y = super().forward(hidden_states)
        return (y, None) if self.tuple_output else y


# ------------------------------------------------------------------------------------------ routers
_router_classes: dict = {}


#: ``router_dtype`` values: "float32" computes the router linear in float32 whatever autocast says
#: (lancet's routing contract); "model" computes it as transformers does (in the model's dtype, or
#: autocast's: bf16 under bf16 autocast), the scores after it in float32.
ROUTER_DTYPES = ("float32", "model")
_FLOAT32_INPUT_ROUTERS = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter")  # cast x and W to float32 first


def _router_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    x = hidden_states.reshape(-1, self.weight.shape[1])
    bias = getattr(self, "bias", None)
    if getattr(self, "lancet_router_dtype", "float32") == "float32":
        return router_logits(x, self.weight, bias)
    w = self.weight
    if type(self).__mro__[1].__name__ in _FLOAT32_INPUT_ROUTERS:
        x, w = x.float(), w.float()
    return torch.nn.functional.linear(x, w, bias).float()


def _lancet_router(router: nn.Module, router_dtype: str) -> nn.Module:
    """Swap ``router``'s class for a subclass whose forward returns float32 logits (with the
    router's bias, if it has one; the linear computed as ``router_dtype`` says). It stays an
    instance of its transformers class, so ``output_router_logits`` still records its output, and
    keeps its parameters and buffers."""
    cls = type(router)
    if cls not in _router_classes.values():
        if cls not in _router_classes:
            _router_classes[cls] = type(
                f"Lancet{cls.__name__}",
                (cls,),
                {
                    "forward": _router_forward,
                    "__doc__": f"{cls.__name__} whose forward returns the float32 router logits [T, E] (lancet-rt).",
                },
            )
        router.__class__ = _router_classes[cls]
    router.lancet_router_dtype = router_dtype
    return router


# ------------------------------------------------------------------------------------------ experts
def _local_experts(hf_experts: nn.Module, group, d_model: int, d_ffn: int, **layout) -> Experts:
    """A lancet :class:`Experts` holding this rank's rows of the transformers experts' weights (the
    same Parameter objects when every expert is local). ``layout``: :class:`Experts` options
    (GPT-OSS's parameter layout, activation and biases)."""
    E = hf_experts.gate_up_proj.shape[0]
    W, r = (group.size, group.rank) if group is not None else (1, 0)
    if E % W:
        raise ValueError(f"the model has {E} experts, not divisible by the expert-parallel world size {W}")
    L = E // W
    experts = Experts(L, d_model, d_ffn, device="meta", dtype=hf_experts.gate_up_proj.dtype, **layout)
    for name, _ in experts.named_parameters():
        p = getattr(hf_experts, name)
        if W > 1:
            p = nn.Parameter(p.detach()[r * L : (r + 1) * L].clone(), requires_grad=p.requires_grad)
        setattr(experts, name, p)
    return experts


def _check_silu(block: nn.Module, config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"{type(block).__name__}: lancet-rt's experts compute SwiGLU (silu); the model's hidden_act is {act!r}"
        )


# ------------------------------------------------------------------------------------------ blocks
def _softmax_block(block, config, group, capacity_factor, **extra) -> HFMoE:
    """Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE: softmax over the logits, top-k, optional renormalisation."""
    if getattr(block, "jitter_noise", 0) and block.jitter_noise > 0:
        raise ValueError(
            f"{type(block).__name__}: router_jitter_noise={block.jitter_noise} draws random "
            f"noise on the tokens in training, which lancet-rt does not reproduce; set it to 0"
        )
    _check_silu(block, config)
    gate = block.gate
    return _build(
        block,
        gate,
        group,
        capacity_factor,
        score_fn="softmax",
        normalize_topk=bool(getattr(gate, "norm_topk_prob", True)),
        **extra,
    )


def _qwen2_block(block, config, group, capacity_factor) -> HFMoE:
    return _softmax_block(
        block,
        config,
        group,
        capacity_factor,
        shared_experts=block.shared_expert,
        shared_expert_gate=block.shared_expert_gate,
        names=dict(router="gate", shared_experts="shared_expert"),
    )


def _deepseek_block(block, config, group, capacity_factor) -> HFMoE:
    """DeepSeek-V3, GLM-4.5: sigmoid scores, selection bias, group-limited top-k, scaling, shared experts."""
    _check_silu(block, config)
    gate = block.gate
    return _build(
        block,
        gate,
        group,
        capacity_factor,
        score_fn="sigmoid",
        normalize_topk=bool(gate.norm_topk_prob),
        expert_bias=True,
        n_group=int(gate.num_group),
        topk_group=int(gate.topk_group),
        routed_scaling_factor=float(gate.routed_scaling_factor),
        shared_experts=block.shared_experts,
        names=dict(router="gate"),
    )


def _gpt_oss_block(block, config, group, capacity_factor) -> HFMoE:
    """GPT-OSS: a router with a bias, top-k over the logits then softmax over the K chosen (the
    contract's softmax with renormalisation: the same choice and weights), experts with biases and
    the clamped SwiGLU in transformers' own interleaved layout; the block returns a tuple."""
    hf = block.experts
    experts = _local_experts(
        hf, group, hf.hidden_size, hf.intermediate_size, layout="gpt_oss", alpha=float(hf.alpha), limit=float(hf.limit)
    )
    moe = _build(
        block,
        block.router,
        group,
        capacity_factor,
        experts=experts,
        score_fn="softmax",
        normalize_topk=True,
        names=dict(router="router"),
    )
    moe.tuple_output = True
    return moe


def _build(block, gate, group, capacity_factor, *, names=None, experts=None, **kwargs) -> HFMoE:
    if experts is None:  # transformers' fused layout: gate_up_proj [E, 2F, D]
        _, twoF, D = block.experts.gate_up_proj.shape
        experts = _local_experts(block.experts, group, D, twoF // 2)
    E = block.experts.gate_up_proj.shape[0]
    moe = HFMoE(
        experts.d_model,
        experts.d_ffn,
        E,
        int(gate.top_k),
        capacity_factor=capacity_factor,
        ep_group=group,
        router=_lancet_router(gate, "float32"),
        experts=experts,
        names=names or dict(router="gate"),
        **kwargs,
    )
    moe.hf_block_class = type(block).__name__
    # The block's own child order, so that parameters() lists them as the model did (optimizer
    # state and checkpoints that go by position stay valid).
    order = [name for name, _ in block.named_children() if name in moe._modules]
    moe._modules = {**{name: moe._modules[name] for name in order}, **moe._modules}
    return moe


#: transformers block class name -> builder(block, config, group, capacity_factor).
SUPPORTED: dict[str, Callable] = {
    "MixtralSparseMoeBlock": _softmax_block,
    "Qwen3MoeSparseMoeBlock": _softmax_block,
    "OlmoeSparseMoeBlock": _softmax_block,
    "Qwen2MoeSparseMoeBlock": _qwen2_block,
    "DeepseekV3MoE": _deepseek_block,
    "Glm4MoeMoE": _deepseek_block,
    "GptOssMLP": _gpt_oss_block,
}


def _is_moe_block(module: nn.Module) -> bool:
    """A block holding fused experts (transformers 5's MoE layout) that is not ours."""
    experts = getattr(module, "experts", None)
    return (
        not isinstance(module, MoE)
        and isinstance(experts, nn.Module)
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
    )


# ------------------------------------------------------------------------------------------ runner
class _BaseModelRunner:
    """Installed as the base model's ``forward``: runs it under :class:`Overlapped` (when chunking
    or deferring dW), makes activation checkpointing replay MoE routing, and calls the model's own
    forward for the chunks (and, unchunked, for generation with a KV cache).

    With ``head`` (a ``*ForCausalLM``'s LM head) and ``head_wanted`` set by :class:`_CausalLMForward`
    for this call, each chunk also runs the head on its rows of the last hidden state; the logits,
    concatenated, wait in ``stash`` for the model's own ``lm_head`` call (:class:`_HeadForward`).
    """

    def __init__(self, base: nn.Module, chunks, defer_wgrad: bool, head: Optional[nn.Module] = None):
        self.base = base
        self.inner = type(base).forward
        self.__wrapped__ = self.inner.__get__(base)  # inspect.signature(base.forward): the model's own
        self.overlapped = (
            Overlapped(base, chunks=chunks, defer_wgrad=defer_wgrad) if chunks != 1 or defer_wgrad else None
        )
        self.active = False
        self.head = head if self.overlapped is not None else None  # (unchunked, the model runs as written)
        self.head_wanted = False
        self.stash: Optional[tuple] = None  # (last hidden state, its logits) of the call in progress
        self.whole: Optional[tuple] = None  # (args, kwargs) of one row of the call in progress
        self._chunk_logits: Optional[dict] = None
        self.fused_loss = False  # from_hf(fused_loss=True)
        self.early_backward = True  # from_hf(early_backward=...)
        self.loss_mode: Optional[_dense.LossMode] = None  # set by _CausalLMForward for a fused-loss call

    def __call__(self, *args, **kwargs):
        if self.active or self.overlapped is None:
            _replay_checkpoints(self.base)
            scope = _scope.current() if self.active else None
            empty = scope is not None and scope.rows[scope.chunk] == 0
            if empty:  # transformers cannot run 0 rows: one stand-in row, dropped from every output
                args, kwargs = self.whole
            out = self.inner(self.base, *args, **kwargs)
            if empty:
                out = pytree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) and t.dim() else t, out)
            if self.loss_mode is not None:  # this chunk's loss term and head gradient (hf_dense)
                _dense.chunk_loss(self.loss_mode, out)
            if self._chunk_logits is not None:  # a chunk (or the one run) of a call that wants the head
                scope = _scope.current()
                self._chunk_logits[scope.chunk if scope is not None else 0] = self.head(out.last_hidden_state)
            return out
        if any(kwargs.get(k) is not None for k in ("cache", "past_key_values")) or self._returns_cache(kwargs):
            # A forward that returns a KV cache (generation, an eval forward with use_cache left on):
            # unchunked, so the cache is the batch's (the numbers are the same; chunks only overlap).
            return self.inner(self.base, *args, **kwargs)
        _replay_checkpoints(self.base)
        kwargs["use_cache"] = False  # a cache per chunk would be the chunk's, not the batch's
        self.whole = _stand_in(args, kwargs)
        self.stash = None
        self._chunk_logits = {} if self.head is not None and self.head_wanted else None
        self.active = True
        try:
            out = self.overlapped(*args, **kwargs)
            parts = self._chunk_logits
            if parts:
                logits = torch.cat([parts[c] for c in sorted(parts)], dim=0)
                hidden = getattr(out, "last_hidden_state", None)
                if isinstance(hidden, torch.Tensor) and logits.shape[:-1] == hidden.shape[:-1]:
                    self.stash = (hidden, logits)
            return out
        finally:
            self.active = False
            self._chunk_logits = None
            self.whole = None

    def _returns_cache(self, kwargs) -> bool:
        """Whether transformers would return a KV cache: ``use_cache`` (default the config's) in eval
        mode (in training the cache is of no use, and gradient checkpointing turns it off)."""
        use = kwargs.get("use_cache")
        if use is None:
            use = not self.base.training and bool(getattr(getattr(self.base, "config", None), "use_cache", False))
        return use is True


def _stand_in(args: tuple, kwargs: dict) -> tuple:
    """The first row of the batch's inputs: what an empty chunk runs (its output is dropped)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    rows = max((v.shape[0] for v in leaves if isinstance(v, torch.Tensor) and v.dim()), default=0)
    return pytree.tree_unflatten(
        [v[:1] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v for v in leaves], spec
    )


class _CausalLMForward:
    """Installed as a ``*ForCausalLM``'s ``forward``: tells the base model's runner whether this call
    wants the logits of every position (keyword arguments only, ``logits_to_keep`` 0), so that the
    chunks run the head; the stashed logits never outlive the call."""

    def __init__(self, model: nn.Module, runner: _BaseModelRunner):
        self.model, self.runner = model, runner
        self.inner = type(model).forward
        self.__wrapped__ = self.inner.__get__(model)  # (Trainer and generate() read the signature)

    def __call__(self, *args, **kwargs):
        keep = kwargs.get("logits_to_keep", 0)
        mode, kwargs = (
            _dense.loss_mode_for(
                self.model, self.model.get_output_embeddings(), args, kwargs, self.runner.early_backward
            )
            if self.runner.fused_loss
            else (None, kwargs)
        )
        self.runner.loss_mode = mode
        self.runner.head_wanted = mode is None and len(args) <= 1 and isinstance(keep, int) and keep == 0
        try:
            out = self.inner(self.model, *args, **kwargs)
            return out if mode is None else _dense.finish(self.model, mode, out)
        finally:
            self.runner.head_wanted = False
            self.runner.stash = None
            self.runner.loss_mode = None


class _HeadForward:
    """Installed as the LM head's ``forward``: for the last hidden state whose logits the chunks
    computed (the model slices it whole, ``hidden[:, 0:, :]``), returns them; otherwise the head's
    own forward."""

    def __init__(self, head: nn.Module, runner: _BaseModelRunner):
        self.head, self.runner = head, runner
        self.inner = type(head).forward
        self.__wrapped__ = self.inner.__get__(head)

    def __call__(self, hidden: torch.Tensor, *args, **kwargs):
        if self.runner.loss_mode is not None:  # the fused loss ran in the chunks: no logits
            return None
        stash = self.runner.stash
        if stash is not None and not args and not kwargs and _same_view(hidden, stash[0]):
            self.runner.stash = None
            return stash[1]
        return self.inner(self.head, hidden, *args, **kwargs)


def _same_view(t: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``t`` is ``whole`` or a view of all of it (same shape, strides and offset)."""
    if t is whole:
        return True
    return (
        isinstance(t, torch.Tensor)
        and t._base is whole
        and t.shape == whole.shape
        and t.stride() == whole.stride()
        and t.storage_offset() == whole.storage_offset()
    )


class _ReplayingCheckpoint:
    """A decoder layer's checkpoint function with lancet's replay of MoE routing (``context_fn``)."""

    def __init__(self, fn):
        keywords = getattr(fn, "keywords", {}) or {}
        if keywords.get("use_reentrant", False):
            raise ValueError(
                "activation checkpointing around lancet MoE layers needs use_reentrant=False: "
                "model.activation_checkpointing_enable(activation_checkpointing_kwargs="
                "{'use_reentrant': False}) (the reentrant checkpoint cannot replay their routing)"
            )
        if "context_fn" in keywords:
            raise ValueError(
                "activation checkpointing around lancet MoE layers sets its own context_fn "
                "(lancet_rt.checkpoint_context); the model's checkpoint kwargs already have one"
            )
        self.fn = fn

    def __call__(self, function, *args, **kwargs):
        return self.fn(function, *args, context_fn=_recompute.checkpoint_context, **kwargs)


def _replay_checkpoints(base: nn.Module) -> None:
    for m in base.modules():
        fn = getattr(m, "_gradient_checkpointing_func", None)
        if getattr(m, "gradient_checkpointing", False) and fn is not None and not isinstance(fn, _ReplayingCheckpoint):
            m._gradient_checkpointing_func = _ReplayingCheckpoint(fn)


# ------------------------------------------------------------------------------------------ entry
def from_hf(
    model: nn.Module,
    ep_group=None,
    *,
    chunks=1,
    defer_wgrad: bool = False,
    capacity_factor: Optional[float] = None,
    router_dtype: str = "float32",
    fused_loss: bool = False,
    early_backward: bool = True,
) -> nn.Module:
    """Make a transformers MoE model a lancet-rt model, in place.

    Args:
        model: a transformers ``*ForCausalLM`` (or its base model) whose sparse MoE blocks are in
            :data:`SUPPORTED`. With expert parallelism every rank passes the full model (for example
            from one ``from_pretrained`` or state dict) and keeps its own experts.
        ep_group: None (all experts local), a torch.distributed ProcessGroup or an
            :class:`~lancet_rt.comm.group.ExpertParallelGroup` (e.g. :class:`lancet_rt.EmulatedGroup`).
            Expert e lives on rank e // (E / W); every rank passes its own batch. A gloo ProcessGroup is
            split at its first collective, as for :class:`lancet_rt.MoE`.
        chunks: >= 1, "auto" (after ``import lancet_rt.autotune``) or another chunk policy, as for
            :class:`lancet_rt.Overlapped`: cut the base model's batch into this many chunks and overlap their
            computation with the all-to-alls (:class:`lancet_rt.Overlapped`).
        defer_wgrad: defer the weight gradients of the base model's linears and experts into the
            backward all-to-alls.
        capacity_factor: None (dropless, as transformers computes) or a capacity factor (tokens past
            capacity are dropped, as in the routing contract).
        router_dtype: "float32" (default: the router linear in float32 whatever autocast says, the
            routing contract's precision) or "model" (as transformers computes it: in the model's
            dtype, or autocast's; under bf16 autocast the logits are bf16-rounded, so the routing
            is transformers' own; the scores after the linear are float32 either way).
        fused_loss: in training with ``labels`` (and ``logits_to_keep=0``), compute the loss with
            :func:`lancet_rt.dense.linear_cross_entropy` per chunk, never forming the logits; the
            output's ``logits`` is then None (:mod:`lancet_rt.integrations.hf_dense`).
        early_backward: with ``fused_loss`` and expert parallelism, chunked: each chunk issues its last
            MoE layer's first backward all-to-all from the forward, right after its loss term, so it
            travels while the other chunks finish (:mod:`lancet_rt.schedule.early_backward`: the
            gradients are those without it, another consumer of the last hidden state included;
            skipped with gradient checkpointing, on FSDP).

    Chunk counts above the batch's rows run as many chunks as rows without expert parallelism; with
    it, every rank runs the agreed count (its empty chunks run one stand-in row, dropped, so that
    they take part in the collectives). A forward that returns a KV cache (generation, or an eval
    forward with ``use_cache`` on, the config's default) runs unchunked.

    Returns:
        ``model``, patched: call it as before. Calling ``from_hf`` again on it changes ``chunks``,
        ``defer_wgrad`` and ``router_dtype``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers model (an nn.Module), got {type(model).__name__}")
    _check_options(chunks, defer_wgrad, router_dtype, fused_loss, early_backward)
    group = comm.as_group(ep_group, expert_parallel=True)
    converted = _convert_blocks(model, group, capacity_factor)
    layers = [m for m in model.modules() if isinstance(m, HFMoE)]
    if not layers:
        raise ValueError(
            f"from_hf: {type(model).__name__} holds no MoE block lancet-rt supports ({', '.join(SUPPORTED)})"
        )
    if not converted and (group is not None or capacity_factor is not None):
        raise ValueError("from_hf: the model is converted already; only chunks and defer_wgrad can change")
    for name, m in model.named_modules():
        if isinstance(m, HFMoE):
            m.trace_name = name
            m.router.lancet_router_dtype = router_dtype
    base = getattr(model, "base_model", model)
    old = base.__dict__.get("forward")
    if (
        isinstance(old, _BaseModelRunner)
        and old.overlapped is not None
        and old.overlapped.defer_wgrad
        and not defer_wgrad
    ):
        raise ValueError("from_hf: defer_wgrad cannot be turned off once on (the linears were made deferring)")
    head = model.get_output_embeddings() if base is not model and hasattr(model, "get_output_embeddings") else None
    head = head if isinstance(head, nn.Linear) else None
    runner = _BaseModelRunner(base, chunks, defer_wgrad, head)
    base.forward = runner
    _dense.fuse_rmsnorms(model)
    _dense.fuse_residual_adds(model)
    runner.fused_loss = fused_loss and head is not None
    runner.early_backward = early_backward
    if runner.head is not None or runner.fused_loss:  # the head (or the fused loss) runs per chunk in training
        model.forward = _CausalLMForward(model, runner)
        head.forward = _HeadForward(head, runner)
    else:  # converted again, unchunked: the forwards of an earlier conversion go
        for m, cls in ((model, _CausalLMForward), (head, _HeadForward)):
            if m is not None and isinstance(m.__dict__.get("forward"), cls):
                del m.forward
    if any(m.ep_size > 1 for m in layers) and callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained = _save_pretrained_refused
    return model


def _check_options(chunks, defer_wgrad, router_dtype, fused_loss, early_backward) -> None:
    """:func:`from_hf`'s options, each refused with an error naming it."""
    _policy.check_chunks(chunks)
    if not isinstance(defer_wgrad, bool):
        raise TypeError(f"defer_wgrad must be a bool, got {type(defer_wgrad).__name__}")
    if router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"router_dtype must be one of {ROUTER_DTYPES}, got {router_dtype!r}")
    for name, flag in (("fused_loss", fused_loss), ("early_backward", early_backward)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def _convert_blocks(model: nn.Module, group, capacity_factor) -> int:
    """Replace every supported sparse MoE block by its lancet layer; returns how many were replaced."""
    config = getattr(model, "config", None)
    converted = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            builder = SUPPORTED.get(type(child).__name__)
            if builder is not None:
                setattr(parent, name, builder(child, config, group, capacity_factor))
                converted += 1
            elif _is_moe_block(child):
                raise ValueError(
                    f"from_hf: the MoE block {type(child).__name__} is not supported; supported: {', '.join(SUPPORTED)}"
                )
    return converted


def _save_pretrained_refused(*args, **kwargs):
    raise ValueError(
        "save_pretrained on an expert-parallel lancet model would write each rank's slice of "
        "the experts as the whole; call lancet_rt.save_hf(model, directory) on every rank instead "
        "(it writes the layout save_pretrained writes, loadable with from_pretrained)"
    )


def moe_layers(model: nn.Module) -> list[HFMoE]:
    """The lancet MoE layers of a converted model, in order."""
    return [m for m in model.modules() if isinstance(m, HFMoE)]
