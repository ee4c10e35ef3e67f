"""Saves at paths that are not a plain directory, and saves that fill the disk.

- A symbolic link (``latest -> step1``): the save replaced the link with a real directory and left
  ``.latest.lancet-saving -> step1`` behind (later saves failed with FileExistsError). Now it is written
  at the link's target, the link kept, nothing left beside either.
- A dangling link or a link loop: the error came only after the whole checkpoint was written, a full
  hidden copy left. Now a ValueError naming the path before anything is written, on every rank.
- A full disk (a small tmpfs mounted in the test's folder): the error read "[enforce fail at
  inline_container.cc:672] . unexpected pos ..." and left the staging directory. Now an
  OSError(ENOSPC) naming the path on every rank, no staging left, the previous checkpoint intact.
Each for ``save_checkpoint`` and ``save_hf`` (one process) and ``save_sharded`` (2 gloo ranks)."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

import lancet_rt
from tests.dist import assert_all_ok, outcome, run_ranks

FORMATS = {"dcp": (lancet_rt.save_checkpoint, lancet_rt.load_checkpoint), "hf": (lancet_rt.save_hf, lancet_rt.load_hf)}


def _model(seed, d=8, ep_group=None):
    torch.manual_seed(seed)
    return torch.nn.Sequential(lancet_rt.MoE(d, 6, 4, 2, ep_group=ep_group), torch.nn.LayerNorm(d))


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_save_through_a_symbolic_link_writes_its_target_and_keeps_the_link(tmp_path, fmt):
    save, load = FORMATS[fmt]
    save(_model(0), tmp_path / "step1")
    os.symlink("step1", tmp_path / "latest")
    for seed in (1, 2):  # the second save through the link too (it failed with FileExistsError)
        save(_model(seed), tmp_path / "latest")
        assert os.path.islink(tmp_path / "latest") and os.readlink(tmp_path / "latest") == "step1"
        assert sorted(os.listdir(tmp_path)) == ["latest", "step1"], os.listdir(tmp_path)
        fresh = _model(9)
        load(fresh, tmp_path / "step1")
        assert _same(fresh, _model(seed))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_a_dangling_link_or_a_loop_is_refused_before_anything_is_written(tmp_path, fmt, kind):
    save, _ = FORMATS[fmt]
    os.symlink("missing" if kind == "dangling" else "ckpt", tmp_path / "ckpt")
    with pytest.raises(
        ValueError,
        match=r"(path|directory): .*ckpt' (is a dangling symbolic link|cannot be "
        r"resolved .*symbolic link loop)",
    ):
        save(_model(0), tmp_path / "ckpt")
    assert os.listdir(tmp_path) == ["ckpt"] and os.path.islink(tmp_path / "ckpt")


def _sharded_to_links(rank, world, base):
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import fully_shard, load_sharded, save_sharded
    from tests.distributed import mesh_cases as mc

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    model = mc.make_blocks(mesh["ep"].get_group())
    mc.load_from_reference(model, mc.make_blocks(), mesh["ep"].get_local_rank())
    fully_shard(model, mesh, blocks=list(model.blocks))
    loop = outcome(lambda: save_sharded(model, mesh, f"{base}/loop"))
    save_sharded(model, mesh, f"{base}/latest")
    load_sharded(model, mesh, f"{base}/latest")
    return loop


def test_save_sharded_through_links_on_every_rank(tmp_path):
    os.makedirs(tmp_path / "step1")
    os.symlink("step1", tmp_path / "latest")
    os.symlink("loop", tmp_path / "loop")
    for r, (kind, msg, _) in enumerate(assert_all_ok(run_ranks(_sharded_to_links, 2, str(tmp_path), timeout=300))):
        assert kind == "ValueError" and "symbolic link loop" in msg, (r, kind, msg)
    assert sorted(os.listdir(tmp_path)) == ["latest", "loop", "step1"]
    assert os.path.islink(tmp_path / "latest") and os.path.isfile(tmp_path / "step1" / ".metadata")


# ------------------------------------------------------------------ a full disk
@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs mounted at ``tmp_path / "disk"`` (skipped where mounting is not allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}): no way to fill a disk")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _no_space(fmt, disk):
    save, load = FORMATS[fmt]
    save(_model(0), disk / "ckpt")  # fits
    with pytest.raises(OSError) as info:
        save(_model(1, d=2048), disk / "ckpt")  # does not
    return info.value


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_full_disk_is_enospc_naming_the_path_and_leaves_the_last_checkpoint(small_disk, fmt):
    err = _no_space(fmt, small_disk)
    assert err.errno == errno.ENOSPC, repr(err)
    assert "no space left" in str(err) and repr(str(small_disk / "ckpt")) in str(err), str(err)
    assert os.listdir(small_disk) == ["ckpt"], os.listdir(small_disk)  # no staging directory, no lock
    fresh = _model(9)
    FORMATS[fmt][1](fresh, small_disk / "ckpt")
    assert _same(fresh, _model(0))


def _fill_on_ranks(rank, world, disk):
    import torch.distributed as dist

    lancet_rt.save_checkpoint(_model(0, ep_group=dist.group.WORLD), f"{disk}/ckpt")
    got = outcome(lambda: lancet_rt.save_checkpoint(_model(1, d=2048, ep_group=dist.group.WORLD), f"{disk}/ckpt"))
    fresh = _model(9, ep_group=dist.group.WORLD)
    lancet_rt.load_checkpoint(fresh, f"{disk}/ckpt")
    return got, _same(fresh, _model(0, ep_group=dist.group.WORLD))


def test_a_full_disk_is_enospc_on_every_rank(small_disk):
    for r, ((kind, msg, _), intact) in enumerate(
        assert_all_ok(run_ranks(_fill_on_ranks, 2, str(small_disk), timeout=300))
    ):
        assert kind == "OSError" and "no space left" in msg and "[Errno 28]" in msg, (r, kind, msg)
        assert intact, f"rank {r}: the previous checkpoint does not load as saved"
    assert os.listdir(small_disk) == ["ckpt"]
