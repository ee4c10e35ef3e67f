"""Gradient synchronisation for data + expert parallelism, over one group or a ``("dp", "ep")`` mesh.

Dense parameters (attention, norms, router) are replicated and see only the local batch: their
gradients are averaged over dp x ep. Expert parameters live on one ep rank of each dp replica and
already received their ep group's tokens through the all-to-alls: their gradients are summed over dp
and divided by dp x ep (:mod:`lancet_rt.parallel.mesh`). One group is dp = 1.

:func:`sync_gradients` does it after backward. :class:`GradientSync` does it during backward,
bucket by bucket as gradients become ready (as DDP does), and cuts each bucket's all-reduce into
pieces that queue behind the all-to-alls (Lina, ATC'23), so the all-reduce never delays the
backward's all-to-alls by more than one piece. Buckets are issued in index order on every rank,
whatever order their gradients arrive in (deferred dW arrives in an order that follows each rank's
own timing): a bucket that completes early waits for the ones before it, as in DDP's reducer.
"""

from __future__ import annotations

import zlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lancet_rt.comm.faults import GroupError, PeerError
from lancet_rt.moe.experts import Experts
from lancet_rt.parallel import mesh as _mesh
from lancet_rt.parallel import supported as _supported
from lancet_rt.schedule.accumulate import BackwardSync


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters of every :class:`~lancet_rt.Experts` module in ``model``."""
    for m in model.modules():
        if isinstance(m, Experts):
            yield from m.parameters()


def dense_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Every parameter of ``model`` that is not an expert parameter."""
    experts = {id(p) for p in expert_parameters(model)}
    return (p for p in model.parameters() if id(p) not in experts)


@torch.no_grad()
def _all_reduce_flat(params: list, group, divisor: int, what: str) -> None:
    """Sum the gradients of ``params`` over ``group`` in one all-reduce and divide by ``divisor``, in
    place; a missing gradient counts as zero (every rank issues the same all-reduce) and stays None.
    Through the group's monitor (:func:`lancet_rt.parallel.mesh.monitor`): bounded, a lost peer named,
    on gloo the sizes checked across the ranks first (CollectiveMismatch, not a backend abort)."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    op, post = _mesh.reduce_op(group, divisor)
    mon = _mesh.monitor(group)
    header = (flat.dtype, [flat.numel()] * mon.size, [flat.numel()] * mon.size)
    mon.issue(what, lambda: dist.all_reduce(flat, op=op, group=group, async_op=True), header).wait()
    if post != 1:
        flat /= post
    offset = 0
    for p in params:
        if p.grad is not None:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


@torch.no_grad()
def sync_gradients(model: nn.Module, group=None) -> None:
    """Make every gradient that of the mean loss over the global batch (after ``backward()``).

    Dense gradients are averaged over dp x ep; expert gradients are summed over dp and divided by
    dp x ep (one group: dp = 1, experts only divided). Every rank issues the same collectives in
    the same order (dense, then experts), whatever its gradients.

    Args:
        model: the model after ``backward()``.
        group: the data/expert-parallel process group (None: the default group), or a DeviceMesh
            with dimensions ``("dp", "ep")`` whose "ep" group is the MoE layers' ``ep_group``.
    """
    _supported.check_layers(model, "lancet_rt.parallel.sync_gradients")
    if _mesh.is_mesh(group):  # by membership, before any collective (layout may create the mesh's groups)
        _mesh.check_mesh(group, "group")
        _mesh.check_expert_groups(model, group, "group")
    lay = _mesh.layout(group)
    if lay.emulated:
        raise TypeError(
            "group: sync_gradients needs a ProcessGroup, None or a DeviceMesh; on a "
            "lancet_rt.EmulatedGroup use GradientSync"
        )
    if not _mesh.is_mesh(group):
        _mesh.check_one_group(model, group)
    if lay.divisor == 1:
        return
    dense = [p for p in dense_parameters(model) if p.requires_grad]
    if dense:
        _all_reduce_flat(dense, lay.dense_group, lay.divisor, "gradient all-reduce (dense)")
    experts = [p for p in expert_parameters(model) if p.requires_grad]
    if lay.expert_group is not None:
        if experts:
            _all_reduce_flat(experts, lay.expert_group, lay.divisor, "gradient all-reduce (experts)")
    else:
        for p in experts:
            if p.grad is not None:
                p.grad /= lay.divisor


class GradientSync(BackwardSync):
    """Data-parallel gradient all-reduce during backward: bucket by bucket, in pieces, behind the
    all-to-alls (Lina, ATC'23).

    A context manager around the backward whose gradients it reduces::

        sync = GradientSync(model, mesh, piece_mb=1)   # or a ProcessGroup
        with sync:
            loss.backward()   # each bucket's all-reduce starts as soon as it and those before it are ready
        # here every piece has arrived and the gradients are those of the global mean loss

    Buckets hold the parameters in reverse registration order (about the order backward produces
    their gradients, as DDP's), up to ``bucket_mb`` each, dense and expert parameters apart (they
    reduce over different groups with a mesh). A bucket is complete when every one of its gradients
    has been accumulated (``register_post_accumulate_grad_hook``, so deferred dW, which reaches the
    accumulators at the flush, counts); buckets are issued in index order on every rank: a complete
    bucket waits for the incomplete ones before it on its group, so the collective order never
    depends on when a rank's dW ran. Hooks outside the ``with`` do nothing, so the earlier
    microbatches of a gradient-accumulation step do not reduce. Parameters that got no gradient
    count as zero in the reduction and keep ``grad=None``.

    ``low_priority`` needs a group that can order its transfers: on :class:`lancet_rt.EmulatedGroup`
    a piece starts only when no all-to-all waits for the link (:meth:`EmulatedGroup.all_reduce`).
    On a ProcessGroup the pieces are issued in order. On NCCL the divide is a ``PREMUL_SUM`` in
    the all-reduce; on gloo a ``SUM`` and a divide after it (:func:`lancet_rt.parallel.mesh.reduce_op`).

    Args:
        model: the module whose gradients are reduced.
        group: a torch.distributed ProcessGroup, a :class:`lancet_rt.EmulatedGroup`, None (the
            default process group), or a DeviceMesh with dimensions ``("dp", "ep")``.
        params: "dense" (data + expert parallelism, as :func:`sync_gradients`: dense gradients
            averaged over dp x ep, expert gradients summed over dp and divided by dp x ep) or "all"
            (every gradient averaged over the group: replicas of the whole model).
        bucket_mb: bucket size in MB (1e6 bytes); a parameter larger than it is a bucket of its own.
        piece_mb: the largest all-reduce issued, in MB; a bucket is cut into pieces of at most this
            size (None: one all-reduce per bucket).
        low_priority: issue the pieces at low priority (Lina's rule, see above).

    Attributes:
        issued: all-reduces issued by the last ``with`` (pieces).
        order: the bucket indices in the order the last ``with`` issued them.
    """

    def __init__(
        self,
        model: nn.Module,
        group=None,
        *,
        params: str = "dense",
        bucket_mb: float = 25.0,
        piece_mb: Optional[float] = None,
        low_priority: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if params not in ("dense", "all"):
            raise ValueError(f"params must be 'dense' or 'all', got {params!r}")
        if params == "dense":  # ("all": replicas of the whole model, whatever their layers)
            _supported.check_layers(model, "lancet_rt.parallel.GradientSync")
        if _mesh.is_mesh(group):  # by membership, before any collective (layout may create the mesh's groups)
            _mesh.check_mesh(group, "group")
            _mesh.check_expert_groups(model, group, "group")
        lay = _mesh.layout(group)
        for name, v in (("bucket_mb", bucket_mb), ("piece_mb", piece_mb)):
            if v is None and name == "piece_mb":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not isinstance(low_priority, bool):
            raise TypeError(f"low_priority must be a bool, got {type(low_priority).__name__}")
        if not _mesh.is_mesh(group) and params == "dense" and not lay.emulated:
            _mesh.check_one_group(model, group)
        self.group = group
        self.params = params
        self.piece_bytes = None if piece_mb is None else max(1, int(piece_mb * 1e6))
        self.low_priority = low_priority
        self.issued = 0
        self.order: list = []
        self._active = False
        self._lay = lay
        experts = {id(p) for p in expert_parameters(model)}
        trainable = [p for p in model.parameters() if p.requires_grad]
        dense = [p for p in trainable if params == "all" or id(p) not in experts]
        expert = [p for p in trainable if params == "dense" and id(p) in experts]
        bucket_bytes = int(bucket_mb * 1e6)
        self._buckets = _buckets(list(reversed(dense)), bucket_bytes, lay.dense_group, self._divisor(False))
        self._scaled = []
        if lay.expert_group is not None:
            self._buckets += _buckets(list(reversed(expert)), bucket_bytes, lay.expert_group, self._divisor(True))
        else:
            self._scaled = expert
        for i, b in enumerate(self._buckets):
            b.index = i
        self._queues: dict = {}
        for b in self._buckets:  # one issue order per communicator
            self._queues.setdefault(id(b.group), _Queue()).buckets.append(b)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        for q in self._queues.values():  # now, not at the first step: a lost peer's process is then identified
            if not lay.emulated:
                _mesh.monitor(q.buckets[0].group)
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for b in self._buckets for p in b.params]

    def _divisor(self, expert: bool) -> int:
        return self._lay.divisor

    def __enter__(self) -> "GradientSync":
        if self._active:
            raise RuntimeError("GradientSync: already inside its with block")
        self._check_plan()
        self._start()
        return self

    def _check_plan(self) -> None:
        """gloo: one header all-gather per communicator (the dense group, and the expert group on a
        mesh with dp > 1), before the backward: every rank raises CollectiveMismatch if the buckets,
        their sizes, dtypes or piece sizes, or the number of collectives issued before, differ. Not in
        the gradient hooks (see :meth:`_issue`). No collective on NCCL or an EmulatedGroup."""
        if self._lay.emulated:
            return
        for q in self._queues.values():
            group = q.buckets[0].group
            mon = _mesh.monitor(group)
            if not (mon.check_headers and mon.size > 1):
                continue  # (NCCL: no host sync; one rank: nothing to compare)
            plan = [
                (b.index, len(b.params), sum(p.numel() for p in b.params), str(b.params[0].dtype)) for b in q.buckets
            ]
            total = sum(n for _, _, n, _ in plan)
            crc = zlib.crc32(repr((plan, self.piece_bytes, self.params)).encode())
            mon.check(
                f"gradient sync plan {crc:08x}, {len(plan)} buckets",
                (q.buckets[0].params[0].dtype, [total] * mon.size, [total] * mon.size),
            )

    def _start(self) -> None:
        for b in self._buckets:
            b.reset()
        for q in self._queues.values():
            q.next = 0
        self.issued = 0
        self.order = []
        self._active = True

    def __exit__(self, exc_type, exc, tb) -> None:
        self._active = False
        if exc_type is not None:
            _abort_step(self._buckets, exc)  # a failed backward: change nothing, tell the peers
            return
        self._finish()

    @torch.no_grad()
    def _finish(self) -> None:
        for q in self._queues.values():  # buckets whose gradients did not all arrive (unused parameters)
            while q.next < len(q.buckets):
                self._issue(q.buckets[q.next])
                q.next += 1
        for b in self._buckets:
            for w in b.works:
                w.wait()
            if b.post != 1:
                b.flat.div_(b.post)
            offset = 0
            for p in b.params:
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(b.flat[offset : offset + n].view_as(p.grad))
                offset += n
        for p in self._scaled:
            if p.grad is not None:
                p.grad.div_(self._lay.divisor)

    def remove(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _ready(self, p: torch.Tensor) -> None:
        if not self._active:
            return
        b = self._bucket_of[id(p)]
        b.ready.add(id(p))
        q = self._queues[id(b.group)]
        while q.next < len(q.buckets) and len(q.buckets[q.next].ready) == len(q.buckets[q.next].params):
            self._issue(q.buckets[q.next])
            q.next += 1

    @torch.no_grad()
    def _issue(self, b: "_Bucket") -> None:
        b.flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params])
        step = b.flat.numel() if self.piece_bytes is None else max(1, self.piece_bytes // b.flat.element_size())
        self.order.append(b.index)
        if self._lay.emulated:
            op, b.post = "sum", b.divisor
        else:
            op, b.post = _mesh.reduce_op(b.group, b.divisor)
        pieces = b.flat.split(step)
        if self._lay.emulated:
            b.works += [b.group.all_reduce(piece, "sum", low_priority=self.low_priority) for piece in pieces]
        else:
            # Through the group's monitor: numbered, each wait bounded, a lost peer named. No header here:
            # waiting for the peers in a gradient hook deadlocks when two communicators' buckets complete
            # in different orders on different ranks (deferred dW); the plan was checked at the start.
            mon, what = _mesh.monitor(b.group), f"gradient bucket {b.index} ({len(pieces)} pieces)"
            for piece in pieces:
                b.works.append(
                    mon.issue(what, lambda piece=piece: dist.all_reduce(piece, op=op, group=b.group, async_op=True))
                )
        self.issued += len(pieces)


def _abort_step(buckets: list, exc: BaseException) -> None:
    """A backward that raised inside the step: its buckets did not all go out, so the peers wait in
    all-reduces this rank will not issue, and its next step's would pair with theirs. Break each
    process group's monitor (a failure record: the peers raise PeerError naming this rank within a
    poll; this rank's next use raises GroupError), then let what is in flight arrive."""
    cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    for group in {id(b.group): b.group for b in buckets}.values():
        if isinstance(group, dist.ProcessGroup) or group is None:
            mon = _mesh.monitor(group)  # (one that broke already, with this error say, keeps its record)
            if mon.size > 1:
                mon.break_(
                    mon.error(
                        PeerError,
                        f"{mon.label} {mon.name(mon.rank)} raised in backward inside its "
                        f"gradient sync ({cause[:300]}); the step's gradient all-reduces are incomplete",
                        [mon.rank],
                    )
                )
    _drain(buckets)


def _drain(buckets: list) -> None:
    """Wait for what is in flight after a failed backward; a group that broke meanwhile (the error
    that ended the backward, often) stops the waiting without raising over that error."""
    for b in buckets:
        for w in b.works:
            try:
                w.wait()
            except GroupError:
                return


class _Queue:
    """The buckets of one communicator, issued in this order; ``next`` is the first not issued."""

    def __init__(self):
        self.buckets: list = []
        self.next = 0


class _Bucket:
    def __init__(self, params: list, group, divisor: int):
        self.params = params
        self.group = group
        self.divisor = divisor
        self.index = 0
        self.reset()

    def reset(self) -> None:
        self.ready: set = set()
        self.flat: Optional[torch.Tensor] = None
        self.works: list = []
        self.post = 1


def _buckets(params: list, bucket_bytes: int, group, divisor: int) -> list:
    """Consecutive parameters of one dtype and device, up to ``bucket_bytes`` a bucket."""
    out, cur, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if cur and (size + nbytes > bucket_bytes or (p.dtype, p.device) != (cur[0].dtype, cur[0].device)):
            out.append(_Bucket(cur, group, divisor))
            cur, size = [], 0
        cur.append(p)
        size += nbytes
    if cur:
        out.append(_Bucket(cur, group, divisor))
    return out
