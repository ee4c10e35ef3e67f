"""The house style, checked: ``ruff format`` and ``ruff check`` (configured in pyproject.toml) leave
the tree as it is. Fix a failure with ``ruff format . && ruff check --fix .`` from the root."""

from __future__ import annotations

import shutil
import subprocess
import sys
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
