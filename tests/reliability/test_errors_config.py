"""The kernel-config variables (``LANCET_*_CONFIG``, docs/setup.md): a bad value of any of them is a
ValueError naming the variable, the value and what is allowed, raised by the first kernel launcher
called (the gating forward, whatever the variable pins) before anything is launched; good values,
odd ones included, still pin the configs and give the reference's numbers (Triton interpreter,
``LANCET_KERNELS=triton``)."""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import gating, grouped_gemm

import lancet_rt
from tests.helpers import assert_close

_PERMUTE = ("LANCET_PERMUTE_FWD_CONFIG", "LANCET_UNPERMUTE_FWD_CONFIG", "LANCET_UNPERMUTE_BWD_CONFIG")
_NAMED = ["LANCET_GATING_FWD_CONFIG", "LANCET_GATING_BWD_CONFIG", *_PERMUTE]  # NAME=int items
_GEMM = ["LANCET_GEMM_CONFIG"] + [f"LANCET_GEMM_CONFIG_{op}" for op in ("FWD", "DX", "GATE_UP", "DW")]  # 5 ints
_BAD_NAMED = {  # value -> what the message must say
    "BLOCK_T=abc": "must be an integer",
    "BLOCK_T=0": "not a power of two",
    "BLOCK_T=3": "not a power of two",
    "BLOCK_T=-4": "not a power of two",
    "BLOCK_T=2097152": "not a power of two",
    "garbage": "not NAME=int",
    "BLOCK_X=4": "not NAME=int",
    "BLOCK_T=4,BLOCK_T=8": "given twice",
    "num_warps=4": "missing",
    "BLOCK_T=4,num_warps=3": "num_warps=3 is not one of {1, 2, 4, 8, 16, 32}",
    "BLOCK_T=4,num_warps=64": "num_warps=64",
    "BLOCK_T=4,num_stages=0": "num_stages=0 is not >= 1",
    "BLOCK_T=4,": "not NAME=int",
}
_BAD_GEMM = {
    "1,2,3": "3 values, not 5",
    "128,128,64,8": "4 values",
    "a,b,c,d,e": "must be an integer",
    "128,100,64,8,3": "BLOCK_N=100 is not a power of two",
    "8,16,16,4,2": "BLOCK_M=8 is not a power of two in [16",
    "128,128,64,3,3": "num_warps=3",
    "128,128,64,8,0": "num_stages=0",
    "128,128,64,8,3,1": "6 values",
}


def _cases():
    for var in _NAMED:
        for value, words in _BAD_NAMED.items():
            if var in _PERMUTE and value.startswith("BLOCK_T="):
                value = value.replace("BLOCK_T=", "BLOCK_D=512,BLOCK_T=", 1)  # only the part under test bad
            yield var, value, words
        if var in _PERMUTE:
            yield var, "BLOCK_T=4", "BLOCK_D missing"
            yield var, "BLOCK_T=4,BLOCK_D=48", "BLOCK_D=48 is not a power of two"
    for var in _GEMM:
        for value, words in _BAD_GEMM.items():
            yield var, value, words


@pytest.mark.parametrize("var,value,words", list(_cases()))
def test_a_bad_config_value_is_named_before_any_launch(var, value, words, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(var, value)
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as info:
        gating.gating_fwd(logits, 2)  # the first launcher of a step, whichever kernel ``var`` pins
    msg = str(info.value)
    assert f"{var}={value.strip()!r}" in msg and words in msg, msg
    assert "num_warps in {1, 2, 4, 8, 16, 32}" in msg and "num_stages >= 1" in msg and "expected" in msg, msg


_GOOD = {
    "LANCET_GATING_FWD_CONFIG": "BLOCK_T=1,num_warps=1",
    "LANCET_GATING_BWD_CONFIG": " BLOCK_T = 2 , num_stages=2 ",
    "LANCET_PERMUTE_FWD_CONFIG": "BLOCK_D=64,BLOCK_T=2,num_warps=2",
    "LANCET_UNPERMUTE_FWD_CONFIG": "BLOCK_T=1,BLOCK_D=32",
    "LANCET_UNPERMUTE_BWD_CONFIG": "BLOCK_T=8,BLOCK_D=16,num_warps=4,num_stages=1",
    "LANCET_GEMM_CONFIG": "16,16,16,4,1",
    "LANCET_GEMM_CONFIG_DW": "32,16,16,2,2",
}


def test_every_config_variable_is_listed_once_in_the_kernels_and_in_the_docs():
    from pathlib import Path

    from lancet_rt.kernels._common import CONFIG_VARS

    assert sorted(CONFIG_VARS) == sorted(_NAMED + _GEMM)
    setup = (Path(__file__).parents[2] / "docs" / "setup.md").read_text()
    assert all(var in setup for var in _NAMED + ["LANCET_GEMM_CONFIG"]) and "LANCET_GEMM_CONFIG_<FWD" in setup


def test_good_values_parse_to_what_they_say(monkeypatch):
    from lancet_rt.kernels._common import parse_config

    for var, value in _GOOD.items():
        monkeypatch.setenv(var, value)
    assert parse_config("LANCET_GATING_FWD_CONFIG") == ({"BLOCK_T": 1}, 1, None)
    assert parse_config("LANCET_GATING_BWD_CONFIG") == ({"BLOCK_T": 2}, None, 2)
    assert parse_config("LANCET_PERMUTE_FWD_CONFIG") == ({"BLOCK_T": 2, "BLOCK_D": 64}, 2, None)
    assert parse_config("LANCET_GEMM_CONFIG_DW") == ({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16}, 2, 2)
    assert parse_config("LANCET_GEMM_CONFIG_FWD") is None


def test_good_values_still_launch_and_match_the_reference(monkeypatch):
    """One small MoE layer, forward and backward, on every kernel with every variable pinned."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def run(kernels):
        monkeypatch.setenv("LANCET_KERNELS", kernels)
        torch.manual_seed(0)
        layer = lancet_rt.MoE(16, 8, 4, 2)
        x = torch.randn(5, 16, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn_like(y))
        return [y, x.grad] + [p.grad for p in layer.parameters()]

    ref = run("torch")
    for var, value in _GOOD.items():
        monkeypatch.setenv(var, value)
    got = run("triton")
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(f"output/gradient {i}", a, b)
    assert grouped_gemm.selected_config("dw") == "32,16,16,2,2"  # the Triton kernels ran, pinned
    assert grouped_gemm.selected_config("fwd") == "16,16,16,4,1"


@pytest.mark.parametrize(
    "value,on",
    [
        ("1", True),
        ("true", True),
        ("ON", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("", False),
        ("no", False),
    ],
)
def test_triton_interpret_is_read_as_triton_reads_it(value, on, monkeypatch):
    from triton._C.libtriton import getenv_bool

    from lancet_rt import env

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert env.triton_interpret() is on and getenv_bool("TRITON_INTERPRET", False) is on


@pytest.mark.parametrize("value", ["2", "enabled", " 1"])
def test_a_triton_interpret_value_triton_would_ignore_is_named(value, monkeypatch):
    from lancet_rt import env

    monkeypatch.setenv("TRITON_INTERPRET", value)
    with pytest.raises(ValueError, match=f"TRITON_INTERPRET must be one of 1, true, on, yes .* got {value!r}"):
        env.triton_interpret()
