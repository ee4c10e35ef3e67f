"""The dispatchers' protocols: what a row-exchanging dispatcher does, and what it needs of the layer.

A dispatcher moves each chunk's permuted rows to their experts' ranks and back. Its exchanges are
issued asynchronously and waited for later (:class:`lancet_rt.comm.group.Pending`), so that the
overlap scheduler (:mod:`lancet_rt.runtime.scope`) can run other chunks while they fly; a
dispatcher therefore calls the layer's stage methods (``exchange_counts``, ``dispatch``,
``compute_experts``, ``combine``), which profilers and fault tests wrap per instance, and yields
with :func:`lancet_rt.runtime.scope.switch` between them.

- :mod:`~lancet_rt.moe.dispatch.alltoall`: the default expert-parallel all-to-all;
- :mod:`~lancet_rt.moe.dispatch.pipelined`: the Tutel-style baseline (``pipeline_chunks > 1``);
- :mod:`~lancet_rt.moe.dispatch.allreduce`: Pipeline MoE (``dispatcher="allreduce"``), which sends
  no rows and returns the summed output instead (:func:`~lancet_rt.moe.dispatch.allreduce.allreduce_forward`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch

from lancet_rt.comm import group as comm
from lancet_rt.moe.dispatch.common import Counts, Dispatched, Route

DISPATCHERS = ("alltoall", "allreduce")


class Exchanged(NamedTuple):
    """A row exchange's result on the tokens' rank."""

    y_SD: torch.Tensor  # expert outputs in dispatch-row order
    src_S: torch.Tensor  # each row's source assignment (from the permutation)
    link: Optional[object]  # the combine's backward link for unpermute, or None
    shared: Optional[torch.Tensor]  # the shared experts' output [T, D], or None


class Stages(Protocol):
    """What the dispatchers need of the layer (:class:`lancet_rt.MoE` implements it)."""

    group: Optional[comm.ExpertParallelGroup]
    num_experts: int
    num_local_experts: int
    ep_size: int
    ep_rank: int
    pipeline_chunks: int
    trace_name: str

    def exchange_counts(self, kept_PE: torch.Tensor, error: Optional[Exception] = None) -> Counts:
        """Issue the counts exchange (async; ``wait()`` gives the received counts on the host)."""

    def dispatch(self, x_SD: torch.Tensor, kept_E: torch.Tensor, counts_WL, sent_WL) -> Dispatched:
        """Issue the rows' exchange (async: ``Dispatched.pending``)."""

    def compute_experts(self, x_recv: torch.Tensor, d: Dispatched, ops, link=None) -> torch.Tensor:
        """The local experts over the received rows."""

    def combine(self, y_recv: torch.Tensor, d: Dispatched) -> comm.Pending:
        """Issue the outputs' exchange back (async)."""

    def permute_rows(self, x_TD: torch.Tensor, r: Route, num_rows: int, ops, chunk) -> tuple:
        """(x_SD, src_S): the chunk's kept rows grouped by expert."""

    def shared_output(self, x_TD: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared experts' output, run while the dispatch is in flight (None without any)."""


class Dispatcher(Protocol):
    """A row-exchanging dispatcher: one chunk's permute, dispatch, experts and combine."""

    def __call__(
        self, moe: Stages, x_TD: torch.Tensor, r: Route, ops, chunk: Optional[int], x_in: torch.Tensor
    ) -> Exchanged:
        """Exchange and compute the chunk routed by ``r``; ``x_in`` (the layer's input) feeds the shared experts."""
