"""The CUDA-semantics test mode (tests/cuda_semantics.py) really moves the backward to a device
thread: hooks, nodes and engine callbacks run on one long-lived thread other than the caller's, a
backward from a node runs inline there, errors reach the caller; in gloo ranks too, with the
monitors' header check off. With the mode off, everything runs on the caller's thread (CPU's engine)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests import cuda_semantics
from tests.dist import assert_all_ok, run_ranks


class _Recording(torch.autograd.Function):
    """Identity whose backward records its thread and, if asked, runs a (reentrant) backward of its own."""

    seen: list = []

    @staticmethod
    def forward(ctx, x, reentrant):
        ctx.reentrant = reentrant
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Recording.seen.append(("node", threading.get_ident()))
        if ctx.reentrant:
            with torch.enable_grad():
                w = torch.ones(2, requires_grad=True)
                (w * 3).sum().backward()
                _Recording.seen.append(("reentrant", float(w.grad.sum())))
        return g, None


def _threads_of_one_backward(reentrant: bool) -> list:
    """Where a tensor hook, a custom node, a parameter's post-accumulate hook and an engine callback ran."""
    _Recording.seen = seen = []
    w = torch.nn.Parameter(torch.randn(3))
    w.register_post_accumulate_grad_hook(lambda p: seen.append(("accumulated", threading.get_ident())))
    y = _Recording.apply(w * 2, reentrant)

    def hook(g):
        seen.append(("hook", threading.get_ident()))
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: seen.append(("callback", threading.get_ident()))
        )

    y.register_hook(hook)
    y.sum().backward()
    return seen


def test_the_mode_runs_hooks_and_nodes_on_one_device_thread(execution):
    caller = threading.get_ident()
    first, second = _threads_of_one_backward(False), _threads_of_one_backward(True)
    where = {t for _, t in first + second if not isinstance(t, float)}
    assert [k for k, _ in first] == ["hook", "node", "accumulated", "callback"], first
    assert ("reentrant", 6.0) in second  # a backward inside a node finished (inline), with its gradient
    if execution == "plain":
        assert where == {caller}
        return
    assert caller not in where, "hooks and nodes must not run on the thread that called backward()"
    assert where == {cuda_semantics.device_thread().thread.ident}, where  # one thread, the same for both calls
    assert os.environ[cuda_semantics.CHECK_HEADERS] == "0"


def test_grad_and_the_functional_backward_go_to_the_device_thread_and_errors_come_back(execution):
    caller = threading.get_ident()
    x = torch.randn(4, requires_grad=True)
    ran = []
    y = x.exp()
    y.register_hook(lambda g: ran.append(threading.get_ident()))
    (gx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    torch.testing.assert_close(gx, x.exp().detach())
    torch.autograd.backward([y.sum()])
    assert len(ran) == 2 and (set(ran) == {caller}) == (execution == "plain"), ran
    for exc in (RuntimeError("injected"), KeyboardInterrupt()):
        z = x * 2
        z.register_hook(lambda g, exc=exc: (_ for _ in ()).throw(exc))
        with pytest.raises(type(exc)):
            z.sum().backward()
    x.grad = None  # the device thread survived the errors
    (x * 5).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 5.0))


def test_the_mode_is_off_outside_the_fixture():
    assert not cuda_semantics.active()
    seen = _threads_of_one_backward(False)
    assert {t for _, t in seen} == {threading.get_ident()}


def _rank_threads(rank, world):
    import torch.distributed as dist

    from lancet_rt.parallel import mesh as _mesh

    seen = _threads_of_one_backward(False)
    device = cuda_semantics.device_thread().thread.ident if cuda_semantics.active() else None
    return {
        "on the caller": {t for _, t in seen} == {threading.get_ident()},
        "on the device thread": {t for _, t in seen} == {device},
        "header check": _mesh.monitor(dist.group.WORLD).check_headers,
    }


@pytest.mark.parametrize("mode", cuda_semantics.MODES)
def test_gloo_ranks_run_in_the_mode_of_their_test(mode):
    """A rank forked from the fork server takes the test's environment, and with it the mode: its
    hooks on its own device thread, and its gloo monitors without the header check (as NCCL's)."""
    if mode == "plain":
        results = assert_all_ok(run_ranks(_rank_threads, 2, timeout=120))
        expected = {"on the caller": True, "on the device thread": False, "header check": True}
    else:
        with cuda_semantics.cuda_semantics():
            results = assert_all_ok(run_ranks(_rank_threads, 2, timeout=120))
        expected = {"on the caller": False, "on the device thread": True, "header check": False}
    assert results == [expected, expected]
