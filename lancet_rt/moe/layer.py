"""The lancet-rt MoE layer: exact, expert-parallel, built as stages the scheduler can place.

Stages of one forward (docs/design.md, data flow)::

    route     x_TD -> logits_TE (float32) -> gate -> weight_TK, row_TK, kept_E
    permute   x_TD -> x_SD                     rows grouped by destination rank, then expert
    dispatch  x_SD -> x_RD on the experts' rank (counts first, then rows; async handle)
    experts   x_RD -> y_RD                     grouped GEMMs, SwiGLU
    combine   y_RD -> y_SD back on the token's rank (async handle)
    unpermute y_SD -> y_TD                     gather-based weighted sum over K

Between the two all-to-alls the layer yields to the overlap scheduler (:mod:`lancet_rt.schedule.scope`);
without one the yields are no-ops. The options are validated by :class:`lancet_rt.moe.config.MoEConfig`;
the dispatch, experts and combine are scheduled by a dispatcher (:mod:`lancet_rt.moe.dispatch`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lancet_rt import ops as _ops
from lancet_rt import trace as _trace
from lancet_rt.comm import faults
from lancet_rt.comm import group as comm
from lancet_rt.moe import library as _library
from lancet_rt.moe.config import MoEConfig, check_modules, check_prebuilt, config_names, config_vector, role_names
from lancet_rt.moe.dispatch import allreduce as _allreduce
from lancet_rt.moe.dispatch import alltoall, pipelined, shadow
from lancet_rt.moe.dispatch.common import Counts, Dispatched, Route, exchange_counts, number_layer
from lancet_rt.moe.experts import Experts
from lancet_rt.routing.functions import BatchRouting, gate, permute, unpermute
from lancet_rt.routing.router import Router
from lancet_rt.schedule import recompute as _recompute
from lancet_rt.schedule import scope as _scope


class MoE(nn.Module):
    """A Mixture-of-Experts FFN layer with exact routing and expert parallelism.

    Routing follows the contract in docs/design.md: float32 router, softmax or sigmoid scores, top-k with ties
    to the lower expert, optional renormalisation of the K weights, capacity
    ``C = ceil(capacity_factor * T * K / E)`` over the whole local batch with slots claimed in token
    order then k order (dropped assignments contribute zero), Switch aux loss and z-loss.

    Args:
        d_model: D, the token width.
        d_ffn: F, the experts' hidden width.
        num_experts: E, over all expert-parallel ranks.
        top_k: K, experts per token, 1 <= K <= E.
        capacity_factor: None for dropless, else > 0.
        score_fn: "softmax" or "sigmoid".
        normalize_topk: divide each token's K weights by their sum.
        aux_loss_coef: scale of the Switch aux loss whose gradient reaches the router in backward.
        z_loss_coef: scale of the router z-loss, likewise.
        ep_group: None (all experts local, even if a default process group exists), a
            torch.distributed ProcessGroup, or an :class:`~lancet_rt.comm.group.ExpertParallelGroup`
            such as :class:`lancet_rt.EmulatedGroup`. Expert e lives on rank e // (E / W).
        pipeline_chunks: split the dispatch, the experts and the combine of this layer into this
            many pieces and pipeline them (the Tutel-style baseline; 1 = off).
        router_bias: the router has a learned logit bias [E] (GPT-OSS).
        expert_bias: the router has a selection bias ``e_score_correction_bias`` [E]: experts are
            chosen by score + bias and weighted by the score (DeepSeek-V3's aux-loss-free balancing,
            updated by :func:`update_expert_bias`).
        n_group, topk_group: group-limited top-k (DeepSeek-V3): the E experts form ``n_group`` groups;
            only the ``topk_group`` groups with the largest sums of their two best selection scores
            can be chosen (1, None: no limit).
        routed_scaling_factor: the K weights are multiplied by it after the normalisation.
        shared_experts: a dense module [T, D] -> [T, D] added to the routed output (Qwen2-MoE's
            ``shared_expert``, DeepSeek's ``shared_experts``). It runs while the dispatch
            all-to-all is in flight: dense compute that hides communication.
        shared_expert_gate: a module [T, D] -> [T, 1]; the shared output is scaled by its sigmoid
            (Qwen2-MoE).
        router, experts: prebuilt modules to hold instead of new ones (an integration passes the
            model's own): ``router(x_TD)`` returns float32 logits [T, E] and has ``weight`` [E, D]
            (and ``e_score_correction_bias`` with ``expert_bias``); ``experts`` is an
            :class:`~lancet_rt.Experts` holding this rank's E/W experts.
        names: attribute names under which the submodules are registered, by role ("router",
            "experts", "shared_experts", "shared_expert_gate"); an integration keeps a model's own
            names (Hugging Face's router is "gate") so that state dicts keep their keys. The roles
            stay reachable as ``moe.router`` etc. whatever their names.
        shadow_experts: at most this many hot experts are shadowed per forward (FasterMoE, PPoPP'22;
            0, the default: off): their weights are broadcast to every rank once per step, which computes
            its own rows of them instead of sending them to the expert's rank; the gradients are reduced
            into the owner's parameters. Chosen from the counts exchange, the same on every rank; exact (outputs; weight
            gradients up to float32 reassociation of one sum). See :mod:`lancet_rt.moe.dispatch.shadow`.
        dispatcher: "alltoall" (expert parallelism: each rank its own tokens) or "allreduce"
            (PPMoE: the tokens are the same on every rank of ``ep_group``, each rank computes the
            rows routed to its experts and one all-reduce sums the outputs; see
            :mod:`lancet_rt.moe.dispatch.allreduce`).
        device, dtype: of the parameters.

    Under ``torch.autocast`` with float32 parameters the router stays float32 and the tokens, the
    all-to-alls and the expert GEMMs run in the autocast dtype (as ``nn.Linear`` would); the output
    has the input's dtype.

    Attributes after each forward (detached, for logging): ``aux_loss``, ``z_loss`` (unscaled),
    ``tokens_per_expert`` (int64 [E], assignments before dropping), ``dropped`` (int, dropped
    assignments); with ``shadow_experts``: ``shadowed`` (the experts the last chunk shadowed, a list).
    """

    _ROLES = ("router", "experts", "shared_experts", "shared_expert_gate")
    #: ``hook(layer, x) -> Optional[Exception]``, run by an expert-parallel forward outside
    #: :class:`lancet_rt.Overlapped` before the layer's first collective; an exception it returns is
    #: raised on every rank as a rejected input. :mod:`lancet_rt.schedule.warmup` installs its
    #: first-forward warm-up here (the layer imports nothing of the scheduler).
    before_collectives = None

    def __init__(
        self,
        d_model: int,
        d_ffn: int,
        num_experts: int,
        top_k: int,
        *,
        capacity_factor: Optional[float] = None,
        score_fn: str = "softmax",
        normalize_topk: bool = True,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        ep_group=None,
        pipeline_chunks: int = 1,
        dispatcher: str = "alltoall",
        router_bias: bool = False,
        expert_bias: bool = False,
        n_group: int = 1,
        topk_group: Optional[int] = None,
        routed_scaling_factor: float = 1.0,
        shared_experts: Optional[nn.Module] = None,
        shared_expert_gate: Optional[nn.Module] = None,
        router: Optional[nn.Module] = None,
        experts: Optional[Experts] = None,
        names: Optional[dict] = None,
        shadow_experts: int = 0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        cfg = MoEConfig(
            d_model,
            d_ffn,
            num_experts,
            top_k,
            capacity_factor=capacity_factor,
            score_fn=score_fn,
            normalize_topk=normalize_topk,
            aux_loss_coef=aux_loss_coef,
            z_loss_coef=z_loss_coef,
            pipeline_chunks=pipeline_chunks,
            dispatcher=dispatcher,
            expert_bias=expert_bias,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            dtype=dtype,
            router_bias=router_bias,
            shadow_experts=shadow_experts,
        )
        check_modules(shared_experts, shared_expert_gate, router, experts)
        names = role_names(names, self._ROLES, set(dir(type(self))) - set(self._ROLES))
        self.group = comm.as_group(ep_group)
        if cfg.dispatcher == "allreduce":
            _allreduce.check_group(self.group)
        world = self.group.size if self.group is not None else 1
        cfg.check_world(world)
        shadow.check_group(cfg.shadow_experts, self.group)
        self.shadow_experts = cfg.shadow_experts
        self.shadowed: list = []
        self.config = cfg  # the options as given (the cross-rank check compares them all: moe.config.WIRE_FIELDS)
        self.dispatcher = cfg.dispatcher
        self.d_model, self.d_ffn, self.num_experts, self.top_k = d_model, d_ffn, num_experts, top_k
        self.capacity_factor, self.score_fn, self.normalize_topk = cfg.capacity_factor, score_fn, cfg.normalize_topk
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.pipeline_chunks = pipeline_chunks
        self.expert_bias, self.n_group, self.topk_group = cfg.expert_bias, n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.ep_size = world
        self.ep_rank = self.group.rank if self.group is not None else 0
        self.num_local_experts = num_experts // world

        self._names = names
        if router is None:
            router = Router(d_model, num_experts, bias=router_bias, expert_bias=expert_bias, device=device, dtype=dtype)
        if experts is None:
            experts = Experts(self.num_local_experts, d_model, d_ffn, device=device, dtype=dtype)
        check_prebuilt(router, experts, d_model, num_experts, self.num_local_experts, expert_bias)
        for role, module in (
            ("router", router),
            ("experts", experts),
            ("shared_experts", shared_experts),
            ("shared_expert_gate", shared_expert_gate),
        ):
            if module is not None:
                # (not add_module: its "attribute exists" check would trip over the role properties)
                self._modules[self._names[role]] = module
        self._config_checked = self.group is None
        self.trace_name = "moe"
        self.layer_number = number_layer(self)  # (its counts exchanges' tag: the same layer on every rank)

        self.aux_loss: Optional[torch.Tensor] = None
        self.z_loss: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None
        self._dropped: Optional[torch.Tensor] = None
        # Assignments per expert since the last update_expert_bias (training forwards only).
        self.expert_load: Optional[torch.Tensor] = None

    # The submodules by role, whatever name they are registered under (``names``).
    def _role(self, role: str) -> Optional[nn.Module]:
        names = self.__dict__.get("_names")
        return None if names is None else self._modules.get(names[role])

    @property
    def router(self) -> nn.Module:
        module = self._role("router")
        if module is None:  # (an AttributeError, so that hasattr() during construction says no)
            raise AttributeError("router")
        return module

    @property
    def experts(self) -> Experts:
        module = self._role("experts")
        if module is None:
            raise AttributeError("experts")
        return module

    @property
    def shared_experts(self) -> Optional[nn.Module]:
        return self._role("shared_experts")

    @property
    def shared_expert_gate(self) -> Optional[nn.Module]:
        return self._role("shared_expert_gate")

    @property
    def dropped(self) -> int:
        """Dropped assignments in the last forward (a host sync when read, none in forward)."""
        return 0 if self._dropped is None else int(self._dropped)

    @property
    def local_experts(self) -> range:
        """The global indices of the experts this rank holds."""
        L = self.num_local_experts
        return range(self.ep_rank * L, (self.ep_rank + 1) * L)

    def extra_repr(self) -> str:
        extra = ""
        if self.expert_bias:
            extra += ", expert_bias=True"
        if self.n_group > 1:
            extra += f", n_group={self.n_group}, topk_group={self.topk_group}"
        if self.routed_scaling_factor != 1.0:
            extra += f", routed_scaling_factor={self.routed_scaling_factor}"
        return (
            f"d_model={self.d_model}, d_ffn={self.d_ffn}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, score_fn={self.score_fn!r}, "
            f"ep_size={self.ep_size}{extra}"
            + (f", dispatcher={self.dispatcher!r}" if self.dispatcher != "alltoall" else "")
        )

    # ---------------------------------------------------------------- validation
    def _input_error(self, x) -> Optional[Exception]:
        if not isinstance(x, torch.Tensor):
            return TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            return TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        p = self.router.weight
        if "meta" in (x.device.type, p.device.type, self.experts.gate_up_proj.device.type):
            return ValueError(
                f"{type(self).__name__} layer {self.trace_name!r}: a forward on the meta device computes nothing "
                f"(x on {x.device}, parameters on {p.device}); materialise the model first, e.g. "
                f"model.to_empty(device=...) and initialise its parameters, as after FSDP2's meta-device init"
            )
        if x.device != p.device:
            return ValueError(f"x must be on the parameters' device {p.device}, got {x.device}")
        allowed = {p.dtype}
        if torch.is_autocast_enabled(x.device.type):
            allowed.add(torch.get_autocast_dtype(x.device.type))
        if x.dtype not in allowed:
            return TypeError(
                f"x must have the parameters' dtype {p.dtype} (or the autocast dtype under "
                f"torch.autocast), got {x.dtype}"
            )
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            return ValueError(f"x must have shape [..., d_model={self.d_model}], got {tuple(x.shape)}")
        return None

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype of the tokens, the all-to-alls and the expert GEMMs: the autocast dtype under
        ``torch.autocast`` (as ``nn.Linear`` computes), else the parameters'."""
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return self.experts.gate_up_proj.dtype

    def _check_config(self, error: Optional[Exception]) -> None:
        """One all-gather on first use: every rank raises if configurations or inputs disagree."""
        rows = self.group.all_gather(config_vector(self, faults.status_code(error)))
        names = config_names()
        name = getattr(getattr(self.group, "monitor", None), "name", lambda q: f"rank {q}")
        for r in range(rows.shape[0]):  # compared before the status, so a rejected input cannot skip it
            diff = [n for n, a, b in zip(names, rows[r, 1:].tolist(), rows[self.ep_rank, 1:].tolist()) if a != b]
            if diff:
                raise faults.agreed(
                    ValueError(
                        f"MoE configuration differs across expert-parallel ranks: {name(r)} and "
                        f"{name(self.ep_rank)} differ in {', '.join(diff)}"
                    )
                )
        self._config_checked = True
        faults.raise_on_bad_status(rows[:, 0], error, self.group)

    # ---------------------------------------------------------------- stages
    def route(self, x_TD: torch.Tensor, state: BatchRouting, ops) -> Route:
        """Router GEMM and gating for this chunk; advances the batch's carried capacity."""
        logits_TE = self.router(x_TD)
        options = {}  # the contract's extensions, passed only when used
        if self.expert_bias:
            options["expert_bias"] = self.router.e_score_correction_bias
        if self.n_group > 1:
            options.update(n_group=self.n_group, topk_group=self.topk_group)
        if self.routed_scaling_factor != 1.0:
            options["scaling"] = self.routed_scaling_factor
        weight_TK, _expert_TK, row_TK, kept_E = gate(
            logits_TE,
            state,
            ops,
            score_fn=self.score_fn,
            normalize_topk=self.normalize_topk,
            aux_coef=self.aux_loss_coef,
            z_coef=self.z_loss_coef,
            **options,
        )
        return Route(weight_TK, row_TK, kept_E)

    def exchange_counts(self, kept_PE: torch.Tensor, error: Optional[Exception] = None) -> Counts:
        """Counts first: start sending each rank the rows it will get for each of its local experts.

        ``kept_PE`` holds the kept rows per expert of P pieces sent back to back. Returns a handle
        whose ``wait()`` gives recv [P, W, E_local] on the host: this is the layer's one host
        synchronisation point (split sizes must be on the host to size the row all-to-all), issued
        early and waited on late. The exchange carries a status column: a rank whose input was
        rejected (``error``) still takes part, and every rank raises instead of waiting in the row
        all-to-all.
        """
        return exchange_counts(self, kept_PE, error)

    def fail_peers(self, error: Exception) -> None:
        """Raise ``error`` on this rank and on every peer of the group.

        This rank takes part in the counts exchange the peers wait in, with a failure status, so they
        raise there instead of waiting forever (without a group it just raises).
        """
        if self.group is not None:
            if not self._config_checked:  # the peers' first collective is the configuration check
                self._check_config(error)
            z = torch.zeros(self.pipeline_chunks, self.num_experts, dtype=torch.long, device=self.router.weight.device)
            self.exchange_counts(z, error).wait()  # raises error
        raise error

    def dispatch(
        self,
        x_SD: torch.Tensor,
        kept_E: torch.Tensor,
        counts_WL: Optional[list],
        sent_WL: Optional[list],
        ops=None,
        received: Optional[torch.Tensor] = None,
    ) -> Dispatched:
        """Send each kept row to its expert's rank (async; :func:`lancet_rt.moe.dispatch.alltoall.dispatch`).

        Args:
            x_SD: [S, D] rows grouped by expert (so by destination rank).
            kept_E: [E] kept rows per expert, on the device.
            counts_WL, sent_WL: [W, E_local] rows received / sent per (rank, local expert), host ints
                from :meth:`exchange_counts` (``Counts.host``; without a group None, or ``[kept_E]``
                as host ints).
            ops, received: the kernel namespace and ``Counts.arrived``: the row maps made on the device
                where the kernels run (:func:`lancet_rt.moe.dispatch.alltoall.dispatch`).
        """
        return alltoall.dispatch(self, x_SD, kept_E, counts_WL, sent_WL, ops, received)

    def compute_experts(self, x_recv: torch.Tensor, d: Dispatched, ops, link=None) -> torch.Tensor:
        """Grouped SwiGLU experts over the received rows (rank-major in, rank-major out)."""
        with _trace.span("experts", cuda=x_recv.is_cuda, layer=self.trace_name, rows=x_recv.shape[0]):
            return self.experts(
                x_recv,
                d.segment_offsets(ops, x_recv.device),
                ops,
                to_expert=d.to_expert_major,
                to_rank=d.to_rank_major,
                link=link,
                bounds=d.bounds_L1,
            )

    def combine(self, y_recv: torch.Tensor, d: Dispatched) -> comm.Pending:
        """Send expert outputs back to the tokens' ranks (async)."""
        return alltoall.combine(self, y_recv, d)

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, dispatch, compute and combine ``x`` [..., d_model]; returns the same shape and dtype.

        Under ``torch.compile`` without expert parallelism or an overlap scope, the layer runs as lancet
        custom operators (:mod:`lancet_rt.moe.library`: no graph break); otherwise the compiled graph
        breaks at :meth:`forward_eager`.
        """
        if torch.compiler.is_compiling() and _library.traceable(self):
            return _library.forward(self, x)
        return self.forward_eager(x)

    @torch.compiler.disable  # collectives, host syncs and chunk switches: torch.compile runs around it
    def forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` on the eager runtime (collectives, chunk switches, deferred weight gradients),
        with ``x``'s GPU as the current CUDA device (an Overlapped step sets it around its chunks)."""
        if isinstance(x, torch.Tensor) and x.is_cuda and _scope.current() is None:  # (a non-tensor: rejected below)
            with _ops.on_device(x.device):
                return self._forward_eager(x)
        return self._forward_eager(x)

    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        error = self._input_error(x)
        if error is None and self.shadow_experts and self.group is not None:
            error = shadow.unsupported(self)  # (raised on every rank, as a rejected input)
        hook = MoE.before_collectives
        if error is None and hook is not None and self.group is not None and _scope.current() is None:
            error = hook(self, x)  # (the first forward's warm-up)
        if not self._config_checked:
            self._check_config(error)
        if error is not None:
            self.fail_peers(error)
        x_TD = x.reshape(-1, self.d_model)
        dtype = self._compute_dtype(x_TD)
        ops = _ops.get_ops(x_TD.device, dtype)
        state, replaying = self._routing_state(x_TD.shape[0], x_TD.device)

        scope = _scope.current()
        chunk = scope.chunk if scope is not None else None
        if scope is not None:
            scope.last_combine[chunk] = None  # (set below where this layer's combine qualifies)
        allreduce = self.dispatcher == "allreduce" and self.group is not None
        # (under autocast the replicated tokens meet the experts in the autocast dtype)
        x_in = _allreduce.replicated_input(x_TD.to(dtype), self.group, chunk) if allreduce else None
        with _trace.span("route", cuda=x_TD.is_cuda, layer=self.trace_name, chunk=chunk, tokens=x_TD.shape[0]):
            r = self.route(x_TD, state, ops)
        state.next_chunk += 1
        if state.complete and not replaying:
            self._record_stats(state)
        if allreduce:
            y_TD = _allreduce.allreduce_forward(self, x_in, r, ops, chunk).to(x.dtype)
            shared = self.shared_output(x_TD)
            return (y_TD if shared is None else y_TD + shared).view(x.shape)
        x_c = x_TD.to(dtype)  # under autocast the tokens travel and meet the experts in its dtype
        exchange = alltoall.exchange_and_compute if self.pipeline_chunks == 1 else pipelined.exchange_and_compute
        if self.shadow_experts and self.pipeline_chunks == 1 and self.group is not None:
            exchange = shadow.exchange_and_compute
        y_SD, src_S, link, shared = exchange(self, x_c, r, ops, chunk, x_TD)
        if scope is not None and exchange is alltoall.exchange_and_compute and link is not None and y_SD.requires_grad:
            scope.last_combine[chunk] = (y_SD, link)  # (lancet_rt.schedule.early_backward)
        with _trace.span("unpermute", cuda=x_TD.is_cuda, layer=self.trace_name, chunk=chunk):
            y_TD = unpermute(y_SD, r.row_TK, r.weight_TK, src_S, ops, link)
        y_TD = y_TD.to(x.dtype)
        if shared is not None:
            y_TD = y_TD + shared
        return y_TD.view(x.shape)

    def shared_output(self, x_TD: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared experts' output (gated by sigmoid(shared_expert_gate(x)) if there is a gate)."""
        if self.shared_experts is None:
            return None
        with _trace.span("shared experts", cuda=x_TD.is_cuda, layer=self.trace_name):
            y_TD = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                y_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * y_TD
        return y_TD

    def permute_rows(self, x_TD: torch.Tensor, r: Route, num_rows: int, ops, chunk) -> tuple:
        """(x_SD, src_S): the chunk's kept rows grouped by expert (``num_rows`` of them)."""
        with _trace.span("permute", cuda=x_TD.is_cuda, layer=self.trace_name, chunk=chunk):
            return permute(x_TD, r.row_TK, num_rows, ops)

    def _routing_state(self, T: int, device) -> tuple[BatchRouting, bool]:
        """This call's routing state, and whether it replays a recorded one (a recomputation)."""
        snap = _recompute.replayed()
        if snap is not None:
            state = BatchRouting(self.num_experts, self.top_k, snap.total_tokens, self.capacity_factor, device)
            state.used_E, state.kept_E = snap.used_E.clone(), snap.kept_E.clone()
            state.routed_tokens = snap.routed_tokens
            return state, True
        state = self._live_routing_state(T, device)
        if _recompute.recording():
            _recompute.record(
                _recompute.Snapshot(state.total_tokens, state.routed_tokens, state.used_E.clone(), state.kept_E.clone())
            )
        return state, False

    def _live_routing_state(self, T: int, device) -> BatchRouting:
        s = _scope.current()
        if s is None:
            return BatchRouting(self.num_experts, self.top_k, T, self.capacity_factor, device)
        key = s.call_key(self)
        chunk = s.chunk
        # Chunks pass the gating in order, so carried capacity is exact.
        while True:
            state = s.layer_state.get(key)
            if state is None and chunk == 0:
                state = BatchRouting(self.num_experts, self.top_k, _batch_tokens(T, s), self.capacity_factor, device)
                s.layer_state[key] = state
            if state is not None and state.next_chunk == chunk:
                break
            s.switch()
        if chunk == len(s.rows) - 1 and state.routed_tokens + T != state.total_tokens:
            raise RuntimeError(
                f"Overlapped: the MoE layer saw {state.routed_tokens + T} tokens over {len(s.rows)} "
                f"chunks but {state.total_tokens} were expected from chunk 0's tokens per row; the "
                f"model must be separable along dim 0 outside lancet MoE layers"
            )
        return state

    def _record_stats(self, state: BatchRouting) -> None:
        with torch.no_grad():
            self.aux_loss = state.aux_loss().detach()
            self.z_loss = state.z_loss().detach()
            self.tokens_per_expert = state.used_E.detach().long()
            _trace.record_expert_load(self, self.tokens_per_expert)
            self._dropped = state.used_E.long().sum() - state.kept_E.sum()  # read lazily: no sync here
            if self.expert_bias and self.training:
                load = state.used_E.long()
                self.expert_load = load if self.expert_load is None else self.expert_load + load


def _batch_tokens(T_chunk0: int, s) -> int:
    """Tokens of the whole local batch, from chunk 0's tokens per row (dim 0) of the inputs."""
    rows0 = s.rows[0]
    if rows0 == 0:
        return 0
    if T_chunk0 % rows0:
        raise RuntimeError(
            f"Overlapped: the MoE layer got {T_chunk0} tokens for {rows0} rows of chunk 0; tokens must "
            f"be a whole multiple of the rows along dim 0"
        )
    return T_chunk0 // rows0 * s.total_rows
