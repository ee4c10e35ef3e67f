"""The files of a Hugging Face checkpoint directory: writing one atomically, the index and config, the
safetensors headers, and reads that name the file, the key and the rank when they fail."""
from __future__ import annotations

import copy
import json
import os
import re
import sys

_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _is_hf(model) -> bool:
    # A transformers model exists only if transformers is imported: never import it (seconds) to ask.
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def _write_atomic(save_file, tensors: dict, path: str) -> None:
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def _finish_hf_dir(model, directory: str, names: list, every: list) -> None:
    """Rank 0, once every file is written: the index (or none for one file), the config, stale files out."""
    for f in os.listdir(directory):
        if (_SHARD_NAME.fullmatch(f) or f == _SINGLE) and f not in names:
            os.remove(os.path.join(directory, f))
    index = os.path.join(directory, _INDEX)
    if len(names) == 1:
        if os.path.exists(index):
            os.remove(index)
    else:
        files = [f for per_rank in every for f in per_rank]
        weight_map = {key: names[i] for i, entries in enumerate(files) for key, _ in entries}
        total = sum(nbytes for entries in files for _, nbytes in entries)
        with open(index + ".tmp", "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh,
                      indent=2)
        os.replace(index + ".tmp", index)
    if _is_hf(model):
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(directory)


def _weight_map(directory: str) -> dict:
    index = os.path.join(directory, _INDEX)
    single = os.path.join(directory, _SINGLE)
    if os.path.isfile(single):
        with _safe_open(directory, _SINGLE) as f:
            return {k: _SINGLE for k in f.keys()}
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                return dict(json.load(fh)["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"directory: file {_INDEX!r} of {directory!r} is not a readable index "
                             f"({type(exc).__name__}: {exc})") from exc
    raise ValueError(f"directory: neither {_SINGLE} nor {_INDEX} in {directory!r}")


class _Headers:
    """Shapes from safetensors headers, files opened once (safetensors maps them; nothing is read yet)."""

    def __init__(self, directory: str, weight_map: dict):
        self.directory, self.weight_map, self.open = directory, weight_map, {}

    def file(self, key: str):
        name = self.weight_map[key]
        if name not in self.open:
            self.open[name] = _safe_open(self.directory, name)
        return self.open[name]

    def shape(self, key: str) -> tuple:
        return tuple(self.file(key).get_slice(key).get_shape())


def _safe_open(directory: str, name: str):
    """safetensors' ``safe_open``; a ValueError naming the file if it is missing, truncated or not safetensors
    (safetensors checks the header and that the data covers the file)."""
    from safetensors import safe_open

    try:
        return safe_open(os.path.join(directory, name), framework="pt")
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the file is bad either way
        raise ValueError(f"directory: file {name!r} of {directory!r} is missing or damaged "
                         f"({type(exc).__name__}: {str(exc).strip()[:300]})") from exc


def _read(headers: "_Headers", key: str, rank: int, get):
    """``get(file, key)``; a ValueError naming the file, the key and the rank if the data cannot be read."""
    try:
        return get(headers.file(key), key)
    except Exception as exc:  # noqa: BLE001 - safetensors' errors name neither file nor rank
        raise ValueError(f"directory: file {headers.weight_map.get(key)!r} of {headers.directory!r}, key {key!r}, "
                         f"could not be read on rank {rank} ({type(exc).__name__}: {str(exc).strip()[:300]})") from exc
