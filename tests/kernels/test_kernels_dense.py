"""Dense kernels (lancet_rt.kernels.norm, lancet_rt.kernels.linear_ce) against their references
(lancet_rt.kernels.reference_dense).

CPU lane: under TRITON_INTERPRET=1 (tests/conftest.py), odd shapes (R in {1, 63, 70}, D in {60, 100},
V in {1, 97, 130}), float32 / bfloat16 / float16 rows, with and without the residual and the incoming
gradient of the sum, with the stored rstd and without it (recomputed by the backward: bitwise the same);
output buffers NaN-filled before the launch; the cross-entropy with ignored
rows, a chunk whose rows are all ignored, and labels at both ends of the vocabulary. The references are
computed in float64 from the same (rounded) inputs. GPU lane (``-m gpu``): the same at real sizes.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels.linear_ce import ce_grad_fwd
from lancet_rt.kernels.norm import add_rmsnorm_bwd, add_rmsnorm_fwd
from lancet_rt.kernels.reference_dense import add_rmsnorm_bwd_ref, add_rmsnorm_fwd_ref, ce_grad_fwd_ref

from tests.helpers import assert_close, nan_like

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _norm_case(gen, R, D, dtype, residual, grad_s):
    x = _rand(gen, R, D, dtype=dtype)
    r = _rand(gen, R, D, dtype=dtype) if residual else None
    w = _rand(gen, D, dtype=dtype) + 1.0
    dy = _rand(gen, R, D, dtype=dtype)
    dsn = _rand(gen, R, D, dtype=dtype) if grad_s else None
    y_buf, s_buf = nan_like(x), nan_like(x)
    y, s, rstd = add_rmsnorm_fwd(x, r, w, 1e-5, out=y_buf, out_sum=s_buf if residual else None)
    assert y is y_buf
    # float64 reference from the kernel's own (rounded) sum; the sum itself against the dtype's add
    s_ref = x if r is None else x + r
    assert_close("s", s, s_ref, rel_rms=0.0 if dtype == torch.float32 else None)
    y_ref, _, rstd_ref = add_rmsnorm_fwd_ref(s.double(), None, w.double(), 1e-5)
    assert_close("y", y, y_ref)
    assert_close("rstd", rstd, rstd_ref)
    ds, dw = add_rmsnorm_bwd(dy, dsn, s, rstd, w)
    ds_ref, dw_ref = add_rmsnorm_bwd_ref(
        dy.double(), None if dsn is None else dsn.double(), s.double(), rstd_ref, w.double()
    )
    assert_close("grad x", ds, ds_ref)
    assert_close("grad weight", dw, dw_ref)
    # without the stored rstd (the backward recomputes it from s): bitwise the same outputs and gradients
    y_buf, s_buf = nan_like(x), nan_like(x)
    y2, s2, none = add_rmsnorm_fwd(x, r, w, 1e-5, out=y_buf, out_sum=s_buf if residual else None, with_rstd=False)
    assert none is None and y2 is y_buf and torch.equal(y2, y) and torch.equal(s2, s)
    ds2, dw2 = add_rmsnorm_bwd(dy, dsn, s2, None, w, eps=1e-5)
    assert torch.equal(ds2, ds) and torch.equal(dw2, dw)
    # against autograd of the plain formula: the reference's gradient is the formula's
    xa = x.double().requires_grad_(True)
    ra = r.double().requires_grad_(True) if residual else None
    wa = w.double().requires_grad_(True)
    sa = xa if ra is None else xa + ra
    ya = sa * torch.rsqrt(sa.pow(2).mean(-1, keepdim=True) + 1e-5) * wa
    outs, grads = [ya], [dy.double()]
    if dsn is not None and ra is not None:
        outs.append(sa)
        grads.append(dsn.double())
    torch.autograd.backward(outs, grads)
    if residual:
        assert_close("grad residual (autograd)", ds, ra.grad)
    assert_close("grad weight (autograd)", dw, wa.grad)


@pytest.mark.parametrize("R,D", [(1, 60), (63, 100), (70, 60)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "residual,grad_s", [(True, True), (True, False), (False, False)], ids=["res+ds", "res", "plain"]
)
def test_add_rmsnorm(gen, R, D, dtype, residual, grad_s):
    _norm_case(gen, R, D, dtype, residual, grad_s)


@pytest.mark.parametrize("lead", [(3, 7), (2, 1, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "residual,grad_s", [(True, True), (True, False), (False, False)], ids=["res+ds", "res", "plain"]
)
def test_add_rmsnorm_leading_dims(gen, lead, dtype, residual, grad_s):
    """Contiguous [..., D] rows as they are (no reshape by the caller): bitwise the [R, D] call's
    outputs and gradients, in the caller's shape (rstd over the flattened rows); NaN-filled buffers."""
    D = 60
    x = _rand(gen, *lead, D, dtype=dtype)
    r = _rand(gen, *lead, D, dtype=dtype) if residual else None
    w = _rand(gen, D, dtype=dtype) + 1.0
    dy = _rand(gen, *lead, D, dtype=dtype)
    dsn = _rand(gen, *lead, D, dtype=dtype) if grad_s else None
    y_buf, s_buf = nan_like(x), nan_like(x)
    y, s, rstd = add_rmsnorm_fwd(x, r, w, 1e-5, out=y_buf, out_sum=s_buf if residual else None)
    assert y is y_buf and y.shape == x.shape and s.shape == x.shape and rstd.shape == (x.numel() // D,)
    flat = lambda t: None if t is None else t.reshape(-1, D)
    y2, s2, rstd2 = add_rmsnorm_fwd(flat(x), flat(r), w, 1e-5)
    assert torch.equal(y.reshape(-1, D), y2) and torch.equal(s.reshape(-1, D), s2) and torch.equal(rstd, rstd2)
    ds, dw = add_rmsnorm_bwd(dy, dsn, s, rstd, w)
    ds2, dw2 = add_rmsnorm_bwd(flat(dy), flat(dsn), s2, rstd2, w)
    assert ds.shape == x.shape and torch.equal(ds.reshape(-1, D), ds2) and torch.equal(dw, dw2)
    y_ref, _, _ = add_rmsnorm_fwd_ref(s.double(), None, w.double(), 1e-5)
    assert_close("y", y, y_ref)
    with pytest.raises(ValueError, match="contiguous"):
        add_rmsnorm_fwd(_rand(gen, 4, 3, D, dtype=dtype).transpose(0, 1), None, w)


def test_add_rmsnorm_no_rows_and_bad_input(gen):
    x = _rand(gen, 0, 60)
    y, s, rstd = add_rmsnorm_fwd(x, None, torch.ones(60, device=DEVICE))
    assert y.shape == (0, 60) and rstd.shape == (0,)
    with pytest.raises(ValueError, match="residual_RD"):
        add_rmsnorm_fwd(_rand(gen, 3, 60), _rand(gen, 3, 61), torch.ones(60, device=DEVICE))
    with pytest.raises(TypeError, match="x_RD"):
        add_rmsnorm_fwd(_rand(gen, 3, 60).long(), None, torch.ones(60, device=DEVICE))
    with pytest.raises(ValueError, match="weight_D"):
        add_rmsnorm_fwd(_rand(gen, 3, 60), None, torch.ones(59, device=DEVICE))
    # without the stored rstd
    y, s, rstd = add_rmsnorm_fwd(x, None, torch.ones(60, device=DEVICE), with_rstd=False)
    assert y.shape == (0, 60) and rstd is None
    ds, dw = add_rmsnorm_bwd(x, None, x, None, torch.ones(60, device=DEVICE), eps=1e-6)
    assert ds.shape == (0, 60) and torch.equal(dw, torch.zeros(60, device=DEVICE))
    x3, w3 = _rand(gen, 3, 60), torch.ones(60, device=DEVICE)
    with pytest.raises(TypeError, match="with_rstd"):
        add_rmsnorm_fwd(x3, None, w3, with_rstd=None)
    _, s3, rstd3 = add_rmsnorm_fwd(x3, None, w3)
    with pytest.raises(TypeError, match="eps"):
        add_rmsnorm_bwd(x3, None, s3, None, w3)
    with pytest.raises(ValueError, match="eps"):
        add_rmsnorm_bwd(x3, None, s3, rstd3, w3, eps=1e-6)


@pytest.mark.parametrize("shape", [(1, 60), (63, 100), (70, 60), (2, 35, 60)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_s", [True, False], ids=["ds", "no-ds"])
def test_add_rmsnorm_bwd_into_given_buffers(gen, shape, dtype, grad_s):
    """``out=`` (ds) and ``partials=`` (the dweight partials' memory, asked for by shape): NaN-filled
    before the launch, bitwise the outputs of the call that allocates them, against the reference; one
    partials buffer used by two calls in turn; a callable giving None: allocated as without one."""
    D = shape[-1]
    x, r, w = _rand(gen, *shape, dtype=dtype), _rand(gen, *shape, dtype=dtype), _rand(gen, D, dtype=dtype) + 1.0
    _, s, _ = add_rmsnorm_fwd(x, r, w, 1e-5, with_rstd=False)
    asked, lent = [], {}

    def partials(pshape):
        asked.append(pshape)
        if "buf" not in lent:
            lent["buf"] = torch.full(pshape, float("nan"), device=DEVICE)
        return lent["buf"]

    for _ in range(2):  # two calls in turn on one partials buffer, each with its own gradients
        dy = _rand(gen, *shape, dtype=dtype)
        dsn = _rand(gen, *shape, dtype=dtype) if grad_s else None
        ds_fresh, dw_fresh = add_rmsnorm_bwd(dy, dsn, s, None, w, eps=1e-5)
        out = nan_like(s)
        ds, dw = add_rmsnorm_bwd(dy, dsn, s, None, w, eps=1e-5, out=out, partials=partials)
        assert ds is out and torch.equal(ds, ds_fresh) and torch.equal(dw, dw_fresh) and dw.dtype == w.dtype
        _, _, rstd_ref = add_rmsnorm_fwd_ref(s.double(), None, w.double(), 1e-5)
        ds_ref, dw_ref = add_rmsnorm_bwd_ref(
            dy.double(), None if dsn is None else dsn.double(), s.double(), rstd_ref, w.double()
        )
        assert_close("grad x (into out)", ds, ds_ref)
        assert_close("grad weight (into partials)", dw, dw_ref)
        ds2, dw2 = add_rmsnorm_bwd(dy, dsn, s, None, w, eps=1e-5, partials=lambda pshape: None)
        assert torch.equal(ds2, ds_fresh) and torch.equal(dw2, dw_fresh)
    R = x.numel() // D
    programs = min(-(-R // 16), 3) if DEVICE == "cpu" else asked[0][0]
    assert asked == [(programs, D)] * 2


def test_add_rmsnorm_bwd_bad_buffers(gen):
    x, w = _rand(gen, 5, 60), torch.ones(60, device=DEVICE)
    _, s, rstd = add_rmsnorm_fwd(x, None, w)
    for bad in (nan_like(s)[:4], nan_like(s).double(), torch.empty(60, 5, device=DEVICE).t()):
        with pytest.raises((ValueError, TypeError), match="out"):
            add_rmsnorm_bwd(x, None, s, rstd, w, out=bad)
    with pytest.raises(TypeError, match="partials"):
        add_rmsnorm_bwd(x, None, s, rstd, w, partials=torch.empty(1, 60, device=DEVICE))
    for bad in (torch.empty(7, 60, device=DEVICE), torch.empty(1, 60, device=DEVICE, dtype=torch.float64)):
        with pytest.raises((ValueError, TypeError), match="partials"):
            add_rmsnorm_bwd(x, None, s, rstd, w, partials=lambda pshape, bad=bad: bad)


def _ce_case(gen, C, V, ignored):
    logits = _rand(gen, C, V, scale=3.0)
    labels = torch.randint(0, V, (C,), generator=gen).to(DEVICE)
    labels[0] = V - 1
    if C > 1:
        labels[1] = 0
    labels[ignored] = -100
    ref = logits.double().clone()
    loss_ref = ce_grad_fwd_ref(ref, labels, 0.37)
    buf = logits.clone()
    loss_buf = torch.full((C,), float("nan"), device=DEVICE)
    loss = ce_grad_fwd(buf, labels, 0.37, out=loss_buf)
    assert loss is loss_buf
    assert_close("loss", loss, loss_ref)
    assert_close("grad logits", buf, ref)
    # the reference against autograd of F.cross_entropy(reduction="sum") * scale
    la = logits.double().requires_grad_(True)
    (torch.nn.functional.cross_entropy(la, labels, reduction="sum", ignore_index=-100) * 0.37).backward()
    assert_close("grad logits (autograd)", ref, la.grad)
    return loss, buf


@pytest.mark.parametrize("C,V", [(1, 97), (7, 130), (33, 1)])
def test_ce_grad(gen, C, V):
    _ce_case(gen, C, V, ignored=torch.arange(C) % 3 == 2)


def test_ce_grad_all_rows_ignored(gen):
    loss, grad = _ce_case(gen, 5, 97, ignored=torch.ones(5, dtype=torch.bool))
    assert (loss == 0).all() and (grad == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rmsnorm_gpu(gen, dtype):
    _norm_case(gen, 16384, 4096, dtype, True, True)


@pytest.mark.gpu
def test_ce_grad_gpu(gen):
    _ce_case(gen, 4096, 151936, ignored=torch.arange(4096) % 5 == 0)
