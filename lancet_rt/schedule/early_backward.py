"""The backward's first all-to-all, issued from the forward.

Where a chunk's loss gradient exists in the forward (the fused linear cross-entropy computes it per
chunk: :mod:`lancet_rt.integrations.hf_dense`), the chunk need not wait for ``loss.backward()`` to start
its backward communication. Right after its loss term, a partial backward runs from the chunk's
last hidden state down to the output of its last MoE layer's combine all-to-all, and the combine's
backward (dual) all-to-all is issued then, with the gradient of a loss gradient of 1.

Why: on the schedule's critical path the link otherwise idles from the forward's last combine until
the backward issues its first dual: through the last chunk's loss head, the model's code after the
base model (its auxiliary loss), and the backward's first nodes (on the CPU benchmark's Mixtral,
about 8 ms of a 105 ms step). Issued from the forward, the chunks' duals fly during that time.

Cost: those few nodes (the final norm's, the residual add's, the unpermute's backward) run twice:
0.3-0.5 ms a chunk on that benchmark, against about 3-4 ms less exposed communication a step.

Exactness. The real backward runs those nodes again (the final norm's weight and the router get
their gradients from it, once); the combine's unpermute then finds its dual issued and does not
issue it again, and the dual's result is multiplied by the loss gradient the chunk's loss term
receives (:meth:`GradScale.factor`; 1 unless the loss is scaled, and exact for a power of two such
as a loss scaler's). This equals the gradient the backward would have sent only if the loss term is
the one consumer of the chunk's last hidden state, which the caller guarantees (the fused loss
declines calls asking for hidden states or attentions, gradient checkpointing and FSDP-sharded
models, and a forward running beside a backward). Every rank runs the same schedule, so the duals
are issued in the same order everywhere.
"""
from __future__ import annotations

from typing import Optional

import torch

from lancet_rt.schedule import scope as _scope


class GradScale:
    """One chunk's loss term: the gradient of its hidden state that the forward computed (for a loss
    gradient of 1), and the loss gradient the term's backward received (the factor of the dual
    issued from the forward)."""

    def __init__(self):
        self.grad_hidden: Optional[torch.Tensor] = None
        self.received: Optional[torch.Tensor] = None

    def factor(self) -> torch.Tensor:
        if self.received is None:
            raise RuntimeError("lancet-rt: a combine's backward all-to-all was issued from the forward, but the "
                               "chunk's loss term got no gradient in the backward; its last hidden state has "
                               "another consumer (from_hf(..., early_backward=False) turns this off)")
        return self.received


def issue_from_forward(hidden: torch.Tensor, scale: GradScale) -> bool:
    """Issue the current chunk's last combine-backward all-to-all now (module docstring).

    Args:
        hidden: the chunk's last hidden state, the loss term's input (it depends on the combine's
            output through dense ops only: the layer's residual add, the final norm).
        scale: the loss term's :class:`GradScale`, ``grad_hidden`` set (``hidden``'s shape).

    Returns:
        Whether the dual was issued (False outside a chunk, or where the chunk's last MoE layer
        combined without a qualifying link: then the backward issues it as always).
    """
    s = _scope.current()
    record = s.last_combine.get(s.chunk) if s is not None else None
    if record is None or scale.grad_hidden is None or not torch.is_grad_enabled():
        return False
    y_SD, link = record
    if link.early is not None:
        return False
    link.from_forward = scale
    try:
        torch.autograd.grad(hidden, y_SD, scale.grad_hidden.view(hidden.shape), retain_graph=True,
                            allow_unused=True)
    finally:
        link.from_forward = None
    return link.scaled_by is scale
