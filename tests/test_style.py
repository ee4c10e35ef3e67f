"""The house style, checked: ``ruff format`` and ``ruff check`` (configured in pyproject.toml) leave
the tree as it is (fix a failure with ``ruff format . && ruff check --fix .`` from the root), and the
prose of the code quotes no measurement (they go stale: docs/benchmarks.md and
bench/results/HISTORY.md hold them)."""

from __future__ import annotations

import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: make setup installs it (pyproject.toml's test extra)")
    return [found]


def test_the_tree_is_formatted():
    res = subprocess.run([*_ruff(), "format", "--check", "."], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, f"ruff format would change:\n{res.stdout}{res.stderr}"


def test_the_linter_finds_nothing():
    res = subprocess.run(
        [*_ruff(), "check", "--output-format", "concise", "."], cwd=REPO, capture_output=True, text=True
    )
    assert res.returncode == 0, f"ruff check:\n{res.stdout}{res.stderr}"


# ------------------------------------------------------------------------------------------ measurements
# A figure the code quotes to justify a choice goes stale (a Triton version, a machine, a load):
# measurements live in docs/benchmarks.md and bench/results/HISTORY.md; docstrings and comments say
# what and why, and may point there. Design facts (shapes, tile sizes, constants, defaults,
# formulas) stay. What counts as a measurement here: a time, a rate, a percentage, a decimal ratio or
# an "Nx faster/slower", a register or spill count, a page-fault count.
MEASUREMENT = re.compile(
    r"""(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:ms|us|µs|ns|s)\b  # 2.6 ms, 5-10 s
    | \d\s?(?:[kKMGT]B/s|[MG]bit/s|[MGT]b/s|[GT]FLOP/s)               # 12 GB/s, 600 TFLOP/s
    | \d\s?%                                                            # 10%, +40%
    | \b\d+\.\d+x\b | \b\d+x\s(?:faster|slower)\b                       # 1.4x, 8x slower
    | \d\s(?:registers|bytes\sof\sspills)\b | \bspill\w*\s\d            # 248 registers, spilled 220
    | \d+k?\s(?:minor\s|major\s)?page\sfaults                           # 6-12k minor page faults
    """,
    re.X,
)
# A default is a constant, not a measurement: "default 300 s", "50 us by default".
_DEFAULT_BEFORE = re.compile(r"\bdefault\W{0,2}$")
_DEFAULT_AFTER = re.compile(r"^\s+by default\b")
MEASURED_FOLDERS = ("kernels", "lancet_rt", "autotune")


def prose(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every module, class and function docstring line."""
    lines = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                lines += [(doc.lineno + i, text) for i, text in enumerate(doc.value.value.splitlines())]
    return sorted(lines)


def measurements(source: str) -> list[tuple[int, str]]:
    """The comment and docstring lines of ``source`` that quote a measurement (:data:`MEASUREMENT`)."""
    found = []
    for line, text in prose(source):
        for m in MEASUREMENT.finditer(text):
            if not (_DEFAULT_BEFORE.search(text[: m.start()]) or _DEFAULT_AFTER.match(text[m.end() :])):
                found.append((line, text.strip()))
                break
    return found


def test_no_measurement_in_docstrings_or_comments():
    found = [
        f"{path.relative_to(REPO)}:{line}: {text}"
        for folder in MEASURED_FOLDERS
        for path in sorted((REPO / folder).rglob("*.py"))
        for line, text in measurements(path.read_text())
    ]
    assert not found, (
        "measurements in docstrings or comments (move them to docs/benchmarks.md or bench/results/HISTORY.md "
        "and say there what was measured, on what, when):\n" + "\n".join(found)
    )


def test_the_measurement_check_can_fail():
    planted = '''"""A kernel. Triton 3.6 reaches 248 registers here; it runs 1.4x the eager op (2.6 ms, 12 GB/s)."""

BLOCK = 128  # 20% faster than 64 on an H100
TIMEOUT_S = 300  # the default: a constant, not a measurement


def f():
    """6-12k minor page faults per step; 8x slower; spilled 220-240 bytes per thread."""
'''
    assert [line for line, _ in measurements(planted)] == [1, 3, 8]
    facts = '''"""Tiles of 128 x 64, 3 or 4 stages; E * BLOCK_M rows; T*K*12 bytes; fp32 with 64 accumulator
registers; the timeout (default 300 s); the timer slack (50 us by default); rel error ~1e-7; D=4096."""
# 2 x (W-1)/W x T K D b bytes; GEMMs 2x (dX, dW); 16 MiB blocks
'''
    assert measurements(facts) == []


# ------------------------------------------------------------------------------------------ tracker numbers
# The tracker is not part of the repository: "issue N" or "(#N)" means nothing to a reader of the
# code or the docs, and a number outlives the tracker. Say what is meant instead. bench/results/ (the
# measurement history and the logs) may keep them: there they date a result.
TRACKER = re.compile(r"(?i)\b(?:issues?|PRs?|pull\s+requests?|tickets?)\s+#?\d+|\(#\d+\)")
TRACKER_FREE_EXCEPT = ("bench/results/",)


def tracker_citations(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every citation of a tracker's number in ``text``."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1) if TRACKER.search(line)]


def _tracked_text_files() -> list[Path]:
    listing = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / p for p in listing.stdout.split() if not p.startswith(TRACKER_FREE_EXCEPT)]


def test_no_tracker_numbers():
    found = []
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):  # (binary, or deleted but not yet staged)
            continue
        found += [f"{path.relative_to(REPO)}:{line}: {text}" for line, text in tracker_citations(text)]
    assert not found, "tracker numbers (say what is meant instead):\n" + "\n".join(found)


def test_the_tracker_check_can_fail():
    number = "2" + "3"  # (spelled apart so that this file passes its own check)
    planted = f'# fixed in issue {number}\nx = 1  # see (#{number})\n"""Issues {number}/24, PR #{number}."""\n'
    assert [line for line, _ in tracker_citations(planted)] == [1, 2, 3]
    assert tracker_citations('"rank 0 ran MoE layer #0"; issued #1 gradient all-reduce; triton-lang/triton#11584') == []
