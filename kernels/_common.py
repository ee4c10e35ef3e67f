"""Helpers shared by the kernel launchers: the interpreter switch, pinned configs, argument checks, and
the device every launch runs on (its input tensors', not whichever GPU happens to be current)."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_tensor_device(launcher):
    """``launcher`` run with its first tensor argument's GPU as the current CUDA device.

    Triton launches a kernel on the current CUDA device, on that device's current stream, whatever
    device its pointers are on: a rank that never called ``torch.cuda.set_device`` (or a caller holding
    tensors on another GPU) would run the kernel on the wrong GPU, or fault. Every public launcher
    takes its device from its inputs through this wrapper (CPU tensors, the interpreter's, pass through).

    Args:
        launcher: a launcher whose first tensor argument (positional, else keyword) is on the device
            it computes on.

    Returns:
        The wrapped launcher (``on_tensor_device`` attribute True).
    """
    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if t is None:
            t = next((a for a in kwargs.values() if isinstance(a, torch.Tensor)), None)
        if t is not None and t.is_cuda and t.device.index != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return launcher(*args, **kwargs)
        return launcher(*args, **kwargs)

    launch.on_tensor_device = True
    return launch


def pinned_config(env_var: str) -> Optional[triton.Config]:
    """The config pinned by ``env_var`` ("NAME=int,...,num_warps=int,num_stages=int"), or None."""
    spec = os.environ.get(env_var, "").strip()
    if not spec:
        return None
    meta, opts = {}, {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{env_var}: expected NAME=int items, got {item!r}")
        (opts if name.strip() in ("num_warps", "num_stages") else meta)[name.strip()] = int(value)
    return triton.Config(meta, **opts)


def run_autotuned(tuner, grid, args: tuple, meta: dict, env_var: str) -> None:
    """Launch the ``@triton.autotune`` kernel ``tuner``; when its space prunes to one config (the
    interpreter's, or one pinned by ``env_var``) launch that config directly, untimed.

    Triton 3.9's autotuner skips timing a lone pruned config by itself, but 3.6 (the GPU lane's)
    times it anyway: that needs a GPU driver, so it fails under TRITON_INTERPRET=1, and on CUDA it
    costs a benchmark per new key for nothing. The prune functions return exactly one config in
    both cases, so both Triton versions take the same path.
    """
    if interpreting() or pinned_config(env_var) is not None:
        (config,) = tuner.early_config_prune(tuner.configs, dict(zip(tuner.arg_names, args)), **meta)
        tuner.fn[grid](*args, **meta, **config.all_kwargs())
    else:
        tuner[grid](*args, **meta)


def check_tensor(name, t, *, ndim=None, shape=None, dtypes=None, device=None) -> None:
    """TypeError/ValueError naming ``name`` unless ``t`` is a tensor of the expected kind."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_out(name, t, shape, dtype, device) -> None:
    """An ``out=`` buffer: exact shape, dtype and device, contiguous."""
    check_tensor(name, t, shape=shape, dtypes=(dtype,), device=device)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
