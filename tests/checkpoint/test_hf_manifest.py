"""The Hugging Face layout's own integrity check: a safetensors header edited after ``save_hf`` (one
tensor's dtype F32 made I32, the same byte count; two same-shaped tensors' data offsets swapped) loaded
silently. Now ``save_hf`` writes ``lancet-manifest.json`` (per file the SHA-256 of its header, per
tensor dtype and shape) and ``load_hf`` compares: a ValueError naming the file and the tensor, the
model unchanged. Without a manifest (a transformers ``save_pretrained`` directory) the dtypes are still
checked against the model: an integer tensor does not load into a float parameter."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lancet_rt

MANIFEST = "lancet-manifest.json"

D, E = 8, 4


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(lancet_rt.MoE(D, 6, E, 2), torch.nn.LayerNorm(D))


def _snapshot(model) -> list:
    return [v.detach().clone() for v in model.state_dict().values()]


def edit_header(file: str, edit) -> None:
    """Rewrite the safetensors header of ``file`` in place with ``edit(header dict)``, padded to its length."""
    with open(file, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        edit(header)
        raw = json.dumps(header, separators=(",", ":")).encode()
        assert len(raw) <= n
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))


def _saved(tmp_path):
    path = tmp_path / "hf"
    lancet_rt.save_hf(_model(0), path)
    return path, str(path / "model.safetensors")


def _to_int(header):
    header["1.weight"]["dtype"] = "I32"


def _swap_offsets(header):
    a, b = header["1.weight"], header["1.bias"]
    a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]


@pytest.mark.parametrize(
    "edit, words",
    [
        (_to_int, "tensor '1.weight': dtype/shape ['I32', [8]] in the file, ['F32', [8]] when saved"),
        (_swap_offsets, "its header changed after the save"),
    ],
    ids=["F32-made-I32", "offsets-swapped"],
)
def test_a_header_edited_after_the_save_is_refused_naming_file_and_tensor(tmp_path, edit, words):
    path, file = _saved(tmp_path)
    assert os.path.isfile(path / MANIFEST)
    edit_header(file, edit)
    model = _model(1)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="file 'model.safetensors'") as info:
        lancet_rt.load_hf(model, path)
    assert words in str(info.value), str(info.value)
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(model)))


def test_without_a_manifest_an_integer_tensor_does_not_load_into_a_float_parameter(tmp_path):
    path, file = _saved(tmp_path)
    (path / MANIFEST).unlink(missing_ok=True)  # as transformers' save_pretrained writes it
    lancet_rt.load_hf(_model(1), path)  # a directory without a manifest loads
    edit_header(file, _to_int)
    model = _model(1)
    before = _snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"file 'model.safetensors', tensor '1.weight': dtype I32 in the checkpoint, "
        r"torch.float32 in the model",
    ):
        lancet_rt.load_hf(model, path)
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(model)))


def test_the_manifest_of_a_sharded_save_covers_every_file_and_a_clean_load_works(tmp_path):
    path = tmp_path / "hf"
    saved = _model(0)
    lancet_rt.save_hf(saved, path, max_shard_bytes=256)
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(files) > 1 and sorted(manifest) == files
    model = _model(1)
    lancet_rt.load_hf(model, path)
    assert all(torch.equal(x, y) for x, y in zip(_snapshot(saved), _snapshot(model)))
    lancet_rt.save_hf(saved, path)  # one file now: the manifest lists only it
    assert sorted(json.loads((path / MANIFEST).read_text())["files"]) == ["model.safetensors"]
