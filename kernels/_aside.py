"""Step aside: this checkout's ``kernels/`` or ``autotune/`` folder was found as a top-level name.

The two folders are the packages ``lancet_rt.kernels`` and ``lancet_rt.autotune`` (setuptools'
package-dir); as top-level names, ``kernels`` and ``autotune`` belong to other distributions
(Hugging Face's kernel hub, which transformers imports; PyPI's ``autotune``). Wherever the
repository root is on ``sys.path`` ahead of site-packages (``python -m ...`` or ``pytest`` from the
root, a script saved in the checkout, ``PYTHONPATH=.``), Python finds the folder first. Its
``__init__`` then calls :func:`step_aside`, which loads the next package of that name on
``sys.path`` in its place, or raises ``ModuleNotFoundError`` as if the folder were not there.

This file is executed by path (``runpy.run_path``), never imported: under either top-level name it
would itself be a module of the package it stands aside for.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def step_aside(name: str, init_file: str) -> None:
    """Replace ``sys.modules[name]`` (this checkout's folder) with the next ``name`` on sys.path.

    Args:
        name: the top-level name the folder was imported as (``"kernels"``, ``"autotune"``).
        init_file: the folder's ``__init__.py`` (its ``__file__``).

    Raises:
        ModuleNotFoundError: no other package of that name is installed.
    """
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(init_file))))
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (this checkout's {name}/ folder is lancet_rt.{name}, not a top-level "
            f"package: import lancet_rt.{name})", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the import statement returns what sys.modules holds after our __init__ ran
    spec.loader.exec_module(module)
