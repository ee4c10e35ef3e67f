"""``Overlapped``: Lancet's whole-graph overlap as a runtime around an unmodified eager model.

The batch is cut into N chunks along dim 0 and the model runs once per chunk, each run a coroutine
(a greenlet). A chunk runs until its MoE layer has issued an all-to-all, then the scheduler resumes
the next chunk, round robin: while chunk i's tokens travel, chunk i+1 computes its attention, norms
and gating, and chunk i-1 its experts and the layers after them. Since the communication link is a
FIFO, round robin resumes chunks in the order their transfers finish. The pipeline fills by
alternating a new chunk with the oldest started one (chunks 0, 1, 0, 2, 1, 3, ...).

Exactness: the gating passes chunks in order and carries each expert's used capacity, and capacity
and the aux/z losses are those of the whole batch (docs/design.md, idea 3). The one requirement on the
model: outside lancet MoE layers it is separable along dim 0 of its tensor inputs (row i of the
output depends only on row i of the inputs), which holds for transformer blocks on [batch, seq, ...]
inputs without batch-coupling ops (batch norm, in-batch losses). ``check=True`` verifies it once
against the unchunked forward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lancet_rt import ops as _ops
from lancet_rt import trace as _trace
from lancet_rt.moe.layer import MoE
from lancet_rt.runtime import scope as _scope
from lancet_rt.runtime import wgrad as _wgrad
from lancet_rt.schedule import accumulate as _accumulate
from lancet_rt.schedule import guard as _guard
from lancet_rt.schedule import policy as _policy
from lancet_rt.schedule import warmup as _warmup
from lancet_rt.schedule.balance import BalancedChunks

try:  # greenlet is a dependency; imported lazily so `import lancet_rt` never fails without it
    import greenlet as _greenlet
except ImportError:  # pragma: no cover - exercised only on machines without greenlet
    _greenlet = None


class Overlapped(nn.Module):
    """Run ``model`` on N chunks of its batch, overlapping computation with the MoE all-to-alls.

    Args:
        model: an unmodified model containing :class:`lancet_rt.MoE` layers, separable along dim 0
            of its tensor inputs outside those layers.
        chunks: N >= 1; "auto" (the autotuner's cache, else tuned online in the first steps; needs
            ``import lancet_rt.autotune``, which registers it); another name registered with
            :func:`lancet_rt.schedule.policy.register_chunk_policy`; a
            :class:`~lancet_rt.schedule.policy.ChunkPolicy`; or a factory ``factory(overlapped)`` of one.
            ``chunks=1`` is exactly ``model(...)``.
        defer_wgrad: give the model's ``nn.Linear`` modules and the experts deferred weight
            gradients, computed inside the backward all-to-alls' windows (Lancet's dW scheduling)
            and flushed before ``backward()`` returns.
        max_deferred_bytes: with ``defer_wgrad``, a bound on the bytes the deferred dW items hold
            (their layer inputs and output gradients); past it the oldest items run at once. None:
            four times the largest item (about a layer's chunks); ``math.inf``: no bound
            (:class:`~lancet_rt.runtime.wgrad.WGradQueue`).
        check: verify once, on the first forward, that the chunked output equals the unchunked one
            (needs a deterministic forward: no dropout).
        balance: None (equal rows) or a :class:`lancet_rt.BalancedChunks`: chunk boundaries by the
            estimated cost of variable-length sequences (from a mask or ``cu_seqlens``).

    Every tensor argument with the batch's rows along dim 0 (the most rows of any argument) is cut
    along dim 0; a tensor with one row (position embeddings [1, S, ...], say) goes whole to every
    chunk; other sizes are an error. A rank with fewer rows than chunks still takes part in every
    all-to-all; without expert parallelism (no peer to keep in step) the chunk count is capped at the
    batch's rows instead. Counts above :data:`lancet_rt.schedule.policy.MAX_CHUNKS` (256) are refused,
    from the argument or from a policy. Outputs (tensors, or tuples/lists/dicts/model outputs of
    them) are concatenated along dim 0. Grad mode, autocast and saved-tensor hooks (activation
    checkpointing) are kept per chunk across its switches. On CUDA a step runs with its inputs' GPU as
    the current device, and its first step per compute dtype warms the kernels before the layers'
    first collective (:func:`lancet_rt.schedule.warmup.before_step`).
    """

    def __init__(
        self,
        model: nn.Module,
        chunks=2,
        *,
        defer_wgrad: bool = False,
        check: bool = False,
        balance: Optional[BalancedChunks] = None,
        max_deferred_bytes: Optional[float] = None,
    ):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        _policy.check_chunks(chunks)
        for name, flag in (("defer_wgrad", defer_wgrad), ("check", check)):
            if not isinstance(flag, bool):  # a truthy string or tensor would silently change the schedule
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if balance is not None and not isinstance(balance, BalancedChunks):
            raise TypeError(f"balance must be None or a lancet_rt.BalancedChunks, got {type(balance).__name__}")
        if _greenlet is None:
            raise ImportError("lancet_rt.Overlapped needs the 'greenlet' package (pip install greenlet)")
        self.model = model
        self.chunks = chunks
        self.defer_wgrad = defer_wgrad
        self.check = check
        self.balance = balance
        self._checked = False
        queue = _wgrad.WGradQueue(max_deferred_bytes)  # (checks the argument, deferring or not)
        self.wgrad_queue: Optional[_wgrad.WGradQueue] = queue if defer_wgrad else None
        self._auto = None
        self._step_layers: Optional[list[MoE]] = None  # moe_layers() during a step (one walk per step)
        if defer_wgrad:
            for m in model.modules():
                if type(m) is nn.Linear:
                    m.__class__ = _wgrad.DeferredLinear
        for name, m in model.named_modules():
            if isinstance(m, MoE):
                m.trace_name = name or "moe"

    def moe_layers(self) -> list[MoE]:
        """The model's :class:`lancet_rt.MoE` layers (walked once per step while a step runs)."""
        if self._step_layers is not None:
            return self._step_layers
        return [m for m in self.model.modules() if isinstance(m, MoE)]

    def forward(self, *args, **kwargs):
        layers = self._step_layers = self.moe_layers()  # (the tree does not change during a step)
        try:
            with _ops.on_device(_input_device(args, kwargs)):  # (the schedule check's all-gather included)
                # The step guard: the schedule agreed across ranks once; an exception ends on every rank
                # and leaves no state (lancet_rt.schedule.guard, given the layers: it calls nothing back).
                _guard.check_schedule(self, layers)
                with _guard.StepGuard(layers):
                    if self.wgrad_queue is not None:
                        self.wgrad_queue.discard_orphans()  # left by a backward that raised (e.g. out of memory)
                    return self.forward_chunked(self._resolve_chunks(args, kwargs), args, kwargs)
        finally:
            self._step_layers = None

    def accumulate(self, microbatches, loss_fn, *, interleave: bool = True, grad_sync=None) -> torch.Tensor:
        """Forward and backward of M microbatches, gradients accumulated into ``.grad``: one training step.

        With ``interleave=True`` the backward of microbatch i runs interleaved with the forward of
        microbatch i+1 (:mod:`lancet_rt.schedule.accumulate`), so each pass's all-to-alls hide behind
        the other pass's computation. Gradients equal those of ``for i, mb: loss_fn(self(*mb), i).backward()``
        (``interleave=False`` runs exactly that); capacity and the aux/z losses are per microbatch.
        ``chunks`` and ``defer_wgrad`` hold for every microbatch (a chunk policy such as ``"auto"`` is
        asked once per call, on the first one). The arguments and requirements:
        :class:`lancet_rt.schedule.accumulate.Microbatches`.

        Returns:
            [M] the losses, detached.
        """
        step = _accumulate.Microbatches(
            self.model, microbatches, loss_fn, interleave=interleave, grad_sync=grad_sync, dw_queue=self.wgrad_queue
        )
        layers = self._step_layers = self.moe_layers()
        try:
            # As forward: the schedule agreed across ranks once; an exception ends on every rank and
            # leaves no state behind (lancet_rt.schedule.guard). The step's pieces below this driver
            # (the guard, the microbatches' interleaving) get what they need as data.
            _guard.check_schedule(self, layers)
            with _guard.StepGuard(layers):
                if self.wgrad_queue is not None:
                    self.wgrad_queue.discard_orphans()  # left by a backward that raised
                n = self._resolve_chunks(*step.calls[0])
                with step.running():
                    for i, (args, kwargs) in enumerate(step.calls):
                        with step.microbatch(i) as forward:  # the backward of microbatch i - 1 runs beside it
                            forward.output = self.forward_chunked(n, args, kwargs)
                    return step.end()
        finally:
            self._step_layers = None

    def forward_chunked(self, n: int, args: tuple, kwargs: dict):
        """The forward on ``n`` chunks (``forward`` once the chunk count is known)."""
        with _ops.on_device(_input_device(args, kwargs)):  # (accumulate calls this, not forward)
            if self.check and not self._checked:
                self._check_separable(n, args, kwargs)
            prev = _wgrad.set_current(self.wgrad_queue)
            try:
                if n == 1:
                    return self.model(*args, **kwargs)
                return self.run_chunked(n, args, kwargs)
            finally:
                _wgrad.set_current(prev)

    def _resolve_chunks(self, args, kwargs) -> int:
        """This step's chunk count. First (every step starts here, ``accumulate``'s too) the start of step
        checks and the first-step warm-up, before the layers' first collective and the policy's."""
        with _ops.on_device(_input_device(args, kwargs)):
            _warmup.before_step(self, self.moe_layers(), args, kwargs)
            return self._chunk_count(args, kwargs)

    def _chunk_count(self, args, kwargs) -> int:
        if isinstance(self.chunks, int):
            n = self.chunks
        else:
            if self._auto is None:  # the policy, built on the first forward
                self._auto = _policy.resolve_chunk_policy(self.chunks, self)
            n = _policy.check_chunk_count(self._auto.next_chunks(args, kwargs), "the chunk policy")
        if n > 1 and not any(m.ep_size > 1 for m in self.moe_layers()):
            # No peer issues collectives with us: more chunks than rows would only run empty ones.
            rows = _batch_rows(args, kwargs)  # (None: no tensor argument, which run_chunked reports)
            n = n if rows is None else min(n, max(1, rows))
        return n

    def run_chunked(self, n: int, args: tuple, kwargs: dict):
        """Run the model on ``n`` chunks as coroutines and concatenate the outputs."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        # (cu_seqlens of a packed batch is cut by sequence, not along dim 0)
        skip = self._or_fail(self.balance.lengths_leaf, leaves, args, kwargs) if self.balance is not None else None
        cut = _batch_leaves([None if i == skip else v for i, v in enumerate(leaves)])
        if isinstance(cut, Exception):
            self._fail(cut)
        if self.balance is None:
            pieces = {i: leaves[i].tensor_split(n) for i in cut}
        else:
            pieces = self._or_fail(self.balance.cut, leaves, cut, n, args, kwargs)
        rows = [p.shape[0] for p in pieces[cut[0]]]

        def chunk_inputs(c):
            chunk_leaves = [pieces[i][c] if i in pieces else v for i, v in enumerate(leaves)]
            return pytree.tree_unflatten(chunk_leaves, spec)

        main = _greenlet.getcurrent()
        scope = _scope.ChunkScope(rows, switch=main.switch)
        outputs: list[Any] = [None] * n

        def run(c):
            a, kw = chunk_inputs(c)
            outputs[c] = self.model(*a, **kw)

        lets = [_greenlet.greenlet(lambda c=c: run(c)) for c in range(n)]
        live = list(range(n))
        scope.waiting = not_started(n)
        last = None
        prev = _scope.current()
        _scope.set_current(scope)
        outer = now = _TorchModes.capture()
        modes = [outer] * n
        on_cuda = _on_cuda(leaves)
        try:
            while live:
                c = last = next_chunk(live, scope.waiting, last)
                scope.chunk = c
                if modes[c] != now:  # (the chunks share one state, mostly: nothing to restore)
                    modes[c].restore()
                with _trace.span(f"chunk {c}", "compute", on_cuda, chunk=c):
                    lets[c].switch()
                modes[c] = now = _TorchModes.capture()
                if lets[c].dead:
                    live.remove(c)
        finally:
            for c, g in enumerate(lets):  # on an exception, end the others' coroutines
                if not g.dead:
                    modes[c].restore()  # (their context managers unwind in their own state)
                    try:
                        g.throw(_greenlet.GreenletExit)
                    except Exception:  # the error in flight is the one to report
                        pass
            outer.restore()
            _scope.set_current(prev)
        _guard.check_output_rows(outputs, rows)
        return _concat(outputs)

    def _or_fail(self, fn, *args):
        """``fn(*args)``; a ValueError/TypeError it raises is raised on every rank (:meth:`_fail`)."""
        try:
            return fn(*args)
        except (ValueError, TypeError) as exc:
            self._fail(exc)

    def _fail(self, error: Exception) -> None:
        """Raise ``error`` here and on every peer rank, before any collective of this step.

        The peers passed their own checks and will wait in the first MoE layer's counts exchange:
        :meth:`lancet_rt.MoE.fail_peers` takes part in it with a failure status.
        """
        for m in self.moe_layers():
            if m.group is not None and m.ep_size > 1:
                m.fail_peers(error)
        raise error

    @torch.no_grad()
    def _check_separable(self, n, args, kwargs) -> None:
        if n == 1:
            self._checked = True
            return
        whole = self.model(*args, **kwargs)
        chunked = self.run_chunked(n, args, kwargs)
        for a, b in zip(pytree.tree_leaves(whole), pytree.tree_leaves(chunked)):
            if isinstance(a, torch.Tensor):
                err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                scale = a.double().abs().max().item() if a.numel() else 0.0
                if not err <= 1e-4 * max(scale, 1e-6):
                    self._fail(
                        ValueError(
                            f"Overlapped(check=True): the chunked output differs from the unchunked one "
                            f"(max abs err {err:.3e}, scale {scale:.3e}); the model must be separable along "
                            f"dim 0 outside lancet MoE layers, with a deterministic forward"
                        )
                    )
        self._checked = True


def _input_device(args, kwargs) -> Optional[torch.device]:
    """The first tensor argument's device (None without one)."""
    return next((v.device for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)), None)


def _batch_rows(args, kwargs) -> Optional[int]:
    """The batch's rows: the largest dim 0 among the tensor arguments (None without any)."""
    return max(
        (v.shape[0] for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor) and v.dim() > 0),
        default=None,
    )


def _batch_leaves(leaves: list):
    """Indices of the leaves to cut along dim 0, or a ValueError.

    The batch size B is the largest dim 0 among the tensor arguments; tensors with B rows are cut,
    tensors with one row (batch-independent ones such as position embeddings [1, S, ...] or a mask
    built for a batch of 1) are given whole to every chunk, anything else is an error.
    """
    tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not tensors:
        return ValueError("Overlapped: the model got no tensor argument to cut along dim 0")
    B = max(leaves[i].shape[0] for i in tensors)
    odd = sorted({leaves[i].shape[0] for i in tensors} - {B, 1})
    if odd:
        return ValueError(
            f"Overlapped: tensor arguments are cut along dim 0, so they must have the batch's "
            f"{B} rows (or 1 row, given whole to every chunk); got sizes {odd}"
        )
    return [i for i in tensors if leaves[i].shape[0] == B]


class _TorchModes:
    """Thread-local torch state a chunk may change and keep across a switch.

    Grad mode, autocast and the saved-tensor hooks (activation checkpointing, ``save_on_cpu``) are
    per thread, not per greenlet: a chunk that yields inside ``torch.no_grad()``, ``torch.autocast``
    or a checkpointed region would hand them to the chunk resumed next (whose saved tensors would then
    be packed into the first chunk's checkpoint). The scheduler captures each chunk's state when it
    yields and restores it when the chunk resumes. Two captures compare equal when the grad mode and
    autocast states are equal and the hook stacks hold the same functions (by identity).
    """

    _DEVICES = ("cpu", "cuda")

    def __init__(self, grad: bool, autocast: tuple, hooks: list):
        self.grad, self.autocast, self.hooks = grad, autocast, hooks
        self._key = (grad, autocast, tuple(id(f) for pair in hooks for f in pair))  # (hooks kept alive above)

    def __eq__(self, other) -> bool:
        return isinstance(other, _TorchModes) and self._key == other._key

    __hash__ = None

    @classmethod
    def capture(cls) -> "_TorchModes":
        # (no hooks, the usual case: nothing to pop and push back)
        hooks = [] if _top_saved_tensor_hooks() is None else _pop_saved_tensor_hooks()
        _push_saved_tensor_hooks(hooks)
        return cls(
            torch.is_grad_enabled(),
            tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in cls._DEVICES),
            hooks,
        )

    def restore(self) -> None:
        torch.set_grad_enabled(self.grad)
        for d, (enabled, dtype) in zip(self._DEVICES, self.autocast):
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)
        if self.hooks or _top_saved_tensor_hooks() is not None:
            _pop_saved_tensor_hooks()
            _push_saved_tensor_hooks(self.hooks)


def _top_saved_tensor_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def _pop_saved_tensor_hooks() -> list:
    """Empty this thread's stack of default saved-tensor hooks; returns it, bottom first."""
    autograd = torch._C._autograd
    stack = []
    while (top := _top_saved_tensor_hooks()) is not None:
        stack.append(top)
        autograd._pop_saved_tensors_default_hooks()
    return stack[::-1]


def _push_saved_tensor_hooks(stack: list) -> None:
    for pack, unpack in stack:
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def not_started(n: int) -> dict:
    """The scheduler's ``waiting`` entries of n chunks before any has run.

    Chunk c >= 1 counts as if it had yielded just before the step's c-th yield, so the pipeline
    fills alternating a new chunk with the oldest started one (0, 1, 0, 2, 1, 3, ...): chunk 0's
    experts and combine run before chunk 2 starts, and its combine travels during chunk 2's
    prologue. Starting every chunk first left the link idle in the fill wherever a chunk's prologue
    (attention, dense layers) outlasts its dispatch.
    """
    return {c: (c - 0.5, False) for c in range(n)}


def next_chunk(live: list, waiting: dict, last) -> int:
    """The chunk to resume next: Lancet's "issue communication as early as possible", decided
    from the schedule alone (never from completion timing), so every rank issues its collectives
    in the same order.

    Among the live chunks other than the one that just yielded: first the earliest-yielded chunk
    whose next step issues a transfer (its counts exchange is on its way: it dispatches next), then
    the earliest-yielded chunk (round robin). Transfers finish in issue order on a FIFO link, so the
    earliest-yielded chunk is also the one whose transfer completes first.
    """
    pool = [c for c in live if c != last] or live
    urgent = [c for c in pool if waiting[c][1]]
    return min(urgent or pool, key=lambda c: waiting[c][0])


def _on_cuda(leaves) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in leaves)


def _concat(outputs: list):
    leaves0, spec = pytree.tree_flatten(outputs[0])
    per_chunk = [pytree.tree_flatten(o)[0] for o in outputs]
    merged = []
    for j, v in enumerate(leaves0):
        if isinstance(v, torch.Tensor):
            if v.dim() == 0:
                raise ValueError(
                    "Overlapped: a model output is a 0-dim tensor, which cannot be "
                    "concatenated along dim 0; return per-row outputs and reduce outside"
                )
            merged.append(torch.cat([leaves[j] for leaves in per_chunk], dim=0))
        else:
            merged.append(v)
    return pytree.tree_unflatten(merged, spec)
