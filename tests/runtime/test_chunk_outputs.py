"""Per-chunk outputs as pieces of one batch-sized buffer (scope.chunk_empty / ChunkScope.pieces): the
pieces, their sizes, the fallbacks (outside a scope, unknown sizes, a recomputation), and that a
chunked forward on the kernels gives the same bits with and without them. In backward, through the
ChunkSite an autograd node keeps (the norm's): the chunks' gradient pieces and a scratch buffer lent in
turn (ChunkSite.lend), the same bits, and a backward run twice or for some chunks only."""

import copy
import threading
from collections import deque

import pytest
import torch

import lancet_rt
from lancet_rt.runtime import scope
from tests.schedule.test_overlap import make_model


def _holds(s) -> bool:
    """Whether any site of ``s`` still holds pieces (and so a buffer) not handed out."""
    return any(site.holds() for site in s.sites.values())


def _in_scope(rows):
    s = scope.ChunkScope(rows, switch=lambda: None)
    scope.set_current(s)
    return s


@pytest.fixture(autouse=True)
def _no_scope_left():
    yield
    scope.set_current(None)


def test_each_chunk_gets_its_own_piece_of_one_buffer_sized_by_the_rows():
    s = _in_scope([3, 3, 1])
    got = []
    for c, lead in enumerate([6, 6, 2]):  # two tokens per row
        s.chunk = c
        got.append(scope.chunk_empty("site", (lead, 5), torch.float32, "cpu"))
    base = got[0].untyped_storage().data_ptr()
    assert [p.shape for p in got] == [(6, 5), (6, 5), (2, 5)]
    assert [p.data_ptr() - base for p in got] == [0, 6 * 5 * 4, 12 * 5 * 4]
    assert all(p.is_contiguous() and not p._is_view() for p in got)
    assert not _holds(s)  # every piece handed out: the scope holds no buffer
    # each piece is a tensor of its own for autograd: in place on one leaves the others' versions
    got[1].fill_(1.0)
    assert got[0]._version == 0 and got[2]._version == 0


def test_the_nth_call_of_a_site_in_a_chunk_is_the_nth_in_every_chunk():
    s = _in_scope([1, 1])
    a0, b0 = (scope.chunk_empty("site", (n, 2), torch.int32, "cpu") for n in (4, 3))
    s.chunk = 1
    a1, b1 = (scope.chunk_empty("site", (n, 2), torch.int32, "cpu") for n in (4, 3))
    assert a1.data_ptr() == a0.data_ptr() + 4 * 2 * 4 and b1.data_ptr() == b0.data_ptr() + 3 * 2 * 4


def test_fresh_tensors_where_the_pieces_do_not_apply():
    # outside a scope
    assert scope.chunk_empty("site", (4, 2), torch.float32, "cpu").shape == (4, 2)
    # one chunk: a plain allocation, no split
    s = _in_scope([2])
    assert scope.chunk_empty("site", (4, 2), torch.float32, "cpu").shape == (4, 2) and not _holds(s)
    # unknown sizes: the leading size not a whole multiple of the chunk's rows, or a chunk of no rows
    s = _in_scope([3, 1])
    assert scope.chunk_empty("site", (4, 2), torch.float32, "cpu").shape == (4, 2) and not _holds(s)
    s = _in_scope([0, 2])
    assert scope.chunk_empty("site", (0, 2), torch.float32, "cpu").shape == (0, 2) and not _holds(s)
    # another chunk's shape or dtype than the buffer's: fresh, and the buffer's piece stays unused
    s = _in_scope([1, 1])
    p0 = scope.chunk_empty("site", (2, 2), torch.float32, "cpu")
    s.chunk = 1
    for shape, dtype in (((3, 2), torch.float32), ((2, 3), torch.float32), ((2, 2), torch.float64)):
        p = scope.chunk_empty("site", shape, dtype, "cpu")
        assert p.shape == shape and p.dtype == dtype
        assert not (p.untyped_storage().data_ptr() == p0.untyped_storage().data_ptr())


def test_a_recomputation_in_a_scope_gets_fresh_memory():
    s = _in_scope([1, 1])
    p0 = scope.chunk_empty("site", (2, 2), torch.float32, "cpu")
    s.chunk = 1
    token = scope.CHUNK.replaying.set(deque())
    try:
        fresh = scope.chunk_empty("site", (2, 2), torch.float32, "cpu")
    finally:
        scope.CHUNK.replaying.reset(token)
    assert fresh.untyped_storage().data_ptr() != p0.untyped_storage().data_ptr()
    # the chunk's own piece is still there for its forward
    assert scope.chunk_empty("site", (2, 2), torch.float32, "cpu").data_ptr() == p0.data_ptr() + 16


def test_a_piece_outlives_the_scope_and_its_siblings():
    s = _in_scope([1, 1])
    p0 = scope.chunk_empty("site", (2, 3), torch.float32, "cpu")
    s.chunk = 1
    p1 = scope.chunk_empty("site", (2, 3), torch.float32, "cpu")
    scope.set_current(None)
    del s, p0
    p1.fill_(2.0)  # the buffer lives while a piece does
    assert torch.equal(p1, torch.full((2, 3), 2.0))


def _run(model, chunks, capacity_factor, defer_wgrad, checkpointed):
    torch.manual_seed(1)
    x, g = torch.randn(6, 3, 16), torch.randn(6, 3, 16)
    x.requires_grad_(True)
    if checkpointed:  # each block recomputed in backward (outside the scope: fresh memory)
        for block in model.blocks:
            fwd = block.forward
            block.forward = lambda h, fwd=fwd: lancet_rt.checkpoint(fwd, h)
    runner = lancet_rt.Overlapped(model, chunks=chunks, defer_wgrad=defer_wgrad)
    y = runner(x)
    y.backward(g)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


# (each option on and off, each chunk count and each capacity twice: 4 of the 16 combinations, for CI's time)
@pytest.mark.parametrize(
    "chunks,capacity_factor,defer_wgrad,checkpointed",
    [
        (3, None, False, False),
        (2, 1.25, True, False),
        (2, None, False, True),
        (3, 1.25, True, True),
    ],
)
def test_pieces_give_the_same_bits_on_the_kernels(monkeypatch, chunks, capacity_factor, defer_wgrad, checkpointed):
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    model = make_model(capacity_factor)
    twin = copy.deepcopy(model)
    used = []
    piece = scope.ChunkScope.pieces

    def counted(self, *args):
        p = piece(self, *args)
        used.append(p is not None)
        return p

    monkeypatch.setattr(scope.ChunkScope, "pieces", lambda self, *args: None)
    ref = _run(model, chunks, capacity_factor, defer_wgrad, checkpointed)
    monkeypatch.setattr(scope.ChunkScope, "pieces", counted)
    got = _run(twin, chunks, capacity_factor, defer_wgrad, checkpointed)
    assert any(used)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert (a is None and b is None) or torch.equal(a, b)


def test_count_outputs_share_one_buffer_each_chunk_its_own():
    s = _in_scope([1, 2])
    y0, s0 = scope.chunk_empty("site", (2, 3), torch.float32, "cpu", count=2)
    s.chunk = 1
    y1, s1 = scope.chunk_empty("site", (4, 3), torch.float32, "cpu", count=2)
    base = y0.data_ptr()
    # one [2 * 6, 3] buffer: the first output of every chunk, then the second's
    assert [p.data_ptr() - base for p in (y0, y1, s0, s1)] == [0, 2 * 12, 6 * 12, 8 * 12]
    assert [p.shape for p in (y0, y1, s0, s1)] == [(2, 3), (4, 3), (2, 3), (4, 3)]
    assert not _holds(s)
    scope.set_current(None)
    a, b = scope.chunk_empty("site", (2, 3), torch.float32, "cpu", count=2)
    assert a.data_ptr() != b.data_ptr()


def test_a_norm_output_piece_may_be_modified_in_place(monkeypatch):
    # the pieces are not views for autograd: a custom Function returns them as fresh outputs
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    from lancet_rt.dense import add_rmsnorm

    s = _in_scope([1, 1])
    w = torch.ones(8, requires_grad=True)
    outs = []
    for c in range(2):
        s.chunk = c
        x, r = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
        y, h = add_rmsnorm(x, r, w)
        outs.append((x, y * 1.0, h))
    assert outs[1][2].data_ptr() - outs[0][2].data_ptr() == 3 * 8 * 4  # the sums: pieces of one buffer
    scope.set_current(None)
    outs[1][2].mul_(2.0)  # in place on chunk 1's output leaves chunk 0's graph intact
    outs[0][1].sum().backward()
    assert outs[0][0].grad is not None


@pytest.mark.parametrize("capacity_factor", [1.25])  # (dropless: the kernels' test above, for CI's time)
def test_pieces_give_the_same_bits_over_accumulated_microbatches(monkeypatch, capacity_factor):
    # a new scope, so new buffers, for each microbatch's forward, its backward interleaved with the next
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    torch.manual_seed(1)
    mbs = [(torch.randn(4, 3, 16),) for _ in range(3)]
    gs = [torch.randn(4, 3, 16) for _ in range(3)]

    def step(model):
        ov = lancet_rt.Overlapped(model, chunks=2, defer_wgrad=True)
        losses = ov.accumulate(mbs, lambda y, i: (y * gs[i]).sum(), interleave=True)
        return [losses] + [p.grad for p in model.parameters()]

    model = make_model(capacity_factor)
    twin = copy.deepcopy(model)
    piece = scope.ChunkScope.pieces
    used = []

    def counted(self, *args):
        p = piece(self, *args)
        used.append(p is not None)
        return p

    monkeypatch.setattr(scope.ChunkScope, "pieces", lambda self, *args: None)
    ref = step(model)
    monkeypatch.setattr(scope.ChunkScope, "pieces", counted)
    got = step(twin)
    assert any(used)
    for a, b in zip(ref, got, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_lend_gives_the_chunks_one_buffer_in_turn_then_lets_it_go():
    site = scope.ChunkSite([2, 2, 1])
    first = site.lend((3, 4), torch.float32, "cpu")
    assert first is not None and first.shape == (3, 4) and first.is_contiguous()
    assert site.lend((3, 4), torch.float32, "cpu") is first
    assert site.lend((3, 4), torch.float32, "cpu") is first  # the last chunk's call
    # past one call per chunk (a second backward): the site has let the buffer go, the caller allocates
    assert site.lend((3, 4), torch.float32, "cpu") is None


def test_lend_where_the_caller_allocates():
    assert scope.ChunkSite([4]).lend((3, 4), torch.float32, "cpu") is None  # one chunk
    site = scope.ChunkSite([1, 1, 1, 1])
    buf = site.lend((3, 4), torch.float32, "cpu")
    assert site.lend((2, 4), torch.float32, "cpu") is None  # another shape (another program count)
    assert site.lend((3, 4), torch.float64, "cpu") is None  # another dtype
    got = []
    other = threading.Thread(target=lambda: got.append(site.lend((3, 4), torch.float32, "cpu")))
    other.start()
    other.join()
    assert got == [None]  # another thread than the first caller's: its calls might interleave with theirs
    assert site.lend((3, 4), torch.float32, "cpu") is None and buf is not None  # past one call per chunk


_TAKE, _LEND = scope.ChunkSite.take, scope.ChunkSite.lend


def _norm_chunks(monkeypatch, rows, residual, shared):
    """Chunks of add_rmsnorm on the kernels in a chunk scope (``shared``: with the ChunkSite's pieces and
    loans, else each call allocating): per chunk its inputs, outputs and their gradients; the sites'
    hand-outs from then on (the backward's), recorded."""
    monkeypatch.setenv("LANCET_KERNELS", "triton")
    from lancet_rt.dense import add_rmsnorm

    handed = []

    def record(kind, fn):
        return lambda self, *a: handed.append((kind, fn(self, *a))) or handed[-1][1]

    monkeypatch.setattr(scope.ChunkSite, "take", record("take", _TAKE) if shared else lambda self, *a: None)
    monkeypatch.setattr(scope.ChunkSite, "lend", record("lend", _LEND) if shared else lambda self, *a: None)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(60, generator=g) + 1).requires_grad_(True)
    s = _in_scope(rows)
    chunks = []
    for c, b in enumerate(rows):
        s.chunk = c
        x = torch.randn(b, 5, 60, generator=g, requires_grad=True)
        r = torch.randn(b, 5, 60, generator=g, requires_grad=True) if residual else None
        out = add_rmsnorm(x, r, w, 1e-5)
        outs = list(out) if residual else [out]
        grads = [torch.randn(o.shape, generator=g) for o in outs]
        chunks.append(([x, w] + ([r] if residual else []), outs, grads))
    scope.set_current(None)
    handed.clear()  # (the forward's pieces)
    return chunks, handed


@pytest.mark.parametrize("residual", [True, False])
def test_norm_backward_shares_the_chunks_buffers_same_bits(monkeypatch, residual):
    # rows [4, 1, 2] of 5 tokens: 20 / 5 / 10 rows, so the first chunk's program count differs (its
    # partials allocated afresh); backward in reverse chunk order, as a step runs it
    ref, _ = _norm_chunks(monkeypatch, [4, 1, 2], residual, shared=False)
    want = [torch.autograd.grad(outs, ins, g) for ins, outs, g in reversed(ref)]
    got, handed = _norm_chunks(monkeypatch, [4, 1, 2], residual, shared=True)
    have = [torch.autograd.grad(outs, ins, g) for ins, outs, g in reversed(got)]
    for a, b in zip(want, have, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    pieces = [h[0] for kind, h in handed if kind == "take" and h is not None]
    loans = [h for kind, h in handed if kind == "lend"]
    # each chunk's ds its piece of one buffer (chunk 2's backward first allocated it for all)
    assert len(pieces) == 3
    base = pieces[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in pieces)
    assert sorted(p.data_ptr() - base for p in pieces) == [0, 20 * 60 * 4, 25 * 60 * 4]
    # the partials: one buffer lent to chunks 2 and 1; chunk 0 (another program count) allocates its own
    assert len(loans) == 3 and loans[0] is not None and loans[1] is loans[0] and loans[2] is None


def test_norm_backward_twice_or_for_some_chunks_only(monkeypatch):
    ref, _ = _norm_chunks(monkeypatch, [1, 2], True, shared=False)
    want = [torch.autograd.grad(outs, ins, g) for ins, outs, g in ref]
    got, handed = _norm_chunks(monkeypatch, [1, 2], True, shared=True)
    # chunk 1 alone, twice (retain_graph): the second run gets no piece and no loan, and allocates
    ins, outs, g = got[1]
    for _ in range(2):
        assert all(map(torch.equal, torch.autograd.grad(outs, ins, g, retain_graph=True), want[1]))
    # then chunk 0, its piece still waiting for it
    ins, outs, g = got[0]
    assert all(map(torch.equal, torch.autograd.grad(outs, ins, g), want[0]))
    assert [h is not None for kind, h in handed if kind == "take"] == [True, False, True]
