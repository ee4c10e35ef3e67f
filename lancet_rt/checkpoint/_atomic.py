"""Checkpoint directories that a failed save cannot destroy: write beside the target, swap in at the end.

A save writes into ``.<name>.lancet-saving`` beside ``<name>`` (rank 0 empties it first). Once every
rank has written and agreed, rank 0 writes a completion marker into it, carries over the files of
the old directory that the save does not write (a tokenizer beside a Hugging Face checkpoint), and
swaps it in: one ``renameat2(RENAME_EXCHANGE)`` where the file system has it, else two renames
through ``.<name>.lancet-previous``. Until the swap, ``<name>`` is the last good checkpoint,
untouched; between the two fallback renames a loader finds the previous one (:func:`resolve`).
A process killed anywhere leaves ``<name>`` loadable (old or new) and at most a staging directory,
which the next save removes.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import time
import warnings

MARKER = ".lancet-complete"
# What the two formats write: never carried over from the old directory.
_OWN = re.compile(r"(\.metadata|.*\.distcp|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
                  r"|\.lancet-complete|.*\.tmp)")


def staging(path: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.lancet-saving")


def previous(path: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.lancet-previous")


def prepare(path: str) -> None:
    """Rank 0, before the ranks agree: an empty staging directory beside ``path`` (ValueError if ``path``
    is not a directory or cannot be written beside)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"path: {path!r} exists and is not a directory")
    _recover(path)
    stage = staging(path)
    shutil.rmtree(stage, ignore_errors=True)  # a save killed earlier
    os.makedirs(stage)


def commit(path: str, fmt: str, world: int) -> None:
    """Rank 0, once every rank wrote its part into the staging directory: mark it complete and swap it in."""
    stage = staging(path)
    with open(os.path.join(stage, MARKER), "w") as f:
        json.dump({"format": fmt, "ranks": world, "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.isdir(path):
        _carry_over(path, stage)
    _fsync_dir(stage)
    if not os.path.exists(path):
        os.rename(stage, path)
    elif _exchange(stage, path):  # one atomic step: the old directory is now the staging one
        shutil.rmtree(stage, ignore_errors=True)
    else:
        old = previous(path)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(stage, path)  # (a crash just before this leaves only the previous: resolve() finds it)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(path) or ".")


def resolve(path: str) -> str:
    """The directory to load for ``path``: itself, or its previous version if a save died mid-swap; a
    ValueError for a staging directory (a save that never finished)."""
    if re.fullmatch(r"\..+\.lancet-saving", os.path.basename(os.path.normpath(path))):
        raise ValueError(f"path: {path!r} is the staging directory of a save that did not finish; load the "
                         f"checkpoint beside it")
    if not os.path.exists(path) and os.path.isfile(os.path.join(previous(path), MARKER)):
        warnings.warn(f"lancet_rt: {path!r} is missing and {previous(path)!r} holds the previous complete "
                      f"checkpoint (a save was interrupted while swapping it in); loading that one")
        return previous(path)
    return path


def _recover(path: str) -> None:
    # A save that died between the two fallback renames: put the previous checkpoint back.
    old = previous(path)
    if not os.path.exists(path) and os.path.isfile(os.path.join(old, MARKER)):
        os.rename(old, path)
    elif os.path.exists(old) and os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)


def _carry_over(old: str, stage: str) -> None:
    for name in os.listdir(old):
        src, dst = os.path.join(old, name), os.path.join(stage, name)
        if _OWN.fullmatch(name) or os.path.exists(dst):
            continue
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)


def _exchange(a: str, b: str) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
