"""Expert-parallel communication: the group interface, the torch.distributed group, and the
all-to-all as an autograd Function whose backward is the dual all-to-all.

Collectives here are asynchronous: they return a handle, and the consumer waits on it, never the
producer. The backward of an all-to-all gives the weight-gradient queue (``wgrad``) the time the
collective is in flight.

Each collective is handed to the group's monitor as data, the ``torch.distributed`` call with its
arguments bound (``functools.partial``), which the monitor (or a split group's issuer thread) launches
after its checks: the monitor calls torch, never back into this module.

An all-to-all's :class:`BackwardLink` keeps the state of its dual (backward) all-to-all on itself,
not in the step context (:mod:`lancet_rt.runtime.scope`): ``early``, the dual issued before this
node's backward ran (by its consumer's backward, or from the forward), and ``scaled_by``, the loss
gradient's factor of a dual issued from the forward. Both belong to one autograd node: made in the
forward, read by that node's backward after the forward's chunk scope has ended, on whichever thread
the engine runs it, and gone with the graph. A context would need them keyed by link and cleared
by hand after every backward, including one that raised. Which partial backward issues a dual from
the forward is the step context's (``PROCESS.dual_from_forward``): it lasts one call.
"""

from __future__ import annotations

import functools
import math
import pickle
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from lancet_rt import env
from lancet_rt import trace as _trace
from lancet_rt.comm import faults
from lancet_rt.comm.channels import lane_all_to_all, make_channels
from lancet_rt.comm.link import check_link, link_ms
from lancet_rt.comm.monitor import GroupMonitor
from lancet_rt.runtime import scope as _scope
from lancet_rt.runtime import wgrad


@runtime_checkable
class Work(Protocol):
    def wait(self) -> object: ...


class Done:
    """A handle for work that completed when it was issued."""

    def wait(self) -> bool:
        return True


@runtime_checkable
class ExpertParallelGroup(Protocol):
    """What the MoE layer needs from an expert-parallel group.

    Implemented by :class:`TorchGroup` (a torch.distributed process group) and by
    :class:`lancet_rt.EmulatedGroup` (one process pretending to be rank 0 of a symmetric world).
    """

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]
    ) -> Work:
        """Start an all-to-all of rows; ``output`` is valid after ``wait()``."""

    def exchange(self, send_WN: torch.Tensor) -> "Exchange":
        """Start an all-to-all of one equal-size int64 row per rank (the counts exchange).

        Returns a handle whose ``wait()`` gives recv_WN on the host, row r from rank r. This is the
        layer's one host synchronisation point; issuing it early and waiting late lets the
        scheduler run other chunks in between.
        """

    def all_gather(self, vec_N: torch.Tensor) -> torch.Tensor:
        """Blocking all-gather of a fixed-size int64 vector: returns [W, N]."""


class TorchGroup:
    """An :class:`ExpertParallelGroup` over a torch.distributed process group (gloo or NCCL).

    A link model (:meth:`set_link`: latency and bandwidth, measured by the autotuner when it keys
    or tunes on this group) gives each backward all-to-all a modeled duration, the window in which
    deferred weight gradients run (:meth:`hold_ms`). Without one, deferred dW runs while the
    collective reports itself unfinished, which on CUDA, where the host runs ahead of the device,
    tends to empty the queue into the first window.

    Every collective goes through a :class:`lancet_rt.comm.monitor.GroupMonitor`: a rank waits at most
    ``timeout_s`` in one collective, learns within a fraction of a second that a peer failed in the
    middle of a step, and then raises :class:`lancet_rt.comm.faults.PeerError` naming it (README,
    "Reliability").

    Args:
        group: the process group.
        bandwidth_gbps: the link's all-to-all bandwidth per rank for off-rank bytes, GB/s (None:
            no link model).
        latency_us: the per-collective latency of that model.
        timeout_s: seconds a rank waits in one collective before it raises
            :class:`lancet_rt.comm.faults.PeerTimeout` (None: ``LANCET_TIMEOUT_S``, default 300).
        counts_group: a process group of the same ranks for the counts exchanges (None: ``group``).
            On ``group`` a chunk's counts queue behind the tokens in flight (one communicator runs
            its collectives in order); on a group of their own they arrive in about the link's
            latency, which matters most when two passes share the link
            (:meth:`lancet_rt.Overlapped.accumulate`). Create it as any group, on every rank:
            ``dist.new_group(ranks)`` (on NCCL a second communicator, its buffers allocated at the
            first exchange).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        bandwidth_gbps: Optional[float] = None,
        latency_us: float = 0.0,
        timeout_s: Optional[float] = None,
        counts_group: Optional[dist.ProcessGroup] = None,
        _channels=None,
    ):
        self.group = group
        self._size = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        backend = dist.get_backend(group)
        self.backend = str(backend).lower()
        self.channels = _channels
        self.counts_group = _channels.control if _channels is not None else _counts_group(group, counts_group)
        self._bulk = _channels.bulk if _channels is not None else group  # lancet's all-reduces, broadcasts, ...
        self._small = _channels.control if _channels is not None else group  # small all-gathers
        self.bandwidth_gbps: Optional[float] = None
        self.latency_us = 0.0
        if bandwidth_gbps is not None:
            self.set_link(bandwidth_gbps, latency_us)
        self.monitor = GroupMonitor(
            group,
            self._rank,
            self._size,
            self.backend,
            env.timeout_s() if timeout_s is None else timeout_s,
            counts_group=self.counts_group,
            header_device=self._small_device(),
            channels=_channels,
        )

    @classmethod
    def split(cls, group: dist.ProcessGroup, **kwargs) -> "TorchGroup":
        """A gloo group whose traffic is split over process groups of its own (a collective call, on
        every rank of ``group``): the counts exchanges and the header checks on a control group, each
        direction of the tokens' all-to-alls on a group of its own, lancet's all-reduces on another,
        every checked collective's header check and launch on a thread of the group, off the host's
        path (:mod:`lancet_rt.comm.channels`: why, as a real rate-limited link showed). It checks and
        bounds what a plain group does. ``kwargs``: :class:`TorchGroup`'s (not ``counts_group``).
        ``as_group(group)`` returns it from now on (a TorchGroup made for ``group`` before is an error).

        Returns:
            the :class:`TorchGroup`.
        """
        if "counts_group" in kwargs:
            raise ValueError("counts_group: a split group makes its own (its control group)")
        if "gloo" not in str(dist.get_backend(group)).lower():
            raise ValueError(
                f"group must be a gloo process group to split (NCCL's all-to-all is full duplex), got "
                f"{dist.get_backend(group)}"
            )
        if group in _torch_groups:
            raise ValueError("group already has a TorchGroup (as_group made one): split it before any layer uses it")

        timeout = kwargs.get("timeout_s")
        made = cls(group, _channels=make_channels(group, env.timeout_s() if timeout is None else timeout), **kwargs)
        _torch_groups[group] = made
        return made

    def split_at_first_use(self) -> None:
        """Split this group as :meth:`split` does, at its next collective instead of now: every rank builds
        the lanes where it issues that collective (the same one on every rank: the ranks run the same
        collectives), so a layer's construction needs no collective and the layers sharing the group share
        one split. What a gloo ProcessGroup given as ``ep_group`` gets (:func:`as_group`); nothing for a
        group already split, a group of one rank, an NCCL group or with ``LANCET_EP_TRANSPORT=plain``. A
        peer that does not come is named as in any collective: its failure record, its process gone, or
        a :class:`lancet_rt.comm.faults.PeerTimeout` after the group's timeout."""
        if self.channels is not None or self._size == 1 or "gloo" not in self.backend:
            return
        if env.ep_transport() == "plain" or self.counts_group is not self.group:
            return
        self.monitor.before_next(self._split_now)

    def _split_now(self) -> None:
        ch = make_channels(self.group, self.timeout_s, watch=self.monitor.watch_arrival)
        self.channels, self.counts_group, self._bulk, self._small = ch, ch.control, ch.bulk, ch.control
        self.monitor.use_channels(ch)

    @property
    def counts_channel(self) -> str:
        """ "own" with a counts group of its own, else "shared" (as :class:`lancet_rt.EmulatedGroup`'s)."""
        return "shared" if self.counts_group is self.group else "own"

    @property
    def timeout_s(self) -> float:
        """Seconds a rank waits in one collective of this group before it raises."""
        return self.monitor.timeout_s

    def set_timeout(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds in one collective (set it on every rank)."""
        self.monitor.set_timeout(timeout_s)

    def set_link(self, bandwidth_gbps: float, latency_us: float = 0.0) -> None:
        """Model the link as ``latency_us + off-rank bytes / bandwidth_gbps`` per collective."""
        self.bandwidth_gbps, self.latency_us = check_link(bandwidth_gbps, latency_us)

    def hold_ms(self, off_rank_bytes: int) -> Optional[float]:
        """The modeled time of one collective moving ``off_rank_bytes`` off rank (None: no model)."""
        if self.bandwidth_gbps is None:
            return None
        return link_ms(off_rank_bytes, self.bandwidth_gbps, self.latency_us)

    def __deepcopy__(self, memo):
        return self  # a group is a handle: copies of a model share it

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    def _small_device(self) -> torch.device:
        # NCCL moves only CUDA tensors; gloo is happiest with CPU ones for small control data.
        if "nccl" in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_to_all(self, output, input, output_splits, input_splits) -> Work:
        row_in, row_out = math.prod(input.shape[1:]), math.prod(output.shape[1:])
        header = (input.dtype, [n * row_in for n in input_splits], [n * row_out for n in output_splits])
        self.monitor.prepare("all-to-all")  # (a split at first use: its lanes exist from here on)
        if self.channels is not None:  # each direction on its own lane
            return self.monitor.issue(
                "all-to-all",
                functools.partial(
                    lane_all_to_all, self.channels, self._rank, output, input, output_splits, input_splits
                ),
                header,
            )
        return self.monitor.issue(
            "all-to-all",
            functools.partial(
                dist.all_to_all_single,
                output,
                input,
                list(output_splits),
                list(input_splits),
                group=self.group,
                async_op=True,
            ),
            header,
        )

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str = "all-reduce") -> Work:
        """Start a sum all-reduce of ``tensor`` in place (async); ``tensor`` is valid after ``wait()``."""
        if op != "sum":
            raise ValueError(f"op must be 'sum', got {op!r}")
        header = (tensor.dtype, [tensor.numel()] * self._size, [tensor.numel()] * self._size)
        return self.monitor.issue(
            what,
            functools.partial(dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=self._bulk, async_op=True),
            header,
        )

    def broadcast(self, tensor: torch.Tensor, src: int, what: str = "broadcast") -> Work:
        """Start a broadcast of ``tensor`` in place from group rank ``src`` (async; valid after ``wait()``)."""
        header = (tensor.dtype, [tensor.numel()] * self._size, [tensor.numel()] * self._size)
        root = dist.get_global_rank(self.group, src)
        return self.monitor.issue(
            what, functools.partial(dist.broadcast, tensor, src=root, group=self._bulk, async_op=True), header
        )

    def reduce(self, tensor: torch.Tensor, dst: int, op: str = "sum", what: str = "reduce") -> Work:
        """Start a sum of ``tensor`` over the ranks into group rank ``dst``'s ``tensor`` (async; the others'
        ``tensor`` is undefined after it)."""
        if op != "sum":
            raise ValueError(f"op must be 'sum', got {op!r}")
        header = (tensor.dtype, [tensor.numel()] * self._size, [tensor.numel()] * self._size)
        root = dist.get_global_rank(self.group, dst)
        return self.monitor.issue(
            what,
            functools.partial(dist.reduce, tensor, dst=root, op=dist.ReduceOp.SUM, group=self._bulk, async_op=True),
            header,
        )

    def exchange(self, send_WN: torch.Tensor) -> "Exchange":
        send = send_WN.to(self._small_device(), torch.int64).contiguous()
        recv = torch.empty_like(send)
        n = send.numel() // max(self._size, 1)
        work = self.monitor.issue(
            "counts exchange",
            functools.partial(dist.all_to_all_single, recv, send, group=self.counts_group, async_op=True),
            (send.dtype, [n] * self._size, [n] * self._size),
        )
        if not recv.is_cuda:
            return Exchange(recv, work, send)
        # NCCL: the counts (received and sent) come to pinned host memory on a side stream once the
        # collective is done, so the compute stream never waits for the host and the host waits only
        # for this copy.
        side = _side_stream(recv.device)
        with torch.cuda.stream(side):
            work.wait()  # the side stream waits for the collective
            host = torch.empty((2,) + tuple(recv.shape), dtype=recv.dtype, pin_memory=True)
            host[0].copy_(recv, non_blocking=True)
            host[1].copy_(send, non_blocking=True)
            recv.record_stream(side)
            send.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        return Exchange(host[0], event, host[1], self.monitor)

    def all_gather(self, vec_N: torch.Tensor, what: str = "all-gather") -> torch.Tensor:
        vec = vec_N.to(self._small_device(), torch.int64).contiguous()
        out = [torch.empty_like(vec) for _ in range(self._size)]
        header = (vec.dtype, [vec.numel()] * self._size, [vec.numel()] * self._size)
        self.monitor.issue(
            what, functools.partial(dist.all_gather, out, vec, group=self._small, async_op=True), header
        ).wait()
        return self.monitor.block(lambda: torch.stack(out).cpu())

    def all_gather_object(self, obj, what: str = "object all-gather") -> list:
        """Every rank's picklable ``obj`` (a list, rank order) by two monitored all-gathers (sizes, bytes):
        unlike ``dist.all_gather_object``, bounded by the timeout and naming a lost peer."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([data.numel()]), f"{what} (sizes)")[:, 0].tolist()
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=self._small_device())
        buf[: data.numel()] = data.to(buf.device)
        out = [torch.empty_like(buf) for _ in range(self._size)]
        header = (buf.dtype, [buf.numel()] * self._size, [buf.numel()] * self._size)
        self.monitor.issue(
            what, functools.partial(dist.all_gather, out, buf, group=self._bulk, async_op=True), header
        ).wait()
        host = self.monitor.block(lambda: [t.cpu() for t in out])
        return [pickle.loads(t.numpy()[:n].tobytes()) for t, n in zip(host, sizes)]


def _counts_group(group: dist.ProcessGroup, counts_group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """:class:`TorchGroup`'s ``counts_group`` argument, checked: a group of ``group``'s ranks and backend."""
    if counts_group is None:
        return group
    if not isinstance(counts_group, dist.ProcessGroup):
        raise TypeError(
            f"counts_group must be None or a torch.distributed ProcessGroup, got {type(counts_group).__name__}"
        )
    ranks, theirs = dist.get_process_group_ranks(group), dist.get_process_group_ranks(counts_group)
    if theirs != ranks:
        raise ValueError(f"counts_group must have the ranks of group, {ranks}, got {theirs}")
    if str(dist.get_backend(counts_group)) != str(dist.get_backend(group)):
        raise ValueError(
            f"counts_group must have the backend of group, {dist.get_backend(group)}, got "
            f"{dist.get_backend(counts_group)}"
        )
    return counts_group


class Exchange:
    """A counts exchange in flight; ``wait()`` returns the received counts on the host, and
    ``sent`` (valid after ``wait()``) this rank's own send counts, also on the host."""

    def __init__(self, host: torch.Tensor, work, sent: torch.Tensor, monitor=None):
        self._host, self._work, self.sent, self._monitor = host, work, sent, monitor

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            _scope.host_wait(self._work)
            if isinstance(self._work, torch.cuda.Event):
                if self._monitor is not None:  # a watchdog can end this wait (faults.GroupMonitor.block)
                    self._monitor.block(self._work.synchronize)
                else:
                    self._work.synchronize()
            else:
                self._work.wait()
            self._work = None
        return self._host


_side_streams: dict = {}


def _side_stream(device):
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


_torch_groups: dict = {}


def is_wrapped(pg) -> bool:
    """Whether :func:`as_group` has made the :class:`TorchGroup` of process group ``pg`` already."""
    return pg in _torch_groups


def as_group(ep_group, *, expert_parallel: bool = False) -> Optional[ExpertParallelGroup]:
    """Normalise the ``ep_group`` argument: None, a ProcessGroup, or an ExpertParallelGroup.

    Every layer given the same ProcessGroup shares one :class:`TorchGroup`, so a link model set on
    it (:meth:`TorchGroup.set_link`) holds for all of them. ``expert_parallel`` (a MoE layer's
    ``ep_group``, as the user gave it): a gloo ProcessGroup is split at its first collective
    (:meth:`TorchGroup.split_at_first_use`; ``LANCET_EP_TRANSPORT=plain``, or a :class:`TorchGroup` of
    the group passed instead, keeps it as it is). ``LANCET_EP_TRANSPORT`` is read here: a bad value is a
    ValueError before any collective."""
    if ep_group is None:
        return None
    if isinstance(ep_group, dist.ProcessGroup):
        if expert_parallel:
            env.ep_transport()
        if ep_group not in _torch_groups:
            _torch_groups[ep_group] = TorchGroup(ep_group)
        if expert_parallel:
            _torch_groups[ep_group].split_at_first_use()
        return _torch_groups[ep_group]
    if isinstance(ep_group, ExpertParallelGroup):
        return ep_group
    raise TypeError(
        f"ep_group must be None, a torch.distributed ProcessGroup or an ExpertParallelGroup, "
        f"got {type(ep_group).__name__}"
    )


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``input_splits`` go to the ranks; ``output_splits`` rows come back.

    Forward returns the output buffer at once and leaves the handle in ``link``; the consumer calls
    ``wait()`` before reading it. Backward runs the dual all-to-all. The consumer's backward may
    issue that dual early (:meth:`BackwardLink.issue`), as soon as it has produced the gradient, so
    the autograd engine runs other chunks' backward while it is in flight; this node then only
    waits, draining the deferred weight-gradient queue meanwhile.
    """

    @staticmethod
    def forward(ctx, x, link):
        out = x.new_empty((sum(link.output_splits),) + tuple(x.shape[1:]))
        link.work = link.group.all_to_all(out, x.contiguous(), link.output_splits, link.input_splits)
        ctx.link = link
        ctx.wgrad = wgrad.current()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return finish_backward(ctx.link, grad_out, ctx.wgrad, lambda: ctx.link.window_ms(grad_out)), None


def finish_backward(link, grad, queue, window_ms) -> torch.Tensor:
    """The backward of a collective whose dual its consumer may have issued early (``link.issue``):
    issue it now if not, give a forward running beside this backward its turn
    (:mod:`lancet_rt.schedule.accumulate`), drain deferred dW (``queue``) while it flies for ``window_ms()``,
    then wait. Returns the dual's result."""
    if link.early is None:
        link.issue(grad)
    result, work = link.early
    link.early = None
    scaled = getattr(link, "scaled_by", None)  # (a BackwardLink's dual issued from the forward)
    if scaled is not None:
        link.scaled_by = None
    _scope.backward_wait()  # a forward running beside this backward (lancet_rt.schedule.accumulate) goes on
    if queue is not None:
        with _trace.span("dW", chunk=link.chunk):
            queue.drain_during(work, window_ms())
    with _trace.span("wait", "wait", chunk=link.chunk):
        work.wait()
    if scaled is not None:  # issued from the forward for a loss gradient of 1: times the real one
        result.mul_(scaled.factor().to(result.dtype))
    return result


class BackwardLink:
    """One all-to-all's plan, shared by its forward handle and its consumer's backward.

    Attributes:
        early: (result, work) of the dual all-to-all once issued ahead of this node's backward
            (:meth:`issue`), until that backward takes it; None before.
        scaled_by: the :class:`lancet_rt.schedule.early_backward.GradScale` of a dual issued from the
            forward (for a loss gradient of 1), whose factor the node's backward multiplies the result
            by; None otherwise. (Module docstring: why these live here.)
    """

    def __init__(self, group, output_splits: Sequence[int], input_splits: Sequence[int]):
        self.group = group
        self.output_splits, self.input_splits = list(output_splits), list(input_splits)
        self.work: Work = Done()
        self.early = None
        self.chunk = _scope.current().chunk if _scope.current() is not None else None
        self.scaled_by = None

    def issue(self, grad_out: torch.Tensor) -> None:
        """Start the backward (dual) all-to-all of ``grad_out`` now."""
        early = None
        pending = _scope.PROCESS.dual_from_forward  # (a partial backward issuing this dual from the forward)
        if pending is not None and pending[0] is self:
            early, _scope.PROCESS.dual_from_forward = pending[1], None
        faults.note_dual(self.group, early=early is not None)
        grad_out = grad_out.contiguous()
        grad_in = grad_out.new_empty((sum(self.input_splits),) + tuple(grad_out.shape[1:]))
        work = self.group.all_to_all(grad_in, grad_out, self.input_splits, self.output_splits)
        self.early = (grad_in, work)
        self.scaled_by = early

    def withdraw_early(self) -> None:
        """Drop the dual issued from the forward (waited for, its result unread): the consumer's
        backward issues it again (:mod:`lancet_rt.schedule.early_backward`)."""
        _, work = self.early
        work.wait()
        self.early = None
        self.scaled_by = None

    def window_ms(self, grad_out: torch.Tensor) -> Optional[float]:
        """The backward collective's expected time, where the group models it (the emulated link,
        a :class:`TorchGroup` with a link model); None otherwise."""
        hold = getattr(self.group, "hold_ms", None)
        if hold is None:
            return None
        row_bytes = grad_out.element_size() * math.prod(grad_out.shape[1:])
        return hold((sum(self.output_splits) - self.output_splits[self.group.rank]) * row_bytes)


class Pending:
    """An all-to-all in flight. ``wait()`` returns its output once it has arrived; ``link`` lets the
    output's consumer issue the backward all-to-all early."""

    def __init__(self, out: torch.Tensor, link: Optional[BackwardLink]):
        self._out, self.link = out, link

    def wait(self) -> torch.Tensor:
        if self.link is not None and self.link.work is not None:
            _scope.host_wait(self.link.work)  # a backward beside this forward fills the wait with its dW
            with _trace.span("wait", "wait", chunk=self.link.chunk):
                self.link.work.wait()
            self.link.work = None
        return self._out


def all_to_all(
    x: torch.Tensor, group: ExpertParallelGroup, output_splits: Sequence[int], input_splits: Sequence[int]
) -> Pending:
    """Start an autograd-aware all-to-all of the rows of ``x``; returns a :class:`Pending`."""
    link = BackwardLink(group, output_splits, input_splits)
    if torch.is_grad_enabled() and x.requires_grad:
        faults.note_link(group)
    out = _AllToAll.apply(x, link)
    return Pending(out, link)
