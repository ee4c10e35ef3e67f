"""DCP under the checkpoint safety layer: what :func:`lancet_rt.save_checkpoint` and
:func:`lancet_rt.parallel.save_sharded` (and their loads) share; each format only builds its
:class:`State` (the flat DCP state dict and its save planner).

Saving (:func:`save`): :func:`~lancet_rt.checkpoint._common.guarded_save` with DCP as the write,
into the staging directory, DCP's collectives bounded by the group's monitor, through
:func:`_checksum_writer`: the checksum of each item's bytes, taken as they are written, goes beside
the item's offset and length in DCP's own ``.metadata`` (an attribute of its ``_StorageInfo``,
which a reader without lancet-rt ignores). The checksum is XXH3-64 (the ``xxhash`` package: several
times zlib's CRC-32 rate on one core; bench/results/HISTORY.md), so that checking every byte
costs a fraction of the I/O rather than half of it.

Loading (:func:`load`): the metadata is checked against the model and every data file's presence
and size (ValueError naming the file and key, before any tensor is read); the tensors are read into
new ones through :func:`_reader` (each item's checksum checked over the file before DCP reads and deserialises
it; any failure names the file, the key and the global rank), and copied in only once every rank
read all of its part. DCP's own ``CheckpointException`` (a BaseException) never escapes: it becomes
a ValueError (bad data on every failing rank) or a :class:`~lancet_rt.checkpoint._common.CheckpointError`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import xxhash

from lancet_rt.checkpoint import _atomic
from lancet_rt.checkpoint._common import (
    _FULL_BYTES,
    _agree,
    _bad_argument,
    _dcp_failure,
    _digest,
    _free_bytes,
    _is_no_space,
    _listing,
    guarded_save,
    path_argument,
    write_failure,
)
from lancet_rt.comm.group import as_group

_BLOCK = 1 << 24  # a checksum read back from a file goes in 16 MiB blocks
#: The attribute of an item's storage info that holds its checksum, and the algorithm's name in messages.
FIELD, ALGORITHM = "xxh3_64", "XXH3-64"


def digest(data) -> int:
    """The checksum of ``data`` (bytes-like) that our checkpoints store per item."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass
class State:
    """What a DCP checkpoint format saves or loads: ``flat`` (DCP key -> tensor, DTensor or object),
    ``shards`` (DCP key -> :class:`~lancet_rt.checkpoint._common._Shard` of expert tensors whose
    global shape the DTensor does not carry, for messages and the row planner), the optimizer's
    ``(key, param FQN, state name)`` entries, and the save planner's factory."""

    flat: dict
    shards: dict
    optim_keys: list
    has_optim: bool
    planner: Callable[[], object]

    def signature(self) -> list:
        """Keys, global shapes and dtypes: equal on every rank of one model."""
        out = []
        for k, v in self.flat.items():
            if isinstance(v, torch.Tensor):
                s = self.shards.get(k)
                out.append((k, s.global_shape(v) if s else tuple(v.shape), str(v.dtype)))
            else:
                out.append((k,))
        return out


# ------------------------------------------------------------------ save
def save(build: Callable[[], State], path, pg, use_dist: bool, what: str = "checkpoint save (DCP)") -> None:
    """Save the :class:`State` ``build()`` gives at ``path`` on every rank of ``pg`` (the protocol of
    :func:`~lancet_rt.checkpoint._common.guarded_save`; ``build`` runs inside its validation)."""

    def prepare(_path):
        state = build()
        return state, _digest(state.signature())

    def write(state: State, stage: str, target: str) -> Optional[Exception]:
        import torch.distributed.checkpoint as dcp

        try:
            with _single_process_quiet(), _bounded(pg, use_dist, what):
                dcp.save(
                    state.flat,
                    storage_writer=_checksum_writer(stage),
                    planner=state.planner(),
                    process_group=pg,
                    no_dist=not use_dist,
                )
        except _checkpoint_exception() as exc:  # every rank has it (DCP gathers the failures)
            free = _free_bytes(stage)
            if _is_no_space(exc) or (free is not None and free < _FULL_BYTES):
                return write_failure(
                    exc, target, stage, "writing the checkpoint", "path", dist.get_rank(pg) if use_dist else 0
                )
            return _dcp_failure(exc, target, "writing", pg)
        return None

    guarded_save(prepare, write, path, pg, use_dist, fmt="dcp")


def _file_digest(file, offset: int, length: int) -> int:
    """The checksum of ``length`` bytes of ``file`` at ``offset`` (-1 if the file ends before), read in
    blocks into one reused buffer (from the page cache, about a memory copy: no copy of the whole item)."""
    file.seek(offset)
    h, left = xxhash.xxh3_64(), length
    block = memoryview(bytearray(min(_BLOCK, max(length, 1))))
    while left > 0:
        n = file.readinto(block[: min(len(block), left)])
        if not n:
            break
        h.update(block[:n])
        left -= n
    return h.intdigest() if left == 0 else -1


class _DigestStream:
    """A file being written, with the checksum of the bytes between consecutive ``tell()`` calls: DCP
    calls ``tell()`` before and after each item it writes, so each item's checksum comes from the bytes
    as they pass, without reading the file again. ``segments``: (start, end) -> checksum."""

    def __init__(self, raw, segments: dict):
        self.raw, self.segments = raw, segments
        self.start, self.hash = raw.tell(), xxhash.xxh3_64()

    def write(self, b) -> int:
        n = self.raw.write(b)
        self.hash.update(memoryview(b).cast("B")[:n])
        return n

    def tell(self) -> int:
        pos = self.raw.tell()
        self.segments[(self.start, pos)] = self.hash.intdigest()
        self.start, self.hash = pos, xxhash.xxh3_64()
        return pos

    def __getattr__(self, name):
        return getattr(self.raw, name)


def _checksum_writer(stage: str):
    """DCP's file writer; each written item's storage info gets :data:`FIELD`, the checksum of its bytes as
    written (from the bytes passing through the stream; read back from the file where DCP did not
    delimit the item by ``tell()``)."""
    import contextlib

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.futures import Future

    class Writer(FileSystemWriter):
        def __init__(self):
            super().__init__(stage)
            self.segments: dict = {}  # file name -> {(start, end): checksum}
            create = self.fs.create_stream

            @contextlib.contextmanager
            def create_stream(path, mode):
                with create(path, mode) as raw:
                    if "w" not in mode:
                        yield raw
                    else:
                        yield _DigestStream(raw, self.segments.setdefault(os.path.basename(os.fspath(path)), {}))

            self.fs.create_stream = create_stream

        def write_data(self, plan, planner):
            results = super().write_data(plan, planner).wait()
            for r in results:
                info = r.storage_data
                value = self.segments.get(info.relative_path, {}).get((info.offset, info.offset + info.length))
                if value is None:
                    with open(os.path.join(self.path, info.relative_path), "rb") as f:
                        value = _file_digest(f, info.offset, info.length)
                setattr(info, FIELD, value)  # pickled with it (its __getstate__: its __dict__)
            done: Future = Future()
            done.set_result(results)
            return done

    return Writer()


# ------------------------------------------------------------------ load
def load(build: Callable[[], State], path, pg, use_dist: bool) -> State:
    """Load the checkpoint at ``path`` into the :class:`State` ``build()`` gives (its tensors in
    place, its objects replaced), on every rank of ``pg``; returns that state. Nothing changes
    unless every rank validated and read all of its part; errors are raised on every rank."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    error, state, metadata, same = None, None, None, None
    try:
        path = _atomic.resolve(path_argument(path, "path"))
        metadata, identity = _read_metadata(path)
        same = ("path", (os.path.realpath(path), identity))
        state = build()
        _check_dcp(state, path, metadata)
    except Exception as exc:  # every rank must learn of it, or the others would hang
        error = _bad_argument(exc, "path")
    _agree(error, pg, use_dist, same=same)  # every rank reads one checkpoint: the same path and metadata
    who = _rank_name(pg, use_dist)

    def read(entries: dict) -> Optional[Exception]:
        import torch.distributed.checkpoint as dcp

        try:
            with _single_process_quiet(), _bounded(pg, use_dist, "checkpoint load (DCP)"):
                dcp.load(
                    entries,
                    storage_reader=_reader(path, who, metadata),
                    planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                    process_group=pg,
                    no_dist=not use_dist,
                )
        except _checkpoint_exception() as exc:  # every rank has it (DCP gathers the failures)
            return _dcp_failure(exc, path, "reading", pg)
        return None

    if state.has_optim:
        # The param groups are one pickled object: read and compared first, so that an optimizer
        # grouping other parameters fails before any tensor is read.
        groups = {"optim.param_groups": None}
        _agree(read(groups), pg, use_dist)
        _agree(_param_groups_error(groups["optim.param_groups"], state.flat["optim.param_groups"]), pg, use_dist)
    # Read into new tensors; the parameters and the optimizer's state change only once every rank read all.
    fresh = {k: _fresh(v) for k, v in state.flat.items()}
    _agree(read(fresh), pg, use_dist)
    with torch.no_grad():
        for k, v in state.flat.items():
            if isinstance(v, torch.Tensor):
                local(v).copy_(local(fresh[k]))
            else:
                state.flat[k] = fresh[k]
    return state


def _rank_name(pg, use_dist: bool) -> str:
    if not use_dist:
        return "rank 0"

    return as_group(pg).monitor.name(dist.get_rank(pg))


def _read_metadata(path: str) -> tuple:
    """(DCP metadata, its SHA-256) of the checkpoint at ``path``, read once (DCP is handed this copy):
    a ValueError if it is unreadable, differs from the SHA-256 the save recorded in its completion
    marker, or plans chunks that do not tile their tensors."""
    import hashlib
    import pickle

    from torch.distributed.checkpoint.metadata import StorageMeta

    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            raw = f.read()
        metadata = pickle.loads(raw)
        _ = metadata.state_dict_metadata
    except Exception as exc:  # any unreadable checkpoint is a bad argument
        raise ValueError(
            f"path: no readable torch.distributed.checkpoint at {path!r} ({type(exc).__name__}: {exc})"
        ) from exc
    identity = hashlib.sha256(raw).hexdigest()
    want = _atomic.marker(path).get("metadata_sha256")
    if want is not None and want != identity:
        raise ValueError(
            f"path: file '.metadata' of {path!r} changed since the save (SHA-256 {identity[:16]}..., "
            f"{str(want)[:16]}... when saved): the checkpoint is damaged; nothing was read"
        )
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    _check_chunks(metadata, path)
    return metadata, identity


def _check_chunks(metadata, path: str) -> None:
    """ValueError naming a tensor whose chunks lie outside its shape, overlap, leave elements uncovered or
    have no data: a damaged plan would otherwise leave elements unread (the items' checksums cover their
    bytes, not where they go)."""
    import math

    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    storage, problems = metadata.storage_data or {}, []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        size, boxes, bad = tuple(md.size), [], None
        for c in md.chunks:
            off, n = tuple(c.offsets), tuple(c.sizes)
            if (
                len(off) != len(size)
                or len(n) != len(size)
                or any(o < 0 or k < 0 or o + k > d for o, k, d in zip(off, n, size))
            ):
                bad = f"{fqn}: a chunk at offsets {list(off)} of sizes {list(n)} lies outside its shape {list(size)}"
            elif MetadataIndex(fqn, off) not in storage:
                bad = f"{fqn}: the chunk at offsets {list(off)} has no data in the checkpoint"
            boxes.append((off, n))
        covered = sum(math.prod(n) for _, n in boxes)
        if bad is None and (covered != math.prod(size) or _overlap(boxes)):
            bad = (
                f"{fqn}: its {len(boxes)} chunks cover {covered} elements of its {math.prod(size)} "
                f"(shape {list(size)}){' and overlap' if covered == math.prod(size) else ''}"
            )
        if bad:
            problems.append(bad)
    if problems:
        raise ValueError(f"path: the metadata of the checkpoint at {path!r} is damaged: " + "; ".join(problems[:4]))


def _overlap(boxes: list) -> bool:
    """Whether two of the boxes (offsets, sizes) share an element (a sweep along dim 0)."""
    boxes = sorted(b for b in boxes if all(b[1]))  # an empty chunk holds nothing
    for i, (a, n) in enumerate(boxes):
        for b, m in boxes[i + 1 :]:
            if a and b[0] >= a[0] + n[0]:
                break
            if all(y < x + k and x < y + j for x, k, y, j in zip(a, n, b, m)):
                return True
    return False


def _check_dcp(state: State, path: str, metadata) -> None:
    """ValueError naming what differs between the checkpoint at ``path`` (its ``metadata``) and the model."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    _check_files(metadata.storage_data or {}, path)
    if state.has_optim and not any(k.startswith("optim.") for k in saved):
        raise ValueError(
            f"path: the checkpoint at {path!r} holds no optimizer state (saved without optimizer=); "
            f"load it with optimizer=None"
        )
    missing = [k for k in state.flat if k not in saved]
    compared = ("model.", "optim.") if state.has_optim else ("model.",)  # saved optimizer state may go unread
    unexpected = [k for k in saved if k.startswith(compared) and k not in state.flat]
    problems = []
    for key, v in state.flat.items():
        if key not in saved or not isinstance(v, torch.Tensor):
            continue
        md = saved[key]
        shard = state.shards.get(key)
        want = shard.global_shape(v) if shard else tuple(v.shape)
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key} is not a tensor in the checkpoint")
        elif tuple(md.size) != want:
            if shard and len(md.size) == len(want) and tuple(md.size[1:]) == want[1:]:
                problems.append(
                    f"{key}: the checkpoint has E={md.size[0]} experts, the model's layer "
                    f"{shard.layer!r} has E={shard.num_experts}"
                )
            else:
                problems.append(f"{key}: shape {tuple(md.size)} in the checkpoint, {want} in the model")
    if missing:
        problems.append(f"missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {_listing(unexpected)}")
    if problems:
        raise ValueError(f"path: the checkpoint at {path!r} does not fit the model: " + "; ".join(problems))


def _check_files(storage_data: dict, path: str) -> None:
    """ValueError naming a data file that is missing or shorter than the metadata says (a truncated copy)."""
    ends: dict = {}
    for index, info in storage_data.items():
        end = info.offset + info.length
        if end > ends.get(info.relative_path, (-1, ""))[0]:
            ends[info.relative_path] = (end, index.fqn)
    problems = []
    for rel, (end, fqn) in sorted(ends.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            problems.append(f"file {rel!r} (holding {fqn}) is missing")
        elif os.path.getsize(file) < end:
            problems.append(
                f"file {rel!r} is truncated: {os.path.getsize(file)} bytes, its data for key {fqn} ends at byte {end}"
            )
    if problems:
        raise ValueError(f"path: the checkpoint at {path!r} is damaged: " + "; ".join(problems[:4]))


def _param_groups_error(saved: list, current: list) -> Optional[ValueError]:
    if len(saved) != len(current):
        return ValueError(f"optimizer: has {len(current)} param groups, the checkpoint's optimizer {len(saved)}")
    for i, (a, b) in enumerate(zip(saved, current)):
        if set(a["params"]) != set(b["params"]):
            return ValueError(
                f"optimizer: param group {i} differs from the checkpoint's: only in the checkpoint: "
                f"[{_listing(sorted(set(a['params']) - set(b['params'])))}], only here: "
                f"[{_listing(sorted(set(b['params']) - set(a['params'])))}]"
            )
    return None


def local(v: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a plain tensor as it is)."""
    return v.to_local() if hasattr(v, "to_local") else v


def _fresh(v):
    """A new tensor like ``v`` (a DTensor keeps its mesh, placements and global shape); other values as they are."""
    if not isinstance(v, torch.Tensor):
        return v
    if not hasattr(v, "to_local"):
        return torch.empty_like(v)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        torch.empty_like(v.to_local()), v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride()
    )


def _reader(path: str, who: str, metadata):
    """DCP's file reader of the ``metadata`` already read and agreed on (not read again: the directory may
    change meanwhile); each item's checksum (where the save stored one) is checked before its bytes are
    used, and a failure names the file, the key and the rank (a ValueError: bad data)."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def __init__(self):
            super().__init__(path)
            self.current = None

        def read_metadata(self, *args, **kwargs):
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file, sinfo):
            self.current = sinfo
            want = getattr(sinfo, FIELD, None)
            if want is None:
                return super()._slice_file(file, sinfo)
            # Checked before DCP reads the item (a pass over the page cache that DCP's read then finds warm;
            # reading the item into memory for both would copy it once more and cost more than the hash).
            got = _file_digest(file, sinfo.offset, sinfo.length)
            if got != want:
                short = " (the file ends before it)" if got == -1 else ""
                raise ValueError(
                    f"checksum mismatch: {ALGORITHM} of its {sinfo.length} bytes at offset "
                    f"{sinfo.offset}{short} is {got & (2**64 - 1):016x}, {want:016x} when saved "
                    f"(the file changed after the save)"
                )
            return super()._slice_file(file, sinfo)

        def read_data(self, plan, planner):
            self.current = None
            try:
                return super().read_data(plan, planner)
            except Exception as exc:  # DCP gathers it into every rank's CheckpointException
                s = self.current
                keys = [i.fqn for i, info in self.storage_data.items() if info is s] if s is not None else []
                where = f"file {s.relative_path!r}, key {keys[0] if keys else '?'}" if s is not None else "a file"
                raise ValueError(
                    f"{where} of {self.path!s} could not be read on {who} "
                    f"({type(exc).__name__}: {str(exc).strip()[:300]})"
                ) from exc

    return Reader()


# ------------------------------------------------------------------ DCP's collectives and messages
def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _bounded(pg, use_dist: bool, what: str):
    """DCP's collectives bounded by the group monitor's timeout, a lost peer raised by name."""
    if not use_dist:
        return contextlib.nullcontext()

    return as_group(pg).monitor.bounded(what)


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process call that it assumes one; here that is the documented intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
