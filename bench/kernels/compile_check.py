"""Ahead-of-time compile check of every Triton kernel in kernels/ for Hopper (sm_90), without a GPU.

    python -m bench.kernels.compile_check [--all-configs] [--json PATH] [--jobs N]

The CPU lane runs the kernels in Triton's interpreter, which never lowers them, so a kernel that does
not compile for sm_90, spills registers or needs more shared memory than a block may have would
first show up on the GPU machine, whose Triton is older than CI's. This compiles each kernel the way
a launch would (the JIT's own argument specialization: dtypes, 16-byte alignment, unit strides as
constants) through the NVIDIA backend and the ptxas bundled with the Triton wheel, for
``GPUTarget("cuda", 90, 32)``, and reads registers and spills from ptxas' report and shared memory
from the kernel metadata. Nothing here needs CUDA or a driver.

Representative inputs: bf16 token rows, fp32 router logits and combine weights, int32 indices, the
grouped GEMM in bf16, fp16 and fp32 (exact fp32 on FMA units, the launchers' default, and TF32), sizes
divisible by 16 as at real model sizes (D = 4096). Which configs: for every autotuned kernel the
configs its pruning predicate keeps for those sizes (for the gating kernels per number of experts,
since BLOCK_E is a compile-time constant); for the fixed-config kernels the launcher's choice. The
expert kernels also come in variants (bias, interleaved gate/up, the "swiglu_oai" activation; "gpt_oss"
is GPT-OSS's combination, its weights the transposed views the experts pass). By default only the
first config of each kernel's first case and of the cases in ``_DEFAULT_VARIANTS`` (every GEMM dtype,
every variant constexpr value once); ``--all-configs`` compiles every config of every case.

The table has one row per compile: kernel, variant, config, registers per thread, spilled bytes
(stores/loads), shared memory per block against Hopper's 227 KiB, compile seconds and the error, if
any. The exit status is 1 when a compile fails or a block needs more shared memory than Hopper has.
``--json PATH`` writes the rows with the Triton and torch versions and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, List, Optional, Tuple

from bench.kernels.compile_cases import _SPECS, ARCH, SMEM_LIMIT, WARP_SIZE, Job, _modules, jobs


@dataclasses.dataclass
class Row:
    """One compile's result: registers per thread, spilled and stack bytes, shared memory per block."""

    kernel: str
    variant: str
    config: str
    fn: str = ""  # the @triton.jit function's name
    constexprs: Dict[str, object] = dataclasses.field(default_factory=dict)  # the launcher's, with the config's
    regs: Optional[int] = None
    spill_stores: Optional[int] = None
    spill_loads: Optional[int] = None
    stack: Optional[int] = None
    smem: Optional[int] = None
    num_warps: Optional[int] = None
    seconds: Optional[float] = None
    error: str = ""

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)

    @property
    def smem_over(self) -> bool:
        return self.smem is not None and self.smem > SMEM_LIMIT


# ------------------------------------------------------------------------------------------------
# Compilation
# ------------------------------------------------------------------------------------------------
_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _parse_ptxas(log: str, name: str) -> Tuple[Optional[int], Optional[int], Optional[int], Optional[int]]:
    """(registers, stack bytes, spill stores, spill loads) of entry function ``name`` in a ``ptxas -v`` log."""
    start = log.find(f"Compiling entry function '{name}'")
    part = log[start:] if start >= 0 else log
    regs, spills = _REGS.search(part), _SPILLS.search(part)
    return (
        int(regs.group(1)) if regs else None,
        *(tuple(int(g) for g in spills.groups()) if spills else (None, None, None)),
    )


def _compile_job(job: Job) -> Row:
    """Compile one job for sm_90 and measure it; a failure lands in ``Row.error``.

    The specialization and options come from the JIT's own binder and ``_pack_args`` (the same in
    Triton 3.6 and 3.9), so what is compiled is what a launch with these arguments would compile.
    ptxas runs with ``-v`` inside Triton, which prints its report when asked (dump_ptxas_log); the
    report is taken from stdout. A private cache directory forces a real compile and leaves the
    user's Triton cache alone; :func:`_init_worker` sets both up, in every process of :func:`run`.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    build = _SPECS[job.kernel][0]
    row = Row(job.kernel, job.variant, job.config)
    try:
        fn, args, const = build(job.case)
        row.fn = fn.fn.__name__
        row.constexprs = {**const, **dict(job.meta)}
        kwargs = {**const, **dict(job.meta), "debug": False}
        target = GPUTarget("cuda", ARCH, WARP_SIZE)
        backend = make_backend(target)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
        log = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
            )
        row.seconds = round(time.perf_counter() - start, 2)
        row.smem = kernel.metadata.shared
        row.num_warps = kernel.metadata.num_warps
        row.regs, row.stack, row.spill_stores, row.spill_loads = _parse_ptxas(log.getvalue(), kernel.metadata.name)
        if row.regs is None:
            row.error = "no ptxas report"
    except Exception as e:  # every failure is a finding, reported in the table
        first = str(e).strip().splitlines()
        row.error = f"{type(e).__name__}: {first[0] if first else ''}"[:300]
    return row


def toolchain_missing() -> Optional[str]:
    """Why this Triton cannot build for sm_90 here (no NVIDIA backend, no ptxas), or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        _ = get_ptxas(ARCH).path  # finds ptxas or raises
    except Exception as e:  # ImportError, RuntimeError("Cannot find ptxas"), ...
        return f"Triton has no NVIDIA backend with ptxas: {type(e).__name__}: {e}"
    return None


def _init_worker(cache_dir: str) -> None:
    import triton

    triton.knobs.cache.dir = cache_dir
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True


def run(job_list: List[Job], n_jobs: int = 1) -> List[Row]:
    """Compile ``job_list`` with ``n_jobs`` processes (forked after kernels/ is imported)."""
    _modules()
    with tempfile.TemporaryDirectory(prefix="lancet-compile-check-") as cache_dir:
        if n_jobs <= 1:
            import triton

            saved = (
                triton.knobs.cache.dir,
                triton.knobs.nvidia.dump_ptxas_log,
                triton.knobs.compilation.always_compile,
            )
            try:
                _init_worker(cache_dir)
                return [_compile_job(j) for j in job_list]
            finally:
                (
                    triton.knobs.cache.dir,
                    triton.knobs.nvidia.dump_ptxas_log,
                    triton.knobs.compilation.always_compile,
                ) = saved
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(n_jobs, mp_context=ctx, initializer=_init_worker, initargs=(cache_dir,)) as pool:
            return list(pool.map(_compile_job, job_list))


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
COLUMNS = ("kernel", "variant", "config", "regs", "spills", "smem", "secs", "error")


def _cells(row: Row) -> List[str]:
    spills = "" if row.spill_stores is None else f"{row.spill_stores}/{row.spill_loads}"
    smem = "" if row.smem is None else f"{row.smem}" + (" > 227 KiB!" if row.smem_over else "")
    return [
        row.kernel,
        row.variant,
        row.config,
        "" if row.regs is None else str(row.regs),
        spills,
        smem,
        "" if row.seconds is None else f"{row.seconds:.1f}",
        row.error,
    ]


def print_table(rows: List[Row]) -> None:
    cells = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    for i, c in enumerate(cells):
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def summary(rows: List[Row]) -> str:
    failed = [r for r in rows if r.error]
    spilled = [r for r in rows if r.spills]
    over = [r for r in rows if r.smem_over]
    lines = [
        f"{len(rows)} compiles for sm_{ARCH}: {len(failed)} failed, {len(spilled)} spill, "
        f"{len(over)} over the {SMEM_LIMIT // 1024} KiB shared-memory limit"
    ]
    for label, group in (("FAILED", failed), ("SPILLS", spilled), ("SMEM", over)):
        lines += [f"  {label}: {r.kernel} [{r.variant}] {r.config} {r.error or ''}".rstrip() for r in group]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--all-configs", action="store_true", help="every config of every pruned space")
    parser.add_argument("--json", metavar="PATH", help="write the rows (and versions, date) as JSON")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--kernel", action="append", choices=sorted(_SPECS), help="only this kernel (repeatable)")
    args = parser.parse_args(argv)

    os.environ["TRITON_INTERPRET"] = "0"  # before kernels/ is imported: see _modules
    import torch
    import triton

    job_list = jobs(args.all_configs, args.kernel)
    print(
        f"triton {triton.__version__}, torch {torch.__version__}: {len(job_list)} compiles for "
        f"GPUTarget('cuda', {ARCH}, {WARP_SIZE}) on {args.jobs} processes",
        flush=True,
    )
    start = time.perf_counter()
    rows = run(job_list, args.jobs)
    print_table(rows)
    print(summary(rows))
    print(f"wall {time.perf_counter() - start:.1f} s")
    if args.json:
        report = dict(
            triton=triton.__version__,
            torch=torch.__version__,
            target=f"cuda:{ARCH}",
            smem_limit=SMEM_LIMIT,
            all_configs=args.all_configs,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            rows=[dataclasses.asdict(r) for r in rows],
        )
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(r.error or r.smem_over for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
