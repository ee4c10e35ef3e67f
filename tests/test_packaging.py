"""The installed distribution has one import name, ``lancet_rt``, and shadows no other package.

kernels/ and autotune/ stay top-level folders of the repository but install as ``lancet_rt.kernels``
and ``lancet_rt.autotune``; bench/ is not installed. A top-level ``kernels`` would shadow Hugging
Face's kernel-hub package, which transformers imports when it finds one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("lancet_rt-*.whl")
    return path


def _run(code: str, cwd: Path, path: list[Path]) -> str:
    """Run ``code`` in a fresh interpreter outside the checkout, with only ``path`` added to sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    env["TRANSFORMERS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_wheel_installs_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"lancet_rt", wheel.name.split("-py")[0] + ".dist-info"}, sorted(top)
    for needed in (
        "lancet_rt/kernels/gating.py",
        "lancet_rt/kernels/reference.py",
        "lancet_rt/autotune/search.py",
        "lancet_rt/autotune/defaults.json",
    ):
        assert needed in names, needed
    assert not any(n.startswith("bench/") or "/bench/" in n for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "lancet-autotune = lancet_rt.autotune.__main__:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_package_leaves_kernels_to_hugging_face(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # The wheel adds no top-level name: `kernels` is Hugging Face's where it is installed (transformers
    # >= 5.25 requires it), nothing otherwise, and transformers agrees.
    _run(
        """
        import importlib.metadata, importlib.util
        import lancet_rt, lancet_rt.kernels.gating, lancet_rt.autotune
        assert lancet_rt.__file__.startswith(%r), lancet_rt.__file__
        for name in ("autotune", "bench"):
            assert importlib.util.find_spec(name) is None, (name, importlib.util.find_spec(name))
        try:
            importlib.metadata.version("kernels")
            hub = True
        except importlib.metadata.PackageNotFoundError:
            hub = False
        spec = importlib.util.find_spec("kernels")
        assert (spec is not None) == hub and (spec is None or "lancet_rt" not in spec.origin), spec
        import transformers
        from transformers.utils import is_kernels_available
        assert is_kernels_available() == hub
        import torch
        moe = lancet_rt.MoE(8, 16, 4, 2)
        assert moe(torch.randn(3, 8)).shape == (3, 8)
    """
        % str(site),
        tmp_path,
        [site],
    )
    # With a package named `kernels` ahead of everything (standing in for Hugging Face's), `import
    # kernels` is that package, before and after lancet_rt is imported and used.
    other = tmp_path / "other"
    (other / "kernels").mkdir(parents=True)
    (other / "kernels" / "__init__.py").write_text("__version__ = '0.0.0+stand-in'\n")
    _run(
        """
        import kernels
        assert kernels.__version__ == "0.0.0+stand-in", kernels.__file__
        import torch, lancet_rt
        moe = lancet_rt.MoE(8, 16, 4, 2)
        moe(torch.randn(3, 8)).sum().backward()
        import sys
        assert sys.modules["kernels"] is kernels and "lancet_rt.kernels.reference" in sys.modules
    """,
        tmp_path,
        [other, site],
    )
