"""Routing kernel microbenchmarks: gating, permute and unpermute, forward and backward; then the
dense kernels' rows (add + RMSNorm, the chunked linear cross-entropy: bench/kernels/dense.py).

    python -m bench.kernels [--json [PATH]] [--quick] [--device cuda|cpu]

For every op and shape it times the Triton launcher (kernels.gating / kernels.permute), its PyTorch
reference in eager mode and the same reference under ``torch.compile`` (kernels.reference, the
single source of the baseline), with :func:`bench.common.bench_ms` (median of
``triton.testing.do_bench`` on CUDA). It reports the milliseconds, the bandwidth for the bytes each
op must move (formulas in :func:`op_bytes`), that bandwidth as a fraction of the device copy
bandwidth measured in the same run, and the speedups over eager and compiled. A compile failure is
recorded in the row (``compile_error``) and the run goes on. Each row also says whether the Triton
result matched the eager reference (``check``), so a fast wrong kernel cannot pass unnoticed.

Default sizes: D = 4096, bf16 rows, T in {4096, 16384, 65536}; gating for E in {8, 64, 256} x
K in {1, 2, 8} (9 x 3 shapes); permute/unpermute depend on T, K and D (E only shapes the random
row pattern), so they run E = 64 for every (T, K) plus E in {8, 256} at T = 16384, K = 8. Routing
is dropless for the permute family (S = T * K, the most bytes); gating uses capacity factor 1.25.

``--quick`` runs tiny sizes (on CPU under TRITON_INTERPRET=1, a minute) to check the command;
rows are printed, and written only where ``--json`` says (default path bench/results/kernels.json).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Dict, List, Optional

import torch

from bench.common import RowLog, TimeBudget, bench_ms, copy_bandwidth_gbs, print_table, run_metadata

DEFAULT_JSON = os.path.join("bench", "results", "kernels.json")
OPS = ("gating_fwd", "gating_bwd", "permute_fwd", "permute_bwd", "unpermute_fwd", "unpermute_bwd")
GATING_OPS = OPS[:2]
CAPACITY_FACTOR = 1.25
TARGET_T = 16384
COLUMNS = [
    "op",
    "T",
    "E",
    "K",
    "D",
    "S",
    "MB",
    "triton_ms",
    "eager_ms",
    "compiled_ms",
    "triton_GBs",
    "frac_copy",
    "x_eager",
    "x_compiled",
    "check",
    "compile_error",
    "error",
    "V",
    "head_ms",
    "x_head",
    "peak_MB",
    "eager_peak_MB",
]  # (the last: op=linear_ce rows)


def cases(quick: bool, tokens: Optional[int] = None) -> List[dict]:
    """The benchmark shapes: dicts with op, T, E, K and D (None for the gating ops); ``tokens``: only
    those at T = tokens."""
    if quick:
        gating = [(64, 8, 2), (40, 64, 8)]
        permute = [(64, 8, 2, 128)]
    else:
        gating = [(T, E, K) for T in (4096, 16384, 65536) for E in (8, 64, 256) for K in (1, 2, 8)]
        permute = [(T, 64, K, 4096) for T in (4096, 16384, 65536) for K in (1, 2, 8)]
        permute += [(16384, E, 8, 4096) for E in (8, 256)]
    rows = [dict(op=op, T=T, E=E, K=K, D=None) for (T, E, K) in gating for op in GATING_OPS]
    rows += [dict(op=op, T=T, E=E, K=K, D=D) for (T, E, K, D) in permute for op in OPS[2:]]
    if tokens is not None:
        rows = [r for r in rows if r["T"] == tokens]
    # The targets are at T = 16384: measure those first, so a run stopped by --max-seconds
    # still has them (a stable sort keeps the order within each group).
    return sorted(rows, key=lambda r: r["T"] != TARGET_T)


def op_bytes(op: str, T: int, E: int, K: int, D: Optional[int], S: int, elem: int) -> int:
    """The bytes an op must move (read + write), the floor its bandwidth is measured against.

    Logits, weights and their gradients are float32, indices int32, rows ``elem`` bytes. Terms of
    O(E) (counters, statistics) are left out.
    """
    N = T * K
    if op == "gating_fwd":  # logits in; expert, weight, slot out
        return T * E * 4 + N * (4 + 4 + 4)
    if op == "gating_bwd":  # logits in, grad logits out; expert and grad weight in
        return T * E * 4 * 2 + N * (4 + 4)
    if op == "permute_fwd":  # x in (once), x_SD out, row in, src out
        return T * D * elem + S * D * elem + N * 4 + S * 4
    if op == "permute_bwd":  # grad_x_SD in, grad_x_TD out, row in
        return S * D * elem + T * D * elem + N * 4
    if op == "unpermute_fwd":  # y_SD in, y_TD out, row and weight in
        return S * D * elem + T * D * elem + N * (4 + 4)
    if op == "unpermute_bwd":  # grad_y_TD and y_SD in, grad_y_SD out; row, weight in, grad weight out
        return T * D * elem + 2 * S * D * elem + N * (4 + 4 + 4)
    raise ValueError(op)


def _matches(got, want) -> bool:
    """Integers exactly; floats to a relative max error of 2e-2 (bf16 rows) of the reference scale."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for a, b in zip(got, want):
        if not a.dtype.is_floating_point:
            if not torch.equal(a, b):
                return False
        elif a.numel():
            scale = b.float().abs().max().clamp_min(1e-6)
            if not bool(((a.float() - b.float()).abs().max() / scale) <= 2e-2):
                return False
    return True


def _logits(T: int, E: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Router-like logits with no near-ties: a row's values are distinct ranks 0.05 apart plus
    jitter and a per-token shift. Top-k is discontinuous, and an exp that differs from PyTorch's in
    the last bit could otherwise swap two near-equal experts and fail the exact integer check."""
    step = 0.05 * min(1.0, 64 / E)
    ranks = torch.argsort(torch.rand(T, E, generator=gen, device=device), dim=1).float()
    jitter = torch.rand(T, E, generator=gen, device=device) * 0.4
    return torch.randn(T, 1, generator=gen, device=device) + (ranks + jitter) * step


def _inputs(case: dict, device: torch.device, dtype: torch.dtype, gen: torch.Generator):
    """The (triton, reference) callables' arguments for one row, built outside the timed region."""
    from lancet_rt.kernels.reference import dispatch_rows_ref, gating_fwd_ref, permute_fwd_ref

    op, T, E, K, D = case["op"], case["T"], case["E"], case["K"], case["D"]
    randn = lambda *s, dt=torch.float32: torch.randn(*s, generator=gen, device=device).to(dt)
    logits = _logits(T, E, device, gen)
    if op == "gating_fwd":
        cap = math.ceil(CAPACITY_FACTOR * T * K / E)
        used = torch.zeros(E, dtype=torch.int32, device=device)
        return (logits, K, used), dict(capacity=cap), T * K
    g = gating_fwd_ref(logits, K)
    if op == "gating_bwd":
        return (logits, g.expert_TK, randn(T, K), randn(E), randn(())), {}, T * K
    row_TK = dispatch_rows_ref(g.expert_TK, g.slot_TK, torch.zeros(E, dtype=torch.int32, device=device), g.counts_E)
    S = T * K
    if op == "permute_fwd":
        return (randn(T, D, dt=dtype), row_TK, S), {}, S
    rows_SD = randn(S, D, dt=dtype)
    if op == "permute_bwd":
        return (rows_SD, row_TK), {}, S
    if op == "unpermute_fwd":
        return (rows_SD, row_TK, g.weight_TK), {}, S
    _, src_S = permute_fwd_ref(randn(T, 1), row_TK, S)
    return (randn(T, D, dt=dtype), rows_SD, row_TK, g.weight_TK, src_S), {}, S


def _short_error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def run(
    device: torch.device,
    quick: bool,
    dtype: torch.dtype = torch.bfloat16,
    *,
    json_path=None,
    max_seconds: Optional[float] = None,
    tokens: Optional[int] = None,
    compiled: bool = True,
) -> List[dict]:
    """Measure every case (``tokens``: those at T = tokens; ``compiled`` False: no torch.compile
    baselines, ``compiled_ms`` None); rows go to ``json_path`` as they are made; no case starts after
    ``max_seconds``."""
    from lancet_rt.kernels import gating, permute, reference

    triton_fns: Dict[str, Callable] = {
        "gating_fwd": gating.gating_fwd,
        "gating_bwd": gating.gating_bwd,
        "permute_fwd": permute.permute_fwd,
        "permute_bwd": permute.permute_bwd,
        "unpermute_fwd": permute.unpermute_fwd,
        "unpermute_bwd": permute.unpermute_bwd,
    }
    ref_fns = {op: getattr(reference, f"{op}_ref") for op in OPS}
    compiled_fns = {op: torch.compile(fn) for op, fn in ref_fns.items()}  # one cache per op, across shapes
    timing = dict(warmup=1, rep=3) if quick and device.type == "cpu" else {}

    copy_gbs = copy_bandwidth_gbs(device)
    meta = run_metadata(device, copy_gbs=copy_gbs)
    gen = torch.Generator(device=device).manual_seed(0)
    elem = torch.finfo(dtype).bits // 8
    rows, budget, todo = RowLog(json_path), TimeBudget(max_seconds), cases(quick, tokens)
    for case in todo:
        if budget.spent():
            print(
                f"  --max-seconds {max_seconds} spent: {len(todo) - len(rows)} of {len(todo)} cases not run", flush=True
            )
            break
        op = case["op"]
        args, kwargs, S = _inputs(case, device, dtype, gen)
        nbytes = op_bytes(op, case["T"], case["E"], case["K"], case["D"], S, elem)
        data_dtype = torch.float32 if op in GATING_OPS else dtype  # gating moves fp32 logits
        row = dict(meta, **case, S=S, dtype=str(data_dtype).replace("torch.", ""), bytes=nbytes, MB=nbytes / 1e6)

        tri = lambda: triton_fns[op](*args, **kwargs)
        ref = lambda: ref_fns[op](*args, **kwargs)
        try:
            row["check"] = "ok" if _matches(tri(), ref()) else "MISMATCH"  # also compiles / tunes
            row["triton_ms"] = bench_ms(tri, device, **timing)["ms"]
        except Exception as e:  # a kernel that fails to build or run is a result
            row.update(check="error", error=_short_error(e))
            rows.add(row)
            print(f"  {op:14s} T={case['T']:<6} E={case['E']:<4} K={case['K']:<2}: {row['error']}", flush=True)
            continue
        row["eager_ms"] = bench_ms(ref, device, **timing)["ms"]
        row["compiled_ms"] = None
        try:
            if compiled:
                comp = lambda: compiled_fns[op](*args, **kwargs)
                comp()
                row["compiled_ms"] = bench_ms(comp, device, **timing)["ms"]
        except Exception as e:  # any compile failure is a result, not a crash
            row["compile_error"] = _short_error(e)

        row["triton_GBs"] = nbytes / (row["triton_ms"] * 1e-3) / 1e9
        row["eager_GBs"] = nbytes / (row["eager_ms"] * 1e-3) / 1e9
        row["frac_copy"] = row["triton_GBs"] / copy_gbs
        row["x_eager"] = row["eager_ms"] / row["triton_ms"]
        row["x_compiled"] = None if row["compiled_ms"] is None else row["compiled_ms"] / row["triton_ms"]
        rows.add(row)
        print(
            f"  {op:14s} T={case['T']:<6} E={case['E']:<4} K={case['K']:<2} D={case['D']}: "
            f"{row['triton_ms']:.4g} ms, {row['x_eager']:.3g}x eager, check {row['check']}",
            flush=True,
        )
        args = kwargs = None  # freed before the next case's inputs are made (the lambdas hold them)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    from bench.kernels.dense import run_dense  # the dense kernels' rows (add + RMSNorm, linear CE)

    run_dense(device, quick, dtype, meta, copy_gbs, rows, budget, timing, tokens=tokens, compiled=compiled)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json",
        nargs="?",
        const=DEFAULT_JSON,
        default=None,
        metavar="PATH",
        help=f"append the rows to PATH (default {DEFAULT_JSON}); without it nothing is written",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the command (CPU: a minute)")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no new case after this many seconds (the T=16384 targets run first)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        metavar="T",
        help="only the cases at T tokens (one size; the targets are at 16384)",
    )
    parser.add_argument(
        "--no-compile",
        dest="compiled",
        action="store_false",
        help="leave out the torch.compile baselines (compiled_ms None): the slowest part of a cold run",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="default: cuda when available, else cpu (Triton interpreter)",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if device.type == "cpu":
        if "lancet_rt.kernels.gating" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu needs TRITON_INTERPRET=1 before kernels/ is imported")
        os.environ["TRITON_INTERPRET"] = "1"  # read by Triton when kernels/ is imported (in run)
    try:
        import torch._dynamo as dynamo

        # One compiled function serves many shapes and K values: allow the recompiles.
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
    except ImportError:
        pass

    if not cases(args.quick, args.tokens):
        parser.error(
            f"--tokens {args.tokens}: no case at that size (T of {sorted({c['T'] for c in cases(args.quick)})})"
        )
    rows = run(
        device,
        args.quick,
        json_path=args.json,
        max_seconds=args.max_seconds,
        tokens=args.tokens,
        compiled=args.compiled,
    )
    if not rows:
        return 1
    print_table(
        rows,
        COLUMNS,
        title=f"\nrouting kernels on {rows[0]['device']} "
        f"(copy {rows[0]['copy_gbs']:.4g} GB/s; GB/s = bytes to move / time)",
    )
    if args.json:
        print(f"appended {len(rows)} rows to {args.json}")
    return 0
