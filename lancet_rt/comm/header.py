"""The header a rank sends before each collective (:meth:`lancet_rt.comm.monitor.GroupMonitor.issue`):
sequence number, kind, dtype, name and sizes, and what differs when the ranks' headers disagree.

Row layout (int64): [seq, crc32(kind), crc32(dtype), the kind's name (48 bytes), elements sent to each
of the W ranks, elements expected from each]; 9 + 2 W words, one all-gather of W rows.

The counts exchange carries a tag of its own in the row it sends anyway (:data:`COUNTS_MAGIC` first,
:mod:`lancet_rt.moe.dispatch.common`), checked on receipt without a header: :func:`code` and
:func:`odd_ones` serve both.
"""

from __future__ import annotations

import struct
import zlib


def header_row(seq: int, what: str, dtype, send, recv) -> list:
    """This rank's header for collective ``seq``."""
    return [seq, _code(what), _code(str(dtype))] + _name_words(what) + [int(n) for n in send] + [int(n) for n in recv]


_names: dict = {}
_NAME_BYTES = 48  # a collective's name travels in its header, so a mismatch can name what each rank issued
_H = 3 + _NAME_BYTES // 8  # header words before the sizes: seq, kind, dtype, name


#: The first word of a counts exchange's tag: a row without it is another collective's data.
COUNTS_MAGIC = int.from_bytes(b"lancetC1", "little")


def code(what: str) -> int:
    """A collective kind or dtype as an int64 (crc32), remembered for messages (:func:`known`)."""
    c = zlib.crc32(what.encode())
    _names[c] = what
    return c


_code = code


def known(c: int, default: str = "another dtype") -> str:
    """What :func:`code` gave ``c`` on this rank, else ``default``."""
    return _names.get(c, default)


def odd_ones(keys: list) -> list:
    """The ranks whose key differs from the most common one (every rank where several are as common):
    the same answer on every rank that holds the same ``keys`` (one per rank)."""
    by_key: dict = {}
    for r, k in enumerate(keys):
        by_key.setdefault(k, []).append(r)
    if len(by_key) < 2:
        return []
    biggest = max(len(v) for v in by_key.values())
    common = [v for v in by_key.values() if len(v) == biggest]
    return [r for r in range(len(keys)) if len(common) > 1 or r not in common[0]]


def _name_words(what: str) -> list:
    return list(struct.unpack(f"<{_NAME_BYTES // 8}q", what.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")))


def _name(words: list) -> str:
    return struct.pack(f"<{_NAME_BYTES // 8}q", *words).rstrip(b"\0").decode(errors="replace")


def mismatch(rows: list, W: int, name=lambda r: f"rank {r}") -> tuple[str, list]:
    """("" or what differs, the ranks at fault) from the all-gathered headers [seq, kind, dtype, name, send[W],
    recv[W]];
    ``name(r)`` words group rank r in the message."""

    def show(r):
        seq, _, dtype = rows[r][:3]
        return (
            f"{name(r)} issued #{seq} {_name(rows[r][3:_H])} ({_names.get(dtype, 'another dtype')}, sends "
            f"{rows[r][_H : _H + W]} elements, expects {rows[r][_H + W :]})"
        )

    at_fault = odd_ones([tuple(rows[r][:_H]) for r in range(W)])
    if at_fault:
        return "; ".join(show(r) for r in range(W)), at_fault
    pairs = [(r, q) for r in range(W) for q in range(W) if rows[r][_H + q] != rows[q][_H + W + r]]
    if pairs:
        ranks = sorted({r for pair in pairs for r in pair})
        sizes = ", ".join(
            f"{name(r)} sends {rows[r][_H + q]} elements to {name(q)}, which expects {rows[q][_H + W + r]}"
            for r, q in pairs[:4]
        )
        return f"{sizes} ({'; '.join(show(r) for r in ranks)})", ranks
    return "", []


def blocked_apart(rank: int, seq: int, what: str, at_W: list, name=lambda r: f"rank {r}") -> tuple[str, list]:
    """("" or who waits in what, the ranks at fault) when a peer is blocked in collective ``seq`` of another
    kind than ``what``: ``at_W`` holds each rank's published position ("seq issued what", or None)."""
    others = []
    for q, at in enumerate(at_W):
        parts = at.split(maxsplit=2) if at and q != rank else []
        if len(parts) == 3 and parts[0] == str(seq) and parts[2] != what:
            others.append((q, parts[2]))
    if not others:
        return "", []
    waits = [f"{name(rank)} waits in #{seq} {what}"] + [f"{name(q)} in #{seq} {w}" for q, w in others]
    return "; ".join(waits), sorted([rank] + [q for q, _ in others])
