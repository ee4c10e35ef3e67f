"""Routing traces: recorded under lancet_rt.tracing(), saved, loaded, replayed through router biases."""

import json

import pytest
import torch

import lancet_rt
from lancet_rt.routing.traces import RoutingTrace, bias_routers, parse_routing, zipf_exponent, zipf_shares


def _model(E=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[lancet_rt.MoE(16, d_ffn=32, num_experts=E, top_k=2) for _ in range(2)])


def test_recorded_trace_round_trips(tmp_path):
    model = _model()
    x = torch.randn(3, 10, 16)
    with lancet_rt.tracing() as tr:
        for _ in range(3):
            model(x).sum().backward()
    rt = RoutingTrace.from_trace(tr, meta={"model": "test"})
    assert (rt.steps, rt.layers, rt.experts) == (3, 2, 8)
    for s in range(3):  # each step's loads are the layer's own counts: 30 tokens x top-2
        for l in range(len(model)):
            assert sum(rt.loads[s][l]) == 60
    assert rt.loads[2][1] == model[1].tokens_per_expert.tolist()
    path = tmp_path / "routing.json"
    rt.save(str(path))
    back = RoutingTrace.load(str(path))
    assert back.loads == rt.loads and back.meta == {"model": "test"}
    assert json.loads(path.read_text())["max_over_mean"] == pytest.approx(rt.max_over_mean())
    src = parse_routing(f"trace:{path}")
    assert src.shares(1, 8) == pytest.approx(rt.shares(1))
    with pytest.raises(ValueError, match="experts"):
        src.shares(0, 16)


def test_zipf_preset_and_parse():
    for E in (8, 64, 256):
        s = zipf_exponent(E)
        assert max(zipf_shares(E, s)) * E == pytest.approx(3.0, rel=1e-6)
    assert sum(zipf_shares(8, 1.0, seed=3)) == pytest.approx(1.0)
    assert parse_routing("zipf:1.5").exponent == 1.5
    assert parse_routing("zipf").exponent is None
    assert parse_routing("balanced").shares(0, 4) == [0.25] * 4
    for bad in ("zipf:x", "zipf:-1", "uniform", "trace:"):
        with pytest.raises(ValueError, match="routing"):
            parse_routing(bad)
    with pytest.raises(ValueError, match="loads"):
        RoutingTrace([[[1, 2]], [[1]]])


def test_bias_routers_skews_and_removes():
    model = _model()
    x = torch.randn(4, 32, 16)
    model(x)
    base = max(model[0].tokens_per_expert.tolist()) * 8 / 256
    with bias_routers(list(model), parse_routing("zipf:2")):
        model(x)
        skewed = max(model[0].tokens_per_expert.tolist()) * 8 / 256
    model(x)
    after = max(model[0].tokens_per_expert.tolist()) * 8 / 256
    assert skewed > base + 0.5
    assert after == pytest.approx(base)


@pytest.mark.parametrize(
    "text, field",
    [
        ('{"format": "lancet-rt routing trace v1", "loads": [[[1, 2]]', "line 1"),  # torn JSON
        ('{"format": "lancet-rt routing trace v1", "loads": [[[1, NaN]]]}', r"loads\[0\]\[0\]\[1\]"),
        ('{"format": "lancet-rt routing trace v1", "loads": [[[Infinity, 1]]]}', r"loads\[0\]\[0\]\[0\]"),
        (
            '{"format": "lancet-rt routing trace v1", "loads": [[[1, 2]], [[3, 2.5]]]}',
            r"loads\[1\]\[0\]\[1\] \(step 1, layer 0, expert 1\)",
        ),
        ('{"format": "lancet-rt routing trace v1", "loads": [[[1, -4]]]}', r"loads\[0\]\[0\]\[1\]"),
        ('{"format": "lancet-rt routing trace v1", "loads": [[[1, "7"]]]}', r"loads\[0\]\[0\]\[1\]"),
        ('{"format": "lancet-rt routing trace v1", "loads": [[[1, true]]]}', r"loads\[0\]\[0\]\[1\]"),
        ('{"format": "lancet-rt routing trace v1", "loads": [[[1, null]]]}', r"loads\[0\]\[0\]\[1\]"),
        ('{"format": "lancet-rt routing trace v1", "loads": [[3, 4]]}', r"loads\[0\]\[0\] \(step 0, layer 0\)"),
        ('{"format": "lancet-rt routing trace v1", "loads": [7]}', r"loads\[0\] \(step 0\)"),
        ('{"format": "lancet-rt routing trace v1", "loads": {"a": 1}}', "loads must be a non-empty list"),
        ('{"format": "lancet-rt routing trace v1"}', "'loads' is missing"),
        ('{"format": "lancet-rt routing trace v1", "loads": [[[1, 2]]], "meta": [1]}', "'meta'"),
        ('{"format": "lancet-rt routing trace v1", "loads": [[[1, 2]]], "steps": 3}', "'steps'"),
        ('{"format": "lancet-rt routing trace v1", "loads": [[[1, 2]]], "experts": 2.5}', "'experts'"),
        ('{"format": "something else", "loads": [[[1, 2]]]}', "'format'"),
    ],
)
def test_a_damaged_trace_names_the_file_and_the_field(tmp_path, text, field):
    path = tmp_path / "damaged.json"
    path.write_text(text)
    for load in (lambda: RoutingTrace.load(str(path)), lambda: parse_routing(f"trace:{path}")):
        with pytest.raises(ValueError, match=field) as info:
            load()
        assert str(path) in str(info.value)


def test_a_trace_that_is_not_text_names_the_file(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b'{"loads": "\xff\xfe"}')
    with pytest.raises(ValueError, match="UTF-8") as info:
        RoutingTrace.load(str(path))
    assert str(path) in str(info.value)


def test_loads_are_whole_numbers_never_truncated():
    assert RoutingTrace([[[1, 2.0]]]).loads == [[[1, 2]]]  # a float that is an int is that int
    for bad in (0.5, 2.9999, -1, float("nan"), float("inf"), "3", None, True):
        with pytest.raises(ValueError, match=r"loads\[0\]\[0\]\[1\] \(step 0, layer 0, expert 1\)"):
            RoutingTrace([[[1, bad]]])
