"""Expert GEMMs: the Triton grouped GEMM vs a loop of torch matmuls vs one dense cuBLAS GEMM.

    python -m bench.kernels.experts [--json PATH] [--quick] [--device cuda|cpu] [--gpt-oss]

For each projection of a SwiGLU expert layer (forward: gate_up + SwiGLU, down; backward: dx and dW of
both) it times three ways to do the same FLOPs:

* ``triton``: one launch of :mod:`kernels.grouped_gemm` over all local experts;
* ``loop``: the references in :mod:`kernels.reference` (a Python loop of per-expert torch matmuls,
  with the host sync that reading the offsets costs): what a plain implementation does;
* ``dense``: one cuBLAS GEMM of the same shape with all R rows in one expert: the ceiling a grouped
  GEMM can approach (no per-expert tails, no launch per expert).

at balanced routing (E_local = 8, 4096 rows per expert, D = 4096, F in {14336, 2048}) and skewed,
Zipf-like routing with the same rows (half in one expert, then 1/4, 1/8, ..., three experts empty),
in bf16. Reported: TFLOP/s, the fraction of the dense GEMM and of the dense matmul rate measured at
the start of the same run (bench.common.matmul_tflops), and the speedup over the loop. Rows are
appended to ``--json`` with the run metadata. ``--quick`` uses tiny sizes (on the CPU the kernels run
in the Triton interpreter, so its numbers only show that the command works). ``--gpt-oss`` adds the
projections whose kernels differ in GPT-OSS's layout (``layout="gpt_oss"`` rows): gate_up with the
interleaved transposed weight, bias and "swiglu_oai"; down with bias through the transposed weight;
dx and dW of gate_up through that layout (dW written as the [E, D, 2F] parameter); the bias gradients
are memory-bound segment sums, not timed here.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

from bench.common import RowLog, TimeBudget, bench_ms, matmul_tflops, print_table, run_metadata

FULL = dict(E=8, rows_per_expert=4096, D=4096, F=(14336, 2048))
QUICK = dict(E=4, rows_per_expert=16, D=64, F=(64, 32))


def skewed_counts(E: int, R: int) -> list:
    """Zipf-like: expert i gets R / 2^(i+1) rows for the first E // 2 + 1 experts (the last of them
    takes the remainder), the others none. E = 8: [R/2, R/4, R/8, R/16, R/16, 0, 0, 0]."""
    busy = min(E, E // 2 + 1)
    counts = [R >> (i + 1) for i in range(busy - 1)]
    counts.append(R - sum(counts))
    return counts + [0] * (E - busy)


def _case(gg, ref, op: str, kernel: str, flops: int, fn: str, args: tuple, dense, **kw) -> tuple:
    """One row of the case table: ``gg.<fn>`` (the Triton kernel), ``ref.<fn>_ref`` (the loop of matmuls) on
    the same inputs, and the dense ceiling ``dense``."""
    return (
        op,
        kernel,
        flops,
        lambda: getattr(gg, fn)(*args, **kw),
        lambda: getattr(ref, f"{fn}_ref")(*args, **kw),
        dense,
    )


def _cases(E: int, D: int, F: int, counts: list, device: torch.device, dtype=torch.bfloat16, gpt_oss=False):
    """Inputs for every projection (built outside the timed region) and the three ways to run each;
    with ``gpt_oss`` also GPT-OSS's variants (module docstring).

    Returns a list of (op, kernel name for selected_config, flops, triton_fn, loop_fn, dense_fn, layout).
    """
    from lancet_rt.kernels import grouped_gemm as gg
    from lancet_rt.kernels import reference as ref

    R = sum(counts)
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    off = torch.zeros(E + 1, dtype=torch.int32)
    off[1:] = torch.cumsum(torch.tensor(counts), 0)
    off = off.to(device)
    x, h = randn(R, D), randn(R, F)
    w_gu, w_down = randn(E, 2 * F, D, scale=D**-0.5), randn(E, D, F, scale=F**-0.5)
    dgu, dy = randn(R, 2 * F), randn(R, D)
    wd_gu, wd_down = w_gu[0], w_down[0]  # the dense ceilings' weights: one expert's shape
    gu, dn = 2 * R * 2 * F * D, 2 * R * D * F  # the flops of a gate_up and of a down projection
    case = functools.partial(_case, gg, ref)
    cases = [  # op, kernel, flops, function, its inputs, the dense ceiling
        case("fwd gate_up+swiglu", "gate_up", gu, "gate_up_swiglu", (x, w_gu, off), lambda: x @ wd_gu.t()),
        case("fwd down", "fwd", dn, "grouped_mm", (h, w_down, off), lambda: h @ wd_down.t()),
        case("bwd dx gate_up", "dx", gu, "grouped_mm_dx", (dgu, w_gu, off), lambda: dgu @ wd_gu),
        case("bwd dw gate_up", "dw", gu, "grouped_mm_dw", (dgu, x, off), lambda: dgu.t() @ x),
        case("bwd dx down", "dx", dn, "grouped_mm_dx", (dy, w_down, off), lambda: dy @ wd_down),
        case("bwd dw down", "dw", dn, "grouped_mm_dw", (dy, h, off), lambda: dy.t() @ h),
    ]
    cases = [c + ("lancet",) for c in cases]
    if not gpt_oss:
        return cases
    # GPT-OSS: gate_up_proj [E, D, 2F] (gate/up interleaved) and down_proj [E, F, D], as the experts pass them.
    p_gu, p_down = randn(E, D, 2 * F, scale=4 * D**-0.5), randn(E, F, D, scale=F**-0.5)
    v_gu, v_down = p_gu.transpose(1, 2), p_down.transpose(1, 2)
    b_gu, b_down = randn(E, 2 * F), randn(E, D)
    act = dict(activation="swiglu_oai", interleaved=True)
    oss = [
        case(
            "fwd gate_up+swiglu_oai", "gate_up", gu, "gate_up_swiglu", (x, v_gu, off, b_gu), lambda: x @ p_gu[0], **act
        ),
        case("fwd down+bias", "fwd", dn, "grouped_mm", (h, v_down, off, b_down), lambda: h @ p_down[0]),
        case("bwd dx gate_up", "dx", gu, "grouped_mm_dx", (dgu, v_gu, off), lambda: dgu @ p_gu[0].t()),
        case("bwd dw gate_up", "dw", gu, "grouped_mm_dw", (x, dgu, off), lambda: x.t() @ dgu),
    ]
    return cases + [c + ("gpt_oss",) for c in oss]


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The grouped GEMM against the loop of matmuls: relative max error within 2e-2 of the output's
    scale (bf16 inputs, fp32 accumulation on both sides), so a fast wrong kernel cannot pass."""
    if isinstance(got, tuple):
        return all(_matches(a, b) for a, b in zip(got, want))
    scale = want.float().abs().max().clamp_min(1e-6)
    return bool(((got.float() - want.float()).abs().max() / scale) <= 2e-2)


def run(device: torch.device, quick: bool, *, json_path=None, max_seconds=None, gpt_oss=False) -> list:
    """Measure every (F, routing, projection); rows go to ``json_path`` as they are made; nothing new
    starts after ``max_seconds``. ``gpt_oss`` adds GPT-OSS's projections (module docstring)."""
    from lancet_rt.kernels import grouped_gemm as gg

    sizes = QUICK if quick else FULL
    timing = dict(warmup=0, rep=3) if device.type != "cuda" else {}  # warmed up below
    peak = matmul_tflops(device)
    meta = run_metadata(device, matmul_tflops=peak)
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  commit {meta['commit']}")
    print(f"# dense matmul ceiling: {peak:.1f} TFLOP/s")

    E, D = sizes["E"], sizes["D"]
    R = E * sizes["rows_per_expert"]
    routings = {"balanced": [sizes["rows_per_expert"]] * E, "skewed": skewed_counts(E, R)}
    rows, budget = RowLog(json_path), TimeBudget(max_seconds)
    for F in sizes["F"]:
        for routing, counts in routings.items():
            if budget.spent():
                print(f"# --max-seconds {max_seconds} spent: F={F} {routing} not run", flush=True)
                continue
            for op, kernel, flops, triton_fn, loop_fn, dense_fn, layout in _cases(
                E, D, F, counts, device, gpt_oss=gpt_oss
            ):
                base = dict(
                    meta,
                    bench="experts",
                    op=op,
                    layout=layout,
                    routing=routing,
                    dtype="bfloat16",
                    E=E,
                    R=R,
                    D=D,
                    F=F,
                    counts=counts,
                    flops=flops,
                )
                try:  # warm-up (autotuning and compilation) and the correctness check
                    check = "ok" if _matches(triton_fn(), loop_fn()) else "MISMATCH"
                    dense_fn()
                    t = {
                        name: bench_ms(fn, device, **timing)
                        for name, fn in (("triton", triton_fn), ("loop", loop_fn), ("dense", dense_fn))
                    }
                except Exception as e:  # a kernel that fails to build or run is a result
                    rows.add(dict(base, check="error", error=f"{type(e).__name__}: {str(e).strip()[:160]}"))
                    print(f"# {op} {routing} F={F}: {rows[-1]['error']}", flush=True)
                    continue
                tf = {name: flops / (v["ms"] * 1e-3) / 1e12 for name, v in t.items()}
                rows.add(
                    dict(
                        base,
                        check=check,
                        config=gg.selected_config(kernel),
                        triton_ms=t["triton"]["ms"],
                        triton_ms_q20=t["triton"]["ms_q20"],
                        triton_ms_q80=t["triton"]["ms_q80"],
                        loop_ms=t["loop"]["ms"],
                        dense_ms=t["dense"]["ms"],
                        triton_tflops=tf["triton"],
                        loop_tflops=tf["loop"],
                        dense_tflops=tf["dense"],
                        frac_dense=tf["triton"] / tf["dense"],
                        frac_peak=tf["triton"] / peak,
                        speedup_vs_loop=t["loop"]["ms"] / t["triton"]["ms"],
                    )
                )
                print(
                    f"# {op:22s} {layout:7s} {routing:8s} F={F}: {tf['triton']:.1f} TFLOP/s, "
                    f"{rows[-1]['frac_dense']:.2f} of "
                    f"dense, {rows[-1]['speedup_vs_loop']:.2f}x loop, check {check}",
                    flush=True,
                )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels.experts", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="append the rows to this JSON list")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check that the command works")
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="start no new (F, routing) group after this many seconds"
    )
    parser.add_argument(
        "--gpt-oss",
        action="store_true",
        help="add GPT-OSS's projections (interleaved transposed weights, biases, swiglu_oai)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if device.type == "cpu":
        if "lancet_rt.kernels.grouped_gemm" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu needs TRITON_INTERPRET=1 before kernels.grouped_gemm is imported")
        # Triton reads this when the kernels are defined, i.e. at the import inside run().
        os.environ["TRITON_INTERPRET"] = "1"
        if not args.quick:
            print("# note: full sizes in the CPU interpreter take hours; use --quick", file=sys.stderr)

    rows = run(device, args.quick, json_path=args.json, max_seconds=args.max_seconds, gpt_oss=args.gpt_oss)
    if not rows:
        return 1
    print_table(
        rows,
        [
            "op",
            "layout",
            "routing",
            "F",
            "config",
            "triton_ms",
            "loop_ms",
            "dense_ms",
            "triton_tflops",
            "dense_tflops",
            "frac_dense",
            "frac_peak",
            "speedup_vs_loop",
            "check",
        ],
        title=f"\nexpert GEMMs, bf16, E={rows[0]['E']} R={rows[0]['R']} D={rows[0]['D']}",
    )
    if args.json:
        print(f"# appended {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
