"""A new row count does not compile the dense kernels again: the add + RMSNorm kernels
(kernels/_norm_kernels.py) and the cross-entropy kernel (kernels/linear_ce.py) take the row count
unspecialised (``do_not_specialize``). Triton otherwise specialises an int argument divisible by 16 or
equal to 1, so a chunk of 33 rows after one of 32 compiled another kernel mid-step.

CPU lane: the kernels' own JIT parameters are bound the way ``JITFunction.run`` binds them (its
specialization is the compiled-kernel cache's key), for row counts of every residue. GPU lane: two
launches with different residues leave one compiled kernel in the JIT's cache.
"""

from __future__ import annotations

import pytest
import torch
from lancet_rt.kernels import _norm_kernels, linear_ce
from lancet_rt.kernels.linear_ce import ce_grad_fwd
from lancet_rt.kernels.norm import add_rmsnorm_bwd, add_rmsnorm_fwd
from triton.runtime.jit import JITFunction, create_function_from_signature

ROWS = (1, 16, 32, 33, 48, 4096)


def _jit(kernel) -> JITFunction:
    """The kernel as a JITFunction with its decorator's options (interpreted kernels keep them in
    ``kwargs``)."""
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)


def _specialization(kernel, *args, **meta) -> list:
    """What ``JITFunction.run`` keys its compiled kernels on for these arguments."""
    from triton.backends.compiler import BaseBackend

    jf = _jit(kernel)
    binder = create_function_from_signature(jf.signature, jf.params, BaseBackend)
    return binder(*args, **meta)[1]


def _norm_fwd_args(R):
    x = torch.empty(64, 32)
    return (x, x, x[0], x, x, x[:, 0], R, 32, 1e-6, 32, 32, 32, 32), dict(
        BLOCK_R=16, BLOCK_D=32, HAS_RESIDUAL=True, HAS_RSTD=True
    )


def _norm_bwd_args(R):
    x = torch.empty(64, 32)
    return (x, x, x, x[:, 0], x[0], x, x, R, 32, 1e-6, 32, 32, 32, 32), dict(
        BLOCK_R=16, BLOCK_D=32, HAS_DS=True, RECOMPUTE=False
    )


def _ce_args(C):
    x = torch.empty(64, 32)
    return (x, x[:, 0].long(), x[:, 0], C, 32, 0.5, -100, 32), dict(BLOCK_V=32)


@pytest.mark.parametrize(
    "kernel,args,name",
    [
        (_norm_kernels._add_rmsnorm_fwd_kernel, _norm_fwd_args, "R"),
        (_norm_kernels._add_rmsnorm_bwd_kernel, _norm_bwd_args, "R"),
        (linear_ce._ce_grad_fwd_kernel, _ce_args, "C"),
    ],
    ids=["norm_fwd", "norm_bwd", "ce_grad"],
)
def test_row_count_is_not_specialised(kernel, args, name):
    names = _jit(kernel).arg_names
    assert name in names
    keys = {str(_specialization(kernel, *args(n)[0], **args(n)[1])) for n in ROWS}
    assert len(keys) == 1, f"{name} in {ROWS} gives {len(keys)} compiled variants: {sorted(keys)}"
    # the row count's own entry carries no divisibility or value (no "D", no constexpr 1)
    j = names.index(name)
    spec = _specialization(kernel, *args(33)[0], **args(33)[1])
    assert spec[j] == ("i32", None)


@pytest.mark.gpu
def test_one_compiled_kernel_for_two_row_residues():
    """After a launch at 32 rows, launches at 33, 1 and 4103 rows compile nothing new (other tests in
    the process may have compiled other shapes: the count is taken after the first launch)."""
    dev = torch.device("cuda")
    w = torch.ones(256, device=dev)
    kernels = (
        _norm_kernels._add_rmsnorm_fwd_kernel,
        _norm_kernels._add_rmsnorm_bwd_kernel,
        linear_ce._ce_grad_fwd_kernel,
    )
    index = torch.cuda.current_device()
    counts = None
    for R in (32, 33, 1, 4096 + 7):
        x = torch.randn(R, 256, device=dev)
        y, s, rstd = add_rmsnorm_fwd(x, x, w)
        add_rmsnorm_bwd(y, None, s, rstd, w)
        y, s, _ = add_rmsnorm_fwd(x, x, w, with_rstd=False)  # (rstd recomputed by the backward)
        add_rmsnorm_bwd(y, None, s, None, w, eps=1e-6)
        ce_grad_fwd(torch.randn(R, 512, device=dev), torch.randint(0, 512, (R,), device=dev), 0.5)
        now = [len(k.device_caches[index][0]) for k in kernels]
        counts = counts or now
        assert now == counts, f"R={R}: compiled variants {counts} -> {now} ({[k.fn.__name__ for k in kernels]})"
    torch.cuda.synchronize()
