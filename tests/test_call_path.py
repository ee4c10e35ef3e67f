"""Following one chunk's forward through one MoE layer visits each file once, in order.

Traced with ``sys.setprofile``: every Python call into a file of ``lancet_rt`` is recorded with the
files on the call stack. A call **re-enters** a file when that file is already on the stack below
another of our files, so the callee called back into it (a callback, or a call upwards); calls within
one file and returns to the caller do not count. Frames of other code (torch, the autograd engine, this
test) are stepped over, so a callback passed through ``torch.autograd.Function.apply`` still counts.
Under greenlets each greenlet has its own stack: the scheduler's switches resume a chunk where it
stopped, they call nothing. Under :class:`lancet_rt.Overlapped` the MoE files' order is read from the
chunks' greenlets only (one chunk's path); the re-entries are counted over the whole step, the
driver's frames too (the main greenlet: the step guard, warm-up, the chunking, the scheduler).

What is traced: one forward of a MoE layer of the default dispatcher on an ``EmulatedGroup(2)`` and on a
real 2-rank gloo group (``TorchGroup``: the split lanes its ``ep_group`` gets by default, whose issuer
thread is not traced, and the plain group, ``LANCET_EP_TRANSPORT=plain``, whose monitor launches each
collective on the calling thread as on NCCL), the backward of that forward, one step of ``Overlapped(chunks=2)``
(forward and backward, with deferred dW), and one ``Overlapped.accumulate`` step of 2 microbatches
(with deferred dW and without) on both of its threads: the host (the driver, the forwards, the last
backward and its dW flush) and the helper thread that runs the first microbatch's backward beside
the second's forward, handing the baton back at its all-to-alls. The deferred dW items are closures
(the rest of a Function's backward, holding its operands), which the queue runs from an all-to-all's
window or the flush; they need no exemption: no Function's file is on the stack when they run. No
call re-enters a file, and the forward first visits the MoE
files in the order of :data:`MOE_ORDER`: the layer (validation, routing state, route), the registry
(the lookup), ``base.py`` (the dispatcher's constructor), ``alltoall.py`` (``AllToAll.run``: counts,
permute, dispatch, experts, combine), ``common.py`` (the counts exchange, the layout) and the experts.
The checker is shown to catch a planted callback (a function of ``comm/faults.py`` that calls the
dispatcher's ``common.py`` back, as the counts exchange's ordering once did).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types

import pytest
import torch

import lancet_rt
from lancet_rt.comm import faults
from lancet_rt.moe.dispatch import common
from lancet_rt.schedule import accumulate
from tests.dist import assert_all_ok, run_ranks

try:
    import greenlet
except ImportError:  # (Overlapped needs it; the plain layer does not)
    greenlet = None

ROOT = os.path.dirname(os.path.abspath(lancet_rt.__file__))
MOE_ORDER = (
    "moe/layer.py",
    "moe/dispatch/registry.py",
    "moe/dispatch/base.py",
    "moe/dispatch/alltoall.py",
    "moe/dispatch/common.py",
    "moe/experts.py",
)
D, F, E, K, T = 16, 32, 4, 2, 8


class CallPath:
    """The files of ``lancet_rt`` a traced call visits (first visits, in order) and its re-entries."""

    def __init__(self, chunks_only: bool = False):
        self.chunks_only = chunks_only  # count only greenlets other than the tracing one (Overlapped's chunks)
        self.main = greenlet.getcurrent() if greenlet is not None else None
        self.stacks: dict = {}
        self.order: list[str] = []
        self.reentries: list[str] = []

    def _profile(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        where = greenlet.getcurrent() if greenlet is not None else None
        stack = self.stacks.setdefault(where, [])
        if event == "return":
            if stack:
                stack.pop()
            return
        path = os.path.abspath(frame.f_code.co_filename)
        ours = os.path.relpath(path, ROOT).replace(os.sep, "/") if path.startswith(ROOT + os.sep) else None
        counted = ours is not None and not (self.chunks_only and where is self.main)
        if counted:
            caller = next((s for s in reversed(stack) if s is not None), None)
            if caller is not None and caller[0] != ours and any(s is not None and s[0] == ours for s in stack):
                path_so_far = " -> ".join(f"{f}:{fn}" for f, fn in (s for s in stack if s is not None))
                self.reentries.append(f"{path_so_far} => {ours}:{frame.f_code.co_name}")
            if ours not in self.order:
                self.order.append(ours)
        stack.append((ours, frame.f_code.co_name) if ours is not None else None)

    def run(self, fn):
        sys.setprofile(self._profile)
        try:
            return fn()
        finally:
            sys.setprofile(None)


def trace(fn, chunks_only: bool = False) -> tuple[CallPath, object]:
    path = CallPath(chunks_only)
    return path, path.run(fn)


def assert_no_reentry(path: CallPath, what: str) -> None:
    assert not path.reentries, f"{what}: {len(path.reentries)} call(s) re-enter a file:\n" + "\n".join(path.reentries)


def assert_moe_order(path: CallPath, what: str) -> None:
    seen = [f for f in path.order if f.startswith("moe/")]
    assert seen == list(MOE_ORDER), f"{what}: MoE files first visited in the order {seen}, not {list(MOE_ORDER)}"


def _layer(group) -> tuple[lancet_rt.MoE, torch.Tensor]:
    torch.manual_seed(0)
    moe = lancet_rt.MoE(D, F, E, K, ep_group=group)
    x = torch.randn(T, D, requires_grad=True)
    moe(x).sum().backward()  # warm: first-use work (the gloo split, warm-up) is not the path
    return moe, x


def test_one_layer_forward_and_backward_emulated():
    moe, x = _layer(lancet_rt.EmulatedGroup(world_size=2))
    fwd, y = trace(lambda: moe(x))
    assert_no_reentry(fwd, "forward")
    assert_moe_order(fwd, "forward")
    bwd, _ = trace(lambda: y.sum().backward())
    assert_no_reentry(bwd, "backward")


def test_one_chunk_under_overlapped():
    moe, x = _layer(lancet_rt.EmulatedGroup(world_size=2))
    step = lancet_rt.Overlapped(moe, chunks=2, defer_wgrad=True)
    step(x).sum().backward()
    chunks, _ = trace(lambda: step(x), chunks_only=True)
    assert_moe_order(chunks, "Overlapped forward (the chunks' greenlets)")
    fwd, y = trace(lambda: step(x))
    assert_no_reentry(fwd, "Overlapped forward (the driver and the chunks)")
    bwd, _ = trace(lambda: y.sum().backward())
    assert_no_reentry(bwd, "Overlapped backward")


@contextlib.contextmanager
def _traced_helper(path: CallPath):
    """Trace ``path`` on accumulate's helper thread too (``sys.setprofile`` is per thread: set there)."""
    worker, done = accumulate._worker(), threading.Event()

    def profile(fn):
        done.clear()
        worker.submit(lambda: (sys.setprofile(fn), done.set()))
        assert done.wait(30), "accumulate's helper thread did not take the job"

    profile(path._profile)
    try:
        yield path
    finally:
        profile(None)


@pytest.mark.parametrize("defer_wgrad", [False, True])
def test_an_accumulate_step(defer_wgrad):
    moe, x = _layer(lancet_rt.EmulatedGroup(world_size=2))
    step = lancet_rt.Overlapped(moe, chunks=2, defer_wgrad=defer_wgrad)
    micro = [x.detach(), x.detach() + 1]
    loss_fn = lambda out, i: out.sum()
    step.accumulate(micro, loss_fn)  # warm
    with _traced_helper(CallPath()) as helper:
        host, _ = trace(lambda: step.accumulate(micro, loss_fn))
    assert_no_reentry(host, f"accumulate (defer_wgrad={defer_wgrad}), the host")
    assert_no_reentry(helper, f"accumulate (defer_wgrad={defer_wgrad}), the backward beside the forward")
    # What was traced: the backward on the helper thread, its all-to-alls handing the baton back; and
    # with deferred dW, the queue (drained in windows and flushed) on both threads.
    assert {"schedule/accumulate.py", "comm/group.py", "runtime/scope.py", "runtime/beside.py"} <= set(helper.order)
    assert "runtime/beside.py" in host.order
    assert ("runtime/wgrad.py" in helper.order and "runtime/wgrad.py" in host.order) == defer_wgrad


def _gloo_paths(rank, world, transport):
    import torch.distributed as dist

    os.environ["LANCET_EP_TRANSPORT"] = transport
    moe, x = _layer(dist.group.WORLD)
    fwd, y = trace(lambda: moe(x))
    bwd, _ = trace(lambda: y.sum().backward())
    return fwd.order, fwd.reentries, bwd.reentries


@pytest.mark.parametrize("transport", ["split", "plain"])
def test_one_layer_forward_and_backward_gloo(transport):
    for order, forward, backward in assert_all_ok(run_ranks(_gloo_paths, 2, transport, timeout=120)):
        path = CallPath()
        path.order, path.reentries = order, forward
        assert_no_reentry(path, f"gloo forward ({transport})")
        assert_moe_order(path, f"gloo forward ({transport})")
        path.reentries = backward
        assert_no_reentry(path, f"gloo backward ({transport})")


def _callback(group, handle):  # (planted as a function of comm/faults.py: it calls the dispatcher back)
    common.host_bounds([1])


def test_the_checker_catches_a_planted_callback(monkeypatch):
    moe, x = _layer(lancet_rt.EmulatedGroup(world_size=2))
    code = _callback.__code__.replace(co_filename=faults.__file__)
    monkeypatch.setattr(faults, "note_exchange", types.FunctionType(code, {"common": common}))
    path, _ = trace(lambda: moe(x))
    assert path.reentries, "the planted callback was not found"
    assert all(r.endswith("=> moe/dispatch/common.py:host_bounds") for r in path.reentries), path.reentries
    assert "moe/dispatch/common.py:exchange_counts -> comm/faults.py:_callback" in path.reentries[0]
