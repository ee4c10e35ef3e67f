"""The autotune cache reached through symbolic links (a cache shared by users or jobs): every write
updates the link's target in place, atomically (its lock and temporary file beside it, renamed onto
it), so the links stay links, the shared file does not fork, and writers through two links merge."""
from __future__ import annotations

import json
import multiprocessing
import os
import stat
import sys

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
