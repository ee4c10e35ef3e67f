"""References of the experts' kernels (grouped GEMMs, SwiGLU, segment sums): the contract.

One short, obvious PyTorch path per function, differentiable by autograd: what the Triton kernels
(:mod:`lancet_rt.kernels.grouped_gemm`, :mod:`~lancet_rt.kernels.swiglu`,
:mod:`~lancet_rt.kernels.segment_sum`) and the layer's CPU backend (:mod:`lancet_rt.kernels.cpu_backend`)
are tested against. Speed is not a goal here. Split out of :mod:`lancet_rt.kernels.reference`, which
re-exports every name.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (``promote_types(dtype, float32)``
    for the float dtypes, decided on the host: ``torch.promote_types`` dispatches an ATen op)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _bounds(offsets_E1):
    """Segment bounds as host ints: given as such, or read from the offsets tensor (a host sync)."""
    return offsets_E1 if isinstance(offsets_E1, (list, tuple)) else offsets_E1.tolist()


def _segments(t: torch.Tensor, offsets_E1, dim: int = 0) -> tuple:
    """``t`` cut along ``dim`` into the E segments of ``offsets_E1`` (views; empty ones included)."""
    b = _bounds(offsets_E1)
    return t.split([b[e + 1] - b[e] for e in range(len(b) - 1)], dim=dim)


#: The experts' activations: "swiglu" is silu(gate) * up (Mixtral, Qwen, DeepSeek); "swiglu_oai" is
#: GPT-OSS's clamped variant, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
ACTIVATIONS = ("swiglu", "swiglu_oai")


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _split_gu(gu_R2F: torch.Tensor, interleaved: bool):
    """(gate, up) of a pre-activation: gate columns first, or interleaved (gate 2j, up 2j + 1)."""
    if interleaved:
        return gu_R2F[:, 0::2], gu_R2F[:, 1::2]
    return gu_R2F.chunk(2, dim=-1)


def _join_gu(g_RF: torch.Tensor, u_RF: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack([g_RF, u_RF], dim=-1).flatten(-2)
    return torch.cat([g_RF, u_RF], dim=-1)


def grouped_mm_ref(
    x_RK: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor, bias_EN: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """y[r] = x[r] @ w[e].T (+ bias[e]) for the rows r of segment e = offsets[e]:offsets[e+1].

    Args:
        x_RK: [R, K] rows grouped by local expert.
        w_ENK: [E, N, K] weights (the Hugging Face expert layout: out features first).
        offsets_E1: integer [E + 1] segment bounds, offsets[0] = 0, offsets[E] = R (or the same
            bounds as host ints).
        bias_EN: optional [E, N] per-expert bias.

    Returns:
        y_RN [R, N] in x's dtype.
    """
    xs, ws = _segments(x_RK, offsets_E1), w_ENK.transpose(1, 2).unbind(0)
    if bias_EN is None:
        return torch.cat([torch.mm(x, w) for x, w in zip(xs, ws)])
    return torch.cat([torch.addmm(b, x, w) for x, w, b in zip(xs, ws, bias_EN.unbind(0))])


def grouped_mm_dx_ref(dy_RN: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """dx[r] = dy[r] @ w[e] for the rows of segment e: the input gradient of :func:`grouped_mm_ref`.

    Returns:
        dx_RK [R, K] in dy's dtype.
    """
    return torch.cat([torch.mm(dy, w) for dy, w in zip(_segments(dy_RN, offsets_E1), w_ENK.unbind(0))])


def grouped_mm_dw_ref(dy_RN: torch.Tensor, x_RK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """dw[e] = dy_seg.T @ x_seg over segment e (zeros for an empty segment): the weight gradient.

    Returns:
        dw_ENK [E, N, K] in x's dtype.
    """
    pieces = zip(_segments(dy_RN, offsets_E1), _segments(x_RK, offsets_E1))
    return torch.stack([torch.mm(dy.t(), x) for dy, x in pieces])


def grouped_mm_dw_pair_ref(
    dy_RN: torch.Tensor, x_RK: torch.Tensor, dy_b_RN: torch.Tensor, x_b_RK: torch.Tensor, offsets_E1
) -> tuple:
    """Two weight gradients over the same segments: (grouped_mm_dw_ref(dy, x), grouped_mm_dw_ref(dy_b, x_b)).

    Returns:
        (dw_ENK, dw_b_ENK) in x's dtype.
    """
    return grouped_mm_dw_ref(dy_RN, x_RK, offsets_E1), grouped_mm_dw_ref(dy_b_RN, x_b_RK, offsets_E1)


def segment_sum_ref(g_RN: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """s[e] = sum of the rows of segment e (zeros for an empty one), accumulated in float32: the
    gradient of a per-expert bias from its output's gradient.

    Returns:
        s_EN [E, N] in g's dtype.
    """
    g = g_RN.to(_acc(g_RN))
    return torch.stack([seg.sum(dim=0) for seg in _segments(g, offsets_E1)]).to(g_RN.dtype)


def swiglu_fwd_ref(
    gu_R2F: torch.Tensor,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The experts' activation of the pre-activation gu, computed in float32.

    Args:
        gu_R2F: [R, 2F] pre-activation: gate columns first, or interleaved (gate 2j, up 2j + 1).
        activation: "swiglu": silu(gate) * up; "swiglu_oai" (GPT-OSS): with g = min(gate, limit)
            and u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g).
        interleaved: the column order of gu.
        alpha, limit: the "swiglu_oai" constants (ignored by "swiglu").

    Returns:
        h_RF [R, F] in gu's dtype.
    """
    _check_activation(activation)
    g, u = _split_gu(gu_R2F.to(_acc(gu_R2F)), interleaved)
    return gated_act(g, u, activation, alpha, limit).to(gu_R2F.dtype)


def gated_act(g: torch.Tensor, u: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """The activation of gate and up, each [R, F] in the accumulation dtype."""
    if activation == "swiglu":
        return F.silu(g) * u
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(alpha * g))


def swiglu_bwd_ref(
    gu_R2F: torch.Tensor,
    grad_h_RF: torch.Tensor,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Gradient of :func:`swiglu_fwd_ref` with respect to gu, in float32, returned in gu's dtype and
    column order. d silu(g) / dg = sig (1 + g (1 - sig)) with sig = sigmoid(g): ATen's silu_backward.

    For "swiglu_oai" the clamps pass the gradient where torch.clamp's does (gate <= limit,
    -limit <= up <= limit: bounds included) and give zero elsewhere.

    Returns:
        dgu_R2F [R, 2F] in gu's dtype.
    """
    _check_activation(activation)
    g, u = _split_gu(gu_R2F.to(_acc(gu_R2F)), interleaved)
    dg, du = gated_act_grad(g, u, grad_h_RF.to(g.dtype), activation, alpha, limit)
    return _join_gu(dg, du, interleaved).to(gu_R2F.dtype)


def gated_act_grad(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, activation: str, alpha: float, limit: float):
    """(d gate, d up) of :func:`gated_act` from the gradient ``dh`` of its result, all in the accumulation dtype."""
    if activation == "swiglu":
        return torch.ops.aten.silu_backward(dh * u, g), dh * F.silu(g)
    gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    sig = torch.sigmoid(alpha * gc)
    dg = torch.where(g <= limit, dh * (uc + 1) * sig * (1 + alpha * gc * (1 - sig)), 0.0)
    du = torch.where((u >= -limit) & (u <= limit), dh * gc * sig, 0.0)
    return dg, du


def gate_up_swiglu_ref(
    x_RD: torch.Tensor,
    w_E2FD: torch.Tensor,
    offsets_E1: torch.Tensor,
    bias_E2F: Optional[torch.Tensor] = None,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
):
    """The expert input projection with its activation: gu = grouped_mm(x, w, bias), h = act(gu).

    Args:
        x_RD: [R, D] rows grouped by local expert.
        w_E2FD: [E, 2F, D] weights (any strides); rows in gu's column order (``interleaved``).
        offsets_E1: integer [E + 1] segment bounds.
        bias_E2F: optional [E, 2F] bias, in the same order.
        activation, interleaved, alpha, limit: as in :func:`swiglu_fwd_ref`.

    Returns:
        (h_RF, gu_R2F): the activation and the pre-activation kept for backward.
    """
    gu = grouped_mm_ref(x_RD, w_E2FD, offsets_E1, bias_E2F)
    return swiglu_fwd_ref(gu, activation=activation, interleaved=interleaved, alpha=alpha, limit=limit), gu
