"""Labels outside ``[0, V)`` at the fused loss's boundary: ``lancet_rt.dense.linear_cross_entropy``,
``LinearCrossEntropy``, ``SharedHeadGrad`` and the ``ce_grad_fwd`` launchers raise a ValueError naming
``labels``, the bad values, V and the ignore index (as ``torch.nn.functional.cross_entropy`` refuses
them), on the Triton path (TRITON_INTERPRET=1 on the CPU lane) and on the references. The ignore index
(-100) still means no loss. Without the check the kernel read another row's logit: a finite, wrong loss.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels.linear_ce import ce_grad_fwd
from lancet_rt.kernels.reference_dense import ce_grad_fwd_ref

from lancet_rt import ops
from lancet_rt.dense import LinearCrossEntropy, SharedHeadGrad, linear_cross_entropy
from tests.helpers import assert_close

V, D, T = 40, 16, 12
PATHS = ["triton", "torch"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """LANCET_KERNELS=triton (the kernels, interpreted on the CPU) or torch (the references)."""
    monkeypatch.setenv("LANCET_KERNELS", request.param)
    return request.param


def _case(gen, bad=None):
    h = torch.randn(T, D, generator=gen)
    w = torch.randn(V, D, generator=gen) * 0.3
    labels = torch.randint(0, V, (T,), generator=gen)
    labels[3] = -100
    if bad is not None:
        labels[5] = bad
    return h, w, labels


@pytest.mark.parametrize("bad", [V, 43, -5, -1])
def test_linear_cross_entropy_refuses_a_label_outside_the_vocabulary(gen, path, bad):
    h, w, labels = _case(gen, bad)
    assert ops.get_ops(h.device, h.dtype).name == path
    for shift in (False, True):
        lab = labels if not shift else torch.cat([labels[1:], labels[:1]])  # the bad one lands at 5 again
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with pytest.raises(ValueError, match=rf"labels.*V={V}.*ignore index -100.*\[{bad}\]"):
            linear_cross_entropy(hh, ww, lab, shift_labels=shift, chunk_size=4)
    with pytest.raises(ValueError, match=rf"labels.*\[{bad}\]"):
        LinearCrossEntropy(_head(w), shift_labels=False, chunk_size=5)(h, labels)
    with pytest.raises(ValueError, match=rf"labels.*\[{bad}\]"):  # with a given divisor too
        linear_cross_entropy(h, w, labels, shift_labels=False, num_items_in_batch=7)


def _head(w):
    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    return head


def test_the_chunks_of_a_shared_head_refuse_a_bad_label(gen, path):
    """The fused Hugging Face loss (SharedHeadGrad, one term per Overlapped chunk)."""
    h, w, labels = _case(gen, 43)
    shared = SharedHeadGrad(w.clone().requires_grad_(True), torch.tensor(10), rows=T)
    shared.term(h[:6].clone().requires_grad_(True), labels[:3].clone().repeat(2))  # (good labels: no error)
    with pytest.raises(ValueError, match=r"labels.*\[43\]"):
        shared.term(h[:6].clone().requires_grad_(True), labels[:6])


def test_ignore_index_still_means_no_loss(gen, path):
    h, w, labels = _case(gen)
    labels[7] = -100
    got = linear_cross_entropy(h, w, labels, shift_labels=False, chunk_size=4)
    want = torch.nn.functional.cross_entropy(h @ w.t(), labels, ignore_index=-100)
    assert_close("loss with ignored labels", got.reshape(1), want.reshape(1))


@pytest.mark.parametrize("launcher", [ce_grad_fwd, ce_grad_fwd_ref], ids=["kernel", "reference"])
@pytest.mark.parametrize("bad", [V, 43, -5, -1])
def test_launchers_refuse_a_bad_label(gen, launcher, bad):
    logits = torch.randn(6, V, generator=gen)
    labels = torch.tensor([0, V - 1, -100, bad, 3, 4])
    with pytest.raises(ValueError, match=rf"labels_C.*V={V}.*ignore index -100.*\[{bad}\]"):
        launcher(logits.clone(), labels, 0.5)


@pytest.mark.parametrize("bad", [V, 43, -5])
def test_unchecked_kernel_never_reads_another_row(gen, bad):
    """check_labels=False (the caller checked): a bad row's loss and gradient are NaN, the others'
    exact, and no other row's memory is read."""
    logits = torch.randn(4, V, generator=gen)
    labels = torch.tensor([1, bad, -100, V - 1])
    grad = logits.clone()
    loss = ce_grad_fwd(grad, labels, 0.5, check_labels=False)
    assert torch.isnan(loss[1]) and torch.isnan(grad[1]).all()
    good = torch.tensor([0, 2, 3])
    ref = logits[good].double()
    want = ce_grad_fwd_ref(ref, labels[good], 0.5)
    assert_close("loss of the good rows", loss[good], want)
    assert_close("gradient of the good rows", grad[good], ref)
