"""The autotuner: the command and its cache, chunks="auto" (cached and online), cache robustness
(corrupted, foreign, old-version files; concurrent writers), nearest-bucket lookup, the cost model's
simulation, and the device identity without NVML. CPU, emulated link, small blocks."""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import sys
import types

import pytest
import torch
from lancet_rt.autotune import (
    AutoChunks,
    CacheKey,
    ComputeProfile,
    CostModel,
    LinkModel,
    SimOp,
    TuneCache,
    TuningBlocks,
    candidate_chunks,
    device_identity,
    profiling,
    simulate,
    token_bucket,
)
from lancet_rt.autotune import __main__ as cli
from lancet_rt.autotune import cache as cache_mod
from lancet_rt.autotune import gpu as gpu_mod
from lancet_rt.autotune.profiling import LayerStages

import lancet_rt
from tests.dist import assert_all_ok, run_ranks
from tests.helpers import assert_close

# The tuned block: small enough that one command run takes a few seconds on a 2-core CPU, with a
# link slow enough that chunking matters (about as much communication as computation).
D, F, E, K, W, CF = 64, 128, 8, 2, 4, 1.25
BW_GBPS, LAT_US = 0.05, 20.0
SEQ, ROWS = 128, 4
TOKENS = SEQ * ROWS
ARGS = [
    "--device",
    "cpu",
    "--link",
    "emulated",
    "--world-size",
    str(W),
    "--bandwidth-gbps",
    str(BW_GBPS),
    "--latency-us",
    str(LAT_US),
    "--d-model",
    str(D),
    "--d-ffn",
    str(F),
    "--experts",
    str(E),
    "--top-k",
    str(K),
    "--capacity-factor",
    str(CF),
    "--tokens",
    str(TOKENS),
    "--seq",
    str(SEQ),
    "--layers",
    "1",
    "--heads",
    "4",
    "--dtype",
    "float32",
    "--warmup",
    "1",
    "--reps",
    "3",
    "--no-progress",
]


def make_model(seed=0, bandwidth=BW_GBPS):
    torch.manual_seed(seed)
    link = lancet_rt.EmulatedGroup(W, bandwidth, LAT_US)
    return TuningBlocks(1, D, 4, dict(d_ffn=F, num_experts=E, top_k=K, capacity_factor=CF, ep_group=link))


def train_step(runner, model, x, g):
    x = x.clone().requires_grad_(True)
    y = runner(x)
    y.backward(g)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return y.detach(), x.grad, grads


def a_key(tokens_bucket=1024, **over) -> CacheKey:
    fields = dict(
        device="cpu|test|2 cores",
        device_name="cpu",
        ep_world_size=W,
        link_backend="emulated",
        link_gbps=BW_GBPS,
        link_latency_us=LAT_US,
        dtype="float32",
        d_model=D,
        d_ffn=F,
        num_experts=E,
        top_k=K,
        capacity_factor=CF,
        tokens_bucket=tokens_bucket,
    )
    fields.update(over)
    return CacheKey(**fields)


# ---------------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One command run, shared: (cache path, its result, its printed output)."""
    path = str(tmp_path_factory.mktemp("autotune") / "cache.json")
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = cli.run(ARGS + ["--cache", path])
    return path, result, out.getvalue()


def test_command_creates_an_entry_and_reports_choice_and_prediction(tuned):
    path, result, printed = tuned
    assert not result["cached"]
    entries = json.load(open(path))["entries"]
    assert list(entries) == [result["key"]]
    value = entries[result["key"]]["value"]
    assert value["chunks"] == result["chunks"]
    measured = {r["chunks"]: r["measured_ms"] for r in result["table"] if r["status"] == "ok"}
    assert set(measured) == set(candidate_chunks(TOKENS, ROWS)[0]) == {1, 2, 3, 4}
    # The choice is the measured argmin, so it is within 5% of the best measured (here: 0%).
    assert result["chunks"] == min(measured, key=measured.get)
    assert result["chosen_measured_ms"] == measured[result["chunks"]] == result["best_measured_ms"]
    assert 0.0 <= result["within_best"] <= 0.05
    # The cost model's prediction for the choice, and its error, are reported (not asserted: timing).
    assert math.isfinite(result["predicted_ms"]) and result["predicted_ms"] > 0
    assert result["prediction_error"] == pytest.approx(result["predicted_ms"] / result["chosen_measured_ms"] - 1)
    assert all(r["predicted_ms"] > 0 for r in result["table"] if r["status"] == "ok")
    assert "predicted ms" in printed and "measured ms" in printed
    assert f"choice: {result['chunks']} chunk" in printed and "prediction error" in printed
    print(
        f"\nautotune on this CPU: choice {result['chunks']} chunks, measured {result['chosen_measured_ms']:.1f} ms, "
        f"predicted {result['predicted_ms']:.1f} ms ({result['prediction_error']:+.1%})"
    )


def test_second_command_run_reuses_the_entry(tuned, monkeypatch, capsys):
    path, first, _ = tuned

    def no_measuring(*a, **k):
        raise AssertionError("a cached run must not measure")

    monkeypatch.setattr(cli, "search", no_measuring)
    again = cli.run(ARGS + ["--cache", path])
    assert again["cached"] and again["chunks"] == first["chunks"] and again["key"] == first["key"]
    assert "cache hit" in capsys.readouterr().out
    assert main_returns_zero(ARGS + ["--cache", path])


def main_returns_zero(argv) -> bool:
    return cli.main(argv) == 0


def test_auto_uses_the_cached_entry_without_tuning(tuned, monkeypatch):
    path, result, _ = tuned
    monkeypatch.setenv("LANCET_AUTOTUNE_CACHE", path)  # chunks="auto" finds the cache through the env
    model = make_model(seed=1)
    ov = lancet_rt.Overlapped(model, chunks="auto")
    used = []
    run_chunked = ov.run_chunked
    ov.run_chunked = lambda n, a, kw: used.append(n) or run_chunked(n, a, kw)
    x = torch.randn(ROWS, SEQ, D)
    ov(x).sum().backward()
    auto = ov._auto
    assert auto.cache.path == os.path.abspath(path)
    assert auto.last_source == "cache" and auto.tuning_steps == 0
    assert auto.last_chunks == result["chunks"]
    assert used == ([result["chunks"]] if result["chunks"] > 1 else [])


# ---------------------------------------------------------------------------------- online tuning
def test_auto_tunes_online_stores_the_choice_and_stays_exact(tmp_path, monkeypatch):
    path = tmp_path / "online.json"
    monkeypatch.setenv("LANCET_AUTOTUNE_CACHE", str(path))
    model = make_model()
    twin = copy.deepcopy(model)
    ov = lancet_rt.Overlapped(model, chunks="auto")
    x, g = torch.randn(ROWS, SEQ, D), torch.randn(ROWS, SEQ, D)
    kept, _ = candidate_chunks(TOKENS, ROWS)
    tuning_steps = 3 * len(kept)  # a warm-up round and two timed rounds
    counts = []
    for step in range(tuning_steps + 2):
        got = train_step(ov, model, x, g)
        ref = train_step(twin, twin, x, g)
        counts.append(ov._auto.last_chunks)
        assert_close(f"step {step} y", got[0], ref[0])
        assert_close(f"step {step} grad x", got[1], ref[1])
        for name in ref[2]:
            assert_close(f"step {step} grad {name}", got[2][name], ref[2][name])
    assert counts[:tuning_steps] == kept * 3
    choice = counts[-1]
    assert counts[tuning_steps:] == [choice, choice] and ov._auto.last_source == "tuned"
    entry = TuneCache(str(path)).lookup(ov._auto.last_key, nearest=False)
    assert entry is not None and entry.chunks == choice and entry.value["source"] == "online"
    fastest = {r["chunks"]: r["measured_ms"] for r in entry.value["table"]}
    assert choice == min(fastest, key=fastest.get)
    # A new run finds it.
    fresh = lancet_rt.Overlapped(make_model(seed=2), chunks="auto")
    fresh(x)
    assert fresh._auto.last_source == "cache" and fresh._auto.last_chunks == choice


def test_auto_eval_forward_is_not_a_tuning_step(tmp_path):
    model = make_model()
    ov = lancet_rt.Overlapped(model, chunks="auto")
    ov._auto = AutoChunks(ov, cache=TuneCache(str(tmp_path / "c.json")))
    x = torch.randn(ROWS, SEQ, D)
    with torch.no_grad():
        ov(x)
    assert ov._auto.tuning_steps == 0
    ov(x).sum().backward()
    assert ov._auto.tuning_steps == 1


# ---------------------------------------------------------------------------------- robustness
def _short_training(path, steps):
    """chunks="auto" on 2 rows (candidates 1 and 2: 6 tuning steps) with the cache at ``path``."""
    model = make_model(bandwidth=1.0)
    ov = lancet_rt.Overlapped(model, chunks="auto")
    ov._auto = AutoChunks(ov, cache=TuneCache(str(path)))
    x = torch.randn(2, SEQ, D)
    for _ in range(steps):
        ov(x).sum().backward()
    return ov._auto


def test_corrupted_cache_warns_and_training_goes_on(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text('{"schema": "lancet-rt/autotune-cache", "version": 1, "entries": {')  # torn
    with pytest.warns(RuntimeWarning, match="corrupted"):
        auto = _short_training(path, 7)
    assert auto.last_source == "tuned"
    data = json.loads(path.read_text())  # replaced by a valid file holding the new entry
    assert data["schema"] == cache_mod.SCHEMA and len(data["entries"]) == 1


@pytest.mark.parametrize(
    "content, match",
    [
        ({"schema": "someone-else/v3", "entries": {"x": 1}}, "another tool"),
        ({"schema": cache_mod.SCHEMA, "version": 0, "entries": {}}, "version 0"),
        ([1, 2, 3], "another tool"),
    ],
)
def test_foreign_or_old_cache_is_ignored_with_a_warning(tmp_path, content, match):
    path = tmp_path / "cache.json"
    path.write_text(json.dumps(content))
    cache = TuneCache(str(path), defaults_path=None)
    with pytest.warns(RuntimeWarning, match=match):
        assert cache.lookup(a_key()) is None
    with pytest.warns(RuntimeWarning, match=match):
        auto = _short_training(path, 1)  # training goes on
    assert auto.last_source == "tuning"
    with pytest.warns(RuntimeWarning, match=match):
        cache.store(a_key(), {"chunks": 3})
    assert cache.lookup(a_key()).chunks == 3  # the file was replaced, no warning now


def _write_many(path, writer, count):
    cache = TuneCache(path, defaults_path=None)
    for i in range(count):
        cache.store(a_key(d_model=1000 * writer + i + 1), {"chunks": 1 + i % 8, "writer": writer})


def test_concurrent_writers_keep_every_entry(tmp_path):
    path = str(tmp_path / "shared.json")
    per_writer = 40
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    procs = [ctx.Process(target=_write_many, args=(path, w, per_writer)) for w in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)  # (a hang guard: the writers take seconds)
        assert p.exitcode == 0
    data = json.loads(open(path).read())
    assert data["schema"] == cache_mod.SCHEMA and data["version"] == cache_mod.VERSION
    assert len(data["entries"]) == 2 * per_writer
    writers = sorted(e["value"]["writer"] for e in data["entries"].values())
    assert writers == [1] * per_writer + [2] * per_writer
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_nearest_bucket_lookup(tmp_path):
    cache = TuneCache(str(tmp_path / "c.json"), defaults_path=None)
    cache.store_many([(a_key(256), {"chunks": 2}), (a_key(4096), {"chunks": 6})])
    assert [token_bucket(t) for t in (1, 1000, 1400, 1500, 4096)] == [1, 1024, 1024, 2048, 4096]
    hit = cache.lookup(a_key(512))
    assert hit.chunks == 2 and hit.key.tokens_bucket == 256 and not hit.exact
    assert cache.lookup(a_key(2048)).chunks == 6
    assert cache.lookup(a_key(4096)).exact
    assert cache.lookup(a_key(1024), nearest=False) is None
    assert cache.lookup(a_key(1024), max_bucket_distance=1) is None  # 2 buckets from both
    assert cache.lookup(a_key(1024)).chunks == 6  # a tie goes to the larger bucket
    assert cache.lookup(a_key(512, top_k=1)) is None  # the rest of the key must match
    assert cache.lookup(a_key(256, link_gbps=0.1)) is None  # a configured bandwidth must match exactly


def test_measured_bandwidth_matches_within_a_factor_of_two(tmp_path):
    cache = TuneCache(str(tmp_path / "c.json"), defaults_path=None)
    real = dict(link_backend="nccl", link_latency_us=None, link_measured=True)
    cache.store(a_key(1024, link_gbps=64.0, **real), {"chunks": 3})
    assert cache.lookup(a_key(1024, link_gbps=128.0, **real), nearest=False).chunks == 3  # remeasured
    assert cache.lookup(a_key(1024, link_gbps=16.0, **real)) is None
    assert "~64GB/s" in a_key(1024, link_gbps=64.0, **real).string()


def test_measured_bandwidth_is_compared_unrounded(tmp_path):
    # The entry's name rounds a measured bandwidth to a power of two; lookups compare the measured values,
    # so "within a factor of 2" is exact (compared rounded, 0.36 and 1.41 GB/s, 3.9x apart, would match).
    cache = TuneCache(str(tmp_path / "c.json"), defaults_path=None)
    real = dict(link_backend="gloo", link_latency_us=None, link_measured=True)
    cache.store(a_key(1024, link_gbps=0.7, **real), {"chunks": 3})
    assert "~0.5GB/s" in a_key(1024, link_gbps=0.7, **real).string()
    assert "~2GB/s" in a_key(1024, link_gbps=1.45, **real).string()
    hit = cache.lookup(a_key(1024, link_gbps=1.3, **real), nearest=False)
    assert hit.chunks == 3 and hit.exact and hit.key.link_gbps == 0.7  # the same link, re-measured
    assert cache.lookup(a_key(1024, link_gbps=1.45, **real)) is None  # 2.07x: another link
    assert cache.lookup(a_key(1024, link_gbps=0.34, **real)) is None
    cache.store(a_key(1024, link_gbps=0.6, **real), {"chunks": 2})  # same bucket: replaces the entry
    assert len(cache.entries()) == 1
    assert cache.lookup(a_key(1024, link_gbps=1.3, **real), nearest=False) is None  # 2.17x from 0.6
    assert cache.lookup(a_key(1024, link_gbps=1.1, **real), nearest=False).chunks == 2


def test_shipped_defaults_are_keyed_by_gpu_name(tmp_path):
    defaults = tmp_path / "defaults.json"
    TuneCache(str(defaults), defaults_path=None).store(
        a_key(1024, device="cpu|other machine|64 cores"), {"chunks": 4}, by="device_name"
    )
    cache = TuneCache(str(tmp_path / "user.json"), defaults_path=str(defaults))
    hit = cache.lookup(a_key(1024))
    assert hit.chunks == 4 and hit.source == "defaults"
    cache.store(a_key(1024), {"chunks": 2})
    assert cache.lookup(a_key(1024)).source == "cache"  # the user's cache first
    shipped = json.load(open(cache_mod.DEFAULTS_PATH))  # the file in the package is a valid, empty cache
    assert shipped["schema"] == cache_mod.SCHEMA and shipped["version"] == cache_mod.VERSION


# ---------------------------------------------------------------------------------- identity
def test_gpu_identity_is_cpu_without_nvml(monkeypatch):
    import pynvml

    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    assert gpu_mod.nvml_info(0) is None
    ident = device_identity("cpu")
    assert ident.name == "cpu" and ident.kind == "cpu" and ident.sm_count >= 1
    assert ident.key.startswith("cpu|")
    if not torch.cuda.is_available():
        assert device_identity().name == "cpu" and device_identity("cuda").name == "cpu"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not even installed
    assert gpu_mod.nvml_info(0) is None
    with pytest.raises(ValueError, match="device"):
        device_identity("not a device")


# ---------------------------------------------------------------------------------- cost model
def test_two_stream_simulation():
    ops = [
        SimOp("a", "compute", 2.0),
        SimOp("x", "comm", 3.0, (0,)),
        SimOp("b", "compute", 1.0),
        SimOp("c", "compute", 1.0, (1,)),
        SimOp("y", "comm", 1.0, (2,)),
    ]
    assert simulate(ops) == 6.0
    assert [(o.start, o.end) for o in ops] == [(0, 2), (2, 5), (2, 3), (5, 6), (5, 6)]
    with pytest.raises(ValueError, match="stream"):
        simulate([SimOp("a", "gpu", 1.0)])


def _profile(pre=2.0, experts=2.0, post=1.0, backward=10.0, overhead=0.5, nbytes=3_000_000, world=W):
    stage = LayerStages(pre=pre, issue=0.0, experts=experts, post=post, dispatch_bytes=nbytes, combine_bytes=nbytes)
    forward = pre + experts + post
    return ComputeProfile(
        step1_ms=forward + backward,
        overhead_per_chunk_ms=overhead,
        points={},
        forward_ms=forward,
        layers=(stage,),
        tail_ms=0.0,
        dw_ms=0.0,
        world_size=world,
    )


def test_cost_model_predictions():
    free = CostModel(_profile(), LinkModel(0.0, math.inf))
    for n in (1, 2, 4):  # no communication: the computation alone, C(N) = C(1) + (N - 1) o
        assert free.predict(n).step_ms == pytest.approx(15.0 + 0.5 * (n - 1))
    slow = CostModel(_profile(), LinkModel(0.0, 1.0))  # 3 ms per all-to-all at 1 chunk
    one = slow.predict(1)
    assert one.forward_ms == pytest.approx(5.0 + 2 * 3.0)  # nothing overlaps at 1 chunk
    assert one.comm_ms == pytest.approx(4 * 3.0)
    two = slow.predict(2)
    assert two.forward_ms < one.forward_ms and two.step_ms < one.step_ms  # chunking hides communication
    assert two.step_ms >= max(slow.compute_ms(2), two.comm_ms)
    with pytest.raises(ValueError, match="n must be"):
        slow.predict(0)
    # The counts on a channel of their own: off the link, never queued behind the tokens.
    lat = LinkModel(1.0, 1.0)
    shared, own = CostModel(_profile(), lat).predict(2), CostModel(_profile(), lat, counts_channel="own").predict(2)
    assert {o.stream for o in own.ops if o.name.endswith("exchange")} == {"counts"}
    assert {o.stream for o in shared.ops if o.name.endswith("exchange")} == {"comm"}
    assert own.comm_ms == pytest.approx(shared.comm_ms - 2 * 1.0)  # 2 chunks' exchanges left the link
    assert own.step_ms < shared.step_ms
    with pytest.raises(ValueError, match="counts_channel"):
        CostModel(_profile(), lat, counts_channel="separate")


def test_link_model_fit():
    model = LinkModel.fit([(0, 0.5), (1e6, 1.5), (2e6, 2.5)])
    assert model.latency_ms == pytest.approx(0.5) and model.gbps == pytest.approx(1.0)
    assert model.time_ms(4e6) == pytest.approx(4.5)


class _InjectedLink:
    """A link whose all-to-alls take ``latency + off-rank bytes / bandwidth`` of an injected clock
    (plus ``noise`` ms on every other call), so the fit is checked without wall-clock timings."""

    def __init__(self, size, latency_ms, gbps, noise=0.0):
        self.size, self.latency_ms, self.gbps, self.noise, self.now, self.calls = size, latency_ms, gbps, noise, 0.0, 0

    def perf_counter(self):
        return self.now

    def all_to_all(self, out, x, in_splits, out_splits):
        off_rank = sum(in_splits[1:]) * x[0].numel() * x.element_size()
        self.calls += 1
        self.now += (self.latency_ms + off_rank / (self.gbps * 1e6) + self.noise * (self.calls % 2)) / 1e3
        return types.SimpleNamespace(wait=lambda: out.copy_(x))


def test_link_model_measure_fits_the_timings(monkeypatch):
    """measure() on injected timings: the fitted model is the link's, whatever the machine's load
    (the fastest repetition counts, so noise on some repetitions changes nothing)."""
    link = _InjectedLink(W, latency_ms=0.1, gbps=0.5, noise=7.0)
    monkeypatch.setattr(profiling, "time", link)
    measured = LinkModel.measure(link, device="cpu", row_elems=D, nbytes=(0, 1 << 18, 1 << 20), reps=2)
    assert measured.latency_ms == pytest.approx(0.1, abs=1e-6) and measured.gbps == pytest.approx(0.5, rel=1e-6)
    assert link.calls == 3 * (1 + 2)  # a warm-up and two timed repetitions per size


# ---------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "extra, match",
    [
        (["--tokens", "500"], "--tokens"),
        (["--experts", "6"], "--experts"),
    ],
)
def test_command_rejects_bad_arguments(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        cli.run(ARGS + ["--cache", str(tmp_path / "c.json")] + extra)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--capacity-factor", "-1"], "argument --capacity-factor: must be a finite number > 0"),
        (["--candidates", "0,2"], "argument --candidates: item '0'"),
    ],
)
def test_command_refuses_an_out_of_range_argument_in_argparse(tmp_path, extra, match, capsys):
    with pytest.raises(SystemExit) as info:
        cli.run(ARGS + ["--cache", str(tmp_path / "c.json")] + extra)
    assert info.value.code == 2 and match in capsys.readouterr().err


def test_command_needs_a_bandwidth_for_the_emulated_link(tmp_path):
    argv = [a for a in ARGS if a not in ("--bandwidth-gbps", str(BW_GBPS))]
    with pytest.raises(ValueError, match="--bandwidth-gbps"):
        cli.run(argv + ["--cache", str(tmp_path / "c.json")])


def test_api_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="tokens"):
        token_bucket(0)
    with pytest.raises(ValueError, match="tokens_bucket"):
        a_key(1000)
    with pytest.raises(ValueError, match="chunks"):
        TuneCache(str(tmp_path / "c.json")).store(a_key(), {"chunks": 0})
    with pytest.raises(TypeError, match="overlapped"):
        AutoChunks(make_model())
    with pytest.raises(ValueError, match="candidates"):
        candidate_chunks(TOKENS, ROWS, [0, 2])


# ---------------------------------------------------------------------------------- real group
def _tune_on_gloo(rank, world, path):
    import contextlib
    import io

    torch.set_num_threads(1)
    argv = [
        "--device",
        "cpu",
        "--link",
        "torch",
        "--d-model",
        "32",
        "--d-ffn",
        "64",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--tokens",
        "256",
        "--seq",
        "64",
        "--layers",
        "1",
        "--heads",
        "2",
        "--candidates",
        "1,2",
        "--warmup",
        "1",
        "--reps",
        "2",
        "--no-progress",
        "--cache",
        path,
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        first = cli.run(argv)
        second = cli.run(argv)
    return first["chunks"], first["key"], (first["link_gbps"], second["link_gbps"]), second["cached"]


def test_command_on_a_real_gloo_group(tmp_path):
    results = run_ranks(_tune_on_gloo, 2, str(tmp_path / "gloo.json"), timeout=120)
    assert_all_ok(results)
    (c0, k0, g0, cached0), (c1, k1, g1, cached1) = (results[r][1] for r in range(2))
    assert c0 == c1 and k0 == k1 and "gloo" in k0  # every rank chose the same count
    assert g0 == g1 and cached0 == cached1  # every rank measured the same link and agreed on the hit
    # The second run re-measures the link; the entry is found whenever the two measurements are within
    # the lookup's factor of 2 (loopback gloo on a shared 2-core VM varies by about that much).
    first, second = g0
    assert first > 0 and second > 0
    assert cached0 == (abs(math.log2(second / first)) <= 1.0), (first, second, cached0)


@pytest.mark.parametrize("samples", [[300.0, 100.0], [120.0, 900.0, 150.0]])
def test_quantiles_of_a_few_steps_lie_within_them(samples):
    """A short run (--reps 2 or 3) reports its 20/80% quantiles between the fastest and slowest step:
    never an extrapolated (even negative) time."""
    from lancet_rt.autotune.search import Measurement, _summarise

    table = {1: Measurement(1, samples=list(samples))}
    assert _summarise(table, [1], min, None) == [1]
    assert min(samples) <= table[1].ms_q20 <= table[1].ms_q80 <= max(samples)
