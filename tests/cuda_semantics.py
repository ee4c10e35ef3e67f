"""A CPU test mode with CUDA's execution semantics: backward on a device thread, no header check.

On CUDA the autograd engine runs the backward's nodes, tensor and gradient hooks and queued
callbacks on a per-device worker thread that lives as long as the process, never on the thread that
called ``backward()``; that thread blocks until the graph task ends and then raises what it raised. A
backward started from a node or hook already on the device thread runs there, inline (reentrant).
On CPU the engine runs everything on the caller's thread, so code that takes "the thread that runs
my hooks" for "the thread that called backward" passes every CPU test and fails on a GPU.

This module emulates the device thread one level above the C++ engine: ``_engine_run_backward``
(what ``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad`` all call, after
any Python wrapper of those functions has run on the caller's thread, as on CUDA) is sent to one
long-lived worker thread per process, and the caller blocks for it; exceptions, ``KeyboardInterrupt``
included, reach the caller. The caller's ``contextvars`` travel with the call, as the engine stashes
them for its device threads.

The mode also sets ``LANCET_CHECK_HEADERS=0``: the monitors of gloo groups then see collectives as
they do on NCCL, without the per-collective header all-gather that turns a rank out of step into a
``CollectiveMismatch`` before anything is sent.

Switching: the patch is installed when this module is imported (a test module or conftest imports
it) and does nothing unless ``TESTS_CUDA_SEMANTICS=1`` is in the environment at the time of the
call. The ``execution`` fixture sets both variables for one test; gloo ranks started by
:func:`tests.dist.run_ranks` take the test's environment, and a rank's function lives in a test
module that imports this one, so the ranks run in the same mode.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import threading

import pytest
import torch
import torch.autograd
import torch.autograd.graph

#: "1": autograd calls run on the emulated device thread (read at each call, see the module docstring).
MODE = "TESTS_CUDA_SEMANTICS"
MODES = ("plain", "cuda-semantics")
#: lancet_rt.env.CHECK_HEADERS (spelled out: conftest imports this module before anything imports lancet_rt).
CHECK_HEADERS = "LANCET_CHECK_HEADERS"
_original = torch.autograd.graph._engine_run_backward


class _DeviceThread:
    """The emulated engine's device thread: runs one backward at a time, for the life of the process."""

    def __init__(self):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="cuda-semantics-device", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            job()

    def run(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on this thread; the caller blocks for it and gets its result or exception."""
        ctx = contextvars.copy_context()
        done = threading.Event()
        box: dict = {}

        def job():
            try:
                box["result"] = ctx.run(fn, *args, **kwargs)
            except BaseException as exc:  # handed to the caller, which raises it
                box["error"] = exc
            finally:
                done.set()

        self._jobs.put(job)
        done.wait()
        if "error" in box:
            error = box.pop("error")
            try:
                raise error
            finally:
                del error
        return box["result"]


_devices: dict = {}


def device_thread() -> _DeviceThread:
    """This process's device thread (a forked rank gets its own: threads do not survive a fork)."""
    pid = os.getpid()
    if pid not in _devices:
        _devices[pid] = _DeviceThread()
    return _devices[pid]


def active() -> bool:
    """Whether autograd calls run on the device thread now (``TESTS_CUDA_SEMANTICS=1``)."""
    return os.environ.get(MODE) == "1"


def _engine_run_backward(*args, **kwargs):
    if not active():
        return _original(*args, **kwargs)
    device = device_thread()
    if threading.current_thread() is device.thread:  # reentrant: a backward from a node or hook runs inline
        return _original(*args, **kwargs)
    return device.run(_original, *args, **kwargs)


def install() -> None:
    """Route the engine's entry point through the device thread when the mode is on (idempotent)."""
    torch.autograd.graph._engine_run_backward = _engine_run_backward
    torch.autograd._engine_run_backward = _engine_run_backward  # (the name backward() and grad() call)


def bounded(fn, timeout_s: float, what: str):
    """``fn()`` on a thread of its own (its host), waited for at most ``timeout_s``: a hang fails with an
    AssertionError naming ``what`` instead of blocking the test, and the device thread, possibly stuck
    in it, is replaced so that later calls get a free one. Returns ``fn()``'s result or raises its error."""
    box: dict = {}

    def host():
        try:
            box["result"] = fn()
        except BaseException as exc:  # raised on the test's thread
            box["error"] = exc

    t = threading.Thread(target=host, name="cuda-semantics-host", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        _devices.pop(os.getpid(), None)
        raise AssertionError(f"{what} did not finish within {timeout_s:g} s (hang)")
    if "error" in box:
        raise box["error"]
    return box["result"]


@contextlib.contextmanager
def cuda_semantics():
    """The mode on for the body, in this process and in the gloo ranks it starts."""
    saved = {k: os.environ.get(k) for k in (MODE, CHECK_HEADERS)}
    os.environ[MODE] = "1"
    os.environ[CHECK_HEADERS] = "0"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(params=MODES)
def execution(request):
    """Runs the test twice: "plain" (CPU's engine, the caller's thread) and "cuda-semantics" (the mode above)."""
    if request.param == "plain":
        yield request.param
        return
    with cuda_semantics():
        yield request.param


install()
