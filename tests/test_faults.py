"""Faults, adversarially: bad inputs and failures across the layer, Overlapped, the kernels' launchers
called directly, the distributed paths (2 and 3 gloo ranks) and the autotune cache.

Each case asserts the exception type and that the message names the argument or the rank. Three
outcomes (README, "Reliability"): a clear error before anything runs; recovered (the next correct
step equals a fresh model's); timed out or lost with a clear error naming the rank. The
multi-process cases run in two spawns (3 and 2 gloo ranks) that go through their faults in
sequence, each on its own process group so that a broken group does not end the run; the rank that
dies is the last fault of each spawn.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import warnings

import pytest
import torch

import lancet_rt
import lancet_rt.scope
from lancet_rt import env
from lancet_rt.autotune import CacheKey, TuneCache
from lancet_rt.autotune.block import MoEBlocks
from lancet_rt.faults import GroupError, PeerError, PeerTimeout
from lancet_rt.kernels import gating, grouped_gemm as gg, permute as pm, swiglu as sw
from tests.dist import run_ranks
from tests.helpers import assert_close

D = 16


def make_model(ep_group=None, *, seed=0, E=4, **moe):
    torch.manual_seed(seed)
    kw = dict(d_ffn=12, num_experts=E, top_k=2, capacity_factor=0.75, aux_loss_coef=0.01, z_loss_coef=0.001,
              ep_group=ep_group)
    kw.update(moe)
    return MoEBlocks(2, D, 2, kw)


def train_step(runner, model, x, g):
    x = x.clone().requires_grad_(True)
    y = runner(x)
    y.backward(g)
    out = (y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
           [(m.aux_loss.clone(), m.z_loss.clone(), m.dropped) for m in model.moe_layers()])
    for p in model.parameters():
        p.grad = None
    return out


def assert_same_step(ref, got):
    assert_close("y", got[0], ref[0])
    assert_close("grad x", got[1], ref[1])
    assert got[2].keys() == ref[2].keys()
    for n in ref[2]:
        assert_close(f"grad {n}", got[2][n], ref[2][n])
    for (a0, z0, d0), (a1, z1, d1) in zip(ref[3], got[3]):
        assert_close("aux_loss", a1.reshape(1), a0.reshape(1))
        assert_close("z_loss", z1.reshape(1), z0.reshape(1))
        assert d0 == d1


def in_chunk(module, chunk, action, *, pre=True):
    """Run ``action()`` when ``module`` runs for ``chunk`` of an overlapped forward."""
    def hook(*_):
        s = lancet_rt.scope.current()
        if s is not None and s.chunk == chunk:
            action()
    return module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)


def raise_(exc):
    raise exc


# ====================================================================================== clear errors
# Single process: (id, call, exception type, words the message must contain).
_L = torch.randn(5, 4)
_ROW = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [-1, -1]], dtype=torch.int32)
_X = torch.randn(5, 6)
_OFF = torch.tensor([0, 2, 5])
_W = torch.randn(2, 3, 6)
_I32 = dict(dtype=torch.int32)


class _TokensPerChunkVary(torch.nn.Module):
    """Not separable: chunk 2 sends one row less to the MoE layer than its share."""

    def __init__(self):
        super().__init__()
        self.moe = lancet_rt.MoE(D, 8, 4, 2)

    def forward(self, x):
        if lancet_rt.scope.current() is not None and lancet_rt.scope.current().chunk == 2:
            x = x[:1]
        return self.moe(x)


class _HalfRows(torch.nn.Module):
    """Not separable: the MoE layer sees tokens that are not a whole multiple of the rows."""

    def __init__(self):
        super().__init__()
        self.moe = lancet_rt.MoE(D, 8, 4, 2)

    def forward(self, x):
        return self.moe(x[:1])


CLEAR = [
    # the layer
    ("moe d_model=0", lambda: lancet_rt.MoE(0, 8, 4, 2), ValueError, "d_model"),
    ("moe num_experts=True", lambda: lancet_rt.MoE(8, 8, True, 1), TypeError, "num_experts"),
    ("moe capacity_factor=nan", lambda: lancet_rt.MoE(8, 8, 4, 2, capacity_factor=math.nan), ValueError,
     "capacity_factor"),
    ("moe capacity_factor=inf", lambda: lancet_rt.MoE(8, 8, 4, 2, capacity_factor=math.inf), ValueError,
     "capacity_factor"),
    ("moe z_loss_coef=nan", lambda: lancet_rt.MoE(8, 8, 4, 2, z_loss_coef=math.nan), ValueError, "z_loss_coef"),
    ("moe pipeline_chunks=0", lambda: lancet_rt.MoE(8, 8, 4, 2, pipeline_chunks=0), ValueError, "pipeline_chunks"),
    ("moe dtype=int32", lambda: lancet_rt.MoE(8, 8, 4, 2, dtype=torch.int32), TypeError, "dtype"),
    ("moe experts not divisible by world",
     lambda: lancet_rt.MoE(8, 8, 6, 2, ep_group=lancet_rt.EmulatedGroup(4)), ValueError, "divisible"),
    ("moe x 0-dim", lambda: lancet_rt.MoE(8, 8, 4, 2)(torch.tensor(1.0)), ValueError, "d_model=8"),
    ("moe x complex", lambda: lancet_rt.MoE(8, 8, 4, 2)(torch.randn(3, 8, dtype=torch.complex64)), TypeError,
     "floating"),
    # the emulated link
    ("emulated world_size=0", lambda: lancet_rt.EmulatedGroup(0), ValueError, "world_size"),
    ("emulated bandwidth_gbps=0", lambda: lancet_rt.EmulatedGroup(2, bandwidth_gbps=0), ValueError,
     "bandwidth_gbps"),
    ("emulated latency_us=-1", lambda: lancet_rt.EmulatedGroup(2, latency_us=-1), ValueError, "latency_us"),
    ("emulated asymmetric splits",
     lambda: lancet_rt.EmulatedGroup(2).all_to_all(torch.empty(3, 2), torch.empty(3, 2), [1, 2], [2, 1]),
     ValueError, "splits"),
    # Overlapped
    ("overlapped chunks='3'", lambda: lancet_rt.Overlapped(make_model(), chunks="3"), ValueError, "chunks"),
    ("overlapped chunks=-1", lambda: lancet_rt.Overlapped(make_model(), chunks=-1), ValueError, "chunks"),
    ("overlapped no tensor to cut", lambda: lancet_rt.Overlapped(make_model(), chunks=2)(3.0), ValueError,
     "tensor argument"),
    ("overlapped tokens not a multiple of rows",
     lambda: lancet_rt.Overlapped(_HalfRows(), chunks=2)(torch.randn(6, 2, D)), RuntimeError,
     "whole multiple of the rows along dim 0"),
    ("overlapped output rows differ from input rows",
     lambda: lancet_rt.Overlapped(_HalfRows(), chunks=2)(torch.randn(6, 3, D)), ValueError, "dim 0"),
    ("overlapped tokens differ per chunk",
     lambda: lancet_rt.Overlapped(_TokensPerChunkVary(), chunks=3)(torch.randn(6, 1, D)), RuntimeError,
     "separable along dim 0"),
    # the kernels' launchers, called directly
    ("gating_fwd logits 1-D", lambda: gating.gating_fwd(torch.randn(4), 1), ValueError, "logits_TE"),
    ("gating_fwd no experts", lambda: gating.gating_fwd(torch.randn(3, 0), 1), ValueError, "logits_TE"),
    ("gating_fwd capacity=2.0", lambda: gating.gating_fwd(_L, 1, capacity=2.0), ValueError, "capacity"),
    ("gating_fwd used_E float", lambda: gating.gating_fwd(_L, 1, torch.zeros(4)), TypeError, "used_E"),
    ("gating_fwd out a tuple", lambda: gating.gating_fwd(_L, 1, out=(1, 2)), TypeError, "out"),
    ("gating_bwd grad_score_sum_E shape",
     lambda: gating.gating_bwd(_L, torch.zeros(5, 1, **_I32), torch.ones(5, 1), torch.ones(3), None), ValueError,
     "grad_score_sum_E"),
    ("permute_fwd row_TK rows", lambda: pm.permute_fwd(_X, _ROW[:3], 6), ValueError, "row_TK"),
    ("permute_fwd out shape",
     lambda: pm.permute_fwd(_X, _ROW, 8, out=(torch.empty(7, 6), torch.empty(8, **_I32))), ValueError, "x_SD"),
    ("unpermute_bwd y_SD width",
     lambda: pm.unpermute_bwd(torch.randn(5, 7), torch.randn(8, 6), _ROW, torch.ones(5, 2), torch.zeros(8, **_I32)),
     ValueError, "y_SD"),
    ("dispatch_rows slot_TK shape",
     lambda: pm.dispatch_rows(torch.zeros(5, 2, **_I32), torch.zeros(5, 1, **_I32), torch.zeros(4, **_I32),
                              torch.zeros(4, **_I32)), ValueError, "slot_TK"),
    ("grouped_mm x_RK 1-D", lambda: gg.grouped_mm(torch.randn(6), _W, _OFF), ValueError, "x_RK"),
    ("grouped_mm offsets for E=1", lambda: gg.grouped_mm(_X, _W, torch.tensor([0, 5])), ValueError, "offsets_E1"),
    ("grouped_mm_dw rows differ", lambda: gg.grouped_mm_dw(torch.randn(5, 3), torch.randn(4, 6), _OFF), ValueError,
     "dy_RN"),
    ("gate_up_swiglu out one tensor",
     lambda: gg.gate_up_swiglu(_X, torch.randn(2, 4, 6), _OFF, out=torch.empty(5, 2)), TypeError, "out"),
    ("swiglu_fwd int", lambda: sw.swiglu_fwd(torch.ones(4, 8, **_I32)), TypeError, "gu_R2F"),
    ("swiglu_bwd float64 grad", lambda: sw.swiglu_bwd(torch.randn(5, 8), torch.randn(5, 4).double()), TypeError,
     "grad_h_RF"),
]


@pytest.mark.parametrize("call, exc, words", [c[1:] for c in CLEAR], ids=[c[0] for c in CLEAR])
def test_clear_error(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc and words in str(info.value), f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_timeout_variable_is_validated(monkeypatch, value):
    monkeypatch.setenv(env.TIMEOUT, value)
    with pytest.raises(ValueError) as info:
        env.timeout_s()
    assert type(info.value) is ValueError and env.TIMEOUT in str(info.value) and repr(value) in str(info.value)


def test_pinned_gating_config_is_validated(monkeypatch):
    monkeypatch.setenv("LANCET_GATING_FWD_CONFIG", "BLOCK_T")
    with pytest.raises(ValueError) as info:
        gating.gating_fwd(_L, 1)
    assert type(info.value) is ValueError and "LANCET_GATING_FWD_CONFIG" in str(info.value)


# ====================================================================================== recovered
def _link_idle(link) -> bool:
    """No transfer holds the link: a new one starts now (cancelled ones still queued end at once)."""
    cpu = link._cpu_link
    return cpu._busy_until <= time.perf_counter() and all(w.epoch != cpu._epoch for w in list(cpu._q.queue))


def _fail_in_chunk_forward(model, ov):
    return in_chunk(model.blocks[1], 2, lambda: raise_(RuntimeError("injected in chunk 2")))


def _interrupt_in_chunk_forward(model, ov):
    return in_chunk(model.blocks[1].moe, 1, lambda: raise_(KeyboardInterrupt()))


def _fail_in_experts(model, ov):
    original = type(model.blocks[0].moe).compute_experts

    def compute_experts(self, *a, **kw):
        if lancet_rt.scope.current().chunk == 1:
            raise RuntimeError("injected in the experts")
        return original(self, *a, **kw)
    model.blocks[0].moe.compute_experts = compute_experts.__get__(model.blocks[0].moe)

    class Undo:
        def remove(self):
            del model.blocks[0].moe.compute_experts
    return Undo()


def _interrupt_in_backward(model, ov):
    def hook(module, inputs, out):
        out.register_hook(lambda grad: raise_(KeyboardInterrupt()))
    return model.blocks[0].register_forward_hook(hook)


def _fail_at_concat(model, ov):
    return model.register_forward_hook(lambda m, a, y: y.sum())  # a 0-dim output cannot be concatenated


RECOVER = [
    ("RuntimeError in chunk 2 of 4", _fail_in_chunk_forward, 4, RuntimeError, "injected in chunk 2"),
    ("KeyboardInterrupt in chunk 1 of 3", _interrupt_in_chunk_forward, 3, KeyboardInterrupt, ""),
    ("RuntimeError in the experts, transfers in flight", _fail_in_experts, 3, RuntimeError, "experts"),
    ("KeyboardInterrupt in backward with deferred dW", _interrupt_in_backward, 2, KeyboardInterrupt, ""),
    ("ValueError after the last collective (0-dim output)", _fail_at_concat, 2, ValueError, "0-dim"),
]


@pytest.mark.parametrize("inject, chunks, exc, words", [c[1:] for c in RECOVER], ids=[c[0] for c in RECOVER])
def test_recovered_after_a_failure(inject, chunks, exc, words):
    """After an exception in forward or backward (from a chunk's coroutine, inside the layer, from the
    engine), the next step equals a fresh model's: scope, routing state, dW queue and link are clean."""
    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=0.05, latency_us=2000)
    model = make_model(link)
    fresh = copy.deepcopy(model)
    x, g = torch.randn(6, 3, D), torch.randn(6, 3, D)
    ov = lancet_rt.Overlapped(model, chunks=chunks, defer_wgrad=True)
    handle = inject(model, ov)
    with pytest.raises(exc) as info:
        ov(x.clone().requires_grad_(True)).backward(g)
    handle.remove()
    assert type(info.value) is exc and words in str(info.value)
    assert lancet_rt.scope.current() is None and lancet_rt.wgrad.current() is None
    if exc is not KeyboardInterrupt or chunks != 2:  # a backward that raised is found by the next step
        assert _link_idle(link), "the failed step left transfers on the emulated link"
    for p in model.parameters():
        p.grad = None
    got = train_step(ov, model, x, g)
    assert not ov.wgrad_queue.items and _link_idle(link)
    assert_same_step(train_step(lancet_rt.Overlapped(fresh, chunks=chunks, defer_wgrad=True), fresh, x, g), got)


# ====================================================================================== autotune cache
def _key(**over) -> CacheKey:
    fields = dict(device="cpu|test", device_name="cpu", ep_world_size=2, link_backend="emulated", link_gbps=1.0,
                  link_latency_us=10.0, dtype="float32", d_model=64, d_ffn=128, num_experts=8, top_k=2,
                  capacity_factor=1.25, tokens_bucket=512)
    fields.update(over)
    return CacheKey(**fields)


def test_cache_truncated_is_ignored_and_replaced(tmp_path):
    path = tmp_path / "c.json"
    TuneCache(str(path), defaults_path=None).store(_key(), {"chunks": 2})
    path.write_text(path.read_text()[:40])
    cache = TuneCache(str(path), defaults_path=None)
    with pytest.warns(RuntimeWarning, match="corrupted") as record:
        assert cache.lookup(_key()) is None
    assert str(path) in str(record[0].message)
    with pytest.warns(RuntimeWarning, match="replaced"):
        cache.store(_key(), {"chunks": 3})
    assert cache.lookup(_key()).chunks == 3


@pytest.mark.parametrize("content, words", [
    ({"schema": "lancet-rt/autotune-cache", "version": 1, "entries": []}, "no 'entries' object"),
    ({"schema": "lancet-rt/autotune-cache", "version": 2, "entries": {}}, "version 2"),
    ("null", "schema"),
], ids=["entries not an object", "newer version", "null"])
def test_cache_wrong_schema_is_ignored(tmp_path, content, words):
    path = tmp_path / "c.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.warns(RuntimeWarning) as record:
        assert TuneCache(str(path), defaults_path=None).lookup(_key()) is None
    msg = str(record[0].message)
    assert words in msg and str(path) in msg


def test_cache_malformed_entry_is_skipped_and_the_rest_kept(tmp_path):
    path = tmp_path / "c.json"
    cache = TuneCache(str(path), defaults_path=None)
    cache.store(_key(), {"chunks": 4})
    data = json.loads(path.read_text())
    data["entries"]["bad"] = {"key": {"d_model": -1}, "value": {"chunks": 0}}
    path.write_text(json.dumps(data))
    with pytest.warns(RuntimeWarning, match="skipped 1 malformed entry") as record:
        assert cache.lookup(_key()).chunks == 4
    assert str(path) in str(record[0].message)


def test_cache_directory_in_its_place(tmp_path):
    path = tmp_path / "c.json"
    path.mkdir()
    cache = TuneCache(str(path), defaults_path=None)
    with pytest.warns(RuntimeWarning, match="cannot read") as record:
        assert cache.lookup(_key()) is None
    assert str(path) in str(record[0].message)
    with pytest.raises(IsADirectoryError) as info:
        cache.store(_key(), {"chunks": 2})
    assert str(path) in str(info.value) and "directory" in str(info.value)


def test_cache_parent_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    path = tmp_path / "f" / "c.json"
    with pytest.raises(NotADirectoryError) as info:
        TuneCache(str(path), defaults_path=None).store(_key(), {"chunks": 2})
    assert str(path) in str(info.value) and env.AUTOTUNE_CACHE in str(info.value)


def _store_as_nobody(path, queue):
    try:
        if os.geteuid() == 0:  # root writes anywhere: drop to an unprivileged user first
            os.setgid(65534)
            os.setuid(65534)
        TuneCache(path, defaults_path=None).store(_key(), {"chunks": 2})
        queue.put(("no error", ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((type(exc).__name__, str(exc)))


def test_cache_read_only_directory(tmp_path):
    directory = tempfile.mkdtemp()
    try:
        path = os.path.join(directory, "c.json")
        TuneCache(path, defaults_path=None).store(_key(d_model=32), {"chunks": 3})
        os.chmod(path, 0o644)
        os.chmod(directory, 0o555)
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        p = ctx.Process(target=_store_as_nobody, args=(path, queue))
        p.start()
        p.join(30)
        kind, msg = queue.get(timeout=5)
        assert kind == "PermissionError" and path in msg, (kind, msg)
        assert TuneCache(path, defaults_path=None).lookup(_key(d_model=32)).chunks == 3  # reading still works
        assert json.loads(open(path).read())["entries"], "the failed write must leave the file whole"
    finally:
        os.chmod(directory, 0o755)
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def _write_one(path, writer, barrier):
    barrier.wait(10)
    TuneCache(path, defaults_path=None).store(_key(d_model=100 + writer), {"chunks": 1 + writer % 8, "writer": writer})


def test_cache_eight_concurrent_writers_keep_every_entry(tmp_path):
    path = str(tmp_path / "shared.json")
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(8)
    procs = [ctx.Process(target=_write_one, args=(path, w, barrier)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    entries = json.loads(open(path).read())["entries"]
    assert sorted(e["value"]["writer"] for e in entries.values()) == list(range(8))
    cache = TuneCache(path, defaults_path=None)
    assert [cache.lookup(_key(d_model=100 + w), nearest=False).chunks for w in range(8)] == [1 + w % 8 for w in range(8)]


@pytest.mark.parametrize("call, exc, words", [
    (lambda p: TuneCache("", defaults_path=None), ValueError, "path"),
    (lambda p: TuneCache(p, defaults_path=None).store(_key(), {"chunks": True}), ValueError, "chunks"),
    (lambda p: TuneCache(p, defaults_path=None).lookup("a key"), TypeError, "key"),
], ids=["empty path", "chunks=True", "key not a CacheKey"])
def test_cache_bad_arguments(tmp_path, call, exc, words):
    with pytest.raises(exc) as info:
        call(str(tmp_path / "c.json"))
    assert type(info.value) is exc and words in str(info.value)


# ====================================================================================== distributed
def _outcome(fn) -> list:
    """[exception type name, message, ranks] of ``fn()``, or ["ok", result, None]."""
    try:
        return ["ok", fn(), None]
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is one of the faults
        return [type(exc).__name__, str(exc), getattr(exc, "ranks", None)]


def _step(ov, x, g=None):
    y = ov(x)
    if g is not None:
        y.backward(g)
    return True


def _until_given_up(group, ranks):
    """Stop answering (block this rank) until ``ranks`` have written their failure records."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_process_group_store(group)
    deadline = time.monotonic() + 60
    while not store.check([f"lancet_rt/fail/{r}" for r in ranks]) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group(timeout_s=None):
    import torch.distributed as dist

    g = dist.new_group()
    if timeout_s is not None:
        lancet_rt.comm.as_group(g).set_timeout(timeout_s)
    return g


def _three_ranks(rank, world, out_dir):
    """The 3-rank faults in sequence; returns {case: outcome on this rank}. Rank 2 is the rank at
    fault in every case that breaks a group, and dies in the last one."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, g = torch.randn(4, 3, D, generator=gen), torch.randn(4, 3, D, generator=gen)
    res = {}
    healthy = _group()

    def overlapped(**kw):
        moe = {k: kw.pop(k) for k in list(kw) if k in ("capacity_factor",)}
        return lancet_rt.Overlapped(make_model(healthy, E=6, **moe), **kw)

    # Agreement: every rank raises before any collective of the step; the group stays usable.
    res["chunks differ"] = _outcome(lambda: _step(overlapped(chunks=3 if rank == 2 else 2), x))
    res["defer_wgrad differs"] = _outcome(lambda: _step(overlapped(chunks=2, defer_wgrad=rank == 1), x))
    res["auto on one rank"] = _outcome(lambda: _step(overlapped(chunks="auto" if rank == 0 else 2), x))
    res["check differs"] = _outcome(lambda: _step(overlapped(chunks=2, check=rank == 1), x))
    res["MoE config differs"] = _outcome(lambda: _step(overlapped(chunks=2, capacity_factor=1.0 if rank == 2 else 0.75),
                                                       x))
    # Failures before the step's collectives: status on the first exchange (or the config check).
    ov = overlapped(chunks=3)
    fresh = copy.deepcopy(ov.model)
    res["no tensor on one rank, first step"] = _outcome(lambda: _step(ov, 1.0 if rank == 1 else x))
    h = in_chunk(ov.model.blocks[0].attn, 0, lambda: raise_(RuntimeError("injected before the collectives"))) \
        if rank == 2 else None
    res["model error before the collectives"] = _outcome(lambda: _step(ov, x, g))
    h = h.remove() if h else None
    h = in_chunk(ov.model.blocks[0].attn, 0, lambda: raise_(KeyboardInterrupt())) if rank == 0 else None
    res["KeyboardInterrupt before the collectives"] = _outcome(lambda: _step(ov, x, g))
    h = h.remove() if h else None

    def same_as_fresh():
        got = train_step(ov, ov.model, x, g)
        ref = train_step(lancet_rt.Overlapped(fresh, chunks=3), fresh, x, g)
        assert_same_step(ref, got)
        return True
    res["next step after them equals a fresh model"] = _outcome(same_as_fresh)

    # After the collectives started: the group breaks, the peers are told within a poll.
    broken = lancet_rt.Overlapped(make_model(_group(), E=6), chunks=4)
    h = in_chunk(broken.model.blocks[1], 2, lambda: raise_(RuntimeError("injected in chunk 2 of 4"))) \
        if rank == 2 else None
    res["error in chunk 2 of 4"] = _outcome(lambda: _step(broken, x))
    res["next step on the broken group"] = _outcome(lambda: _step(broken, x))

    bwd = lancet_rt.Overlapped(make_model(_group(), E=6), chunks=2)
    if rank == 2:
        bwd.model.blocks[0].register_forward_hook(
            lambda m, a, y: [y.register_hook(lambda grad: raise_(RuntimeError("injected in backward")))] and None)
    res["error in backward"] = _outcome(lambda: _step(bwd, x, g))
    res["step after the failed backward"] = _outcome(lambda: _step(bwd, x, g))

    hung_group = _group(timeout_s=2.0)
    hung = lancet_rt.Overlapped(make_model(hung_group, E=6), chunks=2)
    if rank == 2:
        in_chunk(hung.model.blocks[1], 1, lambda: _until_given_up(hung_group, [0, 1]))
    res["a rank stops answering"] = _outcome(lambda: _step(hung, x))

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dead = lancet_rt.Overlapped(make_model(_group(), E=6), chunks=2)
    if rank == 2:
        in_chunk(dead.model.blocks[1], 1, lambda: os.kill(os.getpid(), signal.SIGKILL))
    return _outcome(lambda: _step(dead, x))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("three_ranks")
    results = run_ranks(_three_ranks, 3, str(out), timeout=90, may_die=(2,))
    assert 2 not in results, "rank 2 killed itself"
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
        per_rank[r]["a rank is killed"] = results[r][1]
    return per_rank


def _assert_raised(outcome, exc: str, *words, ranks=None):
    kind, msg, at_fault = outcome
    assert kind == exc and all(w in msg for w in words), f"expected {exc} with {words}, got {kind}: {msg}"
    if ranks is not None:
        assert at_fault == ranks, (at_fault, msg)


def test_chunks_must_agree_across_ranks(three_ranks):
    for res in three_ranks:
        _assert_raised(res["chunks differ"], "ValueError", "chunks: rank 0=2, rank 1=2, rank 2=3")


def test_defer_wgrad_must_agree_across_ranks(three_ranks):
    for res in three_ranks:
        _assert_raised(res["defer_wgrad differs"], "ValueError", "defer_wgrad: rank 0=False, rank 1=True, rank 2=False")


def test_auto_chunks_must_agree_across_ranks(three_ranks):
    for res in three_ranks:
        _assert_raised(res["auto on one rank"], "ValueError", "chunks: rank 0='auto', rank 1=2, rank 2=2")


def test_check_must_agree_across_ranks(three_ranks):
    for res in three_ranks:
        _assert_raised(res["check differs"], "ValueError", "check: rank 0=False, rank 1=True, rank 2=False")


def test_moe_config_must_agree_across_ranks(three_ranks):
    for r, res in enumerate(three_ranks):
        _assert_raised(res["MoE config differs"], "ValueError", "differ in capacity_factor", f"rank {r}")


def test_bad_input_before_the_config_check_raises_everywhere(three_ranks):
    _assert_raised(three_ranks[1]["no tensor on one rank, first step"], "ValueError", "no tensor argument")
    for r in (0, 2):
        _assert_raised(three_ranks[r]["no tensor on one rank, first step"], "ValueError", "rank(s) [1]")


def test_model_error_before_the_collectives_raises_everywhere(three_ranks):
    _assert_raised(three_ranks[2]["model error before the collectives"], "RuntimeError", "injected before")
    for r in (0, 1):
        _assert_raised(three_ranks[r]["model error before the collectives"], "PeerError", "rank(s) [2]",
                       "stays usable", ranks=[2])


def test_keyboard_interrupt_before_the_collectives_raises_everywhere(three_ranks):
    _assert_raised(three_ranks[0]["KeyboardInterrupt before the collectives"], "KeyboardInterrupt")
    for r in (1, 2):
        _assert_raised(three_ranks[r]["KeyboardInterrupt before the collectives"], "PeerError", "rank(s) [0]",
                       ranks=[0])


def test_next_step_after_early_failures_equals_a_fresh_model(three_ranks):
    for res in three_ranks:
        assert res["next step after them equals a fresh model"][0] == "ok", res["next step after them equals a fresh model"]


def test_error_in_chunk_two_of_four_reaches_every_rank(three_ranks):
    """PeerError, not PeerTimeout: the peers learnt it from rank 2's failure record, not by waiting."""
    _assert_raised(three_ranks[2]["error in chunk 2 of 4"], "RuntimeError", "injected in chunk 2 of 4")
    for r in (0, 1):
        _assert_raised(three_ranks[r]["error in chunk 2 of 4"], "PeerError", "rank(s) [2] failed or stopped answering",
                       "RuntimeError: injected in chunk 2 of 4", ranks=[2])


def test_broken_group_refuses_the_next_step(three_ranks):
    for res in three_ranks:
        _assert_raised(res["next step on the broken group"], "GroupError", "unusable since", ranks=[2])


def test_error_in_backward_reaches_every_rank(three_ranks):
    _assert_raised(three_ranks[2]["error in backward"], "RuntimeError", "injected in backward")
    _assert_raised(three_ranks[2]["step after the failed backward"], "GroupError", "rank 2: the last backward raised",
                   ranks=[2])
    for r in (0, 1):
        _assert_raised(three_ranks[r]["error in backward"], "PeerError", "rank(s) [2]", "last backward raised",
                       ranks=[2])
        _assert_raised(three_ranks[r]["step after the failed backward"], "GroupError", "unusable since")


def test_a_rank_that_stops_answering_times_out_by_name(three_ranks):
    for r in (0, 1):
        _assert_raised(three_ranks[r]["a rank stops answering"], "PeerTimeout", "rank(s) [2] stopped answering",
                       "its process is alive", "LANCET_TIMEOUT_S", ranks=[2])
    _assert_raised(three_ranks[2]["a rank stops answering"], "PeerError", "rank 2 was reported as not answering",
                   ranks=[2])


def test_a_killed_rank_is_named_by_the_survivors(three_ranks):
    for r in (0, 1):
        _assert_raised(three_ranks[r]["a rank is killed"], "PeerError", "rank(s) [2] stopped answering",
                       "rank 2: its process has exited", ranks=[2])


def _two_ranks(rank, world, out_dir):
    """The 2-rank faults in sequence (LANCET_TIMEOUT_S=2 set by the test); rank 1 dies in the last."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, g = torch.randn(4, 3, D, generator=gen), torch.randn(4, 3, D, generator=gen)
    res = {}
    healthy = _group()
    res["timeout from LANCET_TIMEOUT_S"] = ["ok", lancet_rt.comm.as_group(healthy).timeout_s, None]
    res["chunks 2 and 4"] = _outcome(lambda: _step(lancet_rt.Overlapped(make_model(healthy), chunks=2 + 2 * rank), x))
    res["set_timeout(0)"] = _outcome(lambda: lancet_rt.comm.as_group(healthy).set_timeout(0))

    late = _group()
    if rank == 1:  # never starts the step until rank 0 has given up on it
        _until_given_up(late, [0])
    res["a rank never starts the step"] = _outcome(lambda: _step(lancet_rt.Overlapped(make_model(late), chunks=2), x))

    # The CUDA path's watchdog (a thread follows the collectives in flight; the host wait is plain),
    # run on gloo: it finds rank 1's failure record and aborts; gloo's operation timeout ends the wait.
    watched = _group(timeout_s=1.0)
    monitor = lancet_rt.comm.as_group(watched).monitor
    monitor._watchdog = True
    wd = lancet_rt.Overlapped(make_model(watched), chunks=3)
    if rank == 1:
        in_chunk(wd.model.blocks[1], 2, lambda: raise_(RuntimeError("injected under the watchdog")))
    res["watchdog finds a failure"] = _outcome(lambda: _step(wd, x))
    res["watchdog raised it"] = ["ok", monitor._fatal is not None, None]

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dead = lancet_rt.Overlapped(make_model(_group()), chunks=2)
    if rank == 1:
        dead.model.blocks[0].register_forward_hook(
            lambda m, a, y: [y.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))] and None)
    return _outcome(lambda: _step(dead, x, g))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(env.TIMEOUT, "2")
        results = run_ranks(_two_ranks, 2, str(out), timeout=90, may_die=(1,))
    assert 1 not in results and results[0][0] == "ok", results
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    per_rank[0]["a rank is killed in backward"] = results[0][1]
    return per_rank


def test_two_ranks_read_their_timeout_from_the_environment(two_ranks):
    assert [res["timeout from LANCET_TIMEOUT_S"][1] for res in two_ranks] == [2.0, 2.0]


def test_chunks_must_agree_on_two_ranks(two_ranks):
    for res in two_ranks:
        _assert_raised(res["chunks 2 and 4"], "ValueError", "chunks: rank 0=2, rank 1=4")


def test_bad_group_timeout(two_ranks):
    for res in two_ranks:
        _assert_raised(res["set_timeout(0)"], "ValueError", "timeout_s", "0")


def test_a_rank_that_never_starts_the_step_times_out_by_name(two_ranks):
    _assert_raised(two_ranks[0]["a rank never starts the step"], "PeerTimeout", "rank(s) [1] stopped answering",
                   "timeout 2 s, LANCET_TIMEOUT_S", "collective #1 (all-gather)", ranks=[1])
    _assert_raised(two_ranks[1]["a rank never starts the step"], "PeerError", "rank 1 was reported as not answering",
                   ranks=[1])


def test_the_watchdog_path_names_the_failed_rank(two_ranks):
    """The CUDA path (a watchdog thread, the host waiting plainly), exercised on gloo."""
    _assert_raised(two_ranks[1]["watchdog finds a failure"], "RuntimeError", "injected under the watchdog")
    _assert_raised(two_ranks[0]["watchdog finds a failure"], "PeerError", "rank(s) [1] failed or stopped answering",
                   "RuntimeError: injected under the watchdog", ranks=[1])
    assert two_ranks[0]["watchdog raised it"][1] is True


def test_a_rank_killed_in_backward_is_named(two_ranks):
    _assert_raised(two_ranks[0]["a rank is killed in backward"], "PeerError", "rank(s) [1] stopped answering",
                   "rank 1: its process has exited", ranks=[1])
