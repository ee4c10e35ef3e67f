"""Faults, adversarially, in one process: bad inputs to the layer, Overlapped, the emulated link and
the kernels' launchers called directly; failures in forward and backward after which the next step
must equal a fresh model's; a broken autotune cache. The distributed faults (2 and 3 gloo ranks)
are in tests/distributed/test_faults_distributed.py.

Each case asserts the exception type and that the message names the argument (README, "Reliability").
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import tempfile

import pytest
import torch
from lancet_rt.autotune import CacheKey, TuneCache
from lancet_rt.kernels import gating
from lancet_rt.kernels import grouped_gemm as gg
from lancet_rt.kernels import permute as pm
from lancet_rt.kernels import swiglu as sw

import lancet_rt
import lancet_rt.runtime.scope
from lancet_rt import env
from lancet_rt.models.blocks import MoEBlocks
from tests.helpers import assert_close

D = 16


def make_model(ep_group=None, *, seed=0, E=4, **moe):
    torch.manual_seed(seed)
    kw = dict(
        d_ffn=12, num_experts=E, top_k=2, capacity_factor=0.75, aux_loss_coef=0.01, z_loss_coef=0.001, ep_group=ep_group
    )
    kw.update(moe)
    return MoEBlocks(2, D, 2, kw)


def train_step(runner, model, x, g):
    x = x.clone().requires_grad_(True)
    y = runner(x)
    y.backward(g)
    out = (
        y.detach(),
        x.grad,
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        [(m.aux_loss.clone(), m.z_loss.clone(), m.dropped) for m in model.moe_layers()],
    )
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
        s = lancet_rt.runtime.scope.current()
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
        if lancet_rt.runtime.scope.current() is not None and lancet_rt.runtime.scope.current().chunk == 2:
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
    (
        "moe capacity_factor=nan",
        lambda: lancet_rt.MoE(8, 8, 4, 2, capacity_factor=math.nan),
        ValueError,
        "capacity_factor",
    ),
    (
        "moe capacity_factor=inf",
        lambda: lancet_rt.MoE(8, 8, 4, 2, capacity_factor=math.inf),
        ValueError,
        "capacity_factor",
    ),
    ("moe z_loss_coef=nan", lambda: lancet_rt.MoE(8, 8, 4, 2, z_loss_coef=math.nan), ValueError, "z_loss_coef"),
    ("moe pipeline_chunks=0", lambda: lancet_rt.MoE(8, 8, 4, 2, pipeline_chunks=0), ValueError, "pipeline_chunks"),
    ("moe dtype=int32", lambda: lancet_rt.MoE(8, 8, 4, 2, dtype=torch.int32), TypeError, "dtype"),
    (
        "moe experts not divisible by world",
        lambda: lancet_rt.MoE(8, 8, 6, 2, ep_group=lancet_rt.EmulatedGroup(4)),
        ValueError,
        "divisible",
    ),
    ("moe x 0-dim", lambda: lancet_rt.MoE(8, 8, 4, 2)(torch.tensor(1.0)), ValueError, "d_model=8"),
    (
        "moe x complex",
        lambda: lancet_rt.MoE(8, 8, 4, 2)(torch.randn(3, 8, dtype=torch.complex64)),
        TypeError,
        "floating",
    ),
    # the emulated link
    ("emulated world_size=0", lambda: lancet_rt.EmulatedGroup(0), ValueError, "world_size"),
    ("emulated bandwidth_gbps=0", lambda: lancet_rt.EmulatedGroup(2, bandwidth_gbps=0), ValueError, "bandwidth_gbps"),
    ("emulated latency_us=-1", lambda: lancet_rt.EmulatedGroup(2, latency_us=-1), ValueError, "latency_us"),
    (
        "emulated asymmetric splits",
        lambda: lancet_rt.EmulatedGroup(2).all_to_all(torch.empty(3, 2), torch.empty(3, 2), [1, 2], [2, 1]),
        ValueError,
        "splits",
    ),
    # Overlapped
    ("overlapped chunks='3'", lambda: lancet_rt.Overlapped(make_model(), chunks="3"), ValueError, "chunks"),
    ("overlapped chunks=-1", lambda: lancet_rt.Overlapped(make_model(), chunks=-1), ValueError, "chunks"),
    (
        "overlapped defer_wgrad='no'",
        lambda: lancet_rt.Overlapped(make_model(), defer_wgrad="no"),
        TypeError,
        "defer_wgrad",
    ),
    ("overlapped check=1", lambda: lancet_rt.Overlapped(make_model(), check=1), TypeError, "check"),
    (
        "overlapped no tensor to cut",
        lambda: lancet_rt.Overlapped(make_model(), chunks=2)(3.0),
        ValueError,
        "tensor argument",
    ),
    (
        "overlapped tokens not a multiple of rows",
        lambda: lancet_rt.Overlapped(_HalfRows(), chunks=2)(torch.randn(6, 2, D)),
        RuntimeError,
        "whole multiple of the rows along dim 0",
    ),
    (
        "overlapped output rows differ from input rows",
        lambda: lancet_rt.Overlapped(_HalfRows(), chunks=2)(torch.randn(6, 3, D)),
        ValueError,
        "dim 0",
    ),
    (
        "overlapped tokens differ per chunk",
        lambda: lancet_rt.Overlapped(_TokensPerChunkVary(), chunks=3)(torch.randn(6, 1, D)),
        RuntimeError,
        "separable along dim 0",
    ),
    # the kernels' launchers, called directly
    ("gating_fwd logits 1-D", lambda: gating.gating_fwd(torch.randn(4), 1), ValueError, "logits_TE"),
    ("gating_fwd no experts", lambda: gating.gating_fwd(torch.randn(3, 0), 1), ValueError, "logits_TE"),
    ("gating_fwd capacity=2.0", lambda: gating.gating_fwd(_L, 1, capacity=2.0), ValueError, "capacity"),
    ("gating_fwd used_E float", lambda: gating.gating_fwd(_L, 1, torch.zeros(4)), TypeError, "used_E"),
    ("gating_fwd out a tuple", lambda: gating.gating_fwd(_L, 1, out=(1, 2)), TypeError, "out"),
    (
        "gating_bwd grad_score_sum_E shape",
        lambda: gating.gating_bwd(_L, torch.zeros(5, 1, **_I32), torch.ones(5, 1), torch.ones(3), None),
        ValueError,
        "grad_score_sum_E",
    ),
    ("permute_fwd row_TK rows", lambda: pm.permute_fwd(_X, _ROW[:3], 6), ValueError, "row_TK"),
    (
        "permute_fwd out shape",
        lambda: pm.permute_fwd(_X, _ROW, 8, out=(torch.empty(7, 6), torch.empty(8, **_I32))),
        ValueError,
        "x_SD",
    ),
    (
        "unpermute_bwd y_SD width",
        lambda: pm.unpermute_bwd(torch.randn(5, 7), torch.randn(8, 6), _ROW, torch.ones(5, 2), torch.zeros(8, **_I32)),
        ValueError,
        "y_SD",
    ),
    (
        "dispatch_rows slot_TK shape",
        lambda: pm.dispatch_rows(
            torch.zeros(5, 2, **_I32), torch.zeros(5, 1, **_I32), torch.zeros(4, **_I32), torch.zeros(4, **_I32)
        ),
        ValueError,
        "slot_TK",
    ),
    ("grouped_mm x_RK 1-D", lambda: gg.grouped_mm(torch.randn(6), _W, _OFF), ValueError, "x_RK"),
    ("grouped_mm offsets for E=1", lambda: gg.grouped_mm(_X, _W, torch.tensor([0, 5])), ValueError, "offsets_E1"),
    (
        "grouped_mm_dw rows differ",
        lambda: gg.grouped_mm_dw(torch.randn(5, 3), torch.randn(4, 6), _OFF),
        ValueError,
        "dy_RN",
    ),
    (
        "gate_up_swiglu out one tensor",
        lambda: gg.gate_up_swiglu(_X, torch.randn(2, 4, 6), _OFF, out=torch.empty(5, 2)),
        TypeError,
        "out",
    ),
    ("swiglu_fwd int", lambda: sw.swiglu_fwd(torch.ones(4, 8, **_I32)), TypeError, "gu_R2F"),
    (
        "swiglu_bwd float64 grad",
        lambda: sw.swiglu_bwd(torch.randn(5, 8), torch.randn(5, 4).double()),
        TypeError,
        "grad_h_RF",
    ),
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
    return link._cpu_link.idle()


def _fail_in_chunk_forward(model, ov):
    return in_chunk(model.blocks[1], 2, lambda: raise_(RuntimeError("injected in chunk 2")))


def _interrupt_in_chunk_forward(model, ov):
    return in_chunk(model.blocks[1].moe, 1, lambda: raise_(KeyboardInterrupt()))


def _fail_in_experts(model, ov):
    layer = model.blocks[0].moe
    cls = type(layer.dispatcher)  # (its stage, for this layer only)
    original, own = cls.experts, "experts" in cls.__dict__

    def experts(self, *a, **kw):
        if self.moe is layer and lancet_rt.runtime.scope.current().chunk == 1:
            raise RuntimeError("injected in the experts")
        return original(self, *a, **kw)

    cls.experts = experts

    class Undo:
        def remove(self):
            if own:
                cls.experts = original
            else:
                del cls.experts

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
    assert lancet_rt.runtime.scope.current() is None and lancet_rt.runtime.wgrad.current() is None
    if exc is not KeyboardInterrupt or chunks != 2:  # a backward that raised is found by the next step
        assert _link_idle(link), "the failed step left transfers on the emulated link"
    for p in model.parameters():
        p.grad = None
    got = train_step(ov, model, x, g)
    assert not ov.wgrad_queue.items and _link_idle(link)
    assert_same_step(train_step(lancet_rt.Overlapped(fresh, chunks=chunks, defer_wgrad=True), fresh, x, g), got)


# ====================================================================================== autotune cache
def _key(**over) -> CacheKey:
    fields = dict(
        device="cpu|test",
        device_name="cpu",
        ep_world_size=2,
        link_backend="emulated",
        link_gbps=1.0,
        link_latency_us=10.0,
        dtype="float32",
        d_model=64,
        d_ffn=128,
        num_experts=8,
        top_k=2,
        capacity_factor=1.25,
        tokens_bucket=512,
    )
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


@pytest.mark.parametrize(
    "content, words",
    [
        ({"schema": "lancet-rt/autotune-cache", "version": 1, "entries": []}, "no 'entries' object"),
        ({"schema": "lancet-rt/autotune-cache", "version": 2, "entries": {}}, "version 2"),
        ("null", "schema"),
    ],
    ids=["entries not an object", "newer version", "null"],
)
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
    except BaseException as exc:  # reported to the test
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
    chunks = [cache.lookup(_key(d_model=100 + w), nearest=False).chunks for w in range(8)]
    assert chunks == [1 + w % 8 for w in range(8)]


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda p: TuneCache("", defaults_path=None), ValueError, "path"),
        (lambda p: TuneCache(p, defaults_path=None).store(_key(), {"chunks": True}), ValueError, "chunks"),
        (lambda p: TuneCache(p, defaults_path=None).lookup("a key"), TypeError, "key"),
    ],
    ids=["empty path", "chunks=True", "key not a CacheKey"],
)
def test_cache_bad_arguments(tmp_path, call, exc, words):
    with pytest.raises(exc) as info:
        call(str(tmp_path / "c.json"))
    assert type(info.value) is exc and words in str(info.value)
