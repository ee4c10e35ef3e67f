"""Routing traces and skew sources: per-layer, per-step expert loads, recorded, saved and replayed.

    with lancet_rt.tracing() as tr:          # any model with lancet MoE layers, any number of steps
        train_steps()
    rt = RoutingTrace.from_trace(tr)         # loads[step][layer][expert]
    rt.save("routing.json")                  # small JSON
    RoutingTrace.load("routing.json").max_over_mean()

A routing source (:func:`parse_routing`: ``balanced``, ``zipf``, ``zipf:S`` or ``trace:FILE``)
gives every layer's expert shares. :func:`bias_routers` replays them in a model: a forward hook on
each layer's router adds ``strength * log(share)`` to its logits, so the real router (and with it
the emulated link, :class:`lancet_rt.comm.emulated_skew.SkewedGroup`) sees that skew. The cluster
simulator (``python -m lancet_rt.autotune.simulate``) reads the shares directly.

The ``zipf`` preset: expert e (in a seeded random order) gets a share proportional to
``1 / rank(e) ** S``, with S solved so that the max/mean expert load is :data:`ZIPF_PRESET_MAX_OVER_MEAN`
(3.0) for the layer's expert count; ``zipf:S`` fixes the exponent.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from lancet_rt.jsonfile import read_json

#: The max/mean expert load of the ``zipf`` preset (measured on real runs: 2-4; torchtitan, DeepEP).
ZIPF_PRESET_MAX_OVER_MEAN = 3.0
FORMAT = "lancet-rt routing trace v1"


@dataclass
class RoutingTrace:
    """Expert loads (assignments before dropping) per step, per MoE layer, per expert.

    Attributes:
        loads: ``loads[step][layer][expert]``, ints.
        meta: free-form provenance (model, command, world size...).
    """

    loads: list
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.loads = _checked_loads(self.loads)

    @property
    def steps(self) -> int:
        return len(self.loads)

    @property
    def layers(self) -> int:
        return len(self.loads[0])

    @property
    def experts(self) -> int:
        return len(self.loads[0][0])

    def shares(self, layer: int, step: Optional[int] = None) -> list:
        """Layer ``layer``'s expert shares (summing to 1) at ``step``, or over every step."""
        rows = self.loads if step is None else [self.loads[step]]
        tot = [sum(r[layer][e] for r in rows) for e in range(self.experts)]
        s = sum(tot)
        return [1.0 / self.experts] * self.experts if s == 0 else [v / s for v in tot]

    def max_over_mean(self) -> float:
        """The max/mean expert load, averaged over steps and layers."""
        vals = [max(layer) * len(layer) / sum(layer) for step in self.loads for layer in step if sum(layer)]
        return sum(vals) / len(vals) if vals else 1.0

    def to_dict(self) -> dict:
        return dict(
            format=FORMAT,
            steps=self.steps,
            layers=self.layers,
            experts=self.experts,
            max_over_mean=self.max_over_mean(),
            meta=self.meta,
            loads=self.loads,
        )

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path: str) -> "RoutingTrace":
        """Read a file :meth:`save` wrote.

        Raises:
            ValueError: the file is not UTF-8 JSON (or nested too deeply, or holds an integer longer than
                Python converts), not a routing trace, or a field is damaged (the
                message names the file and the field: ``loads[step][layer][expert]``, ``meta``,
                ``steps``...). A load must be an int >= 0: NaN, infinities, fractions, negative
                numbers, strings, booleans and nulls are refused, never truncated.
            OSError: the file cannot be read.
        """
        d = read_json(path)  # (a ValueError naming the file: not UTF-8, not JSON, nested too deeply, huge numbers)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT!r} file (field 'format')")
        if "loads" not in d:
            raise ValueError(f"{path}: field 'loads' is missing")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError(f"{path}: field 'meta' must be an object, got {type(meta).__name__}")
        try:
            trace = cls(d["loads"], dict(meta))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        for name in ("steps", "layers", "experts"):  # written by save(): a damaged file may disagree
            if name in d and (type(d[name]) is not int or d[name] != getattr(trace, name)):
                raise ValueError(f"{path}: field {name!r} is {d[name]!r}, but 'loads' holds {getattr(trace, name)}")
        return trace

    @classmethod
    def from_trace(cls, trace, meta: Optional[dict] = None) -> "RoutingTrace":
        """The loads a :func:`lancet_rt.tracing` context recorded: layers in order of first appearance,
        the k-th record of a layer being its k-th step (steps every layer completed)."""
        per_layer: dict = {}
        for key, load in trace.expert_loads:
            per_layer.setdefault(key, []).append([int(v) for v in load.tolist()])
        if not per_layer:
            raise ValueError("the trace recorded no expert loads (no MoE layer ran a whole batch under it)")
        cols = list(per_layer.values())
        steps = min(len(c) for c in cols)
        return cls([[c[s] for c in cols] for s in range(steps)], dict(meta or {}))


def _load_value(v, where: str) -> int:
    """One load as an int: an int >= 0, or a float that is one (3.0); anything else is refused, named."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0:
        return int(v)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and v >= 0:
        return int(v)
    raise ValueError(f"{where} must be an int >= 0 (assignments), got {v!r}")


def _checked_loads(loads) -> list:
    """``loads`` as ``[step][layer][expert]`` ints, every step of one shape; a ValueError names the
    first bad field (its index and its step, layer and expert)."""
    if not isinstance(loads, list) or not loads:
        raise ValueError(f"loads must be a non-empty list [step][layer][expert], got {type(loads).__name__}")
    out = []
    for s, step in enumerate(loads):
        if not isinstance(step, list):
            raise ValueError(f"loads[{s}] (step {s}) must be a list of layers, got {type(step).__name__}")
        rows = []
        for l, layer in enumerate(step):
            if not isinstance(layer, list):
                raise ValueError(
                    f"loads[{s}][{l}] (step {s}, layer {l}) must be a list of expert loads, got {type(layer).__name__}"
                )
            rows.append(
                [_load_value(v, f"loads[{s}][{l}][{e}] (step {s}, layer {l}, expert {e})") for e, v in enumerate(layer)]
            )
        out.append(rows)
    shape = (len(out[0]), len(out[0][0]) if out[0] else 0)
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError("loads must have at least one layer and one expert")
    for s, step in enumerate(out):
        if len(step) != shape[0] or any(len(layer) != shape[1] for layer in step):
            raise ValueError(f"loads[{s}] (step {s}) must be [{shape[0]} layers][{shape[1]} experts], like loads[0]")
    return out


def zipf_shares(experts: int, exponent: float, seed: int = 0) -> list:
    """Shares proportional to ``1 / rank ** exponent``, the ranks in a seeded random order."""
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"experts must be an int >= 1, got {experts!r}")
    if not exponent >= 0:
        raise ValueError(f"exponent must be >= 0, got {exponent!r}")
    order = list(range(experts))
    random.Random(seed).shuffle(order)
    w = [0.0] * experts
    for rank, e in enumerate(order):
        w[e] = 1.0 / (rank + 1) ** exponent
    s = sum(w)
    return [v / s for v in w]


def zipf_exponent(experts: int, max_over_mean: float = ZIPF_PRESET_MAX_OVER_MEAN) -> float:
    """The exponent whose Zipf shares have this max/mean over ``experts`` (bisection)."""
    if not 1 <= max_over_mean <= experts:
        raise ValueError(f"max_over_mean must be in [1, experts={experts}], got {max_over_mean!r}")
    lo, hi = 0.0, 16.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if max(zipf_shares(experts, mid)) * experts < max_over_mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class RoutingSource:
    """A routing: ``kind`` "balanced", "zipf" (``exponent``; None: the preset) or "trace" (``trace``)."""

    kind: str
    exponent: Optional[float] = None
    trace: Optional[RoutingTrace] = None
    seed: int = 0
    name: str = ""

    def shares(self, layer: int, experts: int) -> list:
        """Layer ``layer``'s expert shares over ``experts`` experts (a trace's layers repeat cyclically)."""
        if self.kind == "balanced":
            return [1.0 / experts] * experts
        if self.kind == "zipf":
            s = zipf_exponent(experts) if self.exponent is None else self.exponent
            return zipf_shares(experts, s, self.seed + layer)
        if self.trace.experts != experts:
            raise ValueError(f"the routing trace has {self.trace.experts} experts, the model {experts}")
        return self.trace.shares(layer % self.trace.layers)


def parse_routing(text: str) -> RoutingSource:
    """``balanced``, ``zipf`` (the preset, max/mean 3), ``zipf:S`` (exponent S) or ``trace:FILE``."""
    if not isinstance(text, str):
        raise TypeError(f"routing must be a str, got {type(text).__name__}")
    kind, _, arg = text.partition(":")
    if kind == "balanced" and not arg:
        return RoutingSource("balanced", name=text)
    if kind == "zipf":
        try:
            exponent = float(arg) if arg else None
        except ValueError:
            exponent = -1.0
        if exponent is not None and not exponent >= 0:
            raise ValueError(f"routing zipf:S needs a number S >= 0, got {text!r}")
        return RoutingSource("zipf", exponent, name=text)
    if kind == "trace" and arg:
        return RoutingSource("trace", trace=RoutingTrace.load(arg), name=text)
    raise ValueError(f"routing must be 'balanced', 'zipf', 'zipf:S' or 'trace:FILE', got {text!r}")


@contextlib.contextmanager
def bias_routers(moe_layers: Sequence, source: RoutingSource, strength: float = 1.0):
    """Replay ``source`` in a model while open: each layer's router logits gain ``strength * log(share)``."""
    handles = []
    try:
        for i, moe in enumerate(moe_layers):
            if source.kind == "balanced":
                continue
            bias = torch.tensor([strength * math.log(max(p, 1e-12)) for p in source.shares(i, moe.num_experts)])
            handles.append(
                moe.router.register_forward_hook(
                    lambda m, args, out, b=bias: out + b.to(device=out.device, dtype=out.dtype)
                )
            )
        yield
    finally:
        for h in handles:
            h.remove()
