"""Permutation kernels (lancet_rt.kernels.permute: dispatch_rows, permute, unpermute) against their
references (lancet_rt.kernels.reference), outputs and gradients.

CPU lane: the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on small odd shapes
(T in {0, 1, 63, 257}, D in {60, 100}), dropless and dropping row maps from the reference gating,
every token on one expert, all assignments dropped, split D tiles pinned through the config
environment variables, strided inputs, permute_fwd without src_S (and unpermute_bwd given None for
it); every output buffer is poisoned before the launch (NaN for floats, a value no kernel writes
for integers), so an unwritten element fails; integer outputs must match exactly. GPU lane
(``-m gpu``): T = 16384, D = 4096, bf16 rows.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import gating as gating_mod
from lancet_rt.kernels import permute as permute_mod
from lancet_rt.kernels._common import run_autotuned
from lancet_rt.kernels.gating import gating_fwd
from lancet_rt.kernels.permute import dispatch_rows, permute_bwd, permute_fwd, unpermute_bwd, unpermute_fwd
from lancet_rt.kernels.reference import (
    GatingOutput,
    dispatch_rows_ref,
    gating_fwd_ref,
    permute_bwd_ref,
    permute_fwd_ref,
    unpermute_bwd_ref,
    unpermute_fwd_ref,
)

from tests.helpers import assert_close
from tests.routing_inputs import (
    DEVICE,
    GPU_D,
    GPU_EK,
    GPU_T,
    D,
    _capacity,
    _kept_E,
    _logits,
    _poison,
    _routing,
)


# ----------------------------------------------------------------------------------------------
# dispatch_rows
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape", [(63, 7, 2, 0.5), (257, 64, 8, 1.0), (5, 256, 256, None)], ids=lambda s: "T{}-E{}-K{}-cf{}".format(*s)
)
def test_dispatch_rows(gen, shape):
    T, E, K, factor = shape
    capacity = _capacity(T, E, K, factor)
    used = torch.randint(0, 1 + (capacity or 4) // 3, (E,), generator=gen, dtype=torch.int32).to(DEVICE)
    g = gating_fwd_ref(_logits(gen, T, E), K, used, capacity=capacity)
    kept = _kept_E(g.expert_TK, g.slot_TK, E)
    row = dispatch_rows(g.expert_TK, g.slot_TK, used, kept, out=_poison(g.slot_TK))
    assert torch.equal(row, dispatch_rows_ref(g.expert_TK, g.slot_TK, used, kept))
    # Invariants: kept rows are a bijection onto range(S), grouped by expert in ascending order.
    S = int(kept.sum())
    flat = row[row >= 0]
    assert torch.equal(flat.sort().values, torch.arange(S, dtype=torch.int32, device=DEVICE))
    experts_in_row_order = torch.empty(S, dtype=torch.int32, device=DEVICE)
    experts_in_row_order[flat.long()] = g.expert_TK[row >= 0]
    assert bool((experts_in_row_order[1:] >= experts_in_row_order[:-1]).all())


# ----------------------------------------------------------------------------------------------
# Permute / unpermute: outputs and gradients against the reference
# ----------------------------------------------------------------------------------------------
# (T, E, K, capacity_factor, dtype)
PERMUTE_CASES = [
    (1, 2, 1, None, torch.float32),
    (63, 8, 2, None, torch.bfloat16),
    (63, 7, 7, 0.5, torch.float32),
    (63, 64, 1, None, torch.float16),
    (257, 8, 2, 0.6, torch.bfloat16),
    (257, 64, 8, 1.0, torch.float32),
    (257, 256, 2, None, torch.bfloat16),
    (5, 64, 64, 0.5, torch.float32),
]


def _check_permute_family(gen, row_TK, S, weight_TK, dtype, D):
    """permute_fwd, permute_bwd, unpermute_fwd and unpermute_bwd against the reference on [T, D] rows."""
    T = row_TK.shape[0]
    x = torch.randn(T, D, generator=gen).to(DEVICE, dtype)

    x_SD, src_S = permute_fwd(x, row_TK, S, out=(_poison(x.new_empty(S, D)), _poison(row_TK.new_empty(S))))
    x_SD_ref, src_S_ref = permute_fwd_ref(x, row_TK, S)
    assert torch.equal(src_S, src_S_ref), "permute_fwd.src_S"
    assert torch.equal(x_SD, x_SD_ref), "permute_fwd.x_SD (a copy: must be exact)"
    # without src_S: the same rows, no src made (the kernels' unpermute_bwd takes None for it)
    x_SD2, none = permute_fwd(x, row_TK, S, out=(_poison(x.new_empty(S, D)), None), with_src=False)
    assert none is None and torch.equal(x_SD2, x_SD_ref), "permute_fwd(with_src=False)"
    x_SD3, none = permute_fwd(x, row_TK, S, with_src=False)
    assert none is None and torch.equal(x_SD3, x_SD_ref)

    grad_x_SD = torch.randn(S, D, generator=gen).to(DEVICE, dtype)
    assert_close("permute_bwd", permute_bwd(grad_x_SD, row_TK, out=_poison(x)), permute_bwd_ref(grad_x_SD, row_TK))

    y_SD = torch.randn(S, D, generator=gen).to(DEVICE, dtype)
    assert_close(
        "unpermute_fwd",
        unpermute_fwd(y_SD, row_TK, weight_TK, out=_poison(x)),
        unpermute_fwd_ref(y_SD, row_TK, weight_TK),
    )

    grad_y = torch.randn(T, D, generator=gen).to(DEVICE, dtype)
    out = (_poison(y_SD), _poison(weight_TK))
    grad_y_SD, grad_w = unpermute_bwd(grad_y, y_SD, row_TK, weight_TK, src_S, out=out)
    grad_y_SD_ref, grad_w_ref = unpermute_bwd_ref(grad_y, y_SD, row_TK, weight_TK, src_S_ref)
    assert_close("unpermute_bwd.grad_y_SD", grad_y_SD, grad_y_SD_ref)
    # grad_w is float32 on both sides: products of 16-bit inputs are exact in float32, so only the
    # summation order differs.
    assert_close("unpermute_bwd.grad_weight_TK", grad_w, grad_w_ref, torch.float32)
    assert bool((grad_w[row_TK < 0] == 0).all()), "dropped assignments must get zero weight gradient"
    out = (_poison(y_SD), _poison(weight_TK))
    grad_y_SD2, grad_w2 = unpermute_bwd(grad_y, y_SD, row_TK, weight_TK, None, out=out)
    assert torch.equal(grad_y_SD2, grad_y_SD) and torch.equal(grad_w2, grad_w), "unpermute_bwd(src_S=None)"


@pytest.mark.parametrize("case", PERMUTE_CASES, ids=lambda c: "T{}-E{}-K{}-cf{}-{}".format(*c[:4], str(c[4])[6:]))
def test_permute_unpermute_match_reference(gen, case):
    T, E, K, factor, dtype = case
    row_TK, S, weight_TK = _routing(gen, T, E, K, factor)
    _check_permute_family(gen, row_TK, S, weight_TK, dtype, D)


@pytest.mark.parametrize("case", ["all-to-one", "T1"])
def test_permute_unpermute_edge_routing(gen, case):
    """Every token on one expert past its capacity (the other experts get nothing), and a single
    token with some of its K assignments dropped (their experts filled by earlier chunks)."""
    if case == "all-to-one":
        T, E, K, capacity, dtype = 257, 8, 1, 40, torch.bfloat16
        logits = _logits(gen, T, E)
        logits[:, 3] += 50.0
        used = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    else:
        T, E, K, capacity, dtype = 1, 8, 4, 2, torch.float32
        logits = _logits(gen, T, E)
        chosen = gating_fwd_ref(logits, K).expert_TK[0].long()
        used = torch.zeros(E, dtype=torch.int32, device=DEVICE)
        used[chosen[[0, 2]]] = capacity  # the 1st and 3rd choices are full
    row_TK, S, weight_TK = _routing(gen, T, E, K, None, logits=logits, capacity=capacity, used=used)
    if case == "all-to-one":
        assert S == capacity and bool((row_TK[capacity:] == -1).all())
    else:
        assert torch.equal(row_TK[0] >= 0, torch.tensor([False, True, False, True], device=DEVICE))
    _check_permute_family(gen, row_TK, S, weight_TK, dtype, D)


@pytest.mark.parametrize(
    "case",
    [(63, 8, 2, 0.6, torch.float32, 60), (37, 7, 3, None, torch.bfloat16, 100)],
    ids=lambda c: "T{}-E{}-K{}-cf{}-{}-D{}".format(*c[:4], str(c[4])[6:], c[5]),
)
def test_permute_unpermute_split_d(gen, monkeypatch, case):
    """D split across programs (permute_fwd; unpermute_fwd and permute_bwd: pid_d > 0, src_S
    written by the first D tile only) and walked in a loop (unpermute_bwd): 32-wide tiles pinned,
    so D = 60 takes 2 tiles and D = 100 takes 4, the last one partial; 4-token tiles, T odd."""
    T, E, K, factor, dtype, d = case
    envs = (
        permute_mod._ENV_PERMUTE_FWD_CONFIG,
        permute_mod._ENV_UNPERMUTE_FWD_CONFIG,
        permute_mod._ENV_UNPERMUTE_BWD_CONFIG,
    )
    for env in envs:
        monkeypatch.setenv(env, "BLOCK_T=4,BLOCK_D=32,num_warps=4")
    launched = []

    def spy(tuner, grid, args, meta, env_var):
        # The pin is read from the environment at every launch (nothing cached); record what ran.
        (config,) = tuner.early_config_prune(tuner.configs, dict(zip(tuner.arg_names, args)), **meta)
        launched.append((env_var, config.kwargs["BLOCK_T"], config.kwargs["BLOCK_D"]))
        run_autotuned(tuner, grid, args, meta, env_var)

    monkeypatch.setattr(permute_mod, "run_autotuned", spy)
    row_TK, S, weight_TK = _routing(gen, T, E, K, factor)
    _check_permute_family(gen, row_TK, S, weight_TK, dtype, d)
    assert {env for env, _, _ in launched} == set(envs)
    assert all((bt, bd) == (4, 32) for _, bt, bd in launched), launched


def test_permute_strided_and_autograd_consistency(gen):
    """Non-contiguous inputs, and the backward kernels are the adjoints of the forward ones."""
    T, E, K = 63, 8, 2
    row_TK, S, weight_TK = _routing(gen, T, E, K, 0.75)
    x_big = torch.randn(T, 2 * D, generator=gen).to(DEVICE)
    x = x_big[:, ::2]  # stride (2D, 2)
    x_SD, src_S = permute_fwd(x, row_TK, S, out=(_poison(x.new_empty(S, D)), _poison(row_TK.new_empty(S))))
    x_SD_ref, src_S_ref = permute_fwd_ref(x.contiguous(), row_TK, S)
    assert torch.equal(x_SD, x_SD_ref) and torch.equal(src_S, src_S_ref)
    # The backward kernels are the adjoints of the forward ones:
    # <permute(x), g> == <x, permute_bwd(g)> and <unpermute(y), h> == <y, grad_y_SD(h)>.
    g = torch.randn(S, D, generator=gen).to(DEVICE)
    lhs = (x_SD.double() * g.double()).sum()
    rhs = (x.double() * permute_bwd(g, row_TK, out=_poison(x.contiguous())).double()).sum()
    assert torch.allclose(lhs, rhs, rtol=1e-5)
    y = torch.randn(D, S, generator=gen).to(DEVICE).t()  # column-major [S, D]
    h = torch.randn(T, D, generator=gen).to(DEVICE)
    grad_y_SD, grad_w = unpermute_bwd(h, y, row_TK, weight_TK, src_S, out=(_poison(y.contiguous()), _poison(weight_TK)))
    lhs = (unpermute_fwd(y, row_TK, weight_TK, out=_poison(h)).double() * h.double()).sum()
    assert torch.allclose(lhs, (y.double() * grad_y_SD.double()).sum(), rtol=1e-5)
    assert_close("grad_w[strided]", grad_w, unpermute_bwd_ref(h, y, row_TK, weight_TK, src_S)[1])


def test_dispatch_combine_restores_input(gen):
    """Dropless top-2 with weights 1/2 each: combine(dispatch(x)) == x exactly."""
    T, E, K = 257, 8, 2
    g = gating_fwd(_logits(gen, T, E), K)
    zeros = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    row_TK = dispatch_rows(g.expert_TK, g.slot_TK, zeros, g.counts_E)
    x = torch.randn(T, D, generator=gen).to(DEVICE)
    x_SD, _ = permute_fwd(x, row_TK, T * K)
    half = torch.full((T, K), 0.5, device=DEVICE)
    assert torch.equal(unpermute_fwd(x_SD, row_TK, half), x)
    assert torch.equal(permute_bwd(x_SD, row_TK), 2 * x)


def test_permute_zero_tokens_and_all_dropped(gen):
    x = torch.randn(0, D, generator=gen).to(DEVICE)
    row0 = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    x_SD, src = permute_fwd(x, row0, 0)
    assert x_SD.shape == (0, D) and src.shape == (0,)
    assert permute_bwd(x_SD, row0).shape == (0, D)
    assert unpermute_fwd(x_SD, row0, torch.empty(0, 2, device=DEVICE)).shape == (0, D)
    gy_SD, gw = unpermute_bwd(x, x_SD, row0, torch.empty(0, 2, device=DEVICE), src)
    assert gy_SD.shape == (0, D) and gw.shape == (0, 2)
    # Tokens present, every assignment dropped (S = 0): zeros, not garbage.
    T = 9
    row = torch.full((T, 2), -1, dtype=torch.int32, device=DEVICE)
    w = torch.rand(T, 2, generator=gen).to(DEVICE)
    empty = torch.empty(0, D, device=DEVICE)
    zeros = torch.zeros(T, D, device=DEVICE)
    assert torch.equal(permute_bwd(empty, row, out=_poison(zeros)), zeros)
    assert torch.equal(unpermute_fwd(empty, row, w, out=_poison(zeros)), zeros)
    gy_SD, gw = unpermute_bwd(
        torch.randn(T, D, generator=gen).to(DEVICE), empty, row, w, src, out=(empty.clone(), _poison(w))
    )
    assert torch.equal(gw, torch.zeros(T, 2, device=DEVICE))
    x_SD, none = permute_fwd(torch.randn(T, D, generator=gen).to(DEVICE), row, 0, with_src=False)
    assert x_SD.shape == (0, D) and none is None


def test_permute_fwd_with_src_bad_input(gen):
    T, E, K = 9, 4, 2
    row_TK, S, _ = _routing(gen, T, E, K, None)
    x = torch.randn(T, D, generator=gen).to(DEVICE)
    with pytest.raises(TypeError, match="with_src"):
        permute_fwd(x, row_TK, S, with_src=0)
    with pytest.raises(ValueError, match="src_S"):
        permute_fwd(x, row_TK, S, out=(x.new_empty(S, D), row_TK.new_empty(S)), with_src=False)
    with pytest.raises(TypeError, match="src_S"):
        permute_fwd(x, row_TK, S, out=(x.new_empty(S, D), None))  # with_src: the buffer is needed


def test_kernels_are_deterministic(gen, monkeypatch):
    monkeypatch.setattr(gating_mod, "_SINGLE_PROGRAM_MAX_T", 0)
    T, E, K = 257, 64, 8
    logits = _logits(gen, T, E)
    a, b = gating_fwd(logits, K, capacity=40), gating_fwd(logits, K, capacity=40)
    for field, x, y in zip(GatingOutput._fields, a, b):
        assert torch.equal(x, y), field
    zeros = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    row_TK = dispatch_rows(a.expert_TK, a.slot_TK, zeros, _kept_E(a.expert_TK, a.slot_TK, E))
    S = int((row_TK >= 0).sum())
    y = torch.randn(S, D, generator=gen).to(DEVICE, torch.bfloat16)
    assert torch.equal(unpermute_fwd(y, row_TK, a.weight_TK), unpermute_fwd(y, row_TK, a.weight_TK))


@pytest.mark.gpu
@pytest.mark.parametrize("EK", GPU_EK, ids=lambda ek: "E{}-K{}".format(*ek))
def test_gpu_permute_unpermute(gen, EK):
    E, K = EK
    dtype = torch.bfloat16
    row_TK, S, weight_TK = _routing(gen, GPU_T, E, K, 1.25)
    x = torch.randn(GPU_T, GPU_D, generator=gen).to(DEVICE, dtype)
    x_SD, src_S = permute_fwd(x, row_TK, S, out=(_poison(x.new_empty(S, GPU_D)), _poison(row_TK.new_empty(S))))
    x_SD_ref, src_S_ref = permute_fwd_ref(x, row_TK, S)
    assert torch.equal(src_S, src_S_ref) and torch.equal(x_SD, x_SD_ref)
    g_SD = torch.randn(S, GPU_D, generator=gen).to(DEVICE, dtype)
    assert_close("gpu permute_bwd", permute_bwd(g_SD, row_TK, out=_poison(x)), permute_bwd_ref(g_SD, row_TK))
    assert_close(
        "gpu unpermute_fwd",
        unpermute_fwd(g_SD, row_TK, weight_TK, out=_poison(x)),
        unpermute_fwd_ref(g_SD, row_TK, weight_TK),
    )
    grad_y = torch.randn(GPU_T, GPU_D, generator=gen).to(DEVICE, dtype)
    got = unpermute_bwd(grad_y, g_SD, row_TK, weight_TK, src_S, out=(_poison(g_SD), _poison(weight_TK)))
    want = unpermute_bwd_ref(grad_y, g_SD, row_TK, weight_TK, src_S_ref)
    assert_close("gpu unpermute_bwd.grad_y_SD", got[0], want[0])
    assert_close("gpu unpermute_bwd.grad_weight_TK", got[1], want[1], dtype)
