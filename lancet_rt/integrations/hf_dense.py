"""The dense fused layers in converted transformers models (used by :func:`lancet_rt.from_hf`).

- Every RMSNorm of the model (the families' ``*RMSNorm``: decoder layers' input and post-attention
  norms, Qwen3-MoE / OLMoE's q/k norms, the final norm) computes with :func:`lancet_rt.dense.add_rmsnorm`
  (its class swapped for a subclass; parameters and names unchanged).
- Every decoder layer whose forward is transformers' pre-norm pattern (``h = x + attn(norm1(x))``,
  ``out = h + mlp(norm2(h))``: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GLM-4.5, GPT-OSS, checked on
  the forward's syntax tree, so a transformers version that changes it stays unfused) fuses the
  residual add into ``norm2`` (:func:`lancet_rt.dense.add_rmsnorm` returns the norm and the sum).
- In training with ``labels`` and ``logits_to_keep=0``, the loss is :func:`lancet_rt.dense.linear_cross_entropy`
  on the last hidden state, computed per chunk inside the base model's run (under
  :class:`lancet_rt.Overlapped` each chunk ends with its loss term and its head gradient; the divisor is
  the whole batch's count of valid labels, known before the first chunk), the logits are never
  formed and the output's ``logits`` is None (as Liger-Kernel's). The model's auxiliary loss is added
  as transformers adds it. Anything else (evaluation, generation, ``logits_to_keep != 0``, no labels,
  ``return_dict=False``, explicit ``shift_labels``) runs transformers' own code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Optional

import torch
from torch import nn

from lancet_rt.dense import SharedHeadGrad, add_rmsnorm
from lancet_rt.runtime import scope as _scope
from lancet_rt.schedule import early_backward as _early

_norm_classes: dict = {}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _is_rmsnorm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (
        type(m).__name__.endswith("RMSNorm")
        and isinstance(w, nn.Parameter)
        and w.dim() == 1
        and isinstance(getattr(m, "variance_epsilon", None), float)
    )


def _rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != self.weight.dtype or hidden_states.dtype not in _FLOATS:
        return super(type(self), self).forward(hidden_states)  # mixed dtypes promote: transformers' code
    return add_rmsnorm(hidden_states, None, self.weight, self.variance_epsilon)


def fuse_rmsnorms(model: nn.Module) -> int:
    """Swap the class of every transformers RMSNorm in ``model`` for one computing with lancet's
    kernel (float32 statistics; ``weight * normed`` in float32, then cast). Returns how many."""
    n = 0
    for m in model.modules():
        cls = type(m)
        if cls in _norm_classes.values():
            n += 1
        elif _is_rmsnorm(m):
            if cls not in _norm_classes:
                _norm_classes[cls] = type(
                    f"Lancet{cls.__name__}",
                    (cls,),
                    {
                        "forward": _rmsnorm_forward,
                        "__doc__": f"{cls.__name__} computing with lancet_rt.dense.add_rmsnorm (lancet-rt).",
                    },
                )
            m.__class__ = _norm_classes[cls]
            n += 1
    return n


_layer_classes: dict = {}
# The statements of the pre-norm decoder layer's forward (ast.unparse), the attention call and the MLP
# checked apart: the attention takes every parameter of the forward by name, the MLP may return a tuple.
_LAYER_BODY = (
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    None,
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    None,
    "hidden_states = residual + hidden_states",
    "return hidden_states",
)
_MLP = {"hidden_states = self.mlp(hidden_states)": False, "hidden_states, _ = self.mlp(hidden_states)": True}


def _passes_every_parameter(stmt: ast.stmt, sig: inspect.Signature) -> bool:
    """Whether ``stmt`` is ``hidden_states, _ = self.self_attn(name=name, ..., **kwargs)`` over every
    parameter of the forward (so the fused forward may pass them all the same way)."""
    call = getattr(stmt, "value", None)
    if not (
        isinstance(stmt, ast.Assign)
        and ast.unparse(stmt.targets[0]) == "(hidden_states, _)"
        and isinstance(call, ast.Call)
        and ast.unparse(call.func) == "self.self_attn"
        and not call.args
    ):
        return False
    named = {
        k.arg for k in call.keywords if k.arg is not None and isinstance(k.value, ast.Name) and k.value.id == k.arg
    }
    var_kw = [p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
    star = [k.value.id for k in call.keywords if k.arg is None and isinstance(k.value, ast.Name)]
    params = {p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD} - {"self"}
    return len(named) + len(star) == len(call.keywords) and named == params and star == var_kw == ["kwargs"]


def _pre_norm_layer(cls) -> Optional[bool]:
    """None when ``cls.forward`` is not the pre-norm pattern, else whether its MLP returns a tuple."""
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
        sig = inspect.signature(cls.forward)
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != len(_LAYER_BODY) or not _passes_every_parameter(body[2], sig):
        return None
    text = [ast.unparse(s) for s in body]
    if any(want is not None and got != want for got, want in zip(text, _LAYER_BODY)) or text[6] not in _MLP:
        return None
    return _MLP[text[6]]


def _layer_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    """transformers' pre-norm decoder layer with the residual add fused into the post-attention norm."""
    kwargs.update(zip(self._lancet_positional, args))
    for name, default in self._lancet_defaults:
        kwargs.setdefault(name, default)
    residual = hidden_states
    h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    norm = self.post_attention_layernorm
    w = norm.weight
    if h.dtype == residual.dtype == w.dtype and h.dtype in _FLOATS and h.shape == residual.shape:
        normed, hidden = add_rmsnorm(h, residual, w, norm.variance_epsilon)
    else:  # mixed dtypes promote: transformers' code
        hidden = residual + h
        normed = norm(hidden)
    out = self.mlp(normed)
    return hidden + (out[0] if self._lancet_tuple_mlp else out)


def fuse_residual_adds(model: nn.Module) -> int:
    """Swap the class of every transformers pre-norm decoder layer in ``model`` (module docstring) for one
    fusing the residual add before its MLP into the post-attention RMSNorm. Returns how many."""
    n = 0
    for m in model.modules():
        cls = type(m)
        if cls in _layer_classes.values():
            n += 1
            continue
        if not _is_rmsnorm(getattr(m, "post_attention_layernorm", None)) or not hasattr(m, "self_attn"):
            continue
        if cls not in _layer_classes:
            tuple_mlp = _pre_norm_layer(cls)
            if tuple_mlp is None:
                _layer_classes[cls] = None
                continue
            params = [
                p for p in inspect.signature(cls.forward).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD
            ][2:]  # after self, hidden_states
            _layer_classes[cls] = type(
                f"Lancet{cls.__name__}",
                (cls,),
                {
                    "forward": _layer_forward,
                    "_lancet_tuple_mlp": tuple_mlp,
                    "_lancet_positional": tuple(p.name for p in params),
                    "_lancet_defaults": tuple((p.name, p.default) for p in params if p.default is not p.empty),
                    "__doc__": f"{cls.__name__} with its residual add fused into the post-attention norm (lancet-rt).",
                },
            )
        if _layer_classes[cls] is not None:
            m.__class__ = _layer_classes[cls]
            n += 1
    return n


class LossMode:
    """The fused loss of one ``*ForCausalLM`` call: shifted labels [B, S], the loss (with the head's
    gradient shared by the chunks) and the loss term of each chunk; ``early``: each chunk issues its
    last combine's backward all-to-all from the forward (:mod:`lancet_rt.schedule.early_backward`)."""

    def __init__(
        self,
        labels_BS: torch.Tensor,
        divisor: torch.Tensor,
        weight: torch.Tensor,
        ignore_index: int,
        early: bool = False,
    ):
        self.labels_BS = labels_BS
        self.loss = SharedHeadGrad(weight, divisor, ignore_index, rows=labels_BS.numel(), labels=labels_BS)
        self.parts: dict[int, torch.Tensor] = {}
        self.early = early


def _backward_hooks_are_plain(model: nn.Module) -> bool:
    """Whether this model's backward runs the forward's graph with no hook that has a state of its own
    (what issuing a backward all-to-all from the forward needs): no gradient checkpointing (its
    recomputation would rerun the layer), no FSDP-sharded module (its backward hooks unshard and
    reduce). Other consumers of the last hidden state are found by the backward itself
    (:mod:`lancet_rt.schedule.early_backward`)."""
    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    return not any(
        getattr(m, "gradient_checkpointing", False) is True or (fsdp is not None and isinstance(m, fsdp))
        for m in model.modules()
    )


def loss_mode_for(model: nn.Module, head: Optional[nn.Module], args: tuple, kwargs: dict, early: bool = False):
    """(LossMode, kwargs without labels) when this call's loss can be fused, else (None, kwargs).
    ``early``: issue each chunk's first backward all-to-all from the forward where that is exact."""
    labels = kwargs.get("labels")
    keep = kwargs.get("logits_to_keep", 0)
    config = getattr(model, "config", None)
    if (
        not model.training
        or not isinstance(labels, torch.Tensor)
        or labels.dim() != 2
        or len(args) > 1
        or not isinstance(head, nn.Linear)
        or head.bias is not None
        or not (isinstance(keep, int) and keep == 0)
        or kwargs.get("return_dict") is False
        or kwargs.get("shift_labels") is not None
        or getattr(config, "final_logit_softcapping", None) is not None
    ):
        return None, kwargs
    ignore = -100
    shifted = nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
    num_items = kwargs.get("num_items_in_batch")
    divisor = (shifted != ignore).sum() if num_items is None else torch.as_tensor(num_items, device=labels.device)
    early = early and _backward_hooks_are_plain(model)
    kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
    return LossMode(shifted, divisor, head.weight, ignore, early), kwargs


def chunk_loss(mode: LossMode, out) -> None:
    """The loss term of the chunk (or the one run) whose base-model output is ``out``."""
    hidden = getattr(out, "last_hidden_state", None)
    if not isinstance(hidden, torch.Tensor):
        return
    scope = _scope.current()
    c = scope.chunk if scope is not None else 0
    r0 = sum(scope.rows[:c]) if scope is not None else 0
    labels = (
        mode.labels_BS[r0 : r0 + hidden.shape[0]]
        if hidden.shape[0] != mode.labels_BS.shape[0] or r0
        else mode.labels_BS
    )
    early = mode.early and scope is not None and torch.is_grad_enabled() and not _scope.beside_active()
    scale = _early.GradScale() if early else None
    mode.parts[c] = mode.loss.term(hidden, labels, scale)
    if early:
        _early.issue_from_forward(hidden, mode.parts[c], scale)


def finish(model: nn.Module, mode: LossMode, out):
    """The model's output with the fused loss (plus the weighted auxiliary loss, as transformers adds it)."""
    if not mode.parts:
        raise RuntimeError("from_hf: the fused loss saw no last hidden state of the base model")
    loss = mode.loss.attach(sum(mode.parts[c] for c in sorted(mode.parts)))
    aux = getattr(out, "aux_loss", None)
    coef = getattr(model, "router_aux_loss_coef", None)
    if isinstance(aux, torch.Tensor) and coef is not None:
        loss = loss + coef * aux.to(loss.device)
    fields = {k: v for k, v in out.items() if k != "logits"}
    return type(out)(loss=loss, **{k: v for k, v in fields.items() if k != "loss"})
