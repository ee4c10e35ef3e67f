"""The CPU backend of the experts' kernels: the layer's CPU path (``lancet_rt.ops`` on CPU).

The same functions and results as the references in :mod:`lancet_rt.kernels.reference_experts` (the
contract; tests/kernels/test_cpu_backend.py holds this module to them, as the Triton kernels are), with
the short cuts that make eager PyTorch on a CPU cheap per chunk: one ``torch._grouped_mm`` for a grouped
GEMM where its alignment holds (it runs the same per-segment ``mm``); segment ends made once per chunk
(:class:`HostBounds`); 16-bit weights copied contiguous along the reduction (:func:`_along`); gate and
up as contiguous halves (:class:`GateUp`); results written into caller-owned memory (``out=``,
``work=``) that a :class:`Workspace` hands out from per-thread scratch buffers reused across steps.

Differentiated directly (autograd recording), each function runs its reference.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from . import reference_experts as ref
from .reference_experts import _acc, _bounds, _check_activation, _join_gu, _segments, _split_gu

#: The step, in float32 elements, of ATen's vectorized elementwise loops at their widest on x86 (two
#: 512-bit vectors, AVX-512; 16 on AVX2). Such a loop computes the elements of each step with the
#: vector form of the op and a shorter tail with its scalar form, and for silu and silu_backward the two
#: differ in the last bit. Over a half of [R, 2F] the loop runs per row (a tail per row, the same at
#: any R); over a contiguous [R, F] it runs over R * F elements (one tail, where R decides). With F a
#: multiple of this step every element takes the vector form in both: the same bits, at any R.
_VECTOR_STEP = 32


class GateUp(NamedTuple):
    """A pre-activation as its two halves, each a contiguous [R, F] tensor: what
    :func:`gate_up_swiglu` gives with ``halves=True``, and what :func:`swiglu_fwd` and
    :func:`swiglu_bwd` take in place of the [R, 2F] tensor.

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


def _differentiable(*tensors) -> bool:
    """Whether autograd records an op on ``tensors`` now (then the reference runs: ``out=`` records
    no autograd, and the short cuts are for the layer's backward formulas, not for autograd's)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def grouped_mm(
    x_RK: torch.Tensor, w_ENK: torch.Tensor, offsets_E1, bias_EN: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """:func:`~lancet_rt.kernels.reference_experts.grouped_mm_ref`: one ``torch._grouped_mm`` where it
    applies, one ``mm`` for one segment (as a dense FFN pays), else one ``mm`` per segment into the
    output's rows (no concatenation copy)."""
    if _differentiable(x_RK, w_ENK, bias_EN):
        return ref.grouped_mm_ref(x_RK, w_ENK, offsets_E1, bias_EN)
    if x_RK.stride(1) == 1:
        w_ENK = _along(w_ENK, 2)  # (16-bit CPU: reduced over K, contiguous in both operands)
    w_EKN = w_ENK.transpose(1, 2)
    if bias_EN is None and w_EKN.shape[0] == 1:  # one segment: the one GEMM _grouped_mm would run
        return torch.mm(x_RK, w_EKN[0])
    if bias_EN is None and _one_launch(x_RK, w_EKN):
        return torch._grouped_mm(x_RK, w_EKN, offs=_ends(offsets_E1))
    y = x_RK.new_empty(x_RK.shape[0], w_ENK.shape[1])
    pieces = zip(_segments(x_RK, offsets_E1), w_EKN.unbind(0), _segments(y, offsets_E1))
    if bias_EN is None:
        for x, w, out in pieces:
            torch.mm(x, w, out=out)
    else:
        for (x, w, out), b in zip(pieces, bias_EN.unbind(0)):
            torch.addmm(b, x, w, out=out)
    return y


def grouped_mm_dx(
    dy_RN: torch.Tensor,
    w_ENK: torch.Tensor,
    offsets_E1,
    *,
    out: Optional[torch.Tensor] = None,
    work: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`~lancet_rt.kernels.reference_experts.grouped_mm_dx_ref`, in the same ways as :func:`grouped_mm`.

    ``out``: an optional [R, K] buffer in dy's dtype, written row segment by row segment with the
    same per-segment ``mm`` that ``torch._grouped_mm`` runs on CPU (it takes no ``out``), so the
    caller can keep the buffer across steps instead of allocating the product each time.
    ``work``: where a 16-bit CPU weight copy goes (:func:`_along`), reused memory likewise.
    """
    if _differentiable(dy_RN, w_ENK):
        return ref.grouped_mm_dx_ref(dy_RN, w_ENK, offsets_E1)
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


def grouped_mm_dw(dy_RN: Union[torch.Tensor, GateUp], x_RK: torch.Tensor, offsets_E1) -> torch.Tensor:
    """:func:`~lancet_rt.kernels.reference_experts.grouped_mm_dw_ref`, in the same ways as :func:`grouped_mm`.

    ``dy_RN`` may be a :class:`GateUp` (N = 2F): each half's products are written into its rows of
    dw, gate rows first (the same per-segment products as over the joined [R, 2F]).
    """
    if isinstance(dy_RN, GateUp):
        if _differentiable(*dy_RN, x_RK):
            return torch.cat([ref.grouped_mm_dw_ref(half, x_RK, offsets_E1) for half in dy_RN], dim=1)
        half = dy_RN.gate.shape[1]
        dw = x_RK.new_empty(len(_bounds(offsets_E1)) - 1, 2 * half, x_RK.shape[1])
        _dw_loop(dy_RN.gate.t(), x_RK, offsets_E1, dw[:, :half])
        _dw_loop(dy_RN.up.t(), x_RK, offsets_E1, dw[:, half:])
        return dw
    if _differentiable(dy_RN, x_RK):
        return ref.grouped_mm_dw_ref(dy_RN, x_RK, offsets_E1)
    dy_NR = dy_RN.t()
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


def _dtype(gu) -> torch.dtype:
    return gu.gate.dtype if isinstance(gu, GateUp) else gu.dtype


def swiglu_fwd(
    gu_R2F: Union[torch.Tensor, GateUp],
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """:func:`~lancet_rt.kernels.reference_experts.swiglu_fwd_ref` of a [R, 2F] tensor or of its
    halves as a :class:`GateUp`; "swiglu" multiplies in silu's result (one [R, F] fewer)."""
    _check_activation(activation)
    g, u = _halves(gu_R2F, interleaved)
    if activation == "swiglu" and not _differentiable(*GateUp.tensors(gu_R2F)):
        return F.silu(g).mul_(u).to(_dtype(gu_R2F))
    return ref.gated_act(g, u, activation, alpha, limit).to(_dtype(gu_R2F))


def swiglu_bwd(
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
    """:func:`~lancet_rt.kernels.reference_experts.swiglu_bwd_ref` of a [R, 2F] tensor or of its halves
    as a :class:`GateUp`: one [R, 2F] tensor, or with ``halves`` (gate rows first only) a
    :class:`GateUp` of two contiguous [R, F] tensors, the same values.

    ``out``: an optional buffer in gu's dtype for the result, [R, 2F] (a :class:`GateUp` of two
    [R, F] with ``halves``). For "swiglu" the two halves are computed in place (float32: in the
    result's halves; 16-bit: in the float32 copy of gu), the same elementwise ops as written out,
    so the same bits with no [R, F] temporaries.

    ``work``: for 16-bit gu and "swiglu" without autograd, a float32 buffer of gu's layout ([R, 2F],
    or a :class:`GateUp`) for that copy (reused memory); else ignored.
    """
    _check_activation(activation)
    fast = activation == "swiglu" and not _differentiable(*GateUp.tensors(gu_R2F), grad_h_RF)
    g, u = _halves(gu_R2F, interleaved, work if fast else None)
    halves = halves and not interleaved
    if fast:
        return _silu_bwd_in_place(g, u, grad_h_RF.to(g.dtype), _dtype(gu_R2F), gu_R2F.shape, interleaved, out, halves)
    dg, du = ref.gated_act_grad(g, u, grad_h_RF.to(g.dtype), activation, alpha, limit)
    if halves:
        dgu = GateUp(dg.to(_dtype(gu_R2F)), du.to(_dtype(gu_R2F)))
        return dgu if out is None else GateUp(*(o.copy_(t) for o, t in zip(out, dgu)))
    dgu = _join_gu(dg, du, interleaved).to(_dtype(gu_R2F))
    return dgu if out is None else out.copy_(dgu)


def _silu_bwd_in_place(g, u, dh, dtype, shape, interleaved, out, halves):
    """ "swiglu"'s gradient of float32 (or float64) g and u (ours to overwrite when 16-bit: copies)."""
    if out is not None:
        dgu = out
    elif halves:
        dgu = GateUp(*torch.empty((2,) + g.shape, dtype=dtype, device=g.device))
    else:
        dgu = torch.empty(shape, dtype=dtype, device=g.device)
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


def gate_up_swiglu(
    x_RD: torch.Tensor,
    w_E2FD: torch.Tensor,
    offsets_E1,
    bias_E2F: Optional[torch.Tensor] = None,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    halves: bool = False,
):
    """:func:`~lancet_rt.kernels.reference_experts.gate_up_swiglu_ref`, returning (h_RF, gu_R2F).

    ``halves``: give gu as a :class:`GateUp`, gate and up each computed by its own grouped GEMM into
    a contiguous [R, F], so that the activation and its gradient run over contiguous memory. Where F
    is a multiple of :data:`_VECTOR_STEP`, the dtype float32 or 16-bit and autograd records nothing
    (else ignored, as with ``interleaved``): the same bits as the one [R, 2F] GEMM and the passes
    over its strided halves (see :data:`_VECTOR_STEP`).
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
            grouped_mm(x_RD, w_E2FD[:, :half], offsets_E1, b[0]),
            grouped_mm(x_RD, w_E2FD[:, half:], offsets_E1, b[1]),
        )
    else:
        gu = grouped_mm(x_RD, w_E2FD, offsets_E1, bias_E2F)
    return swiglu_fwd(gu, **act), gu


class Scratch(threading.local):
    """Memory a caller reuses from step to step for this backend's ``out=`` and ``work=``: one flat
    buffer per role, dtype and device, grown to the largest request seen; per thread.

    Allocated afresh each step, a backward's large temporaries were returned to the OS by glibc on
    free (above its mmap threshold) and faulted in again page by page, costing minor page faults and
    system time every step. Which tensors may live here is the caller's to decide: only one that dies
    before the caller's next request for the same role (docs/design.md, "No per-step allocation churn").
    """

    def __init__(self):
        self.buffers: dict = {}

    def take(self, role: str, shape: tuple, like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        n = math.prod(shape)
        dtype = dtype or like.dtype
        key = (role, dtype, like.device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self.buffers[key] = torch.empty(n, dtype=dtype, device=like.device)
        return buf[:n].view(shape)


_scratch = Scratch()


class Workspace:
    """The keyword arguments that put an experts' backward's temporaries in :class:`Scratch` memory
    (``out=``, ``work=``) and keep its SwiGLU gradient as halves (``halves=``), for this backend.

    :meth:`for_backward` gives the scratch-backed one where it pays, :data:`NO_WORKSPACE` (fresh
    tensors, every keyword empty) elsewhere: below :attr:`MIN_BYTES` of dgu the temporaries are at
    most a few hundred pages even when faulted in again (none under 128 KiB, glibc's initial mmap
    threshold), while the per-segment ``mm`` into a buffer costs ATen ops per chunk where
    ``torch._grouped_mm`` would run one (``python -m bench.host``).
    """

    MIN_BYTES = 1 << 20

    def __init__(self, like: Optional[torch.Tensor] = None, scratch: Optional[Scratch] = None):
        self.like, self.scratch = like, scratch
        # 16-bit: the weights' copies along the reduction and gu's float32 copy in scratch too
        self.low = like is not None and like.dtype in _HALF

    @classmethod
    def for_backward(cls, h_RF: torch.Tensor, gu_R2F) -> "Workspace":
        """The workspace of a backward whose activation is ``h_RF`` and pre-activation ``gu_R2F``."""
        R, F2 = gu_R2F.shape
        if h_RF.device.type != "cpu" or R * F2 * h_RF.element_size() < cls.MIN_BYTES:
            return NO_WORKSPACE
        return cls(h_RF, _scratch)

    def out(self, role: str, shape: tuple) -> dict:
        """``out=`` a [shape] buffer of the role, in h's dtype (none without scratch)."""
        return {} if self.scratch is None else dict(out=self.scratch.take(role, shape, self.like))

    def along(self, role: str, w: torch.Tensor) -> dict:
        """``work=`` for a 16-bit weight copy (:func:`_along`) of the role (none otherwise)."""
        return dict(work=self.scratch.take(role, (w.numel(),), w)) if self.low else {}

    def swiglu_bwd(self, gu_R2F, halves: bool, held: bool) -> dict:
        """The arguments of :func:`swiglu_bwd` past the activation's: ``halves`` (gu a :class:`GateUp`,
        gate rows first), ``out=`` unless the caller ``held`` dgu past its next request, ``work=`` for
        a 16-bit gu's float32 copy."""
        R, F2 = gu_R2F.shape
        kwargs = {} if held else self.out("dgu", (2, R, F2 // 2) if halves else (R, F2))
        if halves:
            kwargs = dict(halves=True, **{k: GateUp(*v) for k, v in kwargs.items()})
        if self.low:
            split = isinstance(gu_R2F, GateUp)
            work = self.scratch.take("gu32", (2, R, F2 // 2) if split else (R, F2), self.like, torch.float32)
            kwargs["work"] = GateUp(*work) if split else work
        return kwargs


#: No scratch: every keyword empty but ``halves``.
NO_WORKSPACE = Workspace()
