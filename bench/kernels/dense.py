"""Rows of ``python -m bench.kernels`` for the dense kernels: fused add + RMSNorm (forward and
backward) and the chunked linear cross-entropy.

add + RMSNorm: the Triton launcher (kernels.norm) against its reference eager and compiled
(kernels.reference_dense); bytes to move: forward reads x and the residual and writes y and the sum
(4 T D elements), backward reads dy, the sum's gradient and the sum and writes the gradient (4 T D);
GB/s against the copy ceiling measured in the same run.

Linear cross-entropy (``op=linear_ce``, D = 4096, V = 151936 by default): ``lancet_rt.dense.linear_cross_entropy``
(forward with both gradients) against the head matmul alone (``hidden @ W.T``, the floor) and against
transformers' head + float32 cross-entropy forward and backward (``x_eager`` = that time / ours); on
CUDA the peak memory each allocates beyond its inputs (``peak_MB``, ``eager_peak_MB``).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from bench.common import bench_ms


def cases(quick: bool, tokens: Optional[int] = None) -> List[dict]:
    if quick:
        norm, ce = [(64, 128)], [(64, 128, 1000)]
    else:
        norm, ce = [(T, 4096) for T in (4096, 16384, 65536)], [(T, 4096, 151936) for T in (4096, 16384)]
    rows = [dict(op=op, T=T, D=D) for (T, D) in norm for op in ("add_rmsnorm_fwd", "add_rmsnorm_bwd")]
    rows += [dict(op="linear_ce", T=T, D=D, V=V) for (T, D, V) in ce]
    return [r for r in rows if tokens is None or r["T"] == tokens]


def _peak_mb(fn, device) -> Optional[float]:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


def _norm_row(case, device, dtype, gen, timing, elem, compiled=True):
    from lancet_rt.kernels import norm
    from lancet_rt.kernels import reference_dense as ref

    T, D = case["T"], case["D"]
    x, r, dy, dsn = (torch.randn(T, D, device=device, generator=gen).to(dtype) for _ in range(4))
    w = torch.randn(D, device=device, generator=gen).to(dtype)
    if case["op"] == "add_rmsnorm_fwd":
        tri, eag = (lambda: norm.add_rmsnorm_fwd(x, r, w)), (lambda: ref.add_rmsnorm_fwd_ref(x, r, w))
        comp_fn = torch.compile(ref.add_rmsnorm_fwd_ref)
        comp = lambda: comp_fn(x, r, w)
    else:
        _, s, rstd = ref.add_rmsnorm_fwd_ref(x, r, w)
        tri = lambda: norm.add_rmsnorm_bwd(dy, dsn, s, rstd, w)
        eag = lambda: ref.add_rmsnorm_bwd_ref(dy, dsn, s, rstd, w)
        comp_fn = torch.compile(ref.add_rmsnorm_bwd_ref)
        comp = lambda: comp_fn(dy, dsn, s, rstd, w)
    got, want = tri()[0].float(), eag()[0].float()
    check = "ok" if (got - want).abs().max() <= 2e-2 * want.abs().max() else "MISMATCH"
    nbytes = 4 * T * D * elem
    row = dict(
        case,
        bytes=nbytes,
        MB=nbytes / 1e6,
        check=check,
        triton_ms=bench_ms(tri, device, **timing)["ms"],
        eager_ms=bench_ms(eag, device, **timing)["ms"],
    )
    row["compiled_ms"] = None
    try:
        if compiled:
            comp()
            row["compiled_ms"] = bench_ms(comp, device, **timing)["ms"]
    except Exception as e:  # a compile failure is a result
        row["compile_error"] = f"{type(e).__name__}"
    return row


def _ce_row(case, device, dtype, gen, timing, elem, compiled=True):
    from lancet_rt.dense import linear_cross_entropy

    T, D, V = case["T"], case["D"], case["V"]
    h = torch.randn(1, T, D, device=device, generator=gen).to(dtype).requires_grad_(True)
    w = (torch.randn(V, D, device=device, generator=gen) * 0.02).to(dtype).requires_grad_(True)
    labels = torch.randint(0, V, (1, T), device=device, generator=gen)

    def ours():
        return linear_cross_entropy(h, w, labels)

    def transformers_way():
        logits = (h @ w.t()).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        torch.autograd.grad(loss, (h, w))
        return loss

    def head_only():
        with torch.no_grad():
            return h @ w.t()

    a, b = ours().item(), transformers_way().item()
    row = dict(
        case,
        check="ok" if abs(a - b) <= 2e-2 * abs(b) else "MISMATCH",
        MB=None,
        triton_ms=bench_ms(ours, device, **timing)["ms"],
        eager_ms=bench_ms(transformers_way, device, **timing)["ms"],
        head_ms=bench_ms(head_only, device, **timing)["ms"],
        peak_MB=_peak_mb(ours, device),
        eager_peak_MB=_peak_mb(transformers_way, device),
        compiled_ms=None,
    )
    row["x_head"] = row["triton_ms"] / row["head_ms"]
    return row


def run_dense(
    device: torch.device,
    quick: bool,
    dtype: torch.dtype,
    meta: dict,
    copy_gbs: float,
    rows,
    budget,
    timing: dict,
    tokens: Optional[int] = None,
    compiled: bool = True,
) -> None:
    """Add the dense kernels' rows to ``rows`` (a RowLog); no case starts once ``budget`` is spent
    (``tokens``, ``compiled``: as in bench.kernels.run)."""
    gen = torch.Generator(device=device).manual_seed(0)
    elem = torch.finfo(dtype).bits // 8
    for case in cases(quick, tokens):
        if budget.spent():
            break
        try:
            make = _ce_row if case["op"] == "linear_ce" else _norm_row
            row = dict(
                meta, dtype=str(dtype).replace("torch.", ""), **make(case, device, dtype, gen, timing, elem, compiled)
            )
        except Exception as e:  # a kernel that fails to build or run is a result
            row = dict(meta, **case, check="error", error=f"{type(e).__name__}: {str(e)[:160]}")
            rows.add(row)
            print(f"  {case['op']:14s} T={case['T']}: {row['error']}", flush=True)
            continue
        if row.get("bytes"):
            row["triton_GBs"] = row["bytes"] / (row["triton_ms"] * 1e-3) / 1e9
            row["frac_copy"] = row["triton_GBs"] / copy_gbs
        row["x_eager"] = row["eager_ms"] / row["triton_ms"]
        if row.get("compiled_ms"):
            row["x_compiled"] = row["compiled_ms"] / row["triton_ms"]
        rows.add(row)
        print(
            f"  {case['op']:14s} T={case['T']:<6} D={case['D']}: {row['triton_ms']:.4g} ms, "
            f"{row['x_eager']:.3g}x eager, check {row['check']}",
            flush=True,
        )
