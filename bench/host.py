"""What chunking costs the host: per layer and per extra chunk, forward and backward.

For the blocks model on an emulated expert-parallel link (an infinitely fast one: only the host's
and the compute's own work is left), a training step is run unchunked and under
``lancet_rt.Overlapped(chunks=N)``, and each phase is counted:

* ATen ops (a ``TorchDispatchMode`` sees every op the step dispatches, views included; ``aten::detach``
  from a profiled run of the same step with no mode, as the mode makes autograd dispatch detaches of
  its own: :meth:`Step._detaches`);
* host reads of tensor values (``aten._local_scalar_dense``: ``.item()``, ``.tolist()``, ``int(t)``;
  on a GPU each read of a device tensor is a host sync);
* Triton launches (on the kernel path: ``LANCET_KERNELS=triton``, on CPU with ``TRITON_INTERPRET=1``),
  and on CUDA ``launch_us``: a launch's own host cost, the mean host time inside Triton's launcher
  over the counted step (its kernels compiled and cached by the warm-up step before it);
* minor page faults per step (``minflt``, the median over the timed steps: memory returned to the OS
  and faulted in again; ``getrusage``);
* host microseconds (the median wall time of the phase; on a GPU, the time to enqueue it), and
  ``plain_us_per_chunk``: the same for the model run on the chunks' rows one after the other with
  no ``Overlapped`` (one loss, one backward; no deferred dW): the cost of running every op once per
  chunk on smaller tensors, which any chunked schedule pays in eager PyTorch; the difference to
  ``fwd_us_per_chunk + bwd_us_per_chunk`` is the schedule's own host cost;

and per step: the bytes saved for backward (distinct storages packed by autograd, parameters
excluded: what the step holds beyond the model) and, on CUDA, the peak allocated memory.

On CUDA, host against GPU: each timed step starts on an idle device (synchronized before, never
inside), and CUDA events beside the host clock give each phase's GPU time (``fwd_gpu_us``,
``bwd_gpu_us``); ``host_us`` and ``gpu_us`` are the step's per layer and chunk, and
``host_over_gpu`` their ratio (:func:`host_vs_gpu`: well under 1, the GPU sets the pace; near 1, it
waits for the host). CPU rows have none of these fields. Every row carries the model's shape
(``world_size``, ``experts``, ``top_k``, ``layers``, ``d_model``, ``d_ffn``, ``heads``, ``batch``, ``seq``).

The "per extra chunk" columns are (value at N chunks - value unchunked) / (layers x (N - 1)): what
each chunk beyond the first adds to one layer's step. Every option of the layer the step depends on
is a flag: dropless or a capacity factor, autocast, deferred dW.

    python -m bench.host --device cpu                      # the issue's configurations, one table
    python -m bench.host --autocast bf16 --defer-wgrad     # one configuration
    python -m bench.host --top 15                          # and the ops each extra chunk adds, by name
    python -m bench.host --shape fine                      # a fine-grained MoE's shape (SHAPES)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import resource
import statistics
import time
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lancet_rt
from bench.common import PhaseTimer, RowLog, collect_garbage, print_table, run_metadata
from lancet_rt.cli import float_in, int_in, list_of
from lancet_rt.models.blocks import MoEBlocks

_READ = torch.ops.aten._local_scalar_dense.default
#: Counted by the profiler, not the dispatch mode (:meth:`Step._detaches`).
_DETACH = "aten::detach"


#: Tensor methods that read values to the host without dispatching an ATen op on CPU (``tolist``
#: reads a CPU tensor's memory directly; ``cpu()`` of a CPU tensor returns it): counted by name, since
#: on a GPU each is a device-to-host copy.
_HOST_METHODS = ("tolist", "cpu", "numpy")


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``): memory the allocator handed back to
    the OS and touches again (on CPU, a tensor over glibc's mmap threshold freed and allocated anew)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while active, by name, and the host reads: the ATen
    ``_local_scalar_dense`` (``item()``, ``int(t)``, ``bool(t)``) plus calls of :data:`_HOST_METHODS`."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.host_calls = 0
        self._saved: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not LaunchCounter.inside:  # (the interpreter's own tensor ops inside a launch are the kernel)
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in _HOST_METHODS:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def method(t, *a, _original=original, _name=name, **kw):
                if not LaunchCounter.inside:
                    self.host_calls += 1
                    self.ops[f"Tensor.{_name}"] += 1
                return _original(t, *a, **kw)

            setattr(torch.Tensor, name, method)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)

    def set_count(self, name: str, count: int) -> None:
        """Put ``count`` for the op ``name`` (measured another way: :meth:`Step._detaches`)."""
        self.ops[name] = count

    @property
    def total(self) -> int:
        """ATen ops (the host-method calls are not ops)."""
        return sum(self.ops.values()) - self.host_calls

    @property
    def reads(self) -> int:
        return self.ops[_READ.name()] + self.host_calls


class LaunchCounter:
    """Counts Triton kernel launches (compiled or interpreted) while active, and the host seconds spent
    in them (``seconds``: on a GPU a launch is asynchronous, so this is the launch's own host cost, the
    JIT's argument binding and the driver call; under the interpreter it is the kernel's execution);
    ``inside`` is true during a launch (the interpreter runs a kernel as tensor ops, which are not the
    host's ops)."""

    inside = False

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._patched: list = []

    def __enter__(self):
        try:
            from triton.runtime import interpreter, jit
        except ImportError:  # no triton: no launches
            return self
        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            original = cls.run

            def run(fn_self, *args, _original=original, **kwargs):
                counted = not kwargs.get("warmup", False) and not LaunchCounter.inside
                outer, LaunchCounter.inside = LaunchCounter.inside, True
                start = time.perf_counter()
                try:
                    return _original(fn_self, *args, **kwargs)
                finally:
                    LaunchCounter.inside = outer
                    if counted:
                        self.count += 1
                        self.seconds += time.perf_counter() - start

            cls.run = run
            self._patched.append((cls, original))
        return self

    def __exit__(self, *exc):
        for cls, original in self._patched:
            cls.run = original
        self._patched.clear()


@contextlib.contextmanager
def saved_bytes(exclude: set):
    """Yields a dict whose "bytes" is the size of the distinct storages autograd saves for backward
    while active, storages in ``exclude`` (the parameters') left out."""
    seen: set = set()
    out = {"bytes": 0}

    def pack(t):
        if t.device.type != "meta":
            s = t.untyped_storage()
            key = s.data_ptr()
            if key not in seen and key not in exclude and s.nbytes():
                seen.add(key)
                out["bytes"] += s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out


class Step:
    """One model on one emulated link, stepped unchunked or under ``Overlapped(chunks=n)``."""

    def __init__(self, args, device: torch.device):
        link = lancet_rt.EmulatedGroup(args.world_size, float("inf"), 0.0, device=device)
        moe = dict(
            d_ffn=args.d_ffn,
            num_experts=args.experts,
            top_k=args.top_k,
            ep_group=link,
            capacity_factor=args.capacity_factor,
            aux_loss_coef=1e-2,
        )
        torch.manual_seed(0)
        self.model = MoEBlocks(args.layers, args.d_model, args.heads, moe, device=device)
        self.device = device
        self.layers = args.layers
        self.autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)
        self.runners = {1: self.model}
        for n in args.chunks:
            if n > 1:
                self.runners[n] = lancet_rt.Overlapped(self.model, chunks=n, defer_wgrad=args.defer_wgrad)
        if args.defer_wgrad:  # the unchunked step defers too, so only the chunking differs
            self.runners[1] = lancet_rt.Overlapped(self.model, chunks=1, defer_wgrad=True)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(args.batch, args.seq, args.d_model, generator=g).to(device)
        self.params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def forward(self, n: int):
        with self._autocast():
            y = self.runners[n](self.x)
        return y.float().square().mean() + sum(m.aux_loss for m in self.model.moe_layers())

    def plain_forward(self, n: int):
        """The model run on the ``n`` chunks' rows one after the other, with no ``Overlapped`` (one
        loss, one backward): every op of a chunked step, without the schedule."""
        with self._autocast():
            ys = [self.model(x) for x in self.x.tensor_split(n)]
        return sum(y.float().square().mean() for y in ys) + sum(m.aux_loss for m in self.model.moe_layers())

    def run(self, n: int) -> None:
        self.model.zero_grad(set_to_none=True)
        self.forward(n).backward()

    def count(self, n: int) -> dict:
        """Ops, reads and launches of one step's forward and backward; saved bytes and peak memory."""
        self.run(n)  # warm: caches, autotuners, lazily built state
        self.model.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        row: dict = {}
        # The saved bytes on a forward of their own: autograd's pack hook adds ops of its own (a detach
        # per saved tensor) that a step without the hook does not run, so the counted forward has none.
        with saved_bytes(self.params) as saved:
            self.forward(n).backward()
        self.model.zero_grad(set_to_none=True)
        row["saved_bytes"] = saved["bytes"]
        detaches = self._detaches(n)
        with OpCounter() as ops, LaunchCounter() as launches:
            loss = self.forward(n)
        ops.set_count(_DETACH, detaches[0])
        row.update(fwd_ops=ops.total, fwd_reads=ops.reads, fwd_launches=launches.count)
        fwd_ops, fwd_seconds = ops.ops, launches.seconds
        with OpCounter() as ops, LaunchCounter() as launches:
            loss.backward()
        ops.set_count(_DETACH, detaches[1])
        row.update(bwd_ops=ops.total, bwd_reads=ops.reads, bwd_launches=launches.count)
        launched = row["fwd_launches"] + launches.count
        if self.device.type == "cuda" and launched:  # (under the interpreter a launch runs the kernel)
            row["launch_us"] = (fwd_seconds + launches.seconds) / launched * 1e6
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            row["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        row["by_name"] = fwd_ops + ops.ops
        return row

    def _detaches(self, n: int) -> tuple[int, int]:
        """The ``aten::detach`` a step dispatches, forward and backward, counted by the profiler with no
        dispatch mode active. Under :class:`OpCounter` (a Python dispatch mode) autograd makes the shallow
        copy of each tensor a Function saves of its own outputs, and unpacks in backward, through the
        dispatcher (a detach each), which it does in C++ without one otherwise: those detaches are the
        counter's, not the step's."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = self.forward(n)
        fwd = sum(e.name == _DETACH for e in prof.events())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss.backward()
        bwd = sum(e.name == _DETACH for e in prof.events())
        self.model.zero_grad(set_to_none=True)
        return fwd, bwd

    def host_us(self, n: int, reps: int, plain: bool = False) -> dict:
        """Median wall time of the forward and of the backward, in microseconds (GC paused; the device
        synchronized before each step, never inside it); ``plain``: of :meth:`plain_forward`'s step
        instead. On CUDA also the phases' CUDA-event GPU times and :func:`host_vs_gpu`'s fields."""
        forward = self.plain_forward if plain else self.forward
        timer = PhaseTimer(self.device)
        phases, faults = [], []
        collect_garbage()
        gc.disable()
        try:
            for _ in range(reps):
                self.model.zero_grad(set_to_none=True)
                f0 = minor_faults()
                timer.start()
                loss = forward(n)
                timer.lap()
                loss.backward()
                timer.lap()
                phases.append(timer.result())
                faults.append(minor_faults() - f0)
        finally:
            gc.enable()
        fwd, bwd = [p[0] for p in phases], [p[1] for p in phases]  # (host_us, gpu_us) of each step
        out = dict(
            fwd_us=statistics.median(h for h, _ in fwd),
            bwd_us=statistics.median(h for h, _ in bwd),
            minflt=statistics.median(faults),
        )
        if timer.cuda:
            out.update(
                host_vs_gpu(
                    out["fwd_us"],
                    out["bwd_us"],
                    statistics.median(g for _, g in fwd),
                    statistics.median(g for _, g in bwd),
                    self.layers * n,
                )
            )
        return out


def host_vs_gpu(fwd_us: float, bwd_us: float, fwd_gpu_us: float, bwd_gpu_us: float, layer_chunks: int) -> dict:
    """A CUDA row's host time against its GPU time (step totals in, per layer-chunk out).

    Args:
        fwd_us, bwd_us: the phases' host wall times (median, microseconds).
        fwd_gpu_us, bwd_gpu_us: their CUDA-event GPU times (median, microseconds).
        layer_chunks: layers x chunks of the step.

    Returns:
        ``fwd_gpu_us``, ``bwd_gpu_us`` (as given); ``host_us`` and ``gpu_us``, the step's (forward +
        backward) per layer and chunk; ``host_over_gpu`` their ratio, and ``fwd_host_over_gpu``,
        ``bwd_host_over_gpu`` per phase. A phase's GPU time is its span on the device, from an event
        recorded at its start to one at its end, so it counts the time the GPU waited for the host:
        a ratio well under 1 is a GPU-bound step (the host enqueues ahead, by that margin); near 1, the
        GPU waited for the host (host-bound). Above 1 only per phase (a backward whose GPU work
        started late because the forward's had not finished).
    """
    host, gpu = (fwd_us + bwd_us) / layer_chunks, (fwd_gpu_us + bwd_gpu_us) / layer_chunks
    return dict(
        fwd_gpu_us=fwd_gpu_us,
        bwd_gpu_us=bwd_gpu_us,
        host_us=host,
        gpu_us=gpu,
        host_over_gpu=host / gpu,
        fwd_host_over_gpu=fwd_us / fwd_gpu_us,
        bwd_host_over_gpu=bwd_us / bwd_gpu_us,
    )


_PER_CHUNK = ("fwd_ops", "bwd_ops", "fwd_reads", "bwd_reads", "fwd_launches", "bwd_launches", "fwd_us", "bwd_us")


def measure(args, device: torch.device) -> list[dict]:
    """One row per chunk count: the step's counts, and what each chunk beyond the first adds per layer."""
    step = Step(args, device)
    base = None
    rows = []
    for n in sorted({1, *args.chunks}):
        row = dict(chunks=n, **step.count(n))
        if args.count_only:  # (no timed steps: the counts alone, quick on the Triton interpreter)
            row.update(fwd_us=float("nan"), bwd_us=float("nan"), minflt=float("nan"))
        else:
            row.update(step.host_us(n, args.reps))
        if n > 1 and not args.count_only:  # the same ops without the schedule: what remains is the schedule's own cost
            plain = step.host_us(n, args.reps, plain=True)
            row["plain_us"] = plain["fwd_us"] + plain["bwd_us"]
        row["ops"], row["reads"] = row["fwd_ops"] + row["bwd_ops"], row["fwd_reads"] + row["bwd_reads"]
        if base is None:
            base = row
        else:
            per = step.layers * (n - 1)
            for k in _PER_CHUNK + ("ops", "reads"):
                row[f"{k}_per_chunk"] = (row[k] - base[k]) / per
            if "plain_us" in row:
                row["plain_us_per_chunk"] = (row["plain_us"] - base["fwd_us"] - base["bwd_us"]) / per
            row["saved_x"] = row["saved_bytes"] / base["saved_bytes"] if base["saved_bytes"] else float("nan")
            if "peak_mb" in row:
                row["peak_x"] = row["peak_mb"] / base["peak_mb"]
            row["top_added"] = _top_added(base["by_name"], row["by_name"], per, args.top)
        rows.append(row)
    for r in rows:
        r.pop("by_name")
    return rows


def _top_added(base: collections.Counter, now: collections.Counter, per: int, top: int) -> list:
    added = {k: (now[k] - base[k]) / per for k in now.keys() | base.keys()}
    return sorted(((k, v) for k, v in added.items() if v), key=lambda kv: -abs(kv[1]))[:top]


#: The model's shape, in every row.
SHAPE = ("world_size", "experts", "top_k", "layers", "d_model", "d_ffn", "heads", "batch", "seq")

#: ``--shape``'s presets: the model's shape and the chunk counts. ``fine``: a fine-grained MoE like
#: Qwen3-30B-A3B (128 experts of d_ffn 768, top-8, d_model 2048, 32 heads), a 16k-token microbatch
#: (4 x 4096) in 4 chunks of 4096 tokens, on the default world size. The host's ops depend on the
#: routing's structure (experts, top-k, world size) and the token counts (which pick the gating's
#: single-program or scan path), not on d_model, d_ffn or heads: under the Triton interpreter, where its
#: GEMMs do not finish, count it with small ones (docs/benchmarks.md).
SHAPES = {
    "default": dict(
        world_size=4, experts=16, layers=2, d_model=64, d_ffn=128, heads=4, top_k=2, batch=8, seq=32, chunks=[2, 4]
    ),
    "fine": dict(
        world_size=4, experts=128, layers=2, d_model=2048, d_ffn=768, heads=32, top_k=8, batch=4, seq=4096, chunks=[4]
    ),
}


def configurations(args) -> list[dict]:
    """The configurations one run covers: the one given, or with ``--sweep`` the issue's set."""
    if not args.sweep:
        return [dict(capacity_factor=args.capacity_factor, autocast=args.autocast, defer_wgrad=args.defer_wgrad)]
    return [
        dict(capacity_factor=cf, autocast=ac, defer_wgrad=dw)
        for cf in (None, 1.25)
        for ac in ("none", "bf16")
        for dw in (False, True)
    ]


def main(argv: Optional[list] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="default",
        help="the model's shape and chunks (SHAPES; each flag below given overrides it): 'fine' is a fine-grained "
        "MoE like Qwen3-30B-A3B (128 experts of d_ffn 768, top-8, d_model 2048, 32 heads) on 4 chunks of a "
        "16k-token microbatch",
    )
    p.add_argument("--world-size", type=int_in(1, 1024), default=None)
    p.add_argument("--experts", type=int_in(1), default=None)
    p.add_argument("--layers", type=int_in(1), default=None)
    p.add_argument("--d-model", type=int_in(1), default=None)
    p.add_argument("--d-ffn", type=int_in(1), default=None)
    p.add_argument("--heads", type=int_in(1), default=None)
    p.add_argument("--top-k", type=int_in(1), default=None)
    p.add_argument("--batch", type=int_in(1), default=None)
    p.add_argument("--seq", type=int_in(1), default=None)
    p.add_argument("--chunks", type=list_of(int_in(1, 64)), default=None)
    p.add_argument("--capacity-factor", type=float_in(0, above=True), default=None, help="None: dropless")
    p.add_argument("--autocast", choices=("none", "bf16", "fp16"), default="none")
    p.add_argument("--defer-wgrad", action="store_true")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="every combination of dropless / capacity 1.25, autocast none / bf16, defer_wgrad off / on",
    )
    p.add_argument("--reps", type=int_in(1), default=20, help="timed steps per chunk count (host time)")
    p.add_argument(
        "--count-only",
        action="store_true",
        help="count ops, reads and launches only, no timed steps (the counts do not depend on the token count: "
        "with a small --batch/--seq the Triton interpreter's count takes a minute or two)",
    )
    p.add_argument("--top", type=int_in(0), default=0, help="print the N op names each extra chunk adds most")
    p.add_argument("--threads", type=int_in(1, 1024), default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for k, v in SHAPES[args.shape].items():  # (the preset's value where the flag is not given)
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    log = RowLog(args.json)
    meta = run_metadata(device, **{k: getattr(args, k) for k in SHAPE})
    rows = []
    for cfg in configurations(args):
        run_args = copy.copy(args)
        vars(run_args).update(cfg)
        for row in measure(run_args, device):
            row = dict(cfg, **row, **meta)
            rows.append(row)
            log.add(row)
    _print(rows, args.top)
    return rows


def _print(rows: list[dict], top: int) -> None:
    cols = [
        "capacity_factor",
        "autocast",
        "defer_wgrad",
        "chunks",
        "ops_per_chunk",
        "reads_per_chunk",
        "fwd_ops_per_chunk",
        "bwd_ops_per_chunk",
        "fwd_launches_per_chunk",
        "bwd_launches_per_chunk",
        "fwd_us_per_chunk",
        "bwd_us_per_chunk",
        "plain_us_per_chunk",
        "launch_us",
        "saved_x",
        "peak_x",
        "minflt",
    ]
    have = [c for c in cols if any(c in r for r in rows)]
    print_table(
        [r for r in rows if r["chunks"] > 1],
        have,
        "per layer per extra chunk (fwd+bwd), and the step's saved bytes / peak memory against unchunked; "
        "minflt: the step's minor page faults (median)",
    )
    print(
        "minor page faults per step: "
        + ", ".join(
            f"{r['autocast']} cf={r['capacity_factor']} dw={r['defer_wgrad']} chunks={r['chunks']}: {r['minflt']:.0f}"
            for r in rows
        )
    )
    if any("gpu_us" in r for r in rows):
        print_table(
            rows,
            [
                "autocast",
                "defer_wgrad",
                "chunks",
                "fwd_us",
                "fwd_gpu_us",
                "bwd_us",
                "bwd_gpu_us",
                "host_us",
                "gpu_us",
                "host_over_gpu",
            ],
            "\nhost against GPU (us; host_us and gpu_us per layer and chunk; host_over_gpu near 1: the GPU waits)",
        )
    if top:
        for r in rows:
            if r["chunks"] > 1:
                print(
                    f"\nchunks={r['chunks']} {r['autocast']} cf={r['capacity_factor']} dw={r['defer_wgrad']}: "
                    + ", ".join(f"{k} {v:+.1f}" for k, v in r["top_added"])
                )


if __name__ == "__main__":
    main()
