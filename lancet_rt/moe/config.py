"""The MoE layer's options: their validation (:class:`MoEConfig`) and the cross-rank configuration
vector that every expert-parallel rank compares on first use (:data:`WIRE_FIELDS`)."""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from lancet_rt.moe.dispatch.base import DISPATCHERS
from lancet_rt.moe.experts import Experts

SCORE_FNS = ("softmax", "sigmoid")
DTYPE_IDS = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3, torch.float16: 4}


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_number(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class MoEConfig:
    """The options of :class:`lancet_rt.MoE` (see its Args), validated on construction.

    ``topk_group=None`` becomes ``n_group``; numbers become floats and flags bools.
    """

    d_model: int
    d_ffn: int
    num_experts: int
    top_k: int
    capacity_factor: Optional[float] = None
    score_fn: str = "softmax"
    normalize_topk: bool = True
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    pipeline_chunks: int = 1
    dispatcher: str = "alltoall"
    expert_bias: bool = False
    n_group: int = 1
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0
    dtype: Optional[torch.dtype] = None
    router_bias: bool = False
    shadow_experts: int = 0

    def __post_init__(self):
        for name in ("d_model", "d_ffn", "num_experts", "top_k", "pipeline_chunks", "n_group"):
            _check_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        self._check_capacity()
        if self.score_fn not in SCORE_FNS:
            raise ValueError(f"score_fn must be one of {SCORE_FNS}, got {self.score_fn!r}")
        _check_number("aux_loss_coef", self.aux_loss_coef)
        _check_number("z_loss_coef", self.z_loss_coef)
        if self.dtype is not None and self.dtype not in DTYPE_IDS:
            raise TypeError(f"dtype must be one of {list(DTYPE_IDS)}, got {self.dtype}")
        self._check_groups()
        rsf = self.routed_scaling_factor
        if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not 0 < rsf < math.inf:
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {rsf!r}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")
        if self.dispatcher == "allreduce" and self.pipeline_chunks != 1:
            raise ValueError(f"pipeline_chunks must be 1 with dispatcher='allreduce', got {self.pipeline_chunks}")
        self._check_shadow()
        set_ = object.__setattr__  # (frozen: the normalised values once, here)
        set_(self, "capacity_factor", None if self.capacity_factor is None else float(self.capacity_factor))
        set_(self, "normalize_topk", bool(self.normalize_topk))
        set_(self, "expert_bias", bool(self.expert_bias))
        set_(self, "router_bias", bool(self.router_bias))
        for name in ("aux_loss_coef", "z_loss_coef", "routed_scaling_factor"):
            set_(self, name, float(getattr(self, name)))

    def _check_capacity(self) -> None:
        cf = self.capacity_factor
        if cf is None:
            return
        if isinstance(cf, bool) or not isinstance(cf, (int, float)):
            raise TypeError(f"capacity_factor must be None or a number, got {type(cf).__name__}")
        if not cf > 0 or math.isinf(cf):
            raise ValueError(f"capacity_factor must be None (dropless) or a finite number > 0, got {cf}")

    def _check_shadow(self) -> None:
        """shadow_experts: an int in [0, num_experts], 0 with the all-reduce dispatcher (nothing to shadow)
        and with pipeline_chunks > 1 (the pipelined dispatch does not shadow)."""
        n = self.shadow_experts
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"shadow_experts must be an int, got {type(n).__name__}")
        if not 0 <= n <= self.num_experts:
            raise ValueError(f"shadow_experts must be in [0, num_experts={self.num_experts}], got {n}")
        if n and self.dispatcher != "alltoall":
            raise ValueError(
                f"shadow_experts must be 0 with dispatcher={self.dispatcher!r} (it shadows "
                f"experts of the all-to-all dispatch), got {n}"
            )
        if n and self.pipeline_chunks > 1:
            raise ValueError(
                f"shadow_experts must be 0 with pipeline_chunks={self.pipeline_chunks} (the Tutel-style "
                f"pipelined dispatch does not shadow experts), got {n}"
            )

    def _check_groups(self) -> None:
        """Group-limited top-k: n_group divides E, topk_group in [1, n_group], and K experts reachable."""
        E, n_group = self.num_experts, self.n_group
        topk_group = n_group if self.topk_group is None else self.topk_group
        object.__setattr__(self, "topk_group", topk_group)
        if E % n_group:
            raise ValueError(f"n_group must divide num_experts={E}, got {n_group}")
        if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
        if self.top_k > topk_group * (E // n_group):
            raise ValueError(
                f"top_k ({self.top_k}) must be at most topk_group * num_experts / n_group "
                f"= {topk_group * (E // n_group)}"
            )

    def check_world(self, world: int) -> None:
        """A ValueError unless the experts split evenly over ``world`` expert-parallel ranks."""
        if self.num_experts % world != 0:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by the expert-parallel world size ({world})"
            )


def _wire(value) -> int:
    """One setting as an int64: exact for floats (their IEEE bits), crc32 for strings and dtypes, -1 for None."""
    if value is None:
        return -1
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return zlib.crc32(str(value).encode())


def _structure(m: nn.Module) -> int:
    """The layer's parameters and buffers (names, local shapes, dtypes): catches what no option names."""
    items = [(n, tuple(t.shape), str(t.dtype)) for n, t in list(m.named_parameters()) + list(m.named_buffers())]
    return zlib.crc32(repr(sorted(items)).encode())


# What is read from the layer's modules rather than from its options (a prebuilt router decides these).
_LIVE: dict = {
    "dtype": lambda m: m.router.weight.dtype,
    "router_bias": lambda m: getattr(m.router, "bias", None) is not None,
}


def _option(name: str) -> Callable[[nn.Module], int]:
    def value(m):
        if name in _LIVE:
            return _wire(_LIVE[name](m))
        # the layer's attribute where it has one (pipeline_chunks may change after construction)
        return _wire(getattr(m, name) if name in m.__dict__ else getattr(m.config, name))

    return value


def _wire_fields() -> tuple:
    # Every option of MoEConfig (ONE table: a new option is compared without anyone listing it), then
    # the layer's structure, which no option describes.
    options = tuple((f.name, _option(f.name)) for f in dataclasses.fields(MoEConfig))
    return options + (
        ("shared_experts", lambda m: int(m.shared_experts is not None)),
        ("shared_expert_gate", lambda m: int(m.shared_expert_gate is not None)),
        ("parameters and buffers (names, shapes, dtypes)", _structure),
    )


#: (name in the mismatch message, the int64 value of a layer's setting): every MoEConfig option, then the
#: layer's structure. ONE table for the cross-rank vector and its names.
WIRE_FIELDS: tuple[tuple[str, Callable[[nn.Module], int]], ...] = _wire_fields()


def config_vector(moe: nn.Module, status: int) -> torch.Tensor:
    """int64 [1 + len(WIRE_FIELDS)]: ``status`` then the layer's settings, as :data:`WIRE_FIELDS` lists them.

    Args:
        moe: the layer (read now: settings such as ``pipeline_chunks`` may change after construction).
        status: this rank's input status (:func:`lancet_rt.comm.faults.status_code`).
    """
    return torch.tensor([status] + [value(moe) for _, value in WIRE_FIELDS], dtype=torch.int64)


def config_names() -> list[str]:
    """The names of :func:`config_vector`'s entries after the status."""
    return [name for name, _ in WIRE_FIELDS]


def check_modules(shared_experts, shared_expert_gate, router, experts) -> None:
    """The prebuilt or added submodules' types (MoE's Args)."""
    for name, value in (
        ("shared_experts", shared_experts),
        ("shared_expert_gate", shared_expert_gate),
        ("router", router),
    ):
        if value is not None and not isinstance(value, nn.Module):
            raise TypeError(f"{name} must be None or an nn.Module, got {type(value).__name__}")
    if shared_expert_gate is not None and shared_experts is None:
        raise ValueError("shared_expert_gate needs shared_experts")
    if experts is not None and not isinstance(experts, Experts):
        raise TypeError(f"experts must be None or a lancet_rt.Experts, got {type(experts).__name__}")


def role_names(names: Optional[dict], roles: tuple, taken: set) -> dict:
    """The attribute name of each role (``names`` overrides), checked free and distinct.

    Args:
        names: role -> attribute name, or None.
        roles: the layer's roles.
        taken: attribute names the layer's class already uses.

    Returns:
        role -> attribute name, for every role.
    """
    names = dict(names or {})
    unknown = set(names) - set(roles)
    if unknown:
        raise ValueError(f"names takes the roles {roles}, got {sorted(unknown)}")
    for role, name in names.items():
        if not isinstance(name, str) or not name.isidentifier() or name in taken or "." in name:
            raise ValueError(f"names[{role!r}] must be a free attribute name, got {name!r}")
    if len({names.get(r, r) for r in roles}) != len(roles):
        raise ValueError(f"names must give each role its own name, got {names}")
    return {role: names.get(role, role) for role in roles}


def check_prebuilt(
    router: nn.Module, experts: Experts, d_model: int, num_experts: int, local: int, expert_bias: bool
) -> None:
    """A ValueError unless the router and experts have the layer's shapes."""
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (num_experts, d_model):
        raise ValueError(
            f"router must have a weight of shape [num_experts={num_experts}, d_model={d_model}], "
            f"got {None if weight is None else tuple(weight.shape)}"
        )
    bias = getattr(router, "e_score_correction_bias", None)
    if expert_bias and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num_experts,)):
        raise ValueError(
            f"expert_bias=True needs router.e_score_correction_bias of shape [{num_experts}], got "
            f"{None if bias is None else tuple(bias.shape)}"
        )
    if (experts.num_local_experts, experts.d_model) != (local, d_model):
        raise ValueError(
            f"experts must hold num_experts / ep_size = {local} experts of d_model={d_model}, got "
            f"{experts.num_local_experts} of d_model={experts.d_model}"
        )
