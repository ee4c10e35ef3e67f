"""Host reads of the fused Hugging Face loss (lancet_rt.dense.SharedHeadGrad, lancet_rt.integrations.hf_dense):
the loss divisor, the whole batch's count of valid labels, is read on the host once per step however
many chunks the step runs (each read of a CUDA tensor is a host sync that drains the compute queue).

On the CPU every read of a tensor's value (``float()``, ``int()``, ``bool()``, ``.item()``,
``.tolist()``) is counted by its caller's file; on CUDA the same reads are the ones
``torch.cuda.set_sync_debug_mode`` reports (tests/host_sync.py names them in the GPU tests).
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

import lancet_rt
from lancet_rt.models.hf_models import batch, build

_ROOT = os.path.dirname(os.path.abspath(lancet_rt.__file__))
LOSS_FILES = (os.path.join(_ROOT, "dense.py"), os.path.join(_ROOT, "integrations", "hf_dense.py"))
READS = ("__float__", "__int__", "__bool__", "__index__", "item", "tolist")


@pytest.fixture
def host_reads(monkeypatch):
    """A Counter of tensor value reads by the caller's file (the frame that called the read)."""
    counts: collections.Counter = collections.Counter()
    for name in READS:
        inner = getattr(torch.Tensor, name)

        def read(t, *args, _inner=inner, **kwargs):
            counts[os.path.abspath(sys._getframe(1).f_code.co_filename)] += 1
            return _inner(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    return counts


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_loss_reads_its_divisor_once_per_step(family, host_reads):
    """from_hf(fused_loss=True): one read of the divisor per step with 1, 2 or 4 chunks (each chunk's
    loss term reads none), and the same loss as transformers' (the value read is the divisor)."""
    hf = build(family)
    ids, mask, labels = batch(hf.config.vocab_size, 4, 9)
    want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    for chunks in (1, 2, 4):
        lm = lancet_rt.from_hf(build(family), chunks=chunks, fused_loss=True)
        lm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()  # warm-up
        host_reads.clear()
        out = lm(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        reads = sum(host_reads[f] for f in LOSS_FILES)
        assert reads == 1, f"chunks={chunks}: {reads} host reads in the fused loss ({dict(host_reads)})"
        torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)


def test_frozen_head_reads_its_divisor_once_per_step(host_reads):
    """A frozen LM head (no head gradient: LoRA-style training) takes the same path: one read."""
    lm = lancet_rt.from_hf(build("mixtral"), chunks=4, fused_loss=True)
    lm.get_output_embeddings().weight.requires_grad_(False)
    ids, mask, labels = batch(lm.config.vocab_size, 4, 9)
    host_reads.clear()
    out = lm(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert sum(host_reads[f] for f in LOSS_FILES) == 1, dict(host_reads)
    assert lm.get_output_embeddings().weight.grad is None and lm.model.norm.weight.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU lane: needs CUDA; its CPU twin counts the reads")
def test_fused_loss_syncs_once_per_step_on_cuda():
    """On CUDA, torch.cuda.set_sync_debug_mode("warn") reports the fused loss's host syncs by caller
    (tests/host_sync.py): one per step with 1 or 4 chunks."""
    import copy

    from tests.host_sync import record_syncs, report

    hf = build("mixtral").cuda()
    ids, mask, labels = (t.cuda() for t in batch(hf.config.vocab_size, 4, 9))
    for chunks in (1, 4):
        lm = lancet_rt.from_hf(copy.deepcopy(hf), chunks=chunks, fused_loss=True)
        lm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()  # warm-up
        torch.cuda.synchronize()
        with record_syncs() as sites:
            torch.cuda.set_sync_debug_mode("warn")
            try:
                lm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        loss = [s for s in sites if s.caller() is not None and os.path.abspath(s.caller().filename) in LOSS_FILES]
        assert len(loss) == 1, f"chunks={chunks}: {len(loss)} syncs in the fused loss:\n" + report(loss)
