"""The GPU lane's steps and plans (bench.lane): what each step runs, on a GPU and in the CPU dry
run, under which cap, and with which grouped-GEMM configs pinned.

A plan is a list of steps in priority order, each with a fixed cap in seconds (the last takes what
is left). :func:`allot` turns a budget into the plan's caps: each step in order gets its cap out of
what the steps before it have not taken, so a short budget cuts the last steps first. At run time a
step may run until the sum of the caps up to it has passed since the lane started (:func:`deadlines`):
time an earlier step leaves over flows down to the next.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional

from bench.lane.configs import ROUTING_PINS

#: Seconds of the budget kept for the summary and the last archive.
SUMMARY_SECONDS = 10
#: A step with less than this left is not started.
MIN_STEP_SECONDS = 8
#: The host-sync test, run alone (P3) and left out of the runtime's tests (P4).
HOST_SYNC_TEST = "tests/comm/test_gpu_runtime.py::test_overlapped_cuda_steady_state_has_no_host_sync"
#: The runtime's GPU tests (P4): streams, events, the emulated link on CUDA, NCCL with one rank, the
#: accumulate and early-backward twins, the fused loss's host reads, chunked router logits, bench.host's
#: CUDA row. Every file outside tests/kernels with
#: a GPU test is here (tests/bench/test_gpu_lane.py checks).
RUNTIME_TESTS = (
    "tests/comm/test_gpu_runtime.py",
    "tests/comm/test_gpu_twins.py",
    "tests/schedule/test_accumulate.py",
    "tests/distributed/test_mesh_nccl.py",
    "tests/bench/test_host_bench.py",
)

# ------------------------------------------------------------------------------------------------
# Pinned grouped-GEMM configs (lancet_rt.kernels.grouped_gemm: LANCET_GEMM_CONFIG_<OP>)
# ------------------------------------------------------------------------------------------------
#: The variable that pins one op's config (lancet_rt.kernels._gemm_space.CONFIG_ENV + "_" + OP).
CONFIG_ENV = "LANCET_GEMM_CONFIG"
#: Per element type, each op's config as "rows,cols,reduction,num_warps,num_stages". bf16: the configs
#: bench.kernels.experts' autotuning chose on an NVIDIA H100 80GB HBM3 on 2026-11-24 (bench/results/experts.json:
#: D=4096, E=8, 4096 rows per expert, F in {2048, 14336}, balanced and skewed). fwd (down) and dx chose
#: 128,256,64,8,3 in all 8 rows each; gate_up 128,128,64,8,3 at F=2048 and the same with 4 stages at
#: F=14336 (the lane's widths are 768 to 14336, most under 4096); dW 128,256,64,8 with 3 stages in 4
#: rows and 4 in 4: 3, as fwd and dx, in less shared memory. A bf16 config cannot serve fp32 (its
#: 64-element reduction step in fp32 needs 288 KiB of shared memory at 3 stages, over the 227 KiB a
#: block gets), and no fp32 choice was recorded: fp32 takes the largest config that survives each op's
#: fp32 pruning (64 accumulator registers per thread, a 32-element reduction step).
GEMM_PINS = {
    "bf16": dict(fwd="128,256,64,8,3", dx="128,256,64,8,3", gate_up="128,128,64,8,3", dw="128,256,64,8,3"),
    "fp32": dict(fwd="128,128,32,8,3", dx="128,128,32,8,3", gate_up="64,64,32,4,3", dw="128,128,32,8,3"),
}


def pin_env(dtype: Optional[str]) -> dict:
    """The environment that pins every grouped-GEMM op's config for element type ``dtype`` ("bf16" or
    "fp32"; None: nothing pinned, the autotuner chooses) and the routing kernels' configs
    (:data:`bench.lane.configs.ROUTING_PINS`, one set for every dtype). The fp32 GEMM configs also run
    bf16 (correct, not tuned), so a step that may meet both takes them."""
    if dtype is None:
        return {}
    return {**{f"{CONFIG_ENV}_{op.upper()}": cfg for op, cfg in GEMM_PINS[dtype].items()}, **ROUTING_PINS}


# ------------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Context:
    """What a step's command is built from."""

    py: str  # the Python that runs the steps
    repo: Path  # the checkout (bench/ and tests/)
    work: Path  # where the steps write rows, logs and pictures (packed into the archive)
    dry: bool  # the CPU dry run: toy sizes, device cpu
    seconds: float = 0  # the step's allowance, less its stop margin (--max-seconds)

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a plan: ``argv(ctx)`` is its command; ``rows`` the JSON file it appends to (in the
    work directory), ``pins`` the element type whose grouped-GEMM configs its environment pins, with the
    routing kernels' (None: autotuned), ``stop_s`` the seconds of its allowance kept back for a graceful
    stop, ``env`` (name, value) pairs set in its environment (value None: unset)."""

    name: str
    label: str
    cap: Optional[float]  # None: what the budget has left
    what: str
    argv: Callable[[Context], list]
    rows: Optional[str] = None
    pins: Optional[str] = None
    stop_s: float = 0.0
    env: tuple = ()


def _pytest(ctx: Context, name: str, targets, timeout: int, *extra) -> list:
    # -v --tb=short: each outcome as it happens, so a step stopped at its cap still shows its failures;
    # --junitxml: the counts and the failures' text for the summary; --import-mode=append: tests/ is a
    # package, and prepending the repository would put its lancet_rt (kernels/ and autotune/ not mapped
    # in) ahead of the installed one. The per-test timeout fails a hung test instead of the step; by a
    # watchdog thread, which also ends a test blocked in C++ (a CUDA or NCCL wait), where the signal
    # method's handler would never run.
    return [
        ctx.py,
        "-m",
        "pytest",
        *(str(ctx.repo / t) for t in targets),
        "-m",
        "gpu",
        "-v",
        "--tb=short",
        "-rfE",
        "--durations=10",
        f"--timeout={timeout}",
        "--timeout-method=thread",
        "--import-mode=append",
        "-p",
        "no:cacheprovider",
        f"--junitxml={ctx.work / (name + '.xml')}",
        *extra,
    ]


def _preflight(ctx: Context) -> list:
    return [
        ctx.py,
        "-m",
        "bench.lane.preflight",
        "--device",
        ctx.device,
        *(["--quick"] if ctx.dry else []),
        "--json",
        str(ctx.work / "preflight.json"),
    ]


def _overlap(ctx: Context) -> list:
    w = ctx.work
    sizes = (
        [
            "--quick",
            "--layers",
            "1",
            "--d-model",
            "32",
            "--d-ffn",
            "64",
            "--experts",
            "8",
            "--batch",
            "4",
            "--seq",
            "16",
            "--steps",
            "2",
            "--microbatches",
            "2",
            "--accum-steps",
            "1",
        ]
        if ctx.dry
        else ["--microbatches", "4"]
    )  # CUDA sizes: 4 blocks, D=2048 F=4096 E=16 K=2 W=8, 16384 tokens, bf16
    return [
        ctx.py,
        "-m",
        "bench.overlap",
        "--device",
        ctx.device,
        *sizes,
        "--json",
        str(w / "overlap.json"),
        "--png",
        str(w / "overlap.png"),
        "--trace",
        str(w / "overlap-trace.json"),
        "--max-seconds",
        f"{ctx.seconds:.0f}",
    ]


def _overlap_one_queue(ctx: Context) -> list:
    """P1's single step again, its environment with CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue:
    the streams' kernels issue in one order, as Megatron-LM sets it), rows in their own file."""
    sizes = (
        [
            "--quick",
            "--layers",
            "1",
            "--d-model",
            "32",
            "--d-ffn",
            "64",
            "--experts",
            "8",
            "--batch",
            "4",
            "--seq",
            "16",
            "--steps",
            "2",
        ]
        if ctx.dry
        else []
    )
    return [
        ctx.py,
        "-m",
        "bench.overlap",
        "--device",
        ctx.device,
        *sizes,
        "--microbatches",
        "1",
        "--json",
        str(ctx.work / "overlap_conn1.json"),
        "--max-seconds",
        f"{ctx.seconds:.0f}",
    ]


def _configs(ctx: Context) -> list:
    size = ["--quick", "--tokens", "40"] if ctx.dry else ["--tokens", "4096"]
    return [
        ctx.py,
        "-m",
        "bench.lane.configs",
        "--device",
        ctx.device,
        *size,
        "--json",
        str(ctx.work / "routing_configs.json"),
    ]


#: bench.host's two shapes (2 layers each, W=8 emulated ranks, 4096 tokens, bf16 autocast, dropless):
#: Qwen3-30B-A3B-like (its D=2048, 128 experts of F=768, top-8, 32 heads: 16 local experts of about
#: 2048 rows each unchunked, small GEMMs where the host may set the pace) and Mixtral-8x7B-like (D=4096,
#: 8 experts of F=14336, top-2: one local expert of 8192 rows, GEMMs that keep the GPU busy).
HOST_SHAPES = {
    "host_fine": dict(experts=128, top_k=8, d_model=2048, d_ffn=768, heads=32),
    "host_mixtral": dict(experts=8, top_k=2, d_model=4096, d_ffn=14336, heads=32),
}
#: The same two at toy sizes (the dry run): fine-grained keeps more experts and a larger top-k.
_HOST_TOY = {
    "host_fine": dict(experts=8, top_k=4, d_model=32, d_ffn=16, heads=2),
    "host_mixtral": dict(experts=2, top_k=2, d_model=32, d_ffn=64, heads=2),
}


def _host(name: str) -> Callable[[Context], list]:
    def argv(ctx: Context) -> list:
        shape = (
            dict(_HOST_TOY[name], world_size=2, layers=1, batch=2, seq=8)
            if ctx.dry
            else dict(HOST_SHAPES[name], world_size=8, layers=2, batch=4, seq=1024)
        )
        flags = [x for k, v in shape.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        return [
            ctx.py,
            "-m",
            "bench.host",
            "--device",
            ctx.device,
            "--autocast",
            "bf16",
            *flags,
            "--chunks",
            "2" if ctx.dry else "2,4",
            "--reps",
            "2" if ctx.dry else "10",
            "--json",
            str(ctx.work / "host.json"),
        ]

    return argv


def _kernels(ctx: Context) -> list:
    size = ["--quick", "--tokens", "40"] if ctx.dry else ["--tokens", "16384"]  # (T=40: the gating rows alone)
    return [
        ctx.py,
        "-m",
        "bench.kernels",
        "--device",
        ctx.device,
        *size,
        "--no-compile",
        "--json",
        str(ctx.work / "kernels.json"),
        "--max-seconds",
        f"{ctx.seconds:.0f}",
    ]


def _experts(ctx: Context) -> list:
    return [
        ctx.py,
        "-m",
        "bench.kernels.experts",
        "--device",
        ctx.device,
        *(["--quick"] if ctx.dry else []),
        "--json",
        str(ctx.work / "experts.json"),
        "--max-seconds",
        f"{ctx.seconds:.0f}",
    ]


def _autotune(ctx: Context) -> list:
    import json

    path = ctx.work / "overlap.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    bw = rows[-1]["bandwidth_gbps"] if rows else 50.0
    sizes = (
        [
            "--d-model",
            "32",
            "--d-ffn",
            "64",
            "--experts",
            "8",
            "--tokens",
            "256",
            "--seq",
            "16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--candidates",
            "1,2",
            "--warmup",
            "1",
            "--reps",
            "1",
            "--dtype",
            "float32",
        ]
        if ctx.dry
        else [
            "--d-model",
            "2048",
            "--d-ffn",
            "4096",
            "--experts",
            "16",
            "--tokens",
            "16384",
            "--seq",
            "1024",
            "--layers",
            "4",
            "--heads",
            "16",
            "--dtype",
            "bfloat16",
        ]
    )
    return [
        ctx.py,
        "-m",
        "lancet_rt.autotune",
        "--device",
        ctx.device,
        "--link",
        "emulated",
        "--world-size",
        "8",
        "--bandwidth-gbps",
        f"{bw:.6g}",
        "--latency-us",
        "20",
        "--top-k",
        "2",
        "--capacity-factor",
        "1.25",
        *sizes,
        "--cache",
        str(ctx.work / "autotune-cache.json"),
        "--export-defaults",
        str(ctx.work / "defaults.json"),
        "--no-progress",
    ]


PREFLIGHT = Step(
    "preflight",
    "P0",
    40,
    "imports (greenlet too), device, copy and matmul ceilings (after the installs)",
    _preflight,
    rows="preflight.json",
)
#: The routing kernels tuned unpinned at the lane's shapes: which config each autotuner chose, beside the pin.
CONFIGS = Step(
    "configs",
    "P7",
    40,
    "the routing kernels' autotuned configs at the lane's shapes, beside the pins",
    _configs,
    rows="routing_configs.json",
)
#: CUDA_DEVICE_MAX_CONNECTIONS: the hardware queues CUDA gives the streams (the driver's default, 8,
#: when unset; Megatron-LM sets 1 for its communication overlap).
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
#: The default plan: the headline first (../shared/GPU.md).
PRIORITY = [
    PREFLIGHT,
    Step(
        "overlap",
        "P1",
        150,
        "bench.overlap on CUDA: the single step, then 4 microbatches if they fit",
        _overlap,
        rows="overlap.json",
        pins="bf16",
        stop_s=25,
        env=((MAX_CONNECTIONS, None),),
    ),
    Step(
        "host_fine",
        "P2",
        35,
        "bench.host, Qwen3-30B-A3B-like (E=128 F=768 top-8): host vs GPU us per layer-chunk",
        _host("host_fine"),
        rows="host.json",
        pins="bf16",
    ),
    Step(
        "host_mixtral",
        "P2",
        35,
        "bench.host, Mixtral-like (E=8 F=14336 top-2): host vs GPU us per layer-chunk",
        _host("host_mixtral"),
        rows="host.json",
        pins="bf16",
    ),
    Step(
        "hostsync",
        "P3",
        40,
        "the steady-state host-sync test, naming each sync's caller",
        lambda ctx: _pytest(ctx, "hostsync", [HOST_SYNC_TEST], 60),
        pins="fp32",
    ),
    Step(
        "runtime",
        "P4",
        90,
        "the runtime's GPU tests (streams, events, NCCL one rank, twins), 90 s each",
        lambda ctx: _pytest(ctx, "runtime", RUNTIME_TESTS, 90, "--deselect", HOST_SYNC_TEST),
        pins="fp32",
    ),
    Step(
        "overlap_conn1",
        "P5",
        60,
        "P1's single step with CUDA_DEVICE_MAX_CONNECTIONS=1 (overlap_conn1.json)",
        _overlap_one_queue,
        rows="overlap_conn1.json",
        pins="bf16",
        stop_s=15,
        env=((MAX_CONNECTIONS, "1"),),
    ),
    Step(
        "kernels",
        "P6",
        45,
        "bench.kernels at T=16384, no torch.compile baselines",
        _kernels,
        rows="kernels.json",
        stop_s=10,
    ),
    CONFIGS,
    Step(
        "kernel_tests",
        "P8",
        None,
        "the kernel tests (autotuned), with what is left",
        lambda ctx: _pytest(ctx, "kernel_tests", ["tests/kernels"], 90),
    ),
]
#: The steps about tuning (autotuned grouped GEMM, the chunk-count autotuner), for a later call.
TUNING = [
    PREFLIGHT,
    Step(
        "experts",
        "T1",
        240,
        "bench.kernels.experts: the grouped GEMM autotuned, balanced and skewed",
        _experts,
        rows="experts.json",
        stop_s=60,
    ),
    dataclasses.replace(CONFIGS, label="T2"),
    Step("autotune", "T3", None, "lancet-autotune on bench.overlap's block (exported as defaults)", _autotune),
]
PLANS = {"priority": PRIORITY, "tuning": TUNING}


def allot(plan: list, budget: float) -> list:
    """Each step's cap within ``budget`` seconds (less :data:`SUMMARY_SECONDS`), in plan order: a step
    gets its cap out of what the steps before it left, the last one (cap None) the rest."""
    left = max(0.0, budget - SUMMARY_SECONDS)
    caps = []
    for step in plan:
        cap = left if step.cap is None else min(step.cap, left)
        caps.append(cap)
        left -= cap
    return caps


def deadlines(caps: list) -> list:
    """Seconds after the lane's start by which each step must end: the running sum of the caps."""
    out, t = [], 0.0
    for cap in caps:
        t += cap
        out.append(t)
    return out
