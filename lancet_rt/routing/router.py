"""The router of a lancet MoE layer: float32 logits whatever autocast says, an optional learned
logit bias (GPT-OSS) and a selection-only bias with its aux-loss-free update (DeepSeek-V3)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lancet_rt.comm.group import TorchGroup, as_group


class Router(nn.Module):
    """The router: ``logits = x @ weight.T (+ bias)`` in float32 (float64 for a float64 layer).

    Args:
        d_model: D.
        num_experts: E.
        bias: a learned logit bias [E] (GPT-OSS's router has one).
        expert_bias: a selection bias buffer ``e_score_correction_bias`` [E] (float32, no gradient):
            experts are chosen by score + bias, weighted by the score (DeepSeek-V3's aux-loss-free
            balancing; :func:`update_expert_bias` adjusts it).

    Attributes:
        weight: [E, D]. bias: [E] or None. e_score_correction_bias: [E] float32 (with expert_bias).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        bias: bool = False,
        expert_bias: bool = False,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=init_std)
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype)) if bias else None
        if expert_bias:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(num_experts, device=device, dtype=torch.float32)
            )

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return router_logits(x_TD, self.weight, self.bias)


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32 (float64 if either is float64), whatever autocast says:
    the routing decision is made in full precision, as the contract requires."""
    # (on the host: torch.promote_types dispatches an op)
    dtype = torch.float64 if torch.float64 in (x_TD.dtype, weight_ED.dtype) else torch.float32
    args = (x_TD.to(dtype), weight_ED.to(dtype), None if bias_E is None else bias_E.to(dtype))
    if not torch.is_autocast_enabled(x_TD.device.type):  # (the context manager costs host time per chunk)
        return F.linear(*args)
    with torch.autocast(x_TD.device.type, enabled=False):
        return F.linear(*args)


@torch.no_grad()
def update_expert_bias(model: nn.Module, rate: float = 1e-3, group=None) -> None:
    """DeepSeek-V3's aux-loss-free balancing: after a step, move each expert's selection bias by
    ``rate`` towards balance, ``bias_e += rate * sign(mean load - load_e)``.

    The load is the assignments per expert (before dropping) summed over the training forwards
    since the last call (every microbatch of a step), and over ``group`` (the ranks that replicate
    the router: the data-parallel world, expert-parallel ranks included) by one all-reduce, so that
    every rank applies the same update. Layers without ``expert_bias`` are left alone.

    Args:
        model: a model holding :class:`~lancet_rt.MoE` layers (any module with ``expert_bias=True``,
            an ``expert_load`` and a router with ``e_score_correction_bias`` counts as one).
        rate: the bias update speed (DeepSeek-V3: 1e-3).
        group: a torch.distributed ProcessGroup (or a :class:`lancet_rt.TorchGroup`) to sum loads over,
            or None (this process only).
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
    layers = [m for m in model.modules() if _balances_experts(m)]
    if not layers:
        return
    loads = torch.stack(
        [
            m.expert_load
            if m.expert_load is not None
            else torch.zeros(m.num_experts, dtype=torch.long, device=m.router.weight.device)
            for m in layers
        ]
    )
    if group is not None:
        tg = as_group(group)
        if not isinstance(tg, TorchGroup):
            raise TypeError(
                f"group must be None, a torch.distributed ProcessGroup or a TorchGroup, got {type(group).__name__}"
            )
        # Through the group's monitor: numbered, bounded by LANCET_TIMEOUT_S, a lost peer named. gloo
        # reduces CPU tensors, NCCL CUDA ones: the loads live where the router does.
        tg.all_reduce(loads, what="expert-bias all-reduce").wait()
    for m, load in zip(layers, loads):
        bias = m.router.e_score_correction_bias
        bias += (rate * torch.sign(load.double().mean() - load.double())).to(bias.dtype)
        m.expert_load = None


def _balances_experts(m: nn.Module) -> bool:
    """Whether ``m`` is a layer with a selection bias to update (duck-typed: routing does not import the layer)."""
    return (
        getattr(m, "expert_bias", False) is True
        and hasattr(m, "expert_load")
        and hasattr(m, "num_experts")
        and hasattr(m, "router")
    )
