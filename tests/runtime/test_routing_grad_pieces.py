"""The routing Functions' per-token gradients as the chunks' pieces of one batch-sized buffer in backward
(lancet_rt.routing.functions._GradPieces over scope.ChunkSite): the gate's logits gradient, the permute's
token gradient, the unpermute's weight gradient and (dropless) its rows' gradient. The first chunk whose
backward runs allocates for all; the same bits as the kernels' own allocations; a backward run again
(retain_graph), a backward of some chunks only, a recomputation and a capacity's rows fall back to
fresh memory; a chunked training step gives the same bits with and without the pieces."""

import copy

import pytest
import torch

import lancet_rt
from lancet_rt.ops import get_ops
from lancet_rt.routing import functions
from lancet_rt.routing.functions import BatchRouting, gate, permute, unpermute
from lancet_rt.runtime import scope
from tests.schedule.test_overlap import make_model

CPU = torch.device("cpu")
E, K, D = 7, 2, 5
ROWS = [2, 1]  # chunks of 2 and 1 rows, 3 tokens a row: T = 6 and 3
TOKENS = [6, 3]


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    yield
    scope.set_current(None)


def _ops():
    return get_ops(CPU, torch.float32)


def _chunks(capacity_factor=None, rows=ROWS, tokens=TOKENS):
    """Each chunk's routing and permute/unpermute, run in one chunk scope (then left): their inputs, outputs."""
    torch.manual_seed(0)
    ops = _ops()
    s = scope.ChunkScope(rows, switch=lambda: None)
    scope.set_current(s)
    state = BatchRouting(E, K, sum(tokens), capacity_factor, CPU)
    runs = []
    for c, T in enumerate(tokens):
        s.chunk = c
        logits = torch.randn(T, E, requires_grad=True)
        x = torch.randn(T, D, requires_grad=True)
        w, expert, row, kept = gate(
            logits, state, ops, score_fn="softmax", normalize_topk=True, aux_coef=0.01, z_coef=0.001
        )
        x_SD, src = permute(x, row, int(kept.sum()), ops)
        y_SD = (x_SD * 2.0).detach().requires_grad_(True)
        y = unpermute(y_SD, row, w, src, ops, None, dropless=capacity_factor is None)
        runs.append(dict(logits=logits, x=x, w=w, expert=expert, row=row, x_SD=x_SD, y_SD=y_SD, y=y))
    scope.set_current(None)
    return state, runs


def _want(state, r, g_y, g_xSD):
    """The gradients from the kernels called directly (their own allocations)."""
    ops = _ops()
    g_ySD, g_w = ops.unpermute_bwd(g_y, r["y_SD"], r["row"], r["w"].detach(), None)
    g_logits = ops.gating_bwd(r["logits"].detach(), r["expert"], g_w, *state.loss_grads(torch.float32, 0.01, 0.001))
    return dict(y_SD=g_ySD, logits=g_logits, x=ops.permute_bwd(g_xSD, r["row"]))


def _grads(r, g_y, g_xSD):
    """Chunk r's backward: through the unpermute to the rows and the gate, and through the permute."""
    g_ySD, g_logits = torch.autograd.grad(r["y"], (r["y_SD"], r["logits"]), g_y, retain_graph=True)
    (g_x,) = torch.autograd.grad(r["x_SD"], r["x"], g_xSD, retain_graph=True)
    return dict(y_SD=g_ySD, logits=g_logits, x=g_x)


def _inputs(runs):
    torch.manual_seed(1)
    return [(torch.randn_like(r["y"]), torch.randn_like(r["x_SD"])) for r in runs]


def test_the_chunks_gradients_are_pieces_of_one_buffer_the_last_chunk_first():
    state, runs = _chunks()
    gs = _inputs(runs)
    got = [None, None]
    for c in (1, 0):  # the last chunk's backward first: it allocates for both
        got[c] = _grads(runs[c], *gs[c])
    for c in (0, 1):
        for name, want in _want(state, runs[c], *gs[c]).items():
            assert torch.equal(got[c][name], want), name
    # chunk 1's piece right after chunk 0's, in each buffer (the chunks' rows: 2 and 1)
    for name, per_token in (("logits", E), ("x", D), ("y_SD", K * D)):
        step = TOKENS[0] * per_token * 4
        assert got[1][name].data_ptr() - got[0][name].data_ptr() == step, name
        assert got[0][name].is_contiguous() and not got[0][name]._is_view()


def test_a_backward_run_again_or_of_some_chunks_gets_fresh_memory_and_the_same_values():
    state, runs = _chunks()
    gs = _inputs(runs)
    first = _grads(runs[0], *gs[0])  # chunk 1's backward never runs: its pieces stay unused
    again = _grads(runs[0], *gs[0])  # retain_graph: its pieces were taken, fresh memory now
    want = _want(state, runs[0], *gs[0])
    for name in want:
        assert torch.equal(first[name], want[name]) and torch.equal(again[name], want[name]), name
        assert again[name].untyped_storage().data_ptr() != first[name].untyped_storage().data_ptr(), name
    # the whole graph backward twice (retain_graph): the gradients accumulate exactly
    loss = sum((r["y"] * g).sum() + (r["x_SD"] * h).sum() for r, (g, h) in zip(runs, gs))
    loss.backward(retain_graph=True)
    once = [r["logits"].grad.clone() for r in runs]
    loss.backward()
    assert all(torch.equal(r["logits"].grad, 2 * g) for r, g in zip(runs, once))


def test_with_a_capacity_the_rows_gradient_is_not_a_piece():
    # (the chunks keep different numbers of rows: only the per-token gradients are pieces)
    state, runs = _chunks(capacity_factor=0.6)
    gs = _inputs(runs)
    got = [_grads(r, *g) for r, g in zip(runs, gs)]
    for c in (0, 1):
        for name, want in _want(state, runs[c], *gs[c]).items():
            assert torch.equal(got[c][name], want), name
    assert got[1]["logits"].data_ptr() - got[0]["logits"].data_ptr() == TOKENS[0] * E * 4
    s0, s1 = (g["y_SD"].untyped_storage().data_ptr() for g in got)
    assert s0 != s1


def test_no_pieces_outside_a_scope_or_in_a_recomputation(monkeypatch):
    taken = []
    real = scope.ChunkSite.take
    monkeypatch.setattr(scope.ChunkSite, "take", lambda self, *a: taken.append(a) or real(self, *a))
    ops = _ops()
    logits = torch.randn(4, E, requires_grad=True)
    w = gate(
        logits, BatchRouting(E, K, 4, None, CPU), ops, score_fn="softmax", normalize_topk=True, aux_coef=0, z_coef=0
    )[0]
    w.sum().backward()
    assert logits.grad is not None and not taken
    s = scope.ChunkScope([1, 1], switch=lambda: None)
    scope.set_current(s)
    token = scope.CHUNK.replaying.set(__import__("collections").deque())
    try:
        g = functions._GradPieces("site")
    finally:
        scope.CHUNK.replaying.reset(token)
    assert g.sites == (None,) and g.take(0, (2, 2), torch.float32, CPU) is None


@pytest.mark.parametrize("capacity_factor,defer_wgrad", [(None, False), (1.25, True)])
def test_a_chunked_step_gives_the_same_bits_with_and_without_the_pieces(monkeypatch, capacity_factor, defer_wgrad):
    model = make_model(capacity_factor)
    twin = copy.deepcopy(model)
    used = []
    take = functions._GradPieces.take

    def counted(self, *args):
        p = take(self, *args)
        used.append(p is not None)
        return p

    def run(m):
        torch.manual_seed(1)
        x, g = torch.randn(6, 3, 16, requires_grad=True), torch.randn(6, 3, 16)
        y = lancet_rt.Overlapped(m, chunks=3, defer_wgrad=defer_wgrad)(x)
        y.backward(g)
        return [y.detach(), x.grad] + [p.grad for p in m.parameters()]

    monkeypatch.setattr(functions._GradPieces, "take", lambda self, *args: None)
    ref = run(model)
    monkeypatch.setattr(functions._GradPieces, "take", counted)
    got = run(twin)
    assert any(used)
    for a, b in zip(ref, got):
        assert (a is None and b is None) or torch.equal(a, b)
