"""What the checkpoint safety layer costs: save_checkpoint / load_checkpoint with and without the XXH3-64
checksums, and plain torch.distributed.checkpoint, in one process, timed interleaved.

A model of lancet MoE blocks (experts: most of the bytes, one DCP chunk per expert, as at scale) is
saved and loaded ``--repeats`` times by each variant in turn, into a fresh directory each time:

* ``lancet``: ``lancet_rt.save_checkpoint`` / ``load_checkpoint`` as shipped (staging directory and
  swap, agreement, checksums written and checked, read into new tensors then copied);
* ``lancet_no_checksum``: the same with the checksum step left out (the writer and reader without it),
  so ``checksum_overhead`` = lancet / lancet_no_checksum - 1 is what the checksums cost;
* ``dcp``: plain ``dcp.save`` / ``dcp.load`` of the same flat state dict (no staging, no checks,
  in place): the safety layer's whole cost is lancet / dcp - 1.

The checksum is taken from the bytes as DCP writes them (and from the bytes a load reads, before it
uses them), so its cost is about one pass over the data at XXH3's rate (``checksum_gbs``, measured
here too) on each side. Times are medians; the machine's load average is in every row.

    python -m bench.checkpoint                          # ~0.6 GB of parameters, 3 repeats
    python -m bench.checkpoint --layers 4 --repeats 5   # ~1.1 GB
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from bench.common import RowLog, print_table, run_metadata
from lancet_rt.checkpoint import dcp_io


def _model(layers: int, d_model: int, d_ffn: int, experts: int):
    from lancet_rt.models.blocks import MoEBlocks

    torch.manual_seed(0)
    return MoEBlocks(layers, d_model, 8, dict(d_ffn=d_ffn, num_experts=experts, top_k=2))


def _checksum_gbs(nbytes: int = 1 << 28) -> float:
    data = os.urandom(1 << 24) * (nbytes // (1 << 24))
    start = time.perf_counter()
    dcp_io.digest(data)
    return len(data) / (time.perf_counter() - start) / 1e9


class _NoChecksums:
    """The lancet variant with the checksum step left out (the writer and reader DCP's own)."""

    def __enter__(self):
        from torch.distributed.checkpoint import FileSystemWriter

        from lancet_rt.checkpoint import dcp_io

        self.saved = dcp_io._checksum_writer
        dcp_io._checksum_writer = FileSystemWriter  # no checksum stored: the reader then checks nothing
        return self

    def __exit__(self, *exc):
        from lancet_rt.checkpoint import dcp_io

        dcp_io._checksum_writer = self.saved
        return False


def _variant(name: str, model, root: str) -> tuple:
    """(save seconds, load seconds) of one variant into a fresh directory."""
    import contextlib
    import warnings

    import torch.distributed.checkpoint as dcp

    import lancet_rt

    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    os.sync()  # no write-back of an earlier variant's files left to slow this one's writes
    ctx = _NoChecksums() if name == "lancet_no_checksum" else contextlib.nullcontext()
    with ctx, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if name == "dcp":
            flat = {"model." + k: v for k, v in model.state_dict().items()}
            start = time.perf_counter()
            dcp.save(flat, checkpoint_id=path, no_dist=True)
            save = time.perf_counter() - start
            start = time.perf_counter()
            dcp.load(flat, checkpoint_id=path, no_dist=True)
            load = time.perf_counter() - start
        else:
            start = time.perf_counter()
            lancet_rt.save_checkpoint(model, path)
            save = time.perf_counter() - start
            start = time.perf_counter()
            lancet_rt.load_checkpoint(model, path)
            load = time.perf_counter() - start
    shutil.rmtree(path, ignore_errors=True)
    return save, load


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ffn", type=int, default=2816)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument(
        "--json",
        default="out/checkpoint_cpu.json",
        help="append the rows here (default out/, untracked; bench/results/ for the project's rows)",
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model = _model(args.layers, args.d_model, args.d_ffn, args.experts)
    nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    variants = ("lancet", "lancet_no_checksum", "dcp")
    times = {v: ([], []) for v in variants}
    root = tempfile.mkdtemp(prefix="lancet-bench-ckpt-", dir=args.dir)
    loads = []
    try:
        for i in range(args.repeats):  # interleaved: each repeat runs every variant once, in a rotated order
            for v in variants[i % 3 :] + variants[: i % 3]:
                s, ld = _variant(v, model, root)
                times[v][0].append(s)
                times[v][1].append(ld)
            loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {v: (statistics.median(times[v][0]), statistics.median(times[v][1])) for v in variants}
    row = dict(
        run_metadata(torch.device("cpu")),
        bench="checkpoint",
        layers=args.layers,
        d_model=args.d_model,
        d_ffn=args.d_ffn,
        experts=args.experts,
        repeats=args.repeats,
        gbytes=round(nbytes / 1e9, 3),
        checksum_gbs=round(_checksum_gbs(), 2),
        loadavg_1m=round(statistics.median(loads), 2),
    )
    for v in variants:
        row[f"{v}_save_s"], row[f"{v}_load_s"] = round(med[v][0], 4), round(med[v][1], 4)
    for side, i in (("save", 0), ("load", 1)):
        row[f"checksum_overhead_{side}"] = round(med["lancet"][i] / med["lancet_no_checksum"][i] - 1, 3)
        row[f"layer_overhead_{side}"] = round(med["lancet"][i] / med["dcp"][i] - 1, 3)
    table = [
        dict(
            variant=v,
            save_s=med[v][0],
            load_s=med[v][1],
            save_gbs=nbytes / med[v][0] / 1e9,
            load_gbs=nbytes / med[v][1] / 1e9,
        )
        for v in variants
    ]
    print_table(
        table,
        ["variant", "save_s", "load_s", "save_gbs", "load_gbs"],
        f"checkpoint, {nbytes / 1e9:.2f} GB of parameters, medians of {args.repeats} "
        f"(load average {row['loadavg_1m']}; XXH3-64 {row['checksum_gbs']} GB/s)",
    )
    print(
        f"checksums cost: save {row['checksum_overhead_save']:+.1%}, load {row['checksum_overhead_load']:+.1%}; "
        f"the whole layer over plain DCP: save {row['layer_overhead_save']:+.1%}, "
        f"load {row['layer_overhead_load']:+.1%}"
    )
    log = RowLog(args.json)
    log.add(row)
    return log


if __name__ == "__main__":
    main()
