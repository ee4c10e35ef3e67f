"""The interpreter switch: whether Triton kernels run in the CPU interpreter, read as Triton reads it.

Apart from the launchers' helpers (which import triton) so the runtime's environment reader
(:func:`lancet_rt.env.triton_interpret`) can ask without importing triton."""

from __future__ import annotations

import os

#: TRITON_INTERPRET's values as Triton reads them (any case): on, and off ("" or unset: off).
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter: ``TRITON_INTERPRET`` read as Triton reads it
    (1, true, on or yes, any case), so the launchers and Triton never disagree (``true`` was off here and
    on in Triton); a ValueError naming it for any other value (Triton would silently read it as off)."""
    text = os.environ.get("TRITON_INTERPRET", "")
    if text.lower() in _ON:
        return True
    if text.lower() in _OFF:
        return False
    raise ValueError(
        f"TRITON_INTERPRET must be one of {', '.join(_ON)} (on) or {', '.join(_OFF[1:])} or unset (off), got {text!r}"
    )
