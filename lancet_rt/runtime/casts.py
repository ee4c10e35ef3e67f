"""One compute-dtype copy of each weight per chunked forward, shared by every chunk.

Under ``torch.autocast`` with float32 parameters, a layer that casts its weights itself (the
experts' grouped GEMMs, :class:`~lancet_rt.runtime.wgrad.DeferredLinear`) would cast them again
in every chunk, and every chunk's autograd node would save its own bfloat16 copy for backward: N
copies at N chunks (the saved bytes measured: bench/results/HISTORY.md).
:func:`compute_copy` makes the copy once per chunked forward (the scope of
:class:`lancet_rt.Overlapped`'s chunks) and hands the same tensor to every chunk; it lives as long
as a chunk's backward still needs it, so it is freed after the backward, as the unchunked step's
copy is. (``nn.Linear`` under autocast needs none of this: autocast's own cache shares the casts of
leaf weights for as long as its context is open.)

The copies are detached: the layers take the parameters as the tensors they differentiate against
and return float32 gradients, so each chunk's weight gradient is summed in the parameter's dtype,
as before (a shared differentiable cast would sum the chunks' gradients in bfloat16 first). A
weight already in the compute dtype is not copied: its detached alias (never the parameter itself,
which the GEMMs' autograd Functions would then see as an input) is made once per chunked forward
too, and shared.
"""

from __future__ import annotations

import torch

from lancet_rt.runtime import scope as _scope


def compute_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` detached, in ``dtype``; inside a chunked forward, the same copy for every chunk.

    The copy is keyed by the tensor and its version counter, so an in-place update between two
    calls (none happens inside one forward) makes a fresh one.
    """
    scope = _scope.current()
    if scope is None:
        return t.detach() if t.dtype == dtype else t.detach().to(dtype)
    key = (id(t), dtype)
    held = scope.casts.get(key)
    if held is not None and held[0] is t and held[1] == t._version:
        return held[2]
    # (already in ``dtype``: the detached alias, also made once and shared by the chunks)
    copy = t.detach() if t.dtype == dtype else t.detach().to(dtype)
    scope.casts[key] = (t, t._version, copy)
    return copy
