"""No folder of this checkout shadows another distribution's top-level name, from anywhere.

kernels/ and autotune/ are the packages ``lancet_rt.kernels`` and ``lancet_rt.autotune``; as top-level
names they are Hugging Face's kernel hub (which transformers >= 5.25 imports when it builds a model)
and PyPI's ``autotune``. Python finds the checkout's folder first wherever the repository root is on
``sys.path`` ahead of site-packages: ``python -m`` or ``pytest`` from the root, a script saved in the
root, ``PYTHONPATH=<root>``. Each case runs a fresh interpreter from the root and from another
directory, with the real ``kernels`` installed and with stand-ins behind the root on ``sys.path``.

bench/ and tests/ are the checkout's commands and suite (``python -m bench.<command>``, pytest): they
are importable from the root by design and installed nowhere (``test_packaging.py``).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the checkout's folders installed under lancet_rt (pyproject.toml's package-dir): never top-level
LIBRARY_FOLDERS = ("kernels", "autotune")
#: the checkout's own top-level packages, importable from the root only
CHECKOUT_PACKAGES = ("lancet_rt", "bench", "tests")

MIXTRAL = """
    import transformers, torch
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config)
    assert model(input_ids=torch.randint(0, 64, (1, 8))).logits.shape == (1, 8, 64)
"""


def _hub_kernels() -> bool:
    try:
        importlib.metadata.version("kernels")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _run(code: str, cwd: Path, how: str, pythonpath=()) -> str:
    """Run ``code`` in a fresh interpreter in ``cwd``: as ``python -c`` (``how="c"``; ``cwd`` first on
    sys.path) or as a script saved in ``cwd`` (``how="script"``: its folder first on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env["TRANSFORMERS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"
    code = textwrap.dedent(code)
    if how == "script":
        script = cwd / "lancet_rt_shadow_probe.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = [sys.executable, "-c", code]
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if how == "script":
            script.unlink()
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def _standins(tmp_path: Path) -> Path:
    """A site folder with a stand-in distribution for each library folder's top-level name."""
    site = tmp_path / "standins"
    for name in LIBRARY_FOLDERS:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"STANDIN = {name!r}\n")
        (site / name / "sub.py").write_text("VALUE = 7\n")
    return site


def test_the_checkouts_top_level_packages_are_listed():
    found = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert found == set(LIBRARY_FOLDERS) | set(CHECKOUT_PACKAGES), sorted(found)


@pytest.mark.skipif(not _hub_kernels(), reason="Hugging Face's kernels is not installed (transformers < 5.25)")
@pytest.mark.parametrize("where,how", [("root", "c"), ("root", "script"), ("elsewhere", "c")])
def test_hugging_faces_kernels_and_a_transformers_model(where, how, tmp_path):
    cwd = ROOT if where == "root" else tmp_path
    out = _run(
        f"""
        import importlib.metadata, sys
        import kernels
        assert hasattr(kernels, "get_kernel") and "site-packages" in kernels.__file__, kernels.__file__
        assert not kernels.__file__.startswith({str(ROOT / "kernels")!r}), kernels.__file__
        {textwrap.indent(textwrap.dedent(MIXTRAL), "        ").strip()}
        import lancet_rt, lancet_rt.kernels.gating, lancet_rt.autotune
        assert sys.modules["kernels"] is kernels
        assert lancet_rt.kernels.__file__.startswith({str(ROOT / "kernels")!r}), lancet_rt.kernels.__file__
        print("hub", importlib.metadata.version("kernels"))
    """,
        cwd,
        how,
    )
    assert out.startswith("hub ")


@pytest.mark.parametrize("where,how", [("root", "c"), ("root", "script"), ("elsewhere", "c")])
def test_another_distributions_names_are_theirs(where, how, tmp_path):
    cwd = ROOT if where == "root" else tmp_path
    site = _standins(tmp_path)
    _run(
        f"""
        import sys
        for name in {LIBRARY_FOLDERS!r}:
            module = __import__(name)
            assert getattr(module, "STANDIN", None) == name, (name, module.__file__)
            assert __import__(name + ".sub").sub.VALUE == 7
            assert sys.modules[name].__file__.startswith({str(site)!r}), sys.modules[name].__file__
        import torch, lancet_rt, lancet_rt.autotune
        moe = lancet_rt.MoE(8, 16, 4, 2)
        moe(torch.randn(3, 8)).sum().backward()
        assert sys.modules["kernels"].STANDIN == "kernels" and sys.modules["autotune"].STANDIN == "autotune"
        assert lancet_rt.autotune.AutoChunks.__module__ == "lancet_rt.autotune.online"
    """,
        cwd,
        how,
        [site],
    )


@pytest.mark.parametrize("how", ["c", "script"])
def test_a_name_no_distribution_owns_is_an_empty_namespace(how):
    """With nothing else of that name installed, the folder is what Python makes of one without
    ``__init__.py``: an empty namespace package, which probing libraries report as absent."""
    _run(
        """
        import importlib.metadata
        try:
            importlib.metadata.version("autotune")
            raise SystemExit(0)  # a distribution named autotune is installed: nothing to check here
        except importlib.metadata.PackageNotFoundError:
            pass
        import autotune
        assert getattr(autotune, "__file__", None) is None and list(autotune.__path__) == [], vars(autotune)
        assert not hasattr(autotune, "AutoChunks") and not hasattr(autotune, "__version__")
        try:
            import autotune.search
        except ModuleNotFoundError as e:
            assert e.name == "autotune.search", e
        else:
            raise AssertionError(f"import autotune.search found {autotune.search.__file__}")
        import sys
        import lancet_rt.autotune
        assert lancet_rt.autotune.AutoChunks and "lancet_rt.autotune.search" in sys.modules
    """,
        ROOT,
        how,
    )


def test_transformers_probing_an_absent_name_finds_nothing():
    """transformers' probe (find_spec, then the distribution's version, then an import) on a name whose
    only candidate is this checkout's folder: reported absent, from the root."""
    _run(
        """
        import importlib.metadata
        try:
            importlib.metadata.version("autotune")
            raise SystemExit(0)
        except importlib.metadata.PackageNotFoundError:
            pass
        from transformers.utils.import_utils import _is_package_available
        assert _is_package_available("autotune", return_version=True) == (False, "N/A")
    """,
        ROOT,
        "c",
    )
