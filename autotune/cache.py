"""The autotuner's persistent cache: chunk counts keyed by device, link and MoE shape.

File format (JSON, ``SCHEMA``/``VERSION`` below)::

    {"schema": "lancet-rt/autotune-cache", "version": 1,
     "entries": {"<key string>": {"key": {...CacheKey fields...},
                                  "value": {"chunks": 4, "defer_wgrad": false, "source": "cli",
                                            "table": [{"chunks": 1, "measured_ms": ..., "predicted_ms": ...}, ...],
                                            ...}}}}

Writes are atomic and safe across processes: under an exclusive ``fcntl.flock`` on a side file
(``<path>.lock``) the writer re-reads what is on disk, merges its entries in, writes a temporary
file in the same directory and ``os.replace``-s it over the cache. A cache path that is a symbolic
link (a shared cache) is written at its target, lock and temporary file included, so the link stays
and writers through other links merge into the same file. Readers never lock: they see the
old file or the new one, never a torn one. A file that is not valid JSON, belongs to another tool
(wrong ``schema``) or has another ``version``, including one that is not UTF-8, is ignored with a
warning and replaced on the next write. A path that is not a regular file (``/dev/null``, a common
way to turn a cache off, another device, a FIFO) is never read nor replaced: lookups find nothing
there and a write is skipped with a warning; a regular file that cannot be read is a warning and no
write either (replacing it would drop entries we could not see). Entries are validated on read: a key that is not a
:class:`CacheKey`, a ``chunks`` that is not an int in [1, ``MAX_CHUNKS``] or a non-bool ``defer_wgrad``
makes the entry skipped, with a warning.

Lookups fall back to the nearest token bucket (in log space) with otherwise the same key, then to the
shipped defaults (``autotune/defaults.json``, same format, keyed by GPU name instead of the full
device identity). This module does not import torch, so it is cheap in helper processes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import tempfile
import time
import warnings
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Iterable, Optional

from lancet_rt.env import autotune_cache_path

try:  # POSIX; elsewhere writes are still atomic but concurrent writers may drop each other's entries
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

SCHEMA = "lancet-rt/autotune-cache"
_WHERE = "point LANCET_AUTOTUNE_CACHE (or --cache) at a writable file"
VERSION = 1
#: The largest chunk count an entry may hold (lancet_rt.schedule.policy.MAX_CHUNKS; this module does
#: not import torch, so it is repeated here and a test keeps the two equal).
MAX_CHUNKS = 256
DEFAULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "defaults.json")


def token_bucket(tokens: int) -> int:
    """The power-of-two bucket of a token count: ``2 ** round(log2(tokens))``.

    Args:
        tokens: tokens per step on this rank, >= 1.

    Returns:
        The nearest power of two in log space (1000 -> 1024, 1500 -> 2048, 1400 -> 1024).
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    return 1 << max(0, round(math.log2(tokens)))


def _round_sig(x: Optional[float], digits: int = 4) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    if math.isinf(x) or x == 0:
        return x
    return float(f"{x:.{digits}g}")


@dataclass(frozen=True)
class CacheKey:
    """What a tuned chunk count depends on.

    Attributes:
        device: the device identity's key (:attr:`lancet_rt.autotune.gpu.DeviceIdentity.key`).
        device_name: the GPU name (or ``"cpu"``); shipped defaults match on this instead of ``device``.
        ep_world_size: W, the expert-parallel world size.
        link_backend: ``"emulated"``, ``"nccl"``, ``"gloo"``, ``"local"`` (no expert parallelism), ...
        link_gbps: the link bandwidth in GB/s: configured (emulated link) or measured (real groups;
            the entry's name shows it rounded to a power of two, so a re-measurement in the same
            bucket replaces the entry); None where unknown.
        link_latency_us: the configured latency of an emulated link; None for real groups.
        dtype: the MoE parameters' dtype (``"float32"``, ``"bfloat16"``, ...).
        d_model, d_ffn, num_experts, top_k: D, F, E, K.
        capacity_factor: None for dropless.
        tokens_bucket: :func:`token_bucket` of the tokens per step on this rank.
        link_measured: ``link_gbps`` was measured (a real group), so lookups accept an entry whose
            bandwidth is within a factor ``2 ** max_gbps_distance`` of it, since measurements vary;
            a configured bandwidth must match exactly.
    """

    device: str
    device_name: str
    ep_world_size: int
    link_backend: str
    link_gbps: Optional[float]
    link_latency_us: Optional[float]
    dtype: str
    d_model: int
    d_ffn: int
    num_experts: int
    top_k: int
    capacity_factor: Optional[float]
    tokens_bucket: int
    link_measured: bool = False

    def __post_init__(self):
        for name in ("ep_world_size", "d_model", "d_ffn", "num_experts", "top_k", "tokens_bucket"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.tokens_bucket & (self.tokens_bucket - 1):
            raise ValueError(f"tokens_bucket must be a power of two (see token_bucket()), got {self.tokens_bucket}")
        for name in ("device", "device_name", "link_backend", "dtype"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name, lowest in (("link_gbps", 0.0), ("link_latency_us", -1.0), ("capacity_factor", 0.0)):
            v = getattr(self, name)  # (None, or a number: > 0, latency >= 0; NaN and strings refused)
            if v is not None and (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not v > lowest
                or (name != "link_gbps" and math.isinf(v))
                or (lowest < 0 and v < 0)
            ):
                raise ValueError(f"{name} must be None or a number > 0{' or 0' if lowest < 0 else ''}, got {v!r}")
        if not isinstance(self.link_measured, bool):
            raise ValueError(f"link_measured must be a bool, got {self.link_measured!r}")
        # Canonical floats, so equal configurations give equal keys.
        object.__setattr__(self, "link_gbps", _round_sig(self.link_gbps))
        object.__setattr__(self, "link_latency_us", _round_sig(self.link_latency_us))
        object.__setattr__(self, "capacity_factor", _round_sig(self.capacity_factor, 6))

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CacheKey":
        """Build a key from :meth:`as_dict`'s output; raises ValueError/TypeError on a bad dict."""
        if not isinstance(d, dict):
            raise TypeError(f"a cache key must be a dict, got {type(d).__name__}")
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise ValueError(f"cache key is missing {missing}")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def with_tokens_bucket(self, bucket: int) -> "CacheKey":
        return CacheKey(**{**self.as_dict(), "tokens_bucket": bucket})

    def string(self, by: str = "device") -> str:
        """The entry name in the JSON file; ``by="device_name"`` for the shipped defaults."""
        dev = self.device if by == "device" else self.device_name
        link = self.link_backend
        if self.link_gbps is not None:
            gbps = self.link_gbps
            if self.link_measured and 0 < gbps < math.inf:
                gbps = 2.0 ** round(math.log2(gbps))
            link += f"/{'~' if self.link_measured else ''}{gbps:g}GB/s"
        if self.link_latency_us is not None:
            link += f"/{self.link_latency_us:g}us"
        cf = "dropless" if self.capacity_factor is None else f"{self.capacity_factor:g}"
        return (
            f"{dev};ep={self.ep_world_size};link={link};{self.dtype};D={self.d_model};F={self.d_ffn};"
            f"E={self.num_experts};K={self.top_k};cf={cf};tokens={self.tokens_bucket}"
        )

    def _match_fields(self, by: str) -> tuple:
        skip = {"tokens_bucket", "device_name" if by == "device" else "device"}
        if self.link_measured:
            skip.add("link_gbps")
        return tuple((f.name, getattr(self, f.name)) for f in fields(self) if f.name not in skip)

    def _gbps_distance(self, other: "CacheKey") -> float:
        """|log2| of the bandwidth ratio of two measured links (0 for configured ones, which match)."""
        if not self.link_measured or self.link_gbps == other.link_gbps:
            return 0.0
        if not self.link_gbps or not other.link_gbps or math.isinf(self.link_gbps) or math.isinf(other.link_gbps):
            return math.inf
        return abs(math.log2(self.link_gbps / other.link_gbps))


@dataclass(frozen=True)
class CacheHit:
    """A lookup result.

    Attributes:
        key: the stored entry's key (its token bucket may differ from the one asked for).
        value: the stored value (``value["chunks"]`` is the chunk count).
        exact: the token bucket matched exactly (and so did a configured bandwidth; a measured one
            matches within the lookup's ``max_gbps_distance``, since it is the same link re-measured).
        source: ``"cache"`` (the user's cache) or ``"defaults"`` (shipped with lancet-rt).
        path: the file it came from.
    """

    key: CacheKey
    value: dict
    exact: bool
    source: str
    path: str

    @property
    def chunks(self) -> int:
        return int(self.value["chunks"])


class TuneCache:
    """The chunk-count cache file, plus the shipped defaults as a read-only fallback.

    Args:
        path: the cache file; None for :func:`lancet_rt.env.autotune_cache_path` (the
            ``LANCET_AUTOTUNE_CACHE`` variable, default ``~/.cache/lancet-rt/autotune.json``).
        defaults_path: the shipped defaults (keyed by GPU name); None to use none.
    """

    def __init__(self, path: Optional[str | os.PathLike] = None, *, defaults_path: Optional[str] = DEFAULTS_PATH):
        if path is None:
            path = autotune_cache_path()
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a file path or None, got {type(path).__name__}")
        if not os.fspath(path):
            raise ValueError("path must not be empty")
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.defaults_path = defaults_path

    def __repr__(self) -> str:
        return f"TuneCache({self.path!r})"

    # ------------------------------------------------------------------ reading
    def entries(self) -> dict[str, dict]:
        """The valid entries on disk now (``{key string: {"key": ..., "value": ...}}``); warns on a bad file."""
        return _read_entries(self.path, what="autotune cache")

    def lookup(
        self,
        key: CacheKey,
        *,
        nearest: bool = True,
        max_bucket_distance: Optional[float] = None,
        max_gbps_distance: float = 1.0,
        use_defaults: bool = True,
    ) -> Optional[CacheHit]:
        """The entry for ``key``: exact, else the nearest token bucket, else the shipped defaults.

        Args:
            key: what to look up.
            nearest: fall back to the entry with the same key but the nearest token bucket (distance
                ``|log2(bucket) - log2(key.tokens_bucket)|``; ties go to the larger bucket).
            max_bucket_distance: largest accepted distance in log2 units (None: any).
            max_gbps_distance: for a measured link (``key.link_measured``), the largest accepted
                ``|log2(stored / measured bandwidth)|`` (1.0: within a factor of 2); among several, the
                nearest token bucket wins, then the nearest bandwidth.
            use_defaults: consult the shipped defaults (by GPU name) when the cache has nothing.

        Returns:
            A :class:`CacheHit`, or None.
        """
        if not isinstance(key, CacheKey):
            raise TypeError(f"key must be a CacheKey, got {type(key).__name__}")
        limits = (nearest, max_bucket_distance, max_gbps_distance)
        hit = _find(self.entries(), key, "device", *limits, "cache", self.path)
        if hit is None and use_defaults and self.defaults_path and os.path.exists(self.defaults_path):
            entries = _read_entries(self.defaults_path, what="shipped autotune defaults")
            hit = _find(entries, key, "device_name", *limits, "defaults", self.defaults_path)
        return hit

    # ------------------------------------------------------------------ writing
    def store(self, key: CacheKey, value: dict, *, by: str = "device") -> None:
        """Write one entry (see :meth:`store_many`)."""
        self.store_many([(key, value)], by=by)

    def store_many(self, items: Iterable[tuple[CacheKey, dict]], *, by: str = "device") -> None:
        """Merge entries into the file atomically, under the side lock, keeping every other entry.

        Args:
            items: (key, value) pairs; ``value`` must be JSON-serialisable with an int ``"chunks"`` >= 1.
            by: ``"device"`` (the user cache) or ``"device_name"`` (a shipped-defaults file, whose
                entries are named by GPU name).

        Raises:
            OSError: the directory cannot be created or written (``IsADirectoryError`` when the path is a
                directory, ``NotADirectoryError`` when a folder on it is a file, ``PermissionError``...),
                with the cache path as its ``filename``; the file is left whole.
        """
        if by not in ("device", "device_name"):
            raise ValueError(f"by must be 'device' or 'device_name', got {by!r}")
        new = {}
        for key, value in items:
            if not isinstance(key, CacheKey):
                raise TypeError(f"key must be a CacheKey, got {type(key).__name__}")
            _check_value(value)
            value = dict(value)
            value.setdefault("written_at", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            new[key.string(by)] = {"key": key.as_dict(), "value": value}
        if os.path.isdir(self.path):
            raise IsADirectoryError(
                errno.EISDIR, f"the autotune cache path is a directory, not a file; {_WHERE}", self.path
            )
        # Through a symbolic link (a cache shared by several users or jobs) the TARGET is updated: its
        # lock, its temporary file beside it, renamed onto it. The link stays a link, and writers
        # through other links to the same file take the same lock and merge.
        target = os.path.realpath(self.path)
        directory = os.path.dirname(target)
        parent = directory
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if parent and not os.path.isdir(parent):
            raise NotADirectoryError(
                errno.ENOTDIR, f"the autotune cache's folder {parent} is a file; {_WHERE}", self.path
            )
        if _not_regular(target):
            warnings.warn(
                f"lancet-rt: the autotune cache {self.path} is not a regular file ({_not_regular(target)}); "
                f"not writing it (this run's entries are not cached)",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        try:
            os.makedirs(directory, exist_ok=True)
            with _locked(target + ".lock"):
                entries = _read_file(target, what="autotune cache", replacing=True)
                if entries is None:  # unreadable, or no longer a regular file: never replaced
                    warnings.warn(
                        f"lancet-rt: not writing the autotune cache {self.path}: it cannot be read, and "
                        f"replacing it would drop its entries",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    return
                entries.update(new)
                data = {"schema": SCHEMA, "version": VERSION, "entries": entries}
                if by == "device_name":
                    data["keyed_by"] = by
                _atomic_write_json(target, data)
        except OSError as exc:
            if exc.errno is None:
                raise
            # The same error type (callers catch OSError), named after the cache, not a side file.
            raise type(exc)(
                exc.errno, f"cannot write the autotune cache ({exc.strerror}: {exc.filename}); {_WHERE}", self.path
            ) from exc


def _check_value(value) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"value must be a dict, got {type(value).__name__}")
    n = value.get("chunks")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHUNKS:
        raise ValueError(f"value['chunks'] must be an int in [1, {MAX_CHUNKS}], got {n!r}")
    if "defer_wgrad" in value and not isinstance(value["defer_wgrad"], bool):
        raise ValueError(f"value['defer_wgrad'] must be a bool, got {value['defer_wgrad']!r}")


def _find(
    entries: dict, key: CacheKey, by: str, nearest: bool, max_distance, max_gbps_distance: float, source: str, path: str
):
    want = key._match_fields(by)
    best = None
    for entry in entries.values():
        try:
            stored = CacheKey.from_dict(entry["key"])
        except (KeyError, TypeError, ValueError):
            continue
        if stored._match_fields(by) != want:
            continue
        gbps_dist = key._gbps_distance(stored)
        if gbps_dist > max_gbps_distance:
            continue
        dist = abs(math.log2(stored.tokens_bucket) - math.log2(key.tokens_bucket))
        if dist and not nearest:
            continue
        if max_distance is not None and dist > max_distance:
            continue
        rank = (dist, -stored.tokens_bucket, gbps_dist)
        if best is None or rank < best[0]:
            best = (rank, stored, entry["value"])
    if best is None:
        return None
    (dist, _, gbps_dist), stored, value = best
    return CacheHit(key=stored, value=value, exact=dist == 0, source=source, path=path)


def _not_regular(path: str) -> Optional[str]:
    """What ``path`` is if it exists and is not a regular file (None otherwise; links followed)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _read_entries(path: str, *, what: str, replacing: bool = False) -> dict:
    """Valid entries of the file at ``path``; a missing file is empty, a bad one empty with a warning, a
    path that is not a regular file empty (never read: a FIFO would block)."""
    entries = _read_file(path, what=what, replacing=replacing)
    return {} if entries is None else entries


def _read_file(path: str, *, what: str, replacing: bool = False) -> Optional[dict]:
    """As :func:`_read_entries`, but None for a file that must not be replaced: unreadable, or not a
    regular file (opened without blocking and checked on the open descriptor)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"lancet-rt: cannot read the {what} {path} ({exc}); ignoring it", RuntimeWarning, stacklevel=3)
        return None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # (a character device, /dev/null, is a cache switched off: said on write)
            if not stat.S_ISCHR(mode):
                warnings.warn(
                    f"lancet-rt: cannot read the {what} {path} ({_not_regular(path)}, not a regular file); ignoring it",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read()
    except OSError as exc:
        warnings.warn(f"lancet-rt: cannot read the {what} {path} ({exc}); ignoring it", RuntimeWarning, stacklevel=3)
        return None
    finally:
        os.close(fd)
    then = " (it will be replaced on this write)" if replacing else " (it is replaced on the next write)"
    try:  # (decoded here: a file that is not UTF-8 is a corrupted cache, not an error in the step)
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        warnings.warn(
            f"lancet-rt: the {what} {path} is corrupted ({exc}); ignoring it{then}", RuntimeWarning, stacklevel=3
        )
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else type(data).__name__
        warnings.warn(
            f"lancet-rt: the {what} {path} has schema {schema!r}, not {SCHEMA!r} (another tool's "
            f"file?); ignoring it{then}",
            RuntimeWarning,
            stacklevel=3,
        )
        return {}
    if data.get("version") != VERSION:
        warnings.warn(
            f"lancet-rt: the {what} {path} has version {data.get('version')!r}, this lancet-rt "
            f"reads version {VERSION}; ignoring it{then}",
            RuntimeWarning,
            stacklevel=3,
        )
        return {}
    entries = data.get("entries")
    if not isinstance(entries, dict):
        warnings.warn(
            f"lancet-rt: the {what} {path} has no 'entries' object; ignoring it{then}", RuntimeWarning, stacklevel=3
        )
        return {}
    valid, bad = {}, 0
    for name, entry in entries.items():
        try:
            if not isinstance(entry, dict):
                raise TypeError("an entry must be an object")
            CacheKey.from_dict(entry["key"])
            _check_value(entry["value"])
        except (KeyError, TypeError, ValueError):
            bad += 1
            continue
        valid[name] = entry
    if bad:
        warnings.warn(
            f"lancet-rt: skipped {bad} malformed entr{'y' if bad == 1 else 'ies'} in the {what} {path}",
            RuntimeWarning,
            stacklevel=3,
        )
    return valid


@contextlib.contextmanager
def _locked(lock_path: str):
    """An exclusive inter-process lock on a side file (kept: deleting lock files races)."""
    with open(lock_path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _atomic_write_json(path: str, data: dict) -> None:
    """``data`` to ``path`` by a temporary file beside it renamed onto it; the file keeps its mode
    (a cache shared through a group-writable file stays group-writable)."""
    directory, base = os.path.split(path)
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{base}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
