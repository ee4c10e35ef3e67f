"""An XXH3-64 checksum of every DCP item in the checkpoint's metadata: written by save_checkpoint (and
save_sharded: tests/distributed/test_mesh_dcp_faults.py), checked on load before the bytes are used.
One bit flipped inside a tensor's bytes is a ValueError naming the key, the file and the rank, with
the model and the optimizer unchanged; checkpoints without checksums (plain DCP) still load, and
plain DCP still reads ours."""

from __future__ import annotations

import io
import os

import pytest
import torch

from lancet_rt.checkpoint.dcp import load_checkpoint, save_checkpoint

D, F, E = 8, 6, 4


def _model(seed=0):
    from lancet_rt.models.blocks import MoEBlocks

    torch.manual_seed(seed)
    return MoEBlocks(2, D, 2, dict(d_ffn=F, num_experts=E, top_k=2))


def _snapshot(model, opt=None) -> list:
    out = [v.detach().clone() for v in model.state_dict().values()]
    if opt is not None:
        out += [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def tensor_bytes_at(path, key: str) -> tuple:
    """(file, absolute offset) of the middle byte of one saved chunk of ``key``'s tensor data."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    info = next(s for i, s in md.storage_data.items() if i.fqn == key)
    file = os.path.join(str(path), info.relative_path)
    with open(file, "rb") as f:
        f.seek(info.offset)
        region = f.read(info.length)
    raw = torch.load(io.BytesIO(region), weights_only=True).numpy().tobytes()
    at = region.find(raw)
    assert at >= 0 and len(raw) > 8, "the tensor's bytes are in the item"
    return file, info.offset + at + len(raw) // 2


def flip_bit(file: str, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x10]))


def test_every_item_has_a_checksum_of_its_bytes(tmp_path):
    import xxhash
    from torch.distributed.checkpoint import FileSystemReader

    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, D)).sum().backward()
    opt.step()
    save_checkpoint(model, tmp_path / "c", opt)
    md = FileSystemReader(str(tmp_path / "c")).read_metadata()
    assert len(md.storage_data) > len(model.state_dict())  # one chunk per expert, the optimizer's entries
    for index, info in md.storage_data.items():
        with open(tmp_path / "c" / info.relative_path, "rb") as f:
            f.seek(info.offset)
            assert info.xxh3_64 == xxhash.xxh3_64_intdigest(f.read(info.length)), index.fqn


@pytest.mark.parametrize(
    "key",
    [
        "model.blocks.0.attn.qkv.weight",
        "model.blocks.1.moe.experts.down_proj",
        "optim.state.blocks.0.norm1.weight.exp_avg",
    ],
)
def test_a_bit_flipped_inside_a_tensor_raises_naming_key_and_file_and_changes_nothing(tmp_path, key):
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, D)).sum().backward()
    opt.step()
    save_checkpoint(model, tmp_path / "c", opt)
    file, offset = tensor_bytes_at(tmp_path / "c", key)
    flip_bit(file, offset)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError) as info:
        load_checkpoint(model, tmp_path / "c", opt)
    msg = str(info.value)
    assert "checksum mismatch" in msg and f"key {key}" in msg and os.path.basename(file) in msg, msg
    assert "rank 0" in msg, msg
    assert _same(_snapshot(model, opt), before)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoints_without_checksums_load_and_plain_dcp_reads_ours(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = _model()
    flat = {"model." + k: v for k, v in model.state_dict().items()}
    dcp.save(flat, checkpoint_id=str(tmp_path / "plain"), no_dist=True)  # no lancet metadata at all
    fresh = _model(seed=1)
    load_checkpoint(fresh, tmp_path / "plain")
    assert _same(_snapshot(fresh), _snapshot(model))
    save_checkpoint(model, tmp_path / "ours")
    target = {"model.blocks.0.attn.qkv.weight": torch.zeros_like(model.blocks[0].attn.qkv.weight)}
    dcp.load(target, checkpoint_id=str(tmp_path / "ours"), no_dist=True)
    assert torch.equal(target["model.blocks.0.attn.qkv.weight"], model.blocks[0].attn.qkv.weight.detach())
