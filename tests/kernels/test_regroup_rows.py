"""The all-to-all's row maps made on the device (lancet_rt.kernels.permute.regroup_rows) against their
reference (lancet_rt.kernels.reference.regroup_rows_ref) and the host-built maps of the dispatch
(lancet_rt.moe.dispatch.common.regroup_permutations).

CPU lane: under TRITON_INTERPRET=1 (tests/conftest.py): odd W x L, empty blocks and a whole rank with
no rows, counts read from the first L columns of a wider strided buffer (the exchanged counts carry a
status column), blocks longer than one step of a program, the output buffer NaN-like (-7) before the
launch; bad arguments raise naming them.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import permute as permute_mod
from lancet_rt.kernels.permute import regroup_rows
from lancet_rt.kernels.reference import regroup_rows_ref

from lancet_rt.moe.dispatch.common import regroup_permutations

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _counts(gen, W, L, high, extra=3):
    """[W, L + extra] int64 (the first L columns the counts, the rest garbage), and the counts alone."""
    c = torch.randint(0, high, (W, L), generator=gen)
    if W > 1:
        c[1] = 0  # a rank with no rows
    c[0, 0] = 0  # an empty block
    wide = torch.randint(-5, 5, (W, L + extra), generator=gen)
    wide[:, :L] = c
    return wide.to(DEVICE), c


@pytest.mark.parametrize("W,L,high", [(2, 2, 5), (4, 4, 7), (3, 5, 9), (8, 16, 4), (1, 3, 6), (5, 1, 6), (2, 3, 700)])
def test_regroup_rows_matches_reference_and_host_maps(gen, W, L, high):
    wide, c = _counts(gen, W, L, high)
    R = int(c.sum())
    out = torch.full((2 * R + L + 1,), -7, dtype=torch.int64, device=DEVICE)
    got = regroup_rows(wide, R, L, out=out)
    ref = regroup_rows_ref(wide, R, L)
    for name, a, b in zip(("to_expert", "to_rank", "offsets_L1"), got, ref):
        assert a.dtype == torch.int64 and torch.equal(a, b), name
    assert torch.equal(got[1][got[0]], torch.arange(R, device=DEVICE))  # inverse permutations
    if W > 1 and L > 1:
        to_expert, to_rank = regroup_permutations(c.tolist(), DEVICE)
        assert torch.equal(got[0], to_expert) and torch.equal(got[1], to_rank)
    bounds = [0] + torch.cumsum(c.sum(0), 0).tolist()
    assert got[2].tolist() == bounds
    # a contiguous [W, L] without ``experts``, a fresh buffer
    fresh = regroup_rows(c.to(DEVICE).to(torch.int32), R)
    assert all(torch.equal(a, b) for a, b in zip(fresh, ref))


def test_regroup_rows_small_steps(gen, monkeypatch):
    """Blocks over many steps of a program (the loop), against the reference."""
    monkeypatch.setattr(permute_mod, "_REGROUP_BLOCK", 4)
    wide, c = _counts(gen, 3, 4, 30)
    R = int(c.sum())
    for a, b in zip(regroup_rows(wide, R, 4), regroup_rows_ref(wide, R, 4)):
        assert torch.equal(a, b)


def test_regroup_rows_no_rows_and_bad_input(gen):
    c = torch.zeros(3, 4, dtype=torch.int64, device=DEVICE)
    to_expert, to_rank, offsets = regroup_rows(c, 0)
    assert to_expert.numel() == 0 and to_rank.numel() == 0 and offsets.tolist() == [0] * 5
    with pytest.raises(TypeError, match="counts_WL"):
        regroup_rows(c.float(), 0)
    with pytest.raises(ValueError, match="counts_WL"):
        regroup_rows(c[0], 0)
    with pytest.raises(ValueError, match="total"):
        regroup_rows(c, -1)
    with pytest.raises(ValueError, match="experts"):
        regroup_rows(c, 0, 5)
    with pytest.raises(ValueError, match="out"):
        regroup_rows(c, 0, out=torch.empty(3, dtype=torch.int64, device=DEVICE))
