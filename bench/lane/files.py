"""What the GPU lane leaves in ``--out`` and how it comes home (bench.lane).

The steps write their rows, logs, pictures and traces into a work directory; after every step (and
every :data:`REFRESH_SECONDS` while one runs) :func:`pack` packs it into ONE archive in ``--out``,
:data:`ARCHIVE`, and the lane rewrites :data:`SUMMARY` beside it: two files, of the at most 8 that a
lent GPU's call brings back. :func:`collect` brings an archive (or an older call's ``$OUT`` directory)
into ``bench/results/`` and ``autotune/defaults.json``.
"""

from __future__ import annotations

import json
import os
import tarfile
import tempfile
from pathlib import Path

ARCHIVE = "lane.tar.gz"
SUMMARY = "summary.json"
#: Under the 16 MiB a returned file may hold: beyond it the largest pictures, traces and logs are left out.
MAX_ARCHIVE_BYTES = 15 << 20
REFRESH_SECONDS = 20
#: The rows --collect appends to bench/results/<name>.json.
ROW_FILES = ("kernels", "experts", "overlap", "host", "overlap_conn1", "routing_configs")
#: The steps whose logs --collect keeps (the tests': their failures are results).
TEST_LOGS = ("hostsync", "runtime", "kernel_tests")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pack(work: Path, out: Path) -> list:
    """Pack every file of ``work`` into ``out/ARCHIVE`` (replaced atomically); returns the names left
    out to keep it under :data:`MAX_ARCHIVE_BYTES` (the largest files that are not JSON rows first)."""
    files = sorted((p for p in work.iterdir() if p.is_file() and not p.name.endswith(".tmp")), key=lambda p: p.name)
    dropped: list = []
    while True:
        tmp = out / (ARCHIVE + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for f in files:
                try:
                    tar.add(f, arcname=f.name)
                except OSError:  # a file a running step replaced or removed meanwhile: the next refresh has it
                    pass
        big = sorted((f for f in files if f.suffix != ".json" or "trace" in f.name), key=_size, reverse=True)
        if tmp.stat().st_size <= MAX_ARCHIVE_BYTES or not big:
            os.replace(tmp, out / ARCHIVE)
            return dropped
        files.remove(big[0])
        dropped.append(big[0].name)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def write_summary(out: Path, summary: dict) -> None:
    _atomic_write(out / SUMMARY, json.dumps(summary, indent=1))


def unpack(archive: Path, dest: Path) -> None:
    """Extract a lane archive into ``dest`` (plain files only, never outside it)."""
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            name = Path(member.name)
            if not member.isfile() or name.is_absolute() or len(name.parts) != 1:
                raise ValueError(f"{archive}: unexpected entry {member.name!r} (the lane packs plain files only)")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # (Python < 3.11.4; the members were checked above)
            tar.extractall(dest)


def _rows(src: Path, name: str) -> list:
    path = src / name
    return json.loads(path.read_text()) if path.exists() else []


def collect(src: Path, results: Path, defaults: Path) -> list:
    """Bring one call's archive (or ``$OUT`` directory) into the repository; returns what was written.

    Rows are appended, never replaced (each carries its device, commit and date): kernels, experts,
    overlap and host rows to ``results/<name>.json``; the summary, with the pre-flight row (versions,
    ceilings), to ``gpu_lane.json``; the timeline and trace under the GPU's name; the tests' logs as
    one ``gpu_lane_<gpu>_<date>_tests.log``; exported autotune defaults merged into ``defaults``.
    """
    if src.is_file():
        with tempfile.TemporaryDirectory(prefix="lancet-collect-") as tmp:
            unpack(src, Path(tmp))
            return collect(Path(tmp), results, defaults)
    from bench.common import write_json

    written = []
    results.mkdir(parents=True, exist_ok=True)
    for name in ROW_FILES:
        rows = _rows(src, f"{name}.json")
        if rows:
            write_json(results / f"{name}.json", rows)
            written.append(f"{results / name}.json (+{len(rows)} rows)")
    found = [r for name in ("preflight", *ROW_FILES) for r in _rows(src, f"{name}.json") if r.get("device")]
    device = found[0]["device"] if found else None
    date = (found[0].get("date") or "")[:10] if found else ""
    slug = "".join(ch if ch.isalnum() else "_" for ch in (device or "gpu")).strip("_").lower()
    if (src / SUMMARY).exists():
        preflight = _rows(src, "preflight.json")
        summary_row = dict(
            json.loads((src / SUMMARY).read_text()), device=device, preflight=preflight[-1] if preflight else None
        )
        write_json(results / "gpu_lane.json", [summary_row])
        written.append(f"{results / 'gpu_lane.json'} (+1 row)")
    for name, dest in (("overlap.png", f"overlap_{slug}.png"), ("overlap-trace.json", f"overlap_{slug}_trace.json")):
        if (src / name).exists():
            (results / dest).write_bytes((src / name).read_bytes())
            written.append(str(results / dest))
    logs = [src / f"{name}.log" for name in TEST_LOGS if (src / f"{name}.log").exists()]
    if logs:
        dest = results / f"gpu_lane_{slug}_{date or 'undated'}_tests.log"
        dest.write_text("".join(f"===== {p.stem}\n{p.read_text()}\n" for p in logs))
        written.append(str(dest))
    exported = src / "defaults.json"
    if exported.exists():
        new = json.loads(exported.read_text()).get("entries", {})
        shipped = json.loads(defaults.read_text())
        shipped.setdefault("entries", {}).update(new)  # the other fields (schema, comment) stay
        defaults.write_text(json.dumps(shipped, indent=1) + "\n")
        written.append(f"{defaults} (+{len(new)} entries)")
    return written
