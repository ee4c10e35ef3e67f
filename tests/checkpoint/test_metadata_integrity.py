"""A damaged DCP ``.metadata`` (the plan of where each chunk goes, which the items' checksums do not
cover): a chunk offset moved past its tensor's end (6 became 22 in an 8-element norm weight) loaded on
every rank with the uncovered elements keeping fresh (uninitialised) values, and two expert rows'
offsets swapped loaded the experts swapped. Now every chunk is checked against its tensor's shape
(within bounds, no overlap, covering it exactly) and the metadata against the SHA-256 the save wrote
into its completion marker, before anything is read: a ValueError naming the key, the model unchanged.
``save_checkpoint`` in one process, ``save_sharded`` on 4 gloo ranks."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import lancet_rt
from lancet_rt.checkpoint import _atomic
from tests.dist import assert_all_ok, outcome, run_ranks


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(lancet_rt.MoE(8, 6, 4, 2), torch.nn.LayerNorm(8))


def _snapshot(model) -> list:
    return [v.detach().clone() for v in model.state_dict().values()]


def rewrite_metadata(path, key: str, move, *, marker_agrees: bool) -> None:
    """Rewrite the ``.metadata`` at ``path`` with ``move(chunk offsets list) -> new offsets list`` applied
    to ``key``'s chunks (and their storage entries); ``marker_agrees``: the marker's SHA-256 updated to
    the new file (a damage the checksum cannot see: only the plan check is left to catch it)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        md = pickle.load(f)
    tensor = md.state_dict_metadata[key]
    old = [tuple(c.offsets) for c in tensor.chunks]
    new = [torch.Size(o) for o in move(old)]
    by_old = {tuple(i.offset): (i, s) for i, s in md.storage_data.items() if i.fqn == key}
    for i, _ in by_old.values():
        del md.storage_data[i]
    for o, n, _c in zip(old, new, tensor.chunks):
        md.storage_data[MetadataIndex(key, n)] = by_old[o][1]
    tensor.chunks = [ChunkStorageMetadata(offsets=n, sizes=c.sizes) for n, c in zip(new, tensor.chunks)]
    with open(file, "wb") as f:
        pickle.dump(md, f)
    marker = os.path.join(path, _atomic.MARKER)
    if marker_agrees and os.path.exists(marker):
        with open(marker) as f:
            record = json.load(f)
        record["metadata_sha256"] = _atomic.metadata_digest(path)
        with open(marker, "w") as f:
            json.dump(record, f)


def _out_of_bounds(offsets):
    *keep, last = offsets
    return keep + [(last[0] + 16,) + last[1:]]


def _swap_first_two(offsets):
    return [offsets[1], offsets[0]] + offsets[2:]


@pytest.mark.parametrize(
    "key, move, marker_agrees, words",
    [
        ("model.1.weight", lambda o: [(o[0][0] + 16,)], True, "lies outside its shape [8]"),
        ("model.0.experts.down_proj", _out_of_bounds, True, "lies outside its shape [4, 8, 6]"),
        ("model.0.experts.down_proj", _swap_first_two, False, "'.metadata' of"),
        ("model.1.bias", lambda o: [(o[0][0] + 1,)], False, "changed since the save"),
    ],
    ids=["norm-offset-past-end", "expert-row-past-end", "expert-rows-swapped", "bias-offset-sha-checked-first"],
)
def test_a_damaged_metadata_is_refused_before_anything_is_read(tmp_path, key, move, marker_agrees, words):
    path = str(tmp_path / "ckpt")
    lancet_rt.save_checkpoint(_model(0), path)
    rewrite_metadata(path, key, move, marker_agrees=marker_agrees)
    model = _model(1)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="damaged|changed since the save") as info:
        lancet_rt.load_checkpoint(model, path)
    assert words in str(info.value) and (not marker_agrees or key in str(info.value)), str(info.value)
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(model)))


def test_a_checkpoint_without_the_marker_sha_still_loads_and_is_plan_checked(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = _model(0)
    lancet_rt.save_checkpoint(saved, path)
    os.remove(os.path.join(path, _atomic.MARKER))  # as plain DCP writes it
    model = _model(1)
    lancet_rt.load_checkpoint(model, path)
    assert all(torch.equal(x, y) for x, y in zip(_snapshot(saved), _snapshot(model)))
    rewrite_metadata(path, "model.1.weight", lambda o: [(o[0][0] + 16,)], marker_agrees=False)
    with pytest.raises(ValueError, match=r"model\.1\.weight: a chunk at offsets \[16\]"):
        lancet_rt.load_checkpoint(_model(1), path)


def _mesh_model(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from lancet_rt.parallel import fully_shard
    from tests.distributed import mesh_cases as mc

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = mc.make_blocks(mesh["ep"].get_group())
    mc.load_from_reference(model, mc.make_blocks(), mesh["ep"].get_local_rank())
    fully_shard(model, mesh, blocks=list(model.blocks))
    return mesh, model


def _save(rank, world, path):
    from lancet_rt.parallel import save_sharded

    mesh, model = _mesh_model(rank, world)
    save_sharded(model, mesh, path)
    import pickle as p

    if rank == 0:
        md = p.load(open(os.path.join(path, ".metadata"), "rb"))
        return sorted(
            (k, len(v.chunks), list(v.size))
            for k, v in md.state_dict_metadata.items()
            if hasattr(v, "chunks") and len(v.size) == 1 and len(v.chunks) > 1
        )
    return None


def _load(rank, world, path):
    from lancet_rt.parallel import load_sharded

    mesh, model = _mesh_model(rank, world)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    before = [p.detach().to_local().clone() for p in model.parameters()]
    got = outcome(lambda: load_sharded(model, mesh, path))
    return got, all(torch.equal(x, p.detach().to_local()) for x, p in zip(before, model.parameters()))


def test_load_sharded_of_a_chunk_moved_past_its_tensor_end_is_refused_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    vectors = assert_all_ok(run_ranks(_save, 4, path, timeout=300))[0]
    assert vectors, "a 1-D tensor saved in several chunks (a norm weight sharded over dp)"
    key = vectors[0][0]
    rewrite_metadata(path, key, _out_of_bounds, marker_agrees=True)
    for r, ((kind, msg, _), unchanged) in enumerate(assert_all_ok(run_ranks(_load, 4, path, timeout=300))):
        assert kind == "ValueError" and key in msg and "lies outside its shape" in msg, (r, kind, msg)
        assert unchanged, f"rank {r}'s model changed"
