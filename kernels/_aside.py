"""Step aside: this checkout's ``kernels/`` or ``autotune/`` folder was found as a top-level name.

The two folders are the packages ``lancet_rt.kernels`` and ``lancet_rt.autotune`` (setuptools'
package-dir); as top-level names, ``kernels`` and ``autotune`` belong to other distributions
(Hugging Face's kernel hub, which transformers imports; PyPI's ``autotune``). Wherever the
repository root is on ``sys.path`` ahead of site-packages (``python -m ...`` or ``pytest`` from the
root, a script saved in the checkout, ``PYTHONPATH=.``), Python finds the folder first. Its
``__init__`` then calls :func:`step_aside`, which loads the next package of that name on
``sys.path`` in its place or, where no other is installed, leaves what Python makes of a folder
without ``__init__.py``: an empty namespace package (no ``__file__``, no version, no submodules). That
is what libraries probing for the name expect of a stray folder: transformers (5.0-5.24, whose
``kernels`` is optional) finds the name, finds no distribution's metadata, imports it, sees no
``__file__`` and reports the package absent.

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

    With no other package of that name, ``sys.modules[name]`` becomes an empty namespace package.
    """
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(init_file))))
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:  # none elsewhere: the namespace package of a folder without __init__.py, without its modules
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = []
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the import statement returns what sys.modules holds after our __init__ ran
    if spec.loader is not None:
        spec.loader.exec_module(module)
