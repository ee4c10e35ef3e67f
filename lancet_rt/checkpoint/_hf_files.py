"""The files of a Hugging Face checkpoint directory: writing one atomically, the index and config, the
safetensors headers, and reads that name the file, the key and the rank when they fail.

Integrity: the save writes ``lancet-manifest.json`` beside the files (transformers ignores it): per
file the SHA-256 of its safetensors header, per tensor its dtype and shape. A load compares every
file's header with it (a header edited after the save, one tensor's F32 made I32 say, names the file
and the tensor) and every tensor's dtype with the model's (a float parameter from an integer tensor
is refused, with or without a manifest: a plain ``save_pretrained`` directory has none). The
checkpoint's identity, which the ranks of a load agree on, is the SHA-256 of the index and headers."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import sys

_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
MANIFEST = "lancet-manifest.json"
_MAX_HEADER = 100 << 20


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
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
        os.replace(index + ".tmp", index)
    _write_manifest(directory, names)
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
            raise ValueError(
                f"directory: file {_INDEX!r} of {directory!r} is not a readable index ({type(exc).__name__}: {exc})"
            ) from exc
    raise ValueError(f"directory: neither {_SINGLE} nor {_INDEX} in {directory!r}")


def _header(directory: str, name: str) -> tuple:
    """(raw bytes, parsed JSON) of a safetensors file's header; a ValueError naming the file if unreadable."""
    try:
        with open(os.path.join(directory, name), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= _MAX_HEADER:
                raise ValueError(f"a header of {n} bytes")
            raw = f.read(n)
        parsed = json.loads(raw)
        if not isinstance(parsed, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"directory: file {name!r} of {directory!r} is missing or damaged "
            f"({type(exc).__name__}: {str(exc).strip()[:300]})"
        ) from exc
    return raw, parsed


def _tensors(header: dict) -> dict:
    return {
        k: [v.get("dtype"), v.get("shape")] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
    }


def _write_manifest(directory: str, names: list) -> None:
    files = {}
    for name in names:
        raw, header = _header(directory, name)
        files[name] = {"header_sha256": hashlib.sha256(raw).hexdigest(), "tensors": _tensors(header)}
    with open(os.path.join(directory, MANIFEST + ".tmp"), "w") as fh:
        json.dump({"format": "lancet-rt/hf-manifest", "version": 1, "files": files}, fh, indent=1, sort_keys=True)
    os.replace(os.path.join(directory, MANIFEST + ".tmp"), os.path.join(directory, MANIFEST))


class _Headers:
    """Shapes and dtypes from the safetensors headers (read once, checked against the manifest where the
    save wrote one), files opened once for reading (safetensors maps them; nothing is read yet);
    ``identity``: the SHA-256 of the index and every header, what the ranks of a load agree on."""

    def __init__(self, directory: str, weight_map: dict):
        self.directory, self.weight_map, self.open = directory, weight_map, {}
        self.headers, self.sha256, h = {}, {}, hashlib.sha256()
        for name in sorted(set(weight_map.values())):
            raw, header = _header(directory, name)
            self.headers[name], self.sha256[name] = _tensors(header), hashlib.sha256(raw).hexdigest()
            h.update(name.encode() + b"\0" + raw)
        h.update(json.dumps(sorted(weight_map.items())).encode())
        self.identity = h.hexdigest()
        self._check_manifest(h)

    def _check_manifest(self, h) -> None:
        try:
            with open(os.path.join(self.directory, MANIFEST), "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            return  # written by transformers' save_pretrained: checked against the model only
        h.update(raw)
        self.identity = h.hexdigest()
        try:
            files = json.loads(raw)["files"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"directory: file {MANIFEST!r} of {self.directory!r} is damaged ({exc})") from exc
        for name, got in self.headers.items():
            want = files.get(name) if isinstance(files, dict) else None
            if not isinstance(want, dict):
                raise ValueError(
                    f"directory: file {name!r} of {self.directory!r} is not in its {MANIFEST} (written after the save?)"
                )
            for key in sorted(set(got) | set(want.get("tensors", {}))):
                a, b = got.get(key), want.get("tensors", {}).get(key)
                if a != b:
                    raise ValueError(
                        f"directory: file {name!r} of {self.directory!r}, tensor {key!r}: dtype/shape {a} in the "
                        f"file, {b} when saved ({MANIFEST}): the file changed after the save; nothing was loaded"
                    )
            if self.sha256[name] != want.get("header_sha256"):
                raise ValueError(
                    f"directory: file {name!r} of {self.directory!r}: its header changed after the "
                    f"save (its SHA-256 differs from {MANIFEST}'s); nothing was loaded"
                )

    def file(self, key: str):
        name = self.weight_map[key]
        if name not in self.open:
            self.open[name] = _safe_open(self.directory, name)
        return self.open[name]

    def shape(self, key: str) -> tuple:
        return tuple(self.file(key).get_slice(key).get_shape())

    def dtype_error(self, key: str, dtype) -> "str | None":
        """Why the tensor ``key`` cannot load into a parameter of ``dtype`` (a cast across kinds), or None."""
        got = (self.headers.get(self.weight_map.get(key), {}).get(key) or [None])[0]
        kind = (
            "float"
            if dtype.is_floating_point
            else "complex"
            if dtype.is_complex
            else "bool"
            if (str(dtype) == "torch.bool")
            else "int"
        )
        disk = {"F": "float", "B": "float", "C": "complex", "I": "int", "U": "int"}.get(str(got)[:1], "?")
        disk = "bool" if got == "BOOL" else disk
        if got is None or disk == kind:
            return None
        return (
            f"file {self.weight_map.get(key)!r}, tensor {key!r}: dtype {got} in the checkpoint, {dtype} in the "
            f"model (a {disk} tensor does not load into a {kind} parameter)"
        )


def _safe_open(directory: str, name: str):
    """safetensors' ``safe_open``; a ValueError naming the file if it is missing, truncated or not safetensors
    (safetensors checks the header and that the data covers the file)."""
    from safetensors import safe_open

    try:
        return safe_open(os.path.join(directory, name), framework="pt")
    except Exception as exc:  # SafetensorError, OSError: the file is bad either way
        raise ValueError(
            f"directory: file {name!r} of {directory!r} is missing or damaged "
            f"({type(exc).__name__}: {str(exc).strip()[:300]})"
        ) from exc


def _read(headers: "_Headers", key: str, rank: int, get):
    """``get(file, key)``; a ValueError naming the file, the key and the rank if the data cannot be read."""
    try:
        return get(headers.file(key), key)
    except Exception as exc:  # safetensors' errors name neither file nor rank
        raise ValueError(
            f"directory: file {headers.weight_map.get(key)!r} of {headers.directory!r}, key {key!r}, "
            f"could not be read on rank {rank} ({type(exc).__name__}: {str(exc).strip()[:300]})"
        ) from exc
