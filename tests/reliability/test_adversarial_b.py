"""Adversarial cases, part B: absurd values from arguments, environment variables and
cache files; malformed cache files; small, empty and odd batches through ``from_hf`` and
``Overlapped``; the eval and generate paths of converted Hugging Face models.

Each case must end in a result equal to the reference or in a ValueError/TypeError (or a warning,
where the README promises one) naming what was wrong: no crash elsewhere, no hang (every test runs
under a timeout), no silent mismatch. The README's "Reliability" section tabulates them.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import lancet_rt
from lancet_rt import env
from lancet_rt.schedule import policy
from tests import cuda_semantics  # noqa: F401 - the execution modes, in the ranks too
from tests.dist import assert_all_ok, run_ranks
from tests.helpers import assert_close

pytestmark = pytest.mark.timeout(900)  # a hang guard (run_ranks waits up to 600 s): each case ends in seconds

D = 16


class _Net(nn.Module):
    """Linear -> MoE -> Linear on [B, S, D], counting its forwards (one per chunk)."""

    def __init__(self, ep_group=None):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, D)
        self.moe = lancet_rt.MoE(D, 32, 4, 2, ep_group=ep_group)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.out(self.moe(self.inp(x)))


class _Returns:
    def __init__(self, n):
        self.n = n

    def next_chunks(self, args, kwargs):
        return self.n


# ------------------------------------------------------------------------ absurd argument values
@pytest.mark.parametrize("chunks", [10**6, policy.MAX_CHUNKS + 1, 0, -3, 2.0, True, "4"])
def test_absurd_chunks_argument_is_refused(chunks):
    with pytest.raises(ValueError, match="chunks"):
        lancet_rt.Overlapped(_Net(), chunks=chunks)


def test_absurd_chunks_refused_by_from_hf():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from bench.hf_models import build

    with pytest.raises(ValueError, match=f"chunks must be an int in \\[1, {policy.MAX_CHUNKS}\\]"):
        lancet_rt.from_hf(build("mixtral"), chunks=10**6)
    with pytest.raises(ValueError, match="router_dtype"):
        lancet_rt.from_hf(build("mixtral"), router_dtype="bf16")


def test_most_chunks_on_a_small_batch_runs_as_many_chunks_as_rows():
    """chunks=MAX_CHUNKS on 3 rows without expert parallelism: 3 chunks (not 256 empty ones), exact."""
    net = _Net()
    x = torch.randn(3, 5, D)
    ref = net(x)
    net.calls = 0
    out = lancet_rt.Overlapped(net, chunks=policy.MAX_CHUNKS)(x)
    assert net.calls == 3
    assert_close("capped", out, ref)
    net.calls = 0
    assert_close("one row", lancet_rt.Overlapped(net, chunks=7)(x[:1]), ref[:1])
    assert net.calls == 1


@pytest.mark.parametrize("n", [10**6, 0, "3", 2.5])
def test_absurd_count_from_a_policy_is_refused(n):
    ov = lancet_rt.Overlapped(_Net(), chunks=_Returns(n))
    with pytest.raises(ValueError, match="the chunk policy returned chunks="):
        ov(torch.randn(4, 3, D))


# ------------------------------------------------------------------------ environment variables
@pytest.mark.parametrize("value", ["1e300", "inf", "nan", "-1", "0", "soon"])
def test_absurd_timeout_variable_is_refused(monkeypatch, value):
    monkeypatch.setenv(env.TIMEOUT, value)
    with pytest.raises(ValueError, match=env.TIMEOUT):
        env.timeout_s()


def test_largest_timeout_variable_is_accepted(monkeypatch):
    monkeypatch.setenv(env.TIMEOUT, f"{env.MAX_TIMEOUT_S:g}")
    assert env.timeout_s() == env.MAX_TIMEOUT_S


def test_bad_kernels_variable_is_refused(monkeypatch):
    monkeypatch.setenv(env.KERNELS, "gpu")
    with pytest.raises(ValueError, match=env.KERNELS):
        env.kernels_override()


# ------------------------------------------------------------------------ cache files
def _auto_step(monkeypatch, path, x):
    """One forward with chunks="auto" and the cache at ``path``; (output, reference, warnings, policy)."""
    import lancet_rt.autotune  # registers "auto"

    monkeypatch.setenv(env.AUTOTUNE_CACHE, str(path))
    net = _Net()
    ref = net(x)
    ov = lancet_rt.Overlapped(net, chunks="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ov(x)
    return out, ref, [str(w.message) for w in caught], ov._auto


def _key_of(monkeypatch, tmp_path, x):
    *_, auto = _auto_step(monkeypatch, tmp_path / "probe.json", x)
    return auto.last_key


def test_non_utf8_cache_file_warns_in_the_step(monkeypatch, tmp_path):
    path = tmp_path / "cache.json"
    path.write_bytes(b"\xff\xfe\x00{not json at all\x80")
    x = torch.randn(4, 8, D)
    out, ref, caught, auto = _auto_step(monkeypatch, path, x)
    assert_close("non-UTF-8 cache", out, ref)
    assert any("corrupted" in m and str(path) in m for m in caught), caught
    assert auto.last_source != "cache"


@pytest.mark.parametrize("text", ["", "[" * 100_000, "null", '{"schema": "lancet-rt/autotune-cache"}'])
def test_malformed_cache_file_warns(monkeypatch, tmp_path, text):
    path = tmp_path / "cache.json"
    path.write_text(text)
    out, ref, caught, _ = _auto_step(monkeypatch, path, torch.randn(4, 8, D))
    assert_close("malformed cache", out, ref)
    assert any(str(path) in m for m in caught), caught


@pytest.mark.parametrize(
    "value",
    [{"chunks": 10**6}, {"chunks": 4.0}, {"chunks": "4"}, {"chunks": True}, {"chunks": 2, "defer_wgrad": "yes"}, {}],
)
def test_absurd_cache_entry_is_skipped_with_a_warning(monkeypatch, tmp_path, value):
    """An entry for exactly this step's key, written by hand with an absurd value: skipped (not run
    with 10**6 chunks, not a TypeError in the step), with a warning."""
    from lancet_rt.autotune import cache as cache_mod

    x = torch.randn(4, 8, D)
    key = _key_of(monkeypatch, tmp_path, x)
    path = tmp_path / "cache.json"
    path.write_text(
        json.dumps(
            {
                "schema": cache_mod.SCHEMA,
                "version": cache_mod.VERSION,
                "entries": {key.string(): {"key": key.as_dict(), "value": value}},
            }
        )
    )
    out, ref, caught, auto = _auto_step(monkeypatch, path, x)
    assert_close("absurd entry", out, ref)
    assert any("malformed" in m for m in caught), caught
    assert auto.last_source != "cache" and 1 <= auto.last_chunks <= 4


def test_cache_entry_with_absurd_key_numbers_is_skipped(tmp_path):
    """A measured-link lookup meeting a stored bandwidth of -1 (log2 of a negative) or NaN."""
    from lancet_rt.autotune import cache as cache_mod

    good = dict(
        device="cpu|x",
        device_name="cpu",
        ep_world_size=2,
        link_backend="gloo",
        link_gbps=8.0,
        link_latency_us=None,
        dtype="float32",
        d_model=8,
        d_ffn=16,
        num_experts=4,
        top_k=2,
        capacity_factor=None,
        tokens_bucket=64,
        link_measured=True,
    )
    entries = {
        f"bad{i}": {"key": {**good, **over}, "value": {"chunks": 3}}
        for i, over in enumerate(
            [{"link_gbps": -1.0}, {"link_gbps": float("nan")}, {"capacity_factor": 0.0}, {"link_measured": "yes"}]
        )
    }
    entries["list"] = ["not", "an", "entry"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"schema": cache_mod.SCHEMA, "version": 1, "entries": entries}))
    with pytest.warns(RuntimeWarning, match="skipped 5 malformed entries"):
        hit = cache_mod.TuneCache(str(path), defaults_path=None).lookup(cache_mod.CacheKey(**good))
    assert hit is None


def test_max_chunks_is_the_same_in_the_cache_module():
    from lancet_rt.autotune import cache as cache_mod

    assert cache_mod.MAX_CHUNKS == policy.MAX_CHUNKS


# ------------------------------------------------------------------------ small, empty, odd batches
def test_overlapped_empty_batch_and_empty_chunks():
    net = _Net()
    x = torch.randn(0, 4, D)
    assert lancet_rt.Overlapped(net, chunks=4)(x).shape == (0, 4, D)
    link = lancet_rt.EmulatedGroup(world_size=2)
    ep = _Net(ep_group=link)
    y = torch.randn(2, 3, D, requires_grad=True)
    ref = ep(y)
    out = lancet_rt.Overlapped(ep, chunks=5)(y)  # expert-parallel: every chunk runs, 3 of them empty
    assert_close("EP empty chunks", out, ref)


# ------------------------------------------------------------------------ Hugging Face models
def _hf(family="mixtral", **overrides):
    pytest.importorskip("transformers")
    from bench.hf_models import build

    return build(family, **overrides)


def _train_step(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _assert_same_step(name, got, want):
    (out_l, grads_l), (out_r, grads_r) = got, want
    assert_close(f"{name} logits", out_l.logits, out_r.logits)
    assert_close(f"{name} loss", out_l.loss.reshape(1), out_r.loss.reshape(1))
    for n, g in grads_r.items():
        assert grads_l[n] is not None, f"{name}: no gradient for {n}"
        assert_close(f"{name} grad {n}", grads_l[n], g)


@pytest.mark.parametrize("family, rows, chunks", [("mixtral", 1, 4), ("gpt_oss", 3, 4), ("qwen2_moe", 2, 3)])
def test_from_hf_batch_with_fewer_rows_than_chunks(family, rows, chunks):
    """Batch-size-1 training, a last batch smaller than chunks: the step equals transformers'."""
    from bench.hf_models import batch

    hf = _hf(family)
    data = batch(hf.config.vocab_size, rows, 7)
    want = _train_step(hf, *data)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=chunks, defer_wgrad=family == "qwen2_moe")
    _assert_same_step(f"{family} {rows} rows, {chunks} chunks", _train_step(lm, *data), want)


def test_from_hf_two_token_sequences():
    """Sequences of 2 tokens (one label each; of 1, transformers' own loss is NaN), 3 rows."""
    from bench.hf_models import batch

    hf = _hf("deepseek_v3")
    ids, _, labels = batch(hf.config.vocab_size, 3, 2, pad_rows=0)
    mask = torch.ones_like(ids)
    want = _train_step(hf, ids, mask, labels)
    _assert_same_step("S=2", _train_step(lancet_rt.from_hf(copy.deepcopy(hf), chunks=2), ids, mask, labels), want)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_from_hf_expert_parallel_empty_chunks(family, execution):
    """Expert parallelism (an emulated 2-rank link) keeps the agreed chunk count: the empty chunks
    run a stand-in row that is dropped; loss and gradients equal the unchunked run's."""
    from bench.hf_models import batch

    hf = _hf(family)
    data = batch(hf.config.vocab_size, 2, 6)
    link = lancet_rt.EmulatedGroup(world_size=2)
    want = _train_step(lancet_rt.from_hf(copy.deepcopy(hf), link, chunks=1), *data)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), lancet_rt.EmulatedGroup(world_size=2), chunks=5, defer_wgrad=True)
    _assert_same_step(f"{family} EP 2 rows 5 chunks", _train_step(lm, *data), want)


def _ranks_with_few_rows(rank, world):
    """Rank 0 has 1 row, rank 1 has 3, chunks=2: rank 0's second chunk is empty."""
    import torch.distributed as dist

    from bench.hf_models import batch, build

    hf = build("qwen2_moe")
    data = batch(hf.config.vocab_size, 1 + 2 * rank, 6, seed=20 + rank)
    ref = lancet_rt.from_hf(copy.deepcopy(hf), dist.group.WORLD, chunks=1)
    want = _train_step(ref, *data)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), dist.group.WORLD, chunks=2, defer_wgrad=True)
    _assert_same_step(f"rank {rank}", _train_step(lm, *data), want)
    return float(want[0].loss)


def test_from_hf_rank_with_fewer_rows_than_chunks_over_gloo(execution):
    pytest.importorskip("transformers")
    losses = assert_all_ok(run_ranks(_ranks_with_few_rows, 2))
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


# ------------------------------------------------------------------------ eval and generate
def test_eval_forward_returns_the_cache_transformers_returns():
    from bench.hf_models import batch

    hf = _hf("mixtral", use_cache=True).eval()
    ids, mask, _ = batch(hf.config.vocab_size, 3, 7)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=2).eval()
    with torch.no_grad():
        want, got = hf(input_ids=ids, attention_mask=mask), lm(input_ids=ids, attention_mask=mask)
    assert type(got.cache) is type(want.cache) and want.cache is not None
    assert got.cache.get_seq_length() == want.cache.get_seq_length() == 7
    for layer_l, layer_r in zip(got.cache.layers, want.cache.layers):
        assert_close("cached keys", layer_l.keys, layer_r.keys)
    assert_close("eval logits", got.logits, want.logits)
    with torch.no_grad():  # use_cache=False: chunked, and no cache, as transformers
        off = lm(input_ids=ids, attention_mask=mask, use_cache=False)
    assert off.get("cache") is None
    assert_close("eval logits, no cache", off.logits, want.logits)


@pytest.mark.parametrize("use_cache, rows", [(False, 1), (True, 3)])
def test_generate_equals_transformers(use_cache, rows):
    from bench.hf_models import batch

    hf = _hf("qwen3_moe").eval()
    ids, _, _ = batch(hf.config.vocab_size, rows, 5, pad_rows=0)
    options = dict(max_new_tokens=4, do_sample=False, use_cache=use_cache, pad_token_id=0)
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), **options)
    lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=4).eval()
    got = lm.generate(ids, attention_mask=torch.ones_like(ids), **options)
    assert torch.equal(got, want)


def test_trainer_evaluate_with_a_last_batch_smaller_than_chunks(tmp_path):
    """7 rows, batches of 4 (the last has 3), chunks=4: evaluate() equals the unconverted model's."""
    pytest.importorskip("accelerate")
    import transformers as tf

    from bench.hf_models import batch

    hf = _hf("olmoe")
    ids, mask, labels = batch(hf.config.vocab_size, 7, 6)
    rows = [dict(input_ids=i, attention_mask=m, labels=y) for i, m, y in zip(ids, mask, labels)]
    args = tf.TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True, dataloader_num_workers=0
    )
    results = []
    for model in (hf, lancet_rt.from_hf(copy.deepcopy(hf), chunks=4)):
        for use_cache in (False, True):  # chunked eval forwards, and unchunked ones returning a cache
            model.config.use_cache = use_cache
            results.append(tf.Trainer(model=model, args=args, eval_dataset=rows).evaluate()["eval_loss"])
    assert results[0] == pytest.approx(results[2], rel=1e-5) and results[1] == pytest.approx(results[3], rel=1e-5)


# ------------------------------------------------------------------------ router precision
def test_router_dtype_model_is_transformers_router_under_autocast():
    """DeepSeek-V3 under bf16 autocast: router_dtype="model" gives transformers' own router logits
    (bf16-rounded); the default "float32" gives full-precision ones (different)."""
    hf = _hf("deepseek_v3")
    h = torch.randn(10, hf.config.hidden_size)
    gate = hf.model.layers[-1].mlp.gate
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = gate(h)[0].float()
    got = {}
    for router_dtype in ("model", "float32"):
        lm = lancet_rt.from_hf(copy.deepcopy(hf), router_dtype=router_dtype)
        router = lancet_rt.integrations.hf.moe_layers(lm)[-1].router
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got[router_dtype] = router(h)
        assert got[router_dtype].dtype == torch.float32
    assert torch.equal(got["model"], want)
    assert not torch.equal(got["float32"], want)
    assert_close("float32 router", got["float32"], torch.nn.functional.linear(h, gate.weight))
