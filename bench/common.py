"""Shared benchmark harness: device identity, measured ceilings, tables and JSON rows (the timers
are in bench.timing).

Every benchmark row carries the device, commit, date, versions and the ceilings it was measured
against, so a number is never separated from what it means (../shared/GPU.md).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch

from bench.timing import bench_ms
from lancet_rt.jsonfile import read_json


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run_metadata(device: torch.device, **ceilings) -> dict:
    """The fields every JSON row carries."""
    return dict(
        device=device_name(device),
        commit=git_commit(),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        **ceilings,
    )


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth, counting bytes read plus written, in GB/s."""
    if device.type != "cuda":
        nbytes = min(nbytes, 1 << 26)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)["ms"]
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(device: torch.device, n: int = 8192, dtype=torch.bfloat16) -> float:
    """Measured dense matmul rate on random data, in TFLOP/s."""
    if device.type != "cuda":
        n, dtype = min(n, 1024), torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = bench_ms(lambda: a @ b, device)["ms"]
    return 2 * n**3 / (ms * 1e-3) / 1e12


def print_table(rows: Sequence[dict], columns: Iterable[str], title: str = "") -> None:
    cols = list(columns)
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    if title:
        print(title)
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


class TimeBudget:
    """A wall-clock allowance for a benchmark run (``--max-seconds``): the run checks it before each
    case and stops starting new ones once it is spent, so a command under a hard time limit (a lent
    GPU's call) ends by itself with every finished row written, rather than being killed mid-row."""

    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def spent(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def left(self) -> float:
        """Seconds left (infinity without an allowance)."""
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()


class RowLog(list):
    """The rows of one run; each is appended to ``path`` (if given) the moment it is measured, so the
    file holds every finished row even when the process is cut short; :meth:`update` rewrites the
    latest one in place as a run adds to it."""

    def __init__(self, path: str | os.PathLike | None = None):
        super().__init__()
        self.path = path
        if path:
            _read_rows(Path(path))  # a damaged file is named now, before the run measures anything
        self._index = None  # the latest row's position in the file

    def add(self, row: dict) -> None:
        self.append(row)
        if self.path:
            self._index = write_json(self.path, [row])

    def update(self, row: dict) -> None:
        """Replace the latest row (in memory and in the file) with ``row``; with none yet, add it."""
        if not self:
            return self.add(row)
        self[-1] = row
        if self.path:
            rows = _read_rows(Path(self.path))
            if self._index is None or self._index >= len(rows):  # the file was replaced meanwhile
                self._index = write_json(self.path, [row])
            else:
                rows[self._index] = row
                _write_rows(Path(self.path), rows)


def write_json(path: str | os.PathLike, rows: Sequence[dict]) -> int:
    """Append ``rows`` to the JSON list at ``path`` (created if missing), written atomically; returns
    the position of the first appended row."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = _read_rows(path)
    _write_rows(path, existing + list(rows))
    return len(existing)


def _read_rows(path: Path) -> list:
    """The rows of the results file at ``path`` ([] when there is none); a ValueError naming it when it is
    not a JSON list (never replaced by the new rows alone: the rows it holds would be lost)."""
    if not path.exists():
        return []
    rows = read_json(path)
    if not isinstance(rows, list):
        raise ValueError(
            f"{path}: not a results file (a JSON list of rows), got a {type(rows).__name__}: move it "
            f"aside or pass another --json"
        )
    return rows


def _write_rows(path: Path, rows: list) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    os.replace(tmp, path)
