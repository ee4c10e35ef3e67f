"""The expert-major regrouping of received rows (lancet_rt.moe.dispatch.common.regroup_permutations):
equal to the per-block definition, and at most one host read of a tensor value."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lancet_rt.moe.dispatch.common import regroup_permutations


def _by_blocks(counts_WL):
    """The definition, block by block: for each local expert l, the rows received from rank 0, 1, ..."""
    W, L = counts_WL.shape
    flat = counts_WL.reshape(-1).tolist()
    starts = [sum(flat[:i]) for i in range(len(flat))]
    order = [
        j for l in range(L) for r in range(W) for j in range(starts[r * L + l], starts[r * L + l] + flat[r * L + l])
    ]
    return torch.tensor(order, dtype=torch.long)


class _ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("W,L", [(2, 2), (3, 5), (4, 1), (1, 3), (8, 16)])
def test_regroup_equals_the_block_definition(W, L):
    g = torch.Generator().manual_seed(W * 100 + L)
    counts_WL = torch.randint(0, 7, (W, L), generator=g)
    counts_WL[0, 0] = 0  # an empty block
    if L > 1:
        counts_WL[:, L - 1] = 0  # a local expert that received nothing
    to_expert, to_rank = regroup_permutations(counts_WL, "cpu")
    if W == 1 or L == 1:
        assert to_expert is None and to_rank is None  # already expert-major
        return
    expected = _by_blocks(counts_WL)
    assert torch.equal(to_expert, expected)
    assert torch.equal(to_rank[to_expert], torch.arange(expected.numel()))  # the inverse


def test_regroup_reads_at_most_one_scalar():
    counts_WL = torch.randint(1, 9, (8, 16), generator=torch.Generator().manual_seed(0))
    with _ScalarReads() as reads:
        regroup_permutations(counts_WL, "cpu")
    assert reads.count <= 1, f"{reads.count} host reads (the per-block loop made {2 * 8 * 16})"
    host = counts_WL.tolist()  # as the dispatch has them (Counts.host)
    with _ScalarReads() as reads:
        to_expert, _ = regroup_permutations(host, "cpu")
    assert reads.count == 0, f"{reads.count} host reads with the counts given as host ints"
    assert torch.equal(to_expert, _by_blocks(counts_WL))


def test_regroup_of_no_rows():
    to_expert, to_rank = regroup_permutations(torch.zeros(3, 4, dtype=torch.long), "cpu")
    assert to_expert.numel() == 0 and to_rank.numel() == 0
