"""Every environment variable lancet-rt reads, in one place (listed in the README), but the kernel-config
variables (``LANCET_*_CONFIG``), which ``kernels/`` reads itself: ``lancet_rt.kernels._common.CONFIG_VARS``
lists them, with one parser."""

from __future__ import annotations

import math
import os

from lancet_rt.kernels.interpret import interpreting

#: "triton" or "torch": force the kernel implementation. Default: triton on CUDA, torch on CPU.
KERNELS = "LANCET_KERNELS"
#: "1": Triton kernels run in the CPU interpreter (Triton's own variable; CI sets it).
TRITON_INTERPRET = "TRITON_INTERPRET"
#: Path of the autotuner's chunk-count cache (default: ~/.cache/lancet-rt/autotune.json).
AUTOTUNE_CACHE = "LANCET_AUTOTUNE_CACHE"
#: Seconds a rank waits in one collective of an expert-parallel group before it names the peers
#: that stopped answering and raises (default 300).
TIMEOUT = "LANCET_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
#: The largest LANCET_TIMEOUT_S accepted (about 115 days: longer is "never", which the clocks and
#: timedelta the monitor waits with cannot hold).
MAX_TIMEOUT_S = 1e7
#: "1" or "0": the expert- and data-parallel groups' per-collective header check on or off (default: on
#: for gloo, off for NCCL, where it costs a host sync per collective). Tests set "0" on gloo ranks to see
#: collectives as NCCL does.
CHECK_HEADERS = "LANCET_CHECK_HEADERS"
#: "split" or "plain": what a gloo ProcessGroup given as a MoE layer's ``ep_group`` carries its traffic on.
#: Default "split": the process groups ``TorchGroup.split`` makes (the counts and header checks on a control
#: group, each direction of the tokens on a lane of its own), built at the group's first collective. "plain":
#: the group as it is. NCCL groups are never split (this variable does not apply to them).
EP_TRANSPORT = "LANCET_EP_TRANSPORT"
#: CUDA's own variable: how many hardware work queues the streams of a process share (CUDA's default 8).
#: At 1 every stream funnels into one queue in launch order, so a wait on a side stream (a collective's
#: completion, the counts' copy to the host) holds back all compute launched after it: Overlapped's
#: overlap disappears. lancet-rt reads it, never sets it (it must be set before CUDA starts).
CUDA_DEVICE_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def kernels_override() -> str | None:
    value = os.environ.get(KERNELS, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("triton", "torch"):
        raise ValueError(f"{KERNELS} must be 'triton', 'torch' or unset, got {value!r}")
    return value


def triton_interpret() -> bool:
    """``TRITON_INTERPRET`` as Triton reads it (a ValueError naming it for a value Triton would ignore): the
    kernels' reader, which ``kernels/`` keeps because it cannot import this module."""
    return interpreting()


def autotune_cache_path() -> str:
    path = os.environ.get(AUTOTUNE_CACHE)
    if path:
        return path
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lancet-rt", "autotune.json")


def timeout_s() -> float:
    """``LANCET_TIMEOUT_S`` as seconds in (0, :data:`MAX_TIMEOUT_S`] (default :data:`DEFAULT_TIMEOUT_S`);
    a ValueError naming it otherwise."""
    text = os.environ.get(TIMEOUT, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{TIMEOUT} must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}, got {text!r}")
    return value


def check_headers(backend: str) -> bool:
    """``LANCET_CHECK_HEADERS`` as a bool; unset: on for a gloo ``backend``, off otherwise (NCCL). A
    ValueError naming it for any other value."""
    text = os.environ.get(CHECK_HEADERS, "").strip()
    if not text:
        return "gloo" in backend
    if text not in ("0", "1"):
        raise ValueError(f"{CHECK_HEADERS} must be '1', '0' or unset, got {text!r}")
    return text == "1"


def ep_transport() -> str:
    """``LANCET_EP_TRANSPORT``: "split" (the default, also when unset) or "plain"; a ValueError naming it for
    any other value."""
    text = os.environ.get(EP_TRANSPORT, "").strip().lower()
    if not text:
        return "split"
    if text not in ("split", "plain"):
        raise ValueError(f"{EP_TRANSPORT} must be 'split', 'plain' or unset, got {text!r}")
    return text


def cuda_device_max_connections() -> int | None:
    """``CUDA_DEVICE_MAX_CONNECTIONS`` as an int >= 1 (None: unset, CUDA's default); a ValueError naming it
    for anything else (CUDA would ignore it silently)."""
    text = os.environ.get(CUDA_DEVICE_MAX_CONNECTIONS, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(
            f"{CUDA_DEVICE_MAX_CONNECTIONS} must be an integer >= 1 (or unset: CUDA's default, 8), got {text!r}"
        )
    return int(text)
