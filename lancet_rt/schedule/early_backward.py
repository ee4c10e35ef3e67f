"""The backward's first all-to-all, issued from the forward.

Where a chunk's loss gradient exists in the forward (the fused linear cross-entropy computes it per
chunk: :mod:`lancet_rt.integrations.hf_dense`), the chunk need not wait for ``loss.backward()`` to start
its backward communication. Right after its loss term, a partial backward runs from the chunk's
last hidden state down to the output of its last MoE layer's combine all-to-all, and the combine's
backward (dual) all-to-all is issued then, with the gradient of a loss gradient of 1.

Why: on the schedule's critical path the link otherwise idles from the forward's last combine until
the backward issues its first dual: through the last chunk's loss head, the model's code after the
base model (its auxiliary loss), and the backward's first nodes. Issued from the forward, the
chunks' duals fly during that time. Cost: those few nodes (the final norm's, the residual add's, the
unpermute's backward) run twice (docs/benchmarks.md has the numbers).

Exactness. The real backward runs those nodes again (the final norm's weight and the router get
their gradients from it, once); the combine's unpermute then finds its dual issued and does not
issue it again, and the dual's result is multiplied by the loss gradient the chunk's loss term
receives (:meth:`GradScale.factor`; 1 unless the loss is scaled, and exact for a power of two such
as a loss scaler's). That equals the gradient the backward would send only if the loss term's
gradient is the only one that reaches the path from the combine's output to the loss term. Anything
else may consume a tensor on that path after the forward issued the dual (a forward hook on the final
norm adding a regulariser, ``hidden_states[-1]`` in the user's loss, a tensor hook that rewrites a
gradient), so the step's backward checks it (:class:`PathWatch`): each node on the path, before it
runs, compares the gradients it received with the ones its neighbours on the path produced, by
identity (the autograd engine hands a lone gradient on as it is, and adds when a second one arrives).
Where anything else arrived, the unpermute withdraws the dual issued from the forward (waits for it,
drops its result) and issues the dual again with the gradient it computed, as it does without the
early backward: the step's gradients are then those of ``early_backward=False`` bit for bit.

The check costs no collective and no host sync: a few Python hooks per chunk. Its decision is made
from which gradients reach the path, which is the graph's structure, not its values: every rank
running the same code decides the same and issues the same collectives in the same order (a consumer
that exists on some ranks only, a rank-dependent branch in the user's loss, would make the ranks'
collectives differ). A path where one tensor feeds two of the path's nodes cannot be checked this way
(the engine adds the two path gradients): the chunk then does not issue its dual from the forward.
"""

from __future__ import annotations

from typing import Optional

import torch

from lancet_rt.runtime import scope as _scope

_LEAF_SEQ = 1 << 63  # AccumulateGrad nodes carry the largest sequence number: never on the path


class GradScale:
    """One chunk's loss term: the gradient of its hidden state that the forward computed (for a loss
    gradient of 1), the loss gradient the term's backward received (the factor of the dual issued from
    the forward), and the :class:`PathWatch` that finds other gradients joining the path."""

    def __init__(self):
        self.grad_hidden: Optional[torch.Tensor] = None
        self.received: Optional[torch.Tensor] = None
        self.watch: Optional[PathWatch] = None

    def factor(self) -> torch.Tensor:
        if self.received is None:
            raise RuntimeError(
                "lancet-rt: a combine's backward all-to-all was issued from the forward, but the "
                "chunk's loss term got no gradient in the backward (from_hf(..., "
                "early_backward=False) turns this off)"
            )
        return self.received


def _path(top, bottom) -> Optional[tuple[list, dict]]:
    """The autograd nodes between ``top`` (the loss term's node) and ``bottom`` (the combine's
    all-to-all node): (nodes, edges) with nodes[0] = top, and for each node index its path edges
    ``(output k, (index of the next node, its input slot))``; bottom is index -1. None where a slot
    has two path edges, or the path has no single last node (module docstring)."""
    floor = bottom._sequence_nr()  # every node on the path was created after the combine's
    nodes, reaches, stack = [top], {}, [(top, 0)]  # (nodes holds every visited one: their ids stay unique)
    while stack:  # iterative depth-first search: a node reaches bottom if a child does
        node, k = stack.pop()
        nxt = node.next_functions
        if k == 0:
            reaches[id(node)] = False
        while k < len(nxt):
            child = nxt[k][0]
            k += 1
            if child is None:
                continue
            if child is bottom:
                reaches[id(node)] = True
                continue
            seq = child._sequence_nr()
            if seq < floor or seq >= _LEAF_SEQ:
                continue
            if id(child) not in reaches:
                nodes.append(child)
                stack.append((node, k))
                stack.append((child, 0))
                break
            reaches[id(node)] |= reaches[id(child)]
        else:
            if stack:
                parent = stack[-1][0]
                reaches[id(parent)] |= reaches[id(node)]
    if not reaches[id(top)]:
        return None
    keep = [n for n in nodes if reaches[id(n)]]
    at = {id(n): i for i, n in enumerate(keep)}
    at[id(bottom)] = -1
    edges, slots = {}, {}
    for i, n in enumerate(keep):
        for k, (child, slot) in enumerate(n.next_functions):
            if child is not None and id(child) in at:
                key = (at[id(child)], slot)
                slots[key] = slots.get(key, 0) + 1
                edges.setdefault(i, []).append((k, key))
    if any(v > 1 for v in slots.values()) or sum(v for (j, _), v in slots.items() if j == -1) != 1:
        return None
    return keep, edges


class PathWatch:
    """The step's backward over one chunk's path (module docstring): each node's hooks note the
    gradients it hands on along the path and check, before it runs, that it received those and nothing
    else. The path's last node (the combine's unpermute) decides before it runs: where anything else
    arrived, the dual issued from the forward is withdrawn and the unpermute issues it again; either
    way the hooks then go.

    Args:
        nodes: the path's autograd nodes, the loss term's first (:func:`_path`).
        edges: for each node index, its path edges ``(output k, (next node index, input slot))``.
        link: the :class:`lancet_rt.comm.group.BackwardLink` whose dual the forward issued.
    """

    def __init__(self, nodes: list, edges: dict, link):
        self.joined = False  # a gradient other than the path's reached the path
        self._link = link
        self._produced: dict = {}
        self._handles: list = []
        slots: dict = {}
        for es in edges.values():
            for _, (j, slot) in es:
                slots.setdefault(j, set()).add(slot)
        for i, node in enumerate(nodes):
            if i in edges:
                self._handles.append(node.register_hook(self._post_hook(edges[i])))
            if i > 0:
                last = any(j == -1 for _, (j, _) in edges.get(i, ()))
                self._handles.append(node.register_prehook(self._pre_hook(i, slots.get(i, set()), last)))

    def _post_hook(self, edges):
        def post(grad_inputs, _grad_outputs):
            for k, key in edges:
                if key[0] >= 0:
                    self._produced[key] = grad_inputs[k]

        return post

    def _pre_hook(self, i: int, slots: set, last: bool):
        def pre(grad_outputs):
            if self._handles is None:  # (decided: the hooks are going)
                return None
            for j, g in enumerate(grad_outputs):
                if j in slots and (i, j) in self._produced:
                    ok = g is self._produced.pop((i, j))  # a lone gradient is handed on as it is
                else:
                    ok = g is None
                self.joined |= not ok
            if last:
                self._decide()
            return None

        return pre

    def _decide(self) -> None:
        link = self._link
        if self.joined and link.early is not None:  # the backward sends the dual it computes
            link.withdraw_early()
        self.remove()

    def remove(self) -> None:
        """Take the hooks off the path (a hook running now finishes as a no-op)."""
        handles, self._handles = self._handles, None
        self._produced.clear()
        for h in handles or ():
            h.remove()


def issue_from_forward(hidden: torch.Tensor, term: torch.Tensor, scale: GradScale) -> bool:
    """Issue the current chunk's last combine-backward all-to-all now (module docstring).

    Args:
        hidden: the chunk's last hidden state, the loss term's input (it depends on the combine's
            output through dense ops only: the layer's residual add, the final norm).
        term: the chunk's loss term (its node is the top of the path the backward watches).
        scale: the loss term's :class:`GradScale`, ``grad_hidden`` set (``hidden``'s shape).

    Returns:
        Whether the dual was issued (False outside a chunk, where the chunk's last MoE layer
        combined without a qualifying link, or where the path cannot be watched: then the backward
        issues it as always).
    """
    s = _scope.current()
    record = s.last_combine.get(s.chunk) if s is not None else None
    if record is None or scale.grad_hidden is None or not torch.is_grad_enabled():
        return False
    y_SD, link = record
    if link.early is not None or term.grad_fn is None or y_SD.grad_fn is None:
        return False
    path = _path(term.grad_fn, y_SD.grad_fn)
    if path is None:
        return False
    _scope.PROCESS.dual_from_forward = (link, scale)  # (the step context's: for this one partial backward)
    try:
        torch.autograd.grad(hidden, y_SD, scale.grad_hidden.view(hidden.shape), retain_graph=True, allow_unused=True)
    finally:
        _scope.PROCESS.dual_from_forward = None
    if link.scaled_by is not scale:
        return False
    scale.watch = PathWatch(*path, link)
    return True
