"""The link model: a collective's modeled time, ``latency + off-rank bytes / bandwidth``.

Both groups that model a link use it: :class:`lancet_rt.TorchGroup` (:meth:`~lancet_rt.TorchGroup.set_link`,
the windows of deferred weight gradients) and :class:`lancet_rt.EmulatedGroup` (how long the emulated link
is held). It sits below both, so a group's collective, called from :mod:`lancet_rt.comm.group`'s autograd
Functions, never calls back into that module for its arithmetic.
"""

from __future__ import annotations


def check_link(bandwidth_gbps, latency_us) -> tuple[float, float]:
    """A link model's parameters as floats, or a ValueError naming the bad one."""
    if isinstance(bandwidth_gbps, bool) or not isinstance(bandwidth_gbps, (int, float)) or not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth_gbps must be a number > 0 (math.inf: free), got {bandwidth_gbps!r}")
    if isinstance(latency_us, bool) or not isinstance(latency_us, (int, float)) or not latency_us >= 0:
        raise ValueError(f"latency_us must be a number >= 0, got {latency_us!r}")
    return float(bandwidth_gbps), float(latency_us)


def link_ms(off_rank_bytes: int, bandwidth_gbps: float, latency_us: float) -> float:
    """One collective's time on a link of ``bandwidth_gbps`` (GB/s for off-rank bytes) and ``latency_us``."""
    return latency_us * 1e-3 + off_rank_bytes / (bandwidth_gbps * 1e9) * 1e3
