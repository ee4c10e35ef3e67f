"""The real peers beside lancet_rt: torchtitan's and DeepSpeed's MoE layers on the same weights.

    make peers                                   # the bench extra: torchtitan 0.3.0, DeepSpeed (CPU, no op builds)
    python -m bench.peers                        # unchunked, no link: 1 process and 2 gloo ranks (bench.peers.run)

Each peer runs its OWN routing, dispatch, expert-parallel all-to-alls and experts, built from the
peer's modules, with every weight copied from a :class:`lancet_rt.MoE`:

* ``"torchtitan"``: torchtitan 0.3.0 as shipped, ``torchtitan.models.common.moe.MoE`` (its
  ``TokenChoiceTopKRouter``, ``RoutedExperts`` of ``GroupedExperts`` and a token dispatcher). Its
  experts cast tokens and weights to bfloat16 (``GroupedExperts.forward``, whatever the model's dtype),
  so its outputs equal ours only to bfloat16 precision.
* ``"torchtitan_fp32"``: the same with :class:`_Float32Experts`, ``GroupedExperts`` minus those casts
  (the same three ``torch._grouped_mm`` through its ``_grouped_mm`` seam): equal numerics in float32.
* ``"deepspeed"``: ``deepspeed.moe.layer.MoE`` (its ``TopKGate``, ``MOELayer`` capacity buffers and
  ``_AllToAll``) around a SwiGLU expert module (:class:`_SwiGLUExpert`).

Expert parallelism, on the process group given (ranks hold experts ``rank * E_local ..``, as ours):
torchtitan's ``AllToAllTokenDispatcher`` wired to a one-axis ``DeviceMesh`` over the group
(``RoutedExperts.parallelize`` calls the same ``wire_meshes``), its expert weights ``DTensor`` shards
``Shard(0)`` on that mesh (the placement its ``expert_param_placement_sparse`` gives the ``ep`` axis),
under torchtitan's ``"partial_dtensor"`` SPMD backend (its default, ``"spmd_types"``, needs the
meshes of a whole ``ParallelDims`` trainer); DeepSpeed's ``MoE(ep_size=W)`` with
``MOELayer._set_ep_group(group)`` (its own ``_create_process_groups`` would make groups over the world).

Our routing contract, in each peer's terms: softmax scores, top-2, the two weights normalised,
dropless, no noise, no expert bias, no aux-loss term in the output:
* torchtitan: ``score_func="softmax"``, ``top_k=2``, ``route_norm=True``, ``route_scale=1.0``,
  ``num_expert_groups=None``, ``load_balance_coeff=None`` (no expert bias); its token-choice routing
  never drops.
* DeepSpeed: ``k=2``, ``drop_tokens=False`` (capacity = the busiest expert's count, all-reduced over
  the group: every assignment kept), ``noisy_gate_policy=None``, ``top2_2nd_expert_sampling=False``
  (its default samples the 2nd expert with Gumbel noise), ``use_rts=False``, ``use_residual=False``;
  its top-2 weights are normalised in ``top2gating``. Its aux loss is returned, not added.

:func:`check_equal` runs ours and a peer forward and backward on the same input and compares the
outputs, the input's gradient and every parameter's (the peers' in our layout): relative RMS error
within 1e-5 in float32 (the project's float32 tolerance, tests/helpers.py: both sides round sums of
at most max(D, F) terms in another order, ~1e-7 relative), 1e-2 where bfloat16 experts are involved.
A misrouted token or a missing expert gives errors of order 1.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import lancet_rt

#: Where ``make peers`` installs the peers: a folder beside the venv's packages, not among them, put at
#: the end of sys.path here (a transformers.Trainer in the venv would otherwise import DeepSpeed and
#: print its accelerator line into the user's run).
PEERS_DIR = Path(sys.prefix) / "peers"
if PEERS_DIR.is_dir() and str(PEERS_DIR) not in sys.path:
    sys.path.append(str(PEERS_DIR))
if not torch.cuda.is_available():  # DeepSpeed's own choice, said once without its warning
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

PEERS = ("torchtitan", "torchtitan_fp32", "deepspeed")
#: Relative RMS error allowed by :func:`check_equal`: float32 experts on both sides, or bfloat16 ones.
RTOL_FLOAT32, RTOL_BFLOAT16 = 1e-5, 1e-2
INSTALL = (
    "make peers (torchtitan==0.3.0, spmd_types, tyro, deepspeed into .venv/peers; "
    "see docs/benchmarks.md, 'The real peers')"
)


def available(peer: str) -> bool:
    """Whether ``peer``'s package imports here."""
    _check_peer(peer)
    try:
        if peer.startswith("torchtitan"):
            import torchtitan.models.common.moe  # noqa: F401
        else:
            import deepspeed.moe.layer  # noqa: F401
    except ImportError:
        return False
    return True


def _check_peer(peer) -> None:
    if peer not in PEERS:
        raise ValueError(f"peer must be one of {PEERS}, got {peer!r}")


def _check_layer(moe) -> None:
    """Only our contract's configuration has an equal peer (module docstring)."""
    if not isinstance(moe, lancet_rt.MoE):
        raise TypeError(f"moe must be a lancet_rt.MoE, got {type(moe).__name__}")
    e = moe.experts
    plain = (
        moe.score_fn == "softmax"
        and moe.normalize_topk
        and moe.capacity_factor is None
        and moe.top_k == 2
        and not moe.expert_bias
        and moe.n_group == 1
        and moe.routed_scaling_factor == 1.0
        and moe.router.bias is None
        and moe.shared_experts is None
        and e.layout == "lancet"
        and e.activation == "swiglu"
        and e.gate_up_proj_bias is None
    )
    if not plain:
        raise ValueError(
            "moe must be softmax top-2, normalised, dropless, without expert bias, groups, scaling, "
            "router bias, shared experts or expert biases, in the lancet layout: the peers' contract"
        )


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


class PeerMoE(nn.Module):
    """A peer's MoE layer where a :class:`lancet_rt.MoE` stood: [..., D] in, the same shape out.

    Attributes:
        peer: its name (:data:`PEERS`).
        layer: the peer's own module.
    """

    def __init__(self, peer: str, layer: nn.Module, grads):
        super().__init__()
        self.peer, self.layer = peer, layer
        self._grads = grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.peer == "deepspeed":
            return self.layer(x)[0].view(x.shape)
        return self.layer(x.reshape(-1, 1, x.shape[-1])).view(x.shape)  # torchtitan: [B, L, D]

    def grads_as_ours(self) -> dict:
        """The gradients of ``router.weight``, ``experts.gate_up_proj`` [E_local, 2F, D] and
        ``experts.down_proj`` [E_local, D, F], as :class:`lancet_rt.MoE` names and lays them out
        (the local experts'); None where a gradient is missing."""
        return self._grads()


def peer_layer(moe: lancet_rt.MoE, peer: str, group=None) -> PeerMoE:
    """``peer``'s MoE layer with ``moe``'s weights, expert-parallel over ``group`` (module docstring).

    Args:
        moe: the :class:`lancet_rt.MoE` to mirror: our contract's configuration, its local experts
            ``rank * E_local ..`` of ``group``.
        peer: one of :data:`PEERS`.
        group: the process group ``moe`` is expert-parallel on (a ``ProcessGroup``), or None.

    Returns:
        a :class:`PeerMoE` holding copies of the weights (the peer trains its own).
    """
    _check_peer(peer)
    _check_layer(moe)
    if not available(peer):
        raise ImportError(f"{peer} is not installed: {INSTALL}")
    world = _group_size(group)
    if world != moe.ep_size:
        raise ValueError(f"group has {world} ranks but moe is expert-parallel over {moe.ep_size}")
    build = _deepspeed if peer == "deepspeed" else _torchtitan
    return build(moe, peer, group, world)


def peer_blocks(model, peer: str, group=None) -> nn.Module:
    """A copy of ``model`` (a :class:`lancet_rt.models.blocks.MoEBlocks`, or any module whose MoE
    layers are the ``moe`` attribute of ``model.blocks``) with every block's MoE layer replaced by
    ``peer``'s (:func:`peer_layer`); every other weight copied."""
    _check_peer(peer)
    layers = [b.moe for b in model.blocks]
    for m in layers:
        _check_layer(m)
    peers = [peer_layer(m, peer, group) for m in layers]
    theirs = copy.deepcopy(model, memo={id(m): p for m, p in zip(layers, peers)})
    return theirs


def _torchtitan(moe: lancet_rt.MoE, peer: str, group, world: int) -> PeerMoE:
    # Its router's autocast(float32) is a no-op on CPU, and torch says so at every call.
    warnings.filterwarnings(
        "ignore", message="In CPU autocast, but the target dtype is not supported", category=UserWarning
    )
    from torchtitan.distributed import utils as tt_utils
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    E, K, D, Fh, E_local = moe.num_experts, moe.top_k, moe.d_model, moe.d_ffn, moe.num_local_experts
    dispatcher = AllToAllTokenDispatcher if world > 1 else LocalTokenDispatcher
    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=Fh, num_experts=E_local),
            token_dispatcher=dispatcher.Config(num_experts=E, top_k=K),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=Linear.Config(in_features=D, out_features=E),
            top_k=K,
            score_func="softmax",
            route_norm=True,
            route_scale=1.0,
        ),
        load_balance_coeff=None,
    )
    layer = cfg.build()
    inner = layer.routed_experts.inner_experts
    if peer == "torchtitan_fp32":
        inner.__class__ = _float32_experts_class()  # (a Config builds its own class: swapped after)
    device = moe.router.weight.device
    layer.to(device)
    with torch.no_grad():
        layer.router.gate.weight.copy_(moe.router.weight)
        gu, down = moe.experts.gate_up_proj, moe.experts.down_proj
        w = dict(w1_EFD=gu[:, :Fh], w3_EFD=gu[:, Fh:], w2_EDF=down)
    if world > 1:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        tt_utils.set_spmd_backend("partial_dtensor")
        mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("ep",))
        for name, t in w.items():
            local = t.detach().clone().contiguous()
            setattr(inner, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))
        layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    else:
        for name, t in w.items():
            setattr(inner, name, nn.Parameter(t.detach().clone().contiguous()))
    layer.train(moe.training)

    def grads():
        g = {n: _local(getattr(inner, n).grad) for n in ("w1_EFD", "w3_EFD", "w2_EDF")}
        gate_up = None if g["w1_EFD"] is None or g["w3_EFD"] is None else torch.cat([g["w1_EFD"], g["w3_EFD"]], 1)
        return {
            "router.weight": layer.router.gate.weight.grad,
            "experts.gate_up_proj": gate_up,
            "experts.down_proj": g["w2_EDF"],
        }

    return PeerMoE(peer, layer, grads)


def _local(t):
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


_FLOAT32_EXPERTS = None


def _float32_experts_class():
    """torchtitan's ``GroupedExperts`` computing in the tokens' dtype: its forward without the
    ``.bfloat16()`` casts (the same three grouped GEMMs through its ``_grouped_mm`` seam)."""
    global _FLOAT32_EXPERTS
    if _FLOAT32_EXPERTS is None:
        from torchtitan.models.common.moe import GroupedExperts

        class Float32Experts(GroupedExperts):
            def forward(self, x_RD, num_tokens_per_expert_E):
                w1, w2, w3 = (_local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
                offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
                h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offs))
                h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offs)
                return self._grouped_mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offs)

        _FLOAT32_EXPERTS = Float32Experts
    return _FLOAT32_EXPERTS


class _SwiGLUExpert(nn.Module):
    """One expert as a DeepSpeed user writes it: ``down(silu(gate x) * up x)``, gate rows first in
    ``gate_up`` [2F, D] (our ``gate_up_proj[e]``), ``down`` [D, F]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_up = nn.Parameter(gate_up.detach().clone())
        self.down = nn.Parameter(down.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.down)


def _deepspeed(moe: lancet_rt.MoE, peer: str, group, world: int) -> PeerMoE:
    from deepspeed.moe.layer import MoE

    gu, down = moe.experts.gate_up_proj, moe.experts.down_proj
    layer = MoE(
        moe.d_model,
        _SwiGLUExpert(gu[0], down[0]),
        num_experts=moe.num_experts,
        ep_size=world,
        k=moe.top_k,
        drop_tokens=False,
        noisy_gate_policy=None,
        use_rts=False,
        use_residual=False,
        top2_2nd_expert_sampling=False,
    )
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(moe.router.weight)
        for e, expert in enumerate(experts):
            expert.gate_up.copy_(gu[e])
            expert.down.copy_(down[e])
    layer.to(moe.router.weight.device)
    if world > 1:
        import deepspeed
        import deepspeed.ops
        import torch.distributed as dist

        # deepspeed.comm's collectives (its _AllToAll) on the torch.distributed world already set up.
        # On CPU its backend would first JIT-compile a shared-memory all-reduce op (a C++ build of
        # minutes, for its inference all-reduce; the MoE layer's collectives are torch.distributed's):
        # no op built, as DS_BUILD_OPS=0 at install. (An unprobed op table reads as "none compatible".)
        deepspeed.ops.__dict__.setdefault("__compatible_ops__", {})
        deepspeed.init_distributed(dist_backend=dist.get_backend(group))
        layer.deepspeed_moe._set_ep_group(group)
    layer.train(moe.training)

    def grads():
        def stacked(name):
            gs = [getattr(x, name).grad for x in experts]
            return None if any(g is None for g in gs) else torch.stack(gs)

        return {
            "router.weight": layer.deepspeed_moe.gate.wg.weight.grad,
            "experts.gate_up_proj": stacked("gate_up"),
            "experts.down_proj": stacked("down"),
        }

    return PeerMoE(peer, layer, grads)


def gradients(model: nn.Module) -> dict:
    """Every parameter's gradient by our names: a peer layer's in our layout (:meth:`PeerMoE.grads_as_ours`)."""
    peers = {name: m for name, m in model.named_modules() if isinstance(m, PeerMoE)}
    inside = tuple(f"{name}." if name else "" for name in peers)
    out = {n: p.grad for n, p in model.named_parameters() if not any(n.startswith(pre) for pre in inside)}
    for name, m in peers.items():
        out.update({(f"{name}.{k}" if name else k): g for k, g in m.grads_as_ours().items()})
    return out


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> tuple:
    a, b = a.detach().double(), b.detach().double()
    diff = a - b
    ref = b.pow(2).mean().sqrt().item()
    return diff.abs().max().item(), diff.pow(2).mean().sqrt().item() / max(ref, 1e-12)


def check_equal(
    ours: nn.Module,
    theirs: nn.Module,
    x: torch.Tensor,
    *,
    autocast: Optional[torch.dtype] = None,
    rtol: Optional[float] = None,
    seed: int = 0,
) -> dict:
    """Ours and a peer (a :class:`PeerMoE` or a model holding them) forward and backward on ``x``:
    outputs, ``x``'s gradient and every parameter's gradient compared (module docstring).

    Args:
        ours: a :class:`lancet_rt.MoE` or a model of them.
        theirs: its peer (:func:`peer_layer`, :func:`peer_blocks`).
        x: the input (this rank's).
        autocast: run both under ``torch.autocast(x.device.type, dtype=autocast)``.
        rtol: relative RMS error allowed; default :data:`RTOL_FLOAT32`, or :data:`RTOL_BFLOAT16` when
            ``autocast`` is set or a peer is torchtitan as shipped (bfloat16 experts).
        seed: of the output gradient.

    Returns:
        ``dict(ok=, rtol=, worst=(name, rel_rms), rows=[(name, max_abs, rel_rms)])``; both models' grads are
        left set (zero them before timing).

    Raises:
        ValueError: a gradient missing on one side, or shapes that differ.
    """
    bf16_peer = any(isinstance(m, PeerMoE) and m.peer == "torchtitan" for m in theirs.modules())
    if rtol is None:
        rtol = RTOL_BFLOAT16 if autocast is not None or bf16_peer else RTOL_FLOAT32
    g = torch.Generator().manual_seed(seed)
    results = []
    for model in (ours, theirs):
        model.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(True)
        with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            y = model(xi)
        if not results:
            dy = torch.randn(y.shape, generator=g, dtype=torch.float32).to(y.device)
        y.float().backward(dy)
        results.append(dict(output=y.detach().float(), input_grad=xi.grad, **gradients(model)))
    rows = []
    for name, a in results[0].items():
        b = results[1].get(name)
        if a is None or b is None:
            raise ValueError(f"{name}: gradient missing ({'ours' if a is None else 'theirs'})")
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} (ours) != {tuple(b.shape)} (theirs)")
        rows.append((name, *_rel_rms(b.float(), a.float())))
    worst = max(rows, key=lambda r: r[2])
    ok = all(r[2] <= rtol for r in rows) and not any(torch.isnan(t).any() for t in results[1].values())
    return dict(ok=ok, rtol=rtol, worst=(worst[0], worst[2]), rows=rows)
