"""Helpers shared by the kernel launchers: the interpreter switch, the kernel-config variables (every one,
and their one parser), argument checks, and the device every launch runs on (its input tensors', not
whichever GPU happens to be current)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton

from .interpret import interpreting  # the launchers' switch, beside their other helpers


@dataclass(frozen=True)
class ConfigVar:
    """What a kernel-config variable may hold: its tile meta-parameters (``tiles``, each a power of two
    in [``min_tile``, 2^20], as ``tl.arange`` needs), ``num_warps`` and ``num_stages``. ``positional``:
    the values in order ("t1,...,num_warps,num_stages", all five required) instead of NAME=int items
    (every tile required, num_warps and num_stages optional)."""

    tiles: Tuple[str, ...]
    example: str
    positional: bool = False
    min_tile: int = 1


#: The allowed num_warps (a power of two up to 1024 threads per program).
NUM_WARPS = (1, 2, 4, 8, 16, 32)
_WARPS = "{" + ", ".join(map(str, NUM_WARPS)) + "}"
_MAX_TILE = 2**20  # Triton's largest block (elements)

_GEMM = ConfigVar(("BLOCK_M", "BLOCK_N", "BLOCK_K"), "128,256,64,8,3", positional=True, min_tile=16)
#: Every kernel-config environment variable and what it may hold (docs/setup.md lists them). They are
#: read here, through :func:`parse_config`, and nowhere else (``kernels/`` cannot import ``lancet_rt.env``).
CONFIG_VARS = {
    "LANCET_GATING_FWD_CONFIG": ConfigVar(("BLOCK_T",), "BLOCK_T=16,num_warps=4"),
    "LANCET_GATING_BWD_CONFIG": ConfigVar(("BLOCK_T",), "BLOCK_T=16,num_warps=4"),
    "LANCET_PERMUTE_FWD_CONFIG": ConfigVar(("BLOCK_T", "BLOCK_D"), "BLOCK_T=4,BLOCK_D=512,num_warps=8"),
    "LANCET_UNPERMUTE_FWD_CONFIG": ConfigVar(("BLOCK_T", "BLOCK_D"), "BLOCK_T=4,BLOCK_D=512,num_warps=8"),
    "LANCET_UNPERMUTE_BWD_CONFIG": ConfigVar(("BLOCK_T", "BLOCK_D"), "BLOCK_T=4,BLOCK_D=512,num_warps=8"),
    "LANCET_GEMM_CONFIG": _GEMM,
    **{f"LANCET_GEMM_CONFIG_{op}": _GEMM for op in ("FWD", "DX", "GATE_UP", "DW")},
}


def parse_config(env_var: str) -> Optional[Tuple[dict, Optional[int], Optional[int]]]:
    """The config pinned by ``env_var`` (a key of :data:`CONFIG_VARS`) as (tile meta-parameters,
    num_warps, num_stages), or None when it is unset or blank.

    Raises:
        ValueError: naming the variable, its value and what is allowed, for any value the kernel could
            not launch with (unknown or missing names, non-integers, tiles that are not powers of two,
            num_warps outside :data:`NUM_WARPS`, num_stages < 1).
    """
    spec = CONFIG_VARS[env_var]
    text = os.environ.get(env_var, "").strip()
    if not text:
        return None
    names = spec.tiles + ("num_warps", "num_stages")
    form = (
        ",".join(names)
        if spec.positional
        else ",".join(f"{n}=int" for n in spec.tiles) + "[,num_warps=int][,num_stages=int]"
    )
    allowed = (
        f"expected '{form}' (e.g. '{spec.example}'): tiles powers of two in [{spec.min_tile}, 2^20], "
        f"num_warps in {_WARPS}, num_stages >= 1"
    )

    def bad(why: str) -> ValueError:
        return ValueError(f"{env_var}={text!r}: {why}; {allowed}")

    items = [item.strip() for item in text.split(",")]
    if spec.positional:
        if len(items) != len(names):
            raise bad(f"{len(items)} values, not {len(names)}")
        pairs = list(zip(names, items))
    else:
        pairs = [tuple(p.strip() for p in item.partition("=")[::2]) for item in items]
        for item, (name, _) in zip(items, pairs):
            if "=" not in item or name not in names:
                raise bad(f"{item!r} is not NAME=int with NAME one of {list(names)}")
        seen = [name for name, _ in pairs]
        missing, twice = [n for n in spec.tiles if n not in seen], sorted({n for n in seen if seen.count(n) > 1})
        if missing or twice:
            raise bad(f"{', '.join(missing)} missing" if missing else f"{', '.join(twice)} given twice")
    values = {}
    for name, value in pairs:
        try:
            values[name] = int(value)
        except ValueError:
            raise bad(f"{name} must be an integer, got {value!r}") from None
    for name in spec.tiles:
        v = values[name]
        if not spec.min_tile <= v <= _MAX_TILE or v & (v - 1):
            raise bad(f"{name}={v} is not a power of two in [{spec.min_tile}, 2^20]")
    num_warps, num_stages = values.get("num_warps"), values.get("num_stages")
    if num_warps is not None and num_warps not in NUM_WARPS:
        raise bad(f"num_warps={num_warps} is not one of {_WARPS}")
    if num_stages is not None and num_stages < 1:
        raise bad(f"num_stages={num_stages} is not >= 1")
    return {name: values[name] for name in spec.tiles}, num_warps, num_stages


_CHECKED: set = set()  # the kernel-config variables' values found good (check_config_vars)
# The values are looked up where os.environ keeps them (POSIX: a bytes dict) with the keys encoded once:
# os.environ.get decodes and encodes per call, and this runs at every launch (its cost: bench/results/HISTORY.md).
_RAW = getattr(os.environ, "_data", None)
_RAW_KEYS = tuple(os.environ.encodekey(var) for var in CONFIG_VARS) if _RAW is not None else ()


def check_config_vars() -> None:
    """Parse every kernel-config variable (:data:`CONFIG_VARS`) once per set of values: each launcher
    calls it, so a bad value of any of them (a backward kernel's too) raises before the first launch."""
    values = tuple(map(_RAW.get, _RAW_KEYS)) if _RAW is not None else tuple(map(os.environ.get, CONFIG_VARS))
    if values not in _CHECKED:
        for var in CONFIG_VARS:
            parse_config(var)
        _CHECKED.add(values)


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
    """The config pinned by ``env_var`` as a ``triton.Config`` (:func:`parse_config`), or None."""
    parsed = parse_config(env_var)
    if parsed is None:
        return None
    meta, num_warps, num_stages = parsed
    opts = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    return triton.Config(meta, **opts)


def run_autotuned(tuner, grid, args: tuple, meta: dict, env_var: str) -> None:
    """Launch the ``@triton.autotune`` kernel ``tuner``; when its space prunes to one config (the
    interpreter's, or one pinned by ``env_var``) launch that config directly, untimed.

    Triton 3.9's autotuner skips timing a lone pruned config by itself, but 3.6 (the GPU lane's)
    times it anyway: that needs a GPU driver, so it fails under TRITON_INTERPRET=1, and on CUDA it
    costs a benchmark per new key for nothing. The prune functions return exactly one config in
    both cases, so both Triton versions take the same path.
    """
    check_config_vars()  # a bad value of any kernel-config variable raises here, before any launch
    pinned = pinned_config(env_var)
    if interpreting() or pinned is not None:
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
