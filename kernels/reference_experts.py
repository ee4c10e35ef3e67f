"""References of the experts' kernels (grouped GEMMs, SwiGLU, segment sums): plain PyTorch, also the
layer's CPU path. Split out of :mod:`lancet_rt.kernels.reference`, which re-exports every name."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (``promote_types(dtype, float32)``
    for the float dtypes, decided on the host: ``torch.promote_types`` dispatches an ATen op)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _bounds(offsets_E1):
    """Segment bounds as host ints: given as such (the layer passes the bounds it knows from the
    counts exchange: no read), or read from the offsets tensor (a host sync: fine for a reference)."""
    return offsets_E1 if isinstance(offsets_E1, (list, tuple)) else offsets_E1.tolist()


#: The experts' activations: "swiglu" is silu(gate) * up (Mixtral, Qwen, DeepSeek); "swiglu_oai" is
#: GPT-OSS's clamped variant, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
ACTIVATIONS = ("swiglu", "swiglu_oai")


def _split_gu(gu_R2F: torch.Tensor, interleaved: bool):
    """(gate, up) of a pre-activation: gate columns first, or interleaved (gate 2j, up 2j + 1)."""
    if interleaved:
        return gu_R2F[:, 0::2], gu_R2F[:, 1::2]
    return gu_R2F.chunk(2, dim=-1)


def _join_gu(g_RF: torch.Tensor, u_RF: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack([g_RF, u_RF], dim=-1).flatten(-2)
    return torch.cat([g_RF, u_RF], dim=-1)


#: The step, in float32 elements, of ATen's vectorized elementwise loops at their widest on x86 (two
#: 512-bit vectors, AVX-512; 16 on AVX2). Such a loop computes the elements of each step with the
#: vector form of the op and a shorter tail with its scalar form, and for silu and silu_backward the two
#: differ in the last bit. Over a half of [R, 2F] the loop runs per row (a tail per row, the same at
#: any R); over a contiguous [R, F] it runs over R * F elements (one tail, where R decides). With F a
#: multiple of this step every element takes the vector form in both: the same bits, at any R.
_VECTOR_STEP = 32


class GateUp(NamedTuple):
    """A pre-activation as its two halves, each a contiguous [R, F] tensor: what
    :func:`gate_up_swiglu_ref` gives with ``halves=True``, and what :func:`swiglu_fwd_ref` and
    :func:`swiglu_bwd_ref` take in place of the [R, 2F] tensor.

    On the CPU an elementwise pass over one half of a [R, 2F] tensor (rows of F floats, F apart) costs
    more than the same pass over a contiguous [R, F] (timings in bench/results/HISTORY.md), and the
    experts' activation and its gradient make six such passes per step. Computing gate and up by
    two [R, F] GEMMs costs what the one [R, 2F] GEMM does (each output the same dot product).
    """

    gate: torch.Tensor
    up: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """[R, 2F], as the joined tensor's."""
        R, F = self.gate.shape
        return torch.Size((R, 2 * F))

    @staticmethod
    def tensors(gu) -> tuple:
        """The tensors of a pre-activation or its gradient: (gate, up) of a GateUp, else (gu,)."""
        return tuple(gu) if isinstance(gu, GateUp) else (gu,)


def _halves(gu, interleaved: bool, work=None) -> tuple:
    """(gate, up) of a pre-activation, a [R, 2F] tensor or a :class:`GateUp`, in the accumulation
    dtype (copies for 16-bit inputs; float32 and float64: views, or the halves themselves). ``work``:
    where a 16-bit input's float32 copy goes (gu's layout, float32; the same values as ``.to``)."""
    if isinstance(gu, GateUp):
        if work is not None and _acc(gu.gate) != gu.gate.dtype:
            return tuple(w.copy_(t) for w, t in zip(work, gu))
        return tuple(t.to(_acc(t)) for t in gu)
    if work is not None and _acc(gu) != gu.dtype:
        return _split_gu(work.copy_(gu), interleaved)
    return _split_gu(gu.to(_acc(gu)), interleaved)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _segments(t: torch.Tensor, offsets_E1, dim: int = 0) -> tuple:
    """``t`` cut along ``dim`` into the E segments of ``offsets_E1`` (views; empty ones included)."""
    b = _bounds(offsets_E1)
    return t.split([b[e + 1] - b[e] for e in range(len(b) - 1)], dim=dim)


def _one_launch(*tensors) -> bool:
    """Whether ``torch._grouped_mm`` can do a grouped GEMM on these CPU operands: one ATen op for
    all segments instead of one matmul each (the same per-segment products: it runs ``mm`` per
    group on CPU). Its limits: float32/bfloat16/float16, strides and base addresses multiples of
    16 bytes."""
    dtype = tensors[0].dtype
    if not _HAS_GROUPED_MM or dtype not in _GROUPED_DTYPES:
        return False
    size = tensors[0].element_size()
    for t in tensors:  # (a plain loop: this runs for every grouped GEMM of every chunk)
        if t.dtype != dtype or t.device.type != "cpu" or t.data_ptr() % 16:
            return False
        for s in t.stride():
            if s != 1 and s * size % 16:
                return False
    return True


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


class HostBounds(tuple):
    """Segment bounds as host ints that also hold ``ends``, their int32 end rows as a CPU tensor
    (``torch._grouped_mm``'s ``offs``), made once and shared by every grouped GEMM of a chunk."""

    @functools.cached_property
    def ends(self) -> torch.Tensor:
        return torch.tensor(self[1:], dtype=torch.int32)


def _ends(offsets_E1) -> torch.Tensor:
    """``torch._grouped_mm``'s ``offs``: the segments' int32 end rows (a CPU tensor from host ints)."""
    if isinstance(offsets_E1, HostBounds):
        return offsets_E1.ends
    return torch.tensor(_bounds(offsets_E1)[1:], dtype=torch.int32)


_HALF = (torch.bfloat16, torch.float16)


def _along(w_ENK: torch.Tensor, dim: int, work: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``w_ENK`` with its ``dim`` (1 or 2: the GEMM's reduction dimension) contiguous, for a 16-bit
    CPU GEMM whose other operand runs contiguously along it: a copy of the weights when needed.

    Where the CPU has no native 16-bit GEMM (AVX2 without AVX512-BF16 or AMX, as on the machines
    this project benchmarks on), ATen's own loops run a [R, K] @ [K, N] product several times slower
    when only one operand is contiguous along K (the experts' dX and dH took most of a layer step;
    torch.profiler timings in bench/results/HISTORY.md). A [E, N, K] weight copy costs far less.
    ``work``: a flat buffer of w's dtype and at least its numel for the copy (reused memory); the same
    values and strides as without.
    """
    if w_ENK.dtype not in _HALF or w_ENK.device.type != "cpu" or w_ENK.stride(dim) == 1:
        return w_ENK
    other = 3 - dim
    t = w_ENK.transpose(dim, other)
    if work is None:
        return t.contiguous().transpose(dim, other)
    return work[: t.numel()].view(t.shape).copy_(t).transpose(dim, other)


def grouped_mm_ref(
    x_RK: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor, bias_EN: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """y[r] = x[r] @ w[e].T (+ bias[e]) for the rows r of segment e = offsets[e]:offsets[e+1].

    One matmul per expert on views of the segments, written into the output (this is also the CPU
    path of the layer, run once per chunk: on CPU, one ``torch._grouped_mm`` where it applies, and one
    ``mm`` for one segment, as a dense FFN pays).

    Args:
        x_RK: [R, K] rows grouped by local expert.
        w_ENK: [E, N, K] weights (the Hugging Face expert layout: out features first).
        offsets_E1: integer [E + 1] segment bounds, offsets[0] = 0, offsets[E] = R (or the same
            bounds as host ints).
        bias_EN: optional [E, N] per-expert bias.

    Returns:
        y_RN [R, N] in x's dtype.
    """
    if not _differentiable(x_RK, w_ENK, bias_EN) and x_RK.stride(1) == 1:
        w_ENK = _along(w_ENK, 2)  # (16-bit CPU: reduced over K, contiguous in both operands)
    w_EKN = w_ENK.transpose(1, 2)
    if _differentiable(x_RK, w_ENK, bias_EN):  # (out= does not record autograd: concatenate)
        xs, ws = _segments(x_RK, offsets_E1), w_EKN.unbind(0)
        if bias_EN is None:
            return torch.cat([torch.mm(x, w) for x, w in zip(xs, ws)])
        return torch.cat([torch.addmm(b, x, w) for x, w, b in zip(xs, ws, bias_EN.unbind(0))])
    if bias_EN is None and w_EKN.shape[0] == 1:  # one segment: the one GEMM _grouped_mm would run
        return torch.mm(x_RK, w_EKN[0])
    if bias_EN is None and _one_launch(x_RK, w_EKN):
        return torch._grouped_mm(x_RK, w_EKN, offs=_ends(offsets_E1))
    y = x_RK.new_empty(x_RK.shape[0], w_ENK.shape[1])
    pieces = zip(_segments(x_RK, offsets_E1), w_EKN.unbind(0), _segments(y, offsets_E1))
    if bias_EN is None:
        for x, w, out in pieces:
            torch.mm(x, w, out=out)  # (into y's rows: no concatenation copy)
    else:
        for (x, w, out), b in zip(pieces, bias_EN.unbind(0)):
            torch.addmm(b, x, w, out=out)
    return y


def _differentiable(*tensors) -> bool:
    """Whether autograd records an op on ``tensors`` now (the references are also differentiated
    directly, in tests and float64 gradient checks)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def grouped_mm_dx_ref(
    dy_RN: torch.Tensor,
    w_ENK: torch.Tensor,
    offsets_E1: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    work: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dx[r] = dy[r] @ w[e] for the rows of segment e: the input gradient of :func:`grouped_mm_ref`.

    ``out``: an optional [R, K] buffer in dy's dtype, written row segment by row segment with the
    same per-segment ``mm`` that ``torch._grouped_mm`` runs on CPU (it takes no ``out``), so the
    caller can keep the buffer across steps instead of allocating the product each time.
    ``work``: where a 16-bit CPU weight copy goes (:func:`_along`), reused memory likewise.
    """
    if _differentiable(dy_RN, w_ENK):
        return torch.cat([torch.mm(dy, w) for dy, w in zip(_segments(dy_RN, offsets_E1), w_ENK.unbind(0))])
    if dy_RN.stride(1) == 1:
        w_ENK = _along(w_ENK, 1, work)  # (16-bit CPU: reduced over N, contiguous in both operands)
    if w_ENK.shape[0] == 1:  # one segment: one GEMM
        return torch.mm(dy_RN, w_ENK[0]) if out is None else torch.mm(dy_RN, w_ENK[0], out=out)
    if out is None and _one_launch(dy_RN, w_ENK):
        return torch._grouped_mm(dy_RN, w_ENK, offs=_ends(offsets_E1))
    dx = dy_RN.new_empty(dy_RN.shape[0], w_ENK.shape[2]) if out is None else out
    for dy, w, out in zip(_segments(dy_RN, offsets_E1), w_ENK.unbind(0), _segments(dx, offsets_E1)):
        torch.mm(dy, w, out=out)
    return dx


def grouped_mm_dw_ref(dy_RN: Union[torch.Tensor, GateUp], x_RK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """dw[e] = dy_seg.T @ x_seg over segment e (zeros for an empty segment): the weight gradient.

    ``dy_RN`` may be a :class:`GateUp` (N = 2F): each half's products are written into its rows of
    dw, gate rows first (the same per-segment products as over the joined [R, 2F]).

    Returns:
        dw_ENK [E, N, K] in x's dtype.
    """
    if isinstance(dy_RN, GateUp):
        if _differentiable(*dy_RN, x_RK):
            return torch.cat([grouped_mm_dw_ref(half, x_RK, offsets_E1) for half in dy_RN], dim=1)
        half = dy_RN.gate.shape[1]
        dw = x_RK.new_empty(len(_bounds(offsets_E1)) - 1, 2 * half, x_RK.shape[1])
        _dw_loop(dy_RN.gate.t(), x_RK, offsets_E1, dw[:, :half])
        _dw_loop(dy_RN.up.t(), x_RK, offsets_E1, dw[:, half:])
        return dw
    dy_NR = dy_RN.t()
    if _differentiable(dy_RN, x_RK):
        return torch.stack(
            [torch.mm(dy, x) for dy, x in zip(_segments(dy_NR, offsets_E1, dim=1), _segments(x_RK, offsets_E1))]
        )
    if len(offsets_E1) == 2:  # one segment: one GEMM (no host read: a length)
        return torch.mm(dy_NR, x_RK).unsqueeze(0)
    if _one_launch(dy_NR, x_RK):
        return torch._grouped_mm(dy_NR, x_RK, offs=_ends(offsets_E1))  # (an empty segment gives zeros)
    return _dw_loop(dy_NR, x_RK, offsets_E1, x_RK.new_empty(len(offsets_E1) - 1, dy_RN.shape[1], x_RK.shape[1]))


def _dw_loop(dy_NR: torch.Tensor, x_RK: torch.Tensor, offsets_E1, dw_ENK: torch.Tensor) -> torch.Tensor:
    """dw[e] = dy_NR[:, segment e] @ x_RK[segment e] into ``dw_ENK`` (any [E, N, K] view with rows
    of unit stride), one ``mm`` per segment, as ``torch._grouped_mm`` runs them."""
    for dy, x, out in zip(_segments(dy_NR, offsets_E1, dim=1), _segments(x_RK, offsets_E1), dw_ENK.unbind(0)):
        torch.mm(dy, x, out=out)  # (an empty segment writes zeros)
    return dw_ENK


def segment_sum_ref(g_RN: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """s[e] = sum of the rows of segment e (zeros for an empty one), accumulated in float32: the
    gradient of a per-expert bias from its output's gradient.

    Returns:
        s_EN [E, N] in g's dtype.
    """
    g = g_RN.to(_acc(g_RN))
    return torch.stack([seg.sum(dim=0) for seg in _segments(g, offsets_E1)]).to(g_RN.dtype)


def swiglu_fwd_ref(
    gu_R2F: Union[torch.Tensor, GateUp],
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The experts' activation of the pre-activation gu, computed in float32.

    Args:
        gu_R2F: [R, 2F] pre-activation: gate columns first, or interleaved (gate 2j, up 2j + 1); or
            its halves as a :class:`GateUp`.
        activation: "swiglu": silu(gate) * up; "swiglu_oai" (GPT-OSS): with g = min(gate, limit)
            and u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g).
        interleaved: the column order of gu.
        alpha, limit: the "swiglu_oai" constants (ignored by "swiglu").

    Returns:
        h_RF [R, F] in gu's dtype.
    """
    _check_activation(activation)
    g, u = _halves(gu_R2F, interleaved)
    dtype = _dtype(gu_R2F)
    if activation == "swiglu":
        if _differentiable(*GateUp.tensors(gu_R2F)):
            return (F.silu(g) * u).to(dtype)
        return F.silu(g).mul_(u).to(dtype)  # (the product in silu's result: one [R, F] fewer)
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return ((u + 1) * (g * torch.sigmoid(alpha * g))).to(dtype)


def _dtype(gu) -> torch.dtype:
    return gu.gate.dtype if isinstance(gu, GateUp) else gu.dtype


def swiglu_bwd_ref(
    gu_R2F: Union[torch.Tensor, GateUp],
    grad_h_RF: torch.Tensor,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    out: Union[torch.Tensor, GateUp, None] = None,
    halves: bool = False,
    work: Union[torch.Tensor, GateUp, None] = None,
):
    """Gradient of :func:`swiglu_fwd_ref` with respect to gu (a [R, 2F] tensor, or its halves as a
    :class:`GateUp`), in gu's dtype and column order: one [R, 2F] tensor, or with ``halves`` (gate
    rows first only) a :class:`GateUp` of two contiguous [R, F] tensors, the same values.

    For "swiglu_oai" the clamps pass the gradient where torch.clamp's does (gate <= limit,
    -limit <= up <= limit: bounds included) and give zero elsewhere.

    ``out``: an optional buffer in gu's dtype for the result, [R, 2F] (a :class:`GateUp` of two
    [R, F] with ``halves``). For "swiglu" the two halves are computed in place (float32: in the
    result's halves; 16-bit: in the float32 copy of gu), the same elementwise ops as written out,
    so the same bits with no [R, F] temporaries.

    ``work``: for 16-bit gu and "swiglu" without autograd, a float32 buffer of gu's layout ([R, 2F],
    or a :class:`GateUp`) for that copy (reused memory: the layer's CPU path); else ignored.
    """
    _check_activation(activation)
    fast = activation == "swiglu" and not _differentiable(*GateUp.tensors(gu_R2F), grad_h_RF)
    g, u = _halves(gu_R2F, interleaved, work if fast else None)
    dtype = _dtype(gu_R2F)
    dh = grad_h_RF.to(g.dtype)
    halves = halves and not interleaved
    if fast:
        dgu = (
            out
            if out is not None
            else GateUp(*torch.empty((2,) + g.shape, dtype=dtype, device=g.device))
            if halves
            else torch.empty(gu_R2F.shape, dtype=dtype, device=g.device)
        )
        dg, du = dgu if halves else _split_gu(dgu, interleaved)
        # d silu(g) = sig (1 + g (1 - sig)): ATen's silu_backward, of dh * u; a product is
        # symmetric bit for bit, so each op below is the written-out formula's.
        if dtype == g.dtype:  # float32/64: the halves in place in the result's columns
            torch.ops.aten.silu_backward.grad_input(torch.mul(dh, u, out=dg), g, grad_input=dg)
            torch.ops.aten.silu.out(g, out=du).mul_(dh)
        else:  # 16-bit: in the float32 copy of gu (ours): dg in u's columns (u's last read is dh * u),
            # du in g's (after silu_backward's last read of g), each rounded into its own columns
            torch.ops.aten.silu_backward.grad_input(u.mul_(dh), g, grad_input=u)
            dg.copy_(u)
            du.copy_(torch.ops.aten.silu_(g).mul_(dh))
        return dgu
    if activation == "swiglu":  # (differentiated: out-of-place)
        dg = torch.ops.aten.silu_backward(dh * u, g)
        du = dh * F.silu(g)
    else:
        gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        sig = torch.sigmoid(alpha * gc)
        dg = torch.where(g <= limit, dh * (uc + 1) * sig * (1 + alpha * gc * (1 - sig)), 0.0)
        du = torch.where((u >= -limit) & (u <= limit), dh * gc * sig, 0.0)
    if halves:
        dgu = GateUp(dg.to(dtype), du.to(dtype))
        return dgu if out is None else GateUp(*(o.copy_(t) for o, t in zip(out, dgu)))
    dgu = _join_gu(dg, du, interleaved).to(dtype)
    return dgu if out is None else out.copy_(dgu)


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
    halves: bool = False,
):
    """The expert input projection with its activation: gu = grouped_mm(x, w, bias), h = act(gu).

    Args:
        x_RD: [R, D] rows grouped by local expert.
        w_E2FD: [E, 2F, D] weights (any strides); rows in gu's column order (``interleaved``).
        offsets_E1: integer [E + 1] segment bounds.
        bias_E2F: optional [E, 2F] bias, in the same order.
        activation, interleaved, alpha, limit: as in :func:`swiglu_fwd_ref`.
        halves: give gu as a :class:`GateUp`, gate and up each computed by its own grouped GEMM into
            a contiguous [R, F], so that the activation and its gradient run over contiguous memory
            (the layer's CPU path). Where F is a multiple of :data:`_VECTOR_STEP`, the dtype float32
            or 16-bit and autograd records nothing (else ignored, as with ``interleaved``): the same
            bits as the one [R, 2F] GEMM and the passes over its strided halves (see
            :data:`_VECTOR_STEP`).

    Returns:
        (h_RF, gu_R2F): the activation and the pre-activation kept for backward (a [R, 2F] tensor,
        or with ``halves`` its :class:`GateUp`).
    """
    act = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    half = w_E2FD.shape[1] // 2
    if (
        halves
        and not interleaved
        and x_RD.dtype in _GROUPED_DTYPES
        and half % _VECTOR_STEP == 0
        and not _differentiable(x_RD, w_E2FD, bias_E2F)
    ):
        b = (None, None) if bias_E2F is None else (bias_E2F[:, :half], bias_E2F[:, half:])
        gu = GateUp(
            grouped_mm_ref(x_RD, w_E2FD[:, :half], offsets_E1, b[0]),
            grouped_mm_ref(x_RD, w_E2FD[:, half:], offsets_E1, b[1]),
        )
    else:
        gu = grouped_mm_ref(x_RD, w_E2FD, offsets_E1, bias_E2F)
    return swiglu_fwd_ref(gu, **act), gu
