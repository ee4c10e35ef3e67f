"""Helpers shared by the kernels' autotune spaces: the interpreter switch and pinned configs."""
from __future__ import annotations

import os
from typing import Optional

import triton


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
