"""The untagged counts row (lancet_rt/moe/dispatch/common.py, lancet_rt/moe/dispatch/alltoall.py): what an
emulated group sends is the int64 [W, P L + 1 (+ E)] row of the counts, the status and (shadowing) the
loads, the same whatever the kept counts' integer dtype, for a passed and a failed status; and ``Counts.wait``
reads a group's row once when the sent row is the received one.
"""

from __future__ import annotations

import types

import pytest
import torch

import lancet_rt
from lancet_rt.comm import faults
from lancet_rt.moe.dispatch.common import exchange_counts


class _Recording(lancet_rt.EmulatedGroup):
    """An emulated group that keeps what each counts exchange sent."""

    def __init__(self, W):
        super().__init__(W)
        self.sent = []

    def exchange(self, send_WN):
        self.sent.append(send_WN.clone())
        return super().exchange(send_WN)


def _moe(W):
    return types.SimpleNamespace(ep_size=W, group=_Recording(W), layer_number=-1)


def _old_row(counts, code, loads):
    """The row as the pad of the int64 counts made it."""
    row = torch.nn.functional.pad(counts.long(), (0, 1), value=code)
    return row if loads is None else torch.cat([row, loads], dim=1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("error", [None, ValueError("rejected")], ids=["ok", "rejected"])
@pytest.mark.parametrize("with_loads", [False, True], ids=["", "loads"])
def test_untagged_row_is_the_padded_counts(gen, dtype, error, with_loads):
    W, L = 4, 3
    moe = _moe(W)
    kept = torch.randint(0, 100, (1, W * L), generator=gen).to(dtype)
    counts = kept.view(W, L)
    loads = kept.sum(0).long().view(1, -1).expand(W, -1) if with_loads else None
    handle = exchange_counts(moe, kept, counts, L, loads, error, torch.float32)
    (sent,) = moe.group.sent
    want = _old_row(counts, faults.status_code(error), loads)
    assert sent.dtype == torch.int64 and torch.equal(sent, want)
    if error is None:
        handle.wait()
        recv, mine = handle.host
        assert recv == mine == [counts.tolist()]
        assert handle.loads == (None if loads is None else loads.tolist())
    else:
        with pytest.raises(ValueError, match="rejected"):
            handle.wait()


def test_alltoall_row_from_int32_kept_counts(gen):
    """The layer's AllToAll dispatcher sends the int32 kept counts of a chunk as the int64 row, and the
    counts come back as host ints in one read."""
    W = 2
    moe = lancet_rt.MoE(8, 6, 4, 2, ep_group=_Recording(W))
    kept = torch.randint(0, 50, (4,), generator=gen, dtype=torch.int32)
    reads = []
    original = torch.Tensor.tolist

    def counting(t):
        reads.append(tuple(t.shape))
        return original(t)

    counts = moe.dispatcher.exchange_counts(kept.view(1, -1), torch.float32)
    torch.Tensor.tolist = counting
    try:
        counts.wait()
    finally:
        torch.Tensor.tolist = original
    (sent,) = moe.group.sent
    assert torch.equal(sent, _old_row(kept.view(W, 2), 0, None))
    assert reads == [(W, 3)]
    assert counts.host == ([[[int(v) for v in kept[:2]], [int(v) for v in kept[2:]]]],) * 2
