"""The autotune cache reached through symbolic links (a cache shared by users or jobs): every write
updates the link's target in place, atomically (its lock and temporary file beside it, renamed onto
it), so the links stay links, the shared file does not fork, and writers through two links merge."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import sys

import pytest
from lancet_rt.autotune import TuneCache
from lancet_rt.autotune import cache as cache_mod

from tests.autotune.test_autotune import _write_many, a_key


def _links(tmp_path):
    """A shared cache file and two links to it from two users' folders (one by a relative path,
    one through a link to a link)."""
    shared = tmp_path / "shared" / "autotune.json"
    shared.parent.mkdir()
    a, b = tmp_path / "alice", tmp_path / "bob"
    a.mkdir()
    b.mkdir()
    os.symlink(os.path.relpath(shared, a), a / "autotune.json")
    os.symlink(shared, b / "hop.json")
    os.symlink(b / "hop.json", b / "autotune.json")
    return shared, str(a / "autotune.json"), str(b / "autotune.json")


def test_a_symlinked_cache_is_updated_at_its_target(tmp_path):
    shared, via_a, via_b = _links(tmp_path)
    TuneCache(via_a, defaults_path=None).store(a_key(d_model=11), {"chunks": 2})  # creates the target
    shared.chmod(0o664)  # a group-shared file stays group-writable
    TuneCache(via_b, defaults_path=None).store(a_key(d_model=22), {"chunks": 3})
    for link in (via_a, via_b, str(tmp_path / "bob" / "hop.json")):
        assert os.path.islink(link), f"{link} was replaced by a plain file"
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o664
    data = json.loads(shared.read_text())
    assert sorted(e["value"]["chunks"] for e in data["entries"].values()) == [2, 3]
    for reader in (via_a, via_b, str(shared)):  # every path reads both writers' entries
        cache = TuneCache(reader, defaults_path=None)
        assert cache.lookup(a_key(d_model=11)).chunks == 2 and cache.lookup(a_key(d_model=22)).chunks == 3
    # the lock and the temporary file live beside the target, none beside the links
    assert sorted(os.listdir(tmp_path / "alice")) == ["autotune.json"]
    assert sorted(os.listdir(tmp_path / "bob")) == ["autotune.json", "hop.json"]
    assert sorted(os.listdir(shared.parent)) == ["autotune.json", "autotune.json.lock"]


def test_concurrent_writers_through_two_links_merge(tmp_path):
    shared, via_a, via_b = _links(tmp_path)
    per_writer = 25
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    procs = [ctx.Process(target=_write_many, args=(path, w, per_writer)) for w, path in ((1, via_a), (2, via_b))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)  # (a hang guard: the writers take seconds)
        assert p.exitcode == 0
    assert os.path.islink(via_a) and os.path.islink(via_b)
    data = json.loads(shared.read_text())
    assert data["schema"] == cache_mod.SCHEMA
    writers = sorted(e["value"]["writer"] for e in data["entries"].values())
    assert writers == [1] * per_writer + [2] * per_writer
    assert not [f for f in os.listdir(shared.parent) if f.endswith(".tmp")]


# ------------------------------------------------------------------ paths that are not a regular file we wrote
def _special(tmp_path, kind: str) -> str:
    """A cache path that is a character device (os.mknod, as /dev/null: 1, 3), a FIFO, a directory, or a
    symbolic link to a character device, made in ``tmp_path``."""
    path = tmp_path / "autotune.json"
    if kind in ("chardev", "link-to-chardev"):
        dev = tmp_path / "null" if kind == "link-to-chardev" else path
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        if kind == "link-to-chardev":
            os.symlink(dev, path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    return str(path)


def _use_the_cache(path: str, queue) -> None:
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cache = TuneCache(path, defaults_path=None)
        found = cache.lookup(a_key(d_model=11))
        try:
            cache.store(a_key(d_model=11), {"chunks": 2})
            raised = None
        except OSError as exc:
            raised = type(exc).__name__
    queue.put((found, raised, [str(w.message) for w in seen]))


def _in_a_child(target, *args):
    """Run ``target(*args, queue)`` in a forked process; (its result or None if it hung or died)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=target, args=args + (queue,))
    p.start()
    p.join(timeout=120)  # a FIFO opened for reading blocks: the hang guard
    if p.is_alive():
        p.kill()
        p.join()
        return None
    return queue.get(timeout=10) if p.exitcode == 0 else None


@pytest.mark.skipif(not hasattr(os, "mknod") or os.geteuid() != 0, reason="os.mknod of a device needs root")
@pytest.mark.parametrize("kind", ["chardev", "fifo", "link-to-chardev", "directory"])
def test_a_cache_path_that_is_not_a_regular_file_is_never_read_nor_replaced(tmp_path, kind):
    path = _special(tmp_path, kind)
    before = os.lstat(path)
    got = _in_a_child(_use_the_cache, path)
    assert got is not None, f"reading or writing the cache at a {kind} hung or crashed"
    found, raised, warned = got
    assert found is None
    if kind == "directory":
        assert raised == "IsADirectoryError"
    else:
        assert raised is None and any("not a regular file" in w for w in warned), warned
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)
    if kind == "link-to-chardev":
        assert stat.S_ISCHR(os.stat(path).st_mode)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def _store_as_nobody(path: str, queue) -> None:
    os.setgid(65534)
    os.setuid(65534)
    _use_the_cache(path, queue)


@pytest.mark.skipif(not hasattr(os, "setuid") or os.geteuid() != 0, reason="dropping privileges needs root")
def test_an_unreadable_cache_file_is_a_warning_and_not_overwritten():
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory(prefix="lancet-cache-") as folder:  # in /tmp: reachable by "nobody"
        os.chmod(folder, 0o777)  # the writer may create files here, but cannot read the cache
        _check_unreadable(pathlib.Path(folder) / "autotune.json")


def _check_unreadable(path) -> None:
    TuneCache(str(path), defaults_path=None).store(a_key(d_model=22), {"chunks": 3})
    path.chmod(0o000)
    os.chmod(str(path) + ".lock", 0o666)  # a shared lock file; only the cache itself is unreadable
    content = path.read_bytes()
    got = _in_a_child(_store_as_nobody, str(path))
    assert got is not None
    found, raised, warned = got
    assert found is None and raised is None
    assert any("cannot read" in w for w in warned) and any("not writing" in w for w in warned), warned
    assert path.read_bytes() == content and stat.S_IMODE(os.stat(path).st_mode) == 0
    assert TuneCache(str(path), defaults_path=None).lookup(a_key(d_model=22)).chunks == 3
