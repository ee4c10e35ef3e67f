"""The step guard around each step of :class:`lancet_rt.Overlapped` (the drivers' side of the fault
protocol in :mod:`lancet_rt.comm.faults`): the schedule agreed across the expert-parallel ranks once,
a backward that raised before this step found, an exception in this step ended on every rank, and
the chunks' outputs checked to concatenate to the unchunked model's.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from lancet_rt.comm import faults as _faults


def check_schedule(overlapped, layers: list) -> None:
    """Compare ``chunks``, ``defer_wgrad`` and ``check`` across each expert-parallel group once.

    ``overlapped``: the :class:`lancet_rt.Overlapped` (its schedule's fields are read, the agreed one
    kept on it); ``layers``: its MoE layers, whose groups are compared.

    One all-gather per group with peers, on the first forward and again if the schedule changes
    (it must change on every rank). Ranks with different schedules would issue different
    collectives (hang, or mix up data), so every rank raises a ValueError naming the ranks and values.
    """
    chunks = overlapped.chunks
    mine = (chunks if isinstance(chunks, int) else 0, int(overlapped.defer_wgrad), int(overlapped.check))
    if getattr(overlapped, "_agreed_schedule", None) == mine:
        return
    for group in _groups(layers):
        if group.size == 1:
            continue
        rows = group.all_gather(torch.tensor(mine, dtype=torch.int64)).tolist()
        diff = []
        for j, name in enumerate(("chunks", "defer_wgrad", "check")):
            if len({row[j] for row in rows}) > 1:
                shown = [
                    ("'auto'" if v == 0 else str(v)) if name == "chunks" else str(bool(v))
                    for v in (row[j] for row in rows)
                ]
                who = getattr(getattr(group, "monitor", None), "name", lambda q: f"rank {q}")  # global ranks
                diff.append(f"{name}: " + ", ".join(f"{who(r)}={v}" for r, v in enumerate(shown)))
        if diff:
            raise ValueError(
                f"Overlapped schedule differs across expert-parallel ranks ({'; '.join(diff)}); every rank "
                f"must use the same chunks, defer_wgrad and check, or the ranks issue different collectives"
            )
    overlapped._agreed_schedule = mine


def check_output_rows(outputs: list, rows: list) -> None:
    """Every output tensor of chunk c must have a fixed multiple of chunk c's rows along dim 0 (the
    rows themselves, or rows x seq for token-major outputs such as transformers' router logits
    [B * S, E]), else concatenating the chunks' outputs would silently give a different result from
    the unchunked model."""
    per_chunk = [pytree.tree_leaves(out) for out in outputs]
    for j in range(len(per_chunk[0]) if per_chunk else 0):
        ratio = None
        for c, (leaves, n) in enumerate(zip(per_chunk, rows)):
            leaf = leaves[j] if j < len(leaves) else None
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                continue
            k = leaf.shape[0] / n if n else (0 if leaf.shape[0] == 0 else None)
            if n and ratio is None:
                ratio = k
            if k is None or (n and (k != ratio or k != int(k))):
                raise ValueError(
                    f"Overlapped: output {j} of chunk {c} has {leaf.shape[0]} rows along dim 0 for the chunk's "
                    f"{n} input rows{'' if ratio is None else f' (other chunks: {ratio:g} per row)'}; the model "
                    f"must keep dim 0 (row i of the output from row i of the inputs)"
                )


class StepGuard:
    """Around one step of :class:`lancet_rt.Overlapped`: find a backward that raised before this
    step, and make an exception in this step end cleanly on every rank (module docstring).

    ``layers``: the step's MoE layers (data, so the guard never calls the driver back)."""

    def __init__(self, layers: list):
        self.layers = layers
        self.groups = _groups(layers)
        self.marks: dict = {}

    def __enter__(self):
        for g in self.groups:
            st = _faults.backward_state(g)
            if not st.backward_open or _faults.in_backward():
                continue
            # The engine dropped the callback that ends the backward: the last backward raised.
            complete = st.duals >= st.links
            duals, links = st.duals, st.links
            st.close()
            _cancel_link(g)
            monitor = getattr(g, "monitor", None)
            if monitor is not None and g.size > 1 and not complete and monitor.broken is None:
                raise monitor.break_(
                    monitor.error(
                        _faults.GroupError,
                        f"expert-parallel {monitor.name(g.rank)}: the last backward raised after issuing "
                        f"{duals} of its "
                        f"{links} backward all-to-alls, so its peers are still waiting in the others. {_faults.ADVICE}",
                        [g.rank],
                    )
                )
        self.marks = {g: g.monitor.exchanges for g in self.groups if getattr(g, "monitor", None) is not None}
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            return False
        for g in self.groups:
            _cancel_link(g)
        if getattr(exc, "_lancet_agreed", False):
            return False  # every rank raised at the same collective: in step
        for g, mark in self.marks.items():
            monitor = g.monitor
            if g.size == 1 or monitor.broken is not None:
                continue
            if monitor.exchanges == mark:
                # No counts exchange of this step yet: the peers wait in the first one (or will).
                exc._lancet_status = 2
                layer = next(m for m in self.layers if m.group is g)
                layer.fail_peers(exc)  # raises on every rank
            monitor.break_(
                monitor.error(
                    _faults.GroupError,
                    f"expert-parallel {monitor.name(g.rank)} raised {type(exc).__name__}: {exc}",
                    [g.rank],
                )
            )
            if hasattr(exc, "add_note"):
                exc.add_note(
                    f"lancet-rt: this happened after the step's collectives had started, so the peers were "
                    f"told and the expert-parallel group is unusable now. {_faults.ADVICE}."
                )
        return False


def _groups(layers: list) -> list:
    seen = []
    for m in layers:
        if m.group is not None and all(m.group is not g for g in seen):
            seen.append(m.group)
    return seen


def _cancel_link(group) -> None:
    cancel = getattr(group, "cancel_pending", None)
    if cancel is not None:
        cancel()
