"""The step context's three parts: THREAD per host thread, CHUNK per greenlet (each chunk), PROCESS shared
with the engine's threads."""

import threading

import pytest
import torch

from lancet_rt.moe.layer import MoE
from lancet_rt.runtime import scope, wgrad


def test_the_chunk_scope_and_the_backward_beside_are_per_thread_the_dw_queue_per_process():
    chunks = scope.ChunkScope([2, 2], switch=lambda: None)
    marker = object()
    prev_queue = wgrad.set_current(marker)
    scope.set_current(chunks)
    scope.set_beside(marker)
    seen = {}

    def other_thread():
        seen["chunks"], seen["beside"] = scope.current(), scope.beside_active()
        seen["queue"], seen["engine beside"] = wgrad.current(), scope.PROCESS.beside

    try:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert scope.current() is chunks and scope.beside_active()
    finally:
        scope.set_beside(None)
        scope.set_current(None)
        wgrad.set_current(prev_queue)
    assert seen == {"chunks": None, "beside": False, "queue": marker, "engine beside": marker}
    assert scope.PROCESS.beside is None and scope.THREAD.chunks is None


def test_a_layer_puts_back_what_a_step_changed():
    moe = MoE(8, 16, 4, 2)
    saved = moe.step_state()
    assert set(saved) <= set(MoE.STEP_STATE) and "aux_loss" in saved
    moe(torch.randn(3, 8))
    assert moe.aux_loss is not saved["aux_loss"]
    moe.restore_step_state(saved)
    assert all(moe.__dict__[k] is v for k, v in saved.items())


def test_the_recompute_log_is_per_chunk_and_the_dual_from_forward_per_process():
    greenlet = pytest.importorskip("greenlet")
    log, seen = [], {}
    token = scope.CHUNK.recording.set(log)
    scope.PROCESS.dual_from_forward = marker = (object(), object())
    try:
        greenlet.greenlet(lambda: seen.setdefault("other chunk", scope.CHUNK.recording.get())).switch()
        t = threading.Thread(target=lambda: seen.setdefault("engine thread", scope.PROCESS.dual_from_forward))
        t.start()
        t.join()
        assert scope.CHUNK.recording.get() is log
    finally:
        scope.CHUNK.recording.reset(token)
        scope.PROCESS.dual_from_forward = None
    assert seen == {"other chunk": None, "engine thread": marker}
    assert scope.CHUNK.recording.get() is None and scope.CHUNK.replaying.get() is None
