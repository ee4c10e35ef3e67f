"""Checkpoint directories that a failed save cannot destroy: write beside the target, swap in at the end.

A save writes into ``.<name>.lancet-saving`` beside ``<name>`` (rank 0 empties it first). Once every
rank has written and agreed, rank 0 writes a completion marker into it, carries over the files of
the old directory that the save does not write (a tokenizer beside a Hugging Face checkpoint), and
swaps it in: one ``renameat2(RENAME_EXCHANGE)`` where the file system has it, else two renames
through ``.<name>.lancet-previous``. Until the swap, ``<name>`` is the last good checkpoint,
untouched; between the two fallback renames a loader finds the previous one (:func:`resolve`).
A process killed anywhere leaves ``<name>`` loadable (old or new) and at most a staging directory,
which the next save removes.

One save at a time per target: rank 0 holds an exclusive ``flock`` on ``.<name>.lancet-lock`` from
before it empties the staging directory until the swap is done (:class:`SaveLock`); a second job saving
to the same path is refused with a :class:`~lancet_rt.checkpoint._common.CheckpointError` instead of
sharing (and emptying) the first one's staging directory. The lock file is removed on release (a
taker checks that the file it locked is still the one at the path). A path that is a symbolic link
is written at its target, the link kept; a dangling link or a loop is refused before anything is
written (:func:`target`). The marker records a SHA-256 of the DCP ``.metadata`` (checked by loads).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import time
import warnings

try:  # POSIX; elsewhere concurrent saves to one path are not detected
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

MARKER = ".lancet-complete"
# What the two formats write: never carried over from the old directory.
_OWN = re.compile(
    r"(\.metadata|.*\.distcp|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|\.lancet-complete|lancet-manifest\.json|.*\.tmp)"
)


def target(path: str, argument: str) -> str:
    """The absolute directory a save to ``path`` writes: a symbolic link (``latest -> step1``) is followed
    to its target, as the autotune cache does, so the link stays a link; a ValueError naming
    ``argument`` for a dangling link or a loop (checked before anything is written)."""
    path = os.path.abspath(path)
    try:
        return os.path.realpath(path, strict=True)
    except FileNotFoundError:
        if os.path.islink(path):
            raise ValueError(
                f"{argument}: {path!r} is a dangling symbolic link (to {os.readlink(path)!r}); "
                f"point it at a directory or pass the directory itself"
            ) from None
        return os.path.realpath(path)  # a new directory (parents that are links followed)
    except OSError as exc:
        raise ValueError(
            f"{argument}: {path!r} cannot be resolved ({exc.strerror}: a symbolic link loop?); pass a directory"
        ) from None


def lock_path(path: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.lancet-lock")


class SaveLock:
    """Rank 0's exclusive hold on saving to ``path`` (a context manager); ``busy(message)`` is raised
    at once if another process holds it (another save to that path is in progress)."""

    def __init__(self, path: str, busy):
        self.file, self.fd = lock_path(path), None
        os.makedirs(os.path.dirname(self.file), exist_ok=True)
        for _ in range(8):  # the file a holder removed on release: take the new one
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise busy(
                    f"path: another save to {path!r} is in progress (it holds {self.file!r}); this save "
                    f"wrote nothing, the checkpoint there is the other save's or the previous one"
                ) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.file))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)
        raise busy(f"path: could not take the save lock {self.file!r} (other saves keep replacing it)")

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.unlink(self.file)  # while holding it: a waiter finds its file gone and retakes a new one
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def discard(path: str) -> None:
    """Rank 0, after a failed save: remove its staging directory (the target is untouched)."""
    shutil.rmtree(staging(path), ignore_errors=True)


def metadata_digest(directory: str) -> "str | None":
    """SHA-256 of the DCP ``.metadata`` in ``directory`` (None if there is none)."""
    try:
        with open(os.path.join(directory, ".metadata"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def marker(directory: str) -> dict:
    """The completion marker's record of the save ({} for a checkpoint written without one)."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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
    record = {"format": fmt, "ranks": world, "time": time.time()}
    digest = metadata_digest(stage)
    if digest is not None:
        record["metadata_sha256"] = digest
    with open(os.path.join(stage, MARKER), "w") as f:
        json.dump(record, f)
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
        raise ValueError(
            f"path: {path!r} is the staging directory of a save that did not finish; load the checkpoint beside it"
        )
    if not os.path.exists(path) and os.path.isfile(os.path.join(previous(path), MARKER)):
        warnings.warn(
            f"lancet_rt: {path!r} is missing and {previous(path)!r} holds the previous complete "
            f"checkpoint (a save was interrupted while swapping it in); loading that one",
            stacklevel=3,
        )
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
