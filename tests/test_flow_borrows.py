"""The flow reading the local pieces' chunks (qwen3_5_joint.FLOW_BORROWS: joint.py's borrowed
chunks): a span step's flow is cut around each piece's span rows, packs them as the local pass
does and its scan reads the local piece's W, U, KD there while the pack, intra-chunk and output
kernels skip the flow's own copies. Pieces as the engine cuts them (span rows, then rows of
other segments riding in the piece, except after a captured span).

- Bit for bit the stream with the same cuts and no borrowing (every chunk computed for itself)
  on test_span_joint_layer.py's layouts (captures of -1, long-span entries, empty and leading
  empty sequences), the Pallas kernels interpreted with the scan's outputs and the skipped
  chunks starting as NaN (a chunk read that nothing wrote shows), and the XLA path.
- The flow's checkpoints at each span's start and end (cuts) and at its sequences' ends
  against the token-by-token recurrence in float64, and the layer against the separate passes.
- The capturing step lowers for CUDA with it."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta import joint
from kernels_pallas.gated_delta.api import CheckpointRows
from kernels_pallas.gated_delta.reference import gated_delta_reference
from minipic_jax.models import qwen3_5_gdn, qwen3_5_joint, qwen3_5_spans
from test_span_joint_layer import (CHUNK, KC, PALLAS, T, assert_outputs_equal, kernel_options,
                                   layer_case)
from test_span_joint_layer import nan_scan_outputs  # noqa: F401 (a fixture)

NAMES = ("core", "delta", "checkpoints", "local finals", "transitions")


@pytest.fixture(autouse=True)
def every_span_run_borrows(monkeypatch):
    """The layouts here hold short span runs (the hardest for the packing): every one borrows
    (the engine's runs borrow from a chunk of rows: qwen3_5_joint.BORROW_MIN_ROWS; the last
    test keeps it)."""
    monkeypatch.setattr(qwen3_5_joint, "BORROW_MIN_ROWS", 1)
SLOW = pytest.mark.slow  # (CI time)


def _layer(pieces, x, cu, p0, delta0, ck, kernel, *, borrow: bool):
    """recurrent_core of the joint stream with FLOW_BORROWS, its chunks borrowed (or, borrow
    False, the same cuts with every chunk computed for itself); traced here."""
    saved, packing = qwen3_5_joint.FLOW_BORROWS, qwen3_5_joint.joint_packing
    qwen3_5_joint.FLOW_BORROWS = True
    qwen3_5_joint.joint_packing = functools.partial(packing, borrow=borrow)
    try:
        plan = qwen3_5_spans.for_layer(qwen3_5_spans.prepare(pieces, cu, T, KC, CHUNK, p0), 0)
        return qwen3_5_gdn.recurrent_core(x, cu, p0, delta0, plan, checkpoint_at=ck,
                                          decode=False, packing=None, **kernel)
    finally:
        qwen3_5_joint.FLOW_BORROWS, qwen3_5_joint.joint_packing = saved, packing


def _span_case(rng, case):
    """layer_case's layout cut into pieces as the engine cuts them (serving/hybrid/span_rows.py
    `step_rows`: a piece starts at a sequence start, at a span start and after a captured span;
    other rows ride in the piece before them, so a piece is its span rows, then others), its
    captures moved onto span pieces, and checkpoints at every span's start and end; checks that
    some chunks are borrowed."""
    pieces, x, cu, p0, ck = layer_case(rng, case)
    pure, span = np.asarray(pieces.piece_cu), np.asarray(pieces.row_span)
    n, cu_np = int(cu[-1]), np.asarray(cu)
    spans = [p for p in range(pure.size - 1) if pure[p] < pure[p + 1] and span[pure[p]]]
    want = [c >= 0 for c in np.asarray(pieces.capture)]
    caps = iter(spans[:sum(want)])
    captured = [next(caps) if w else -1 for w in want]
    seg, starts, prev_captured = np.zeros(n, int), [], False
    for p in range(pure.size - 1):
        a, b = pure[p], pure[p + 1]
        if a == b:
            continue
        if span[a] or a in cu_np or prev_captured or not starts:
            starts.append(p)
        seg[a:b] = len(starts) - 1
        prev_captured = p in captured
    riding = qwen3_5_spans.pieces_from_segments(seg, T, pure.size - 1, span[:n],
                                                np.asarray(pieces.carry_local))
    new_id = {p: starts.index(p) for p in starts}
    capture = jnp.asarray([new_id[c] if c >= 0 else -1 for c in captured], jnp.int32)
    pieces = dataclasses.replace(pieces, piece_cu=riding.piece_cu, capture=capture)
    saved = qwen3_5_joint.FLOW_BORROWS
    qwen3_5_joint.FLOW_BORROWS = True
    try:
        # jitted: eagerly each of the plan's ops was an XLA program of its own (~400)
        jp = jax.jit(lambda pc, c, p: qwen3_5_spans.prepare(pc, c, T, KC, CHUNK, p))(
            pieces, cu, p0)["joint"]["joint"]
    finally:
        qwen3_5_joint.FLOW_BORROWS = saved
    src = np.asarray(jp["chunk_src"])
    assert (src != np.arange(src.size)).sum() >= 2, src  # chunks are borrowed
    assert int(jp["n_used"]) <= src.size, (int(jp["n_used"]), src.size)  # within the bound
    assert len(spans) == sum(want) or any(  # every span captured, or one with rows after it
        pure[p + 1] < int(riding.piece_cu[new_id[p] + 1]) for p in spans), "no riding rows"
    return pieces, x, cu, p0, _with_span_checkpoints(pure, span, cu, p0, ck, spans)


def _with_span_checkpoints(pure, span, cu, p0, ck, spans):
    """ck without those strictly inside a span (the engine asks for none there:
    serving/hybrid/span_cache.py `_checkpoints`; the flow over a span runs on its grid), plus one
    at every span's first row and after its last."""
    cu, p0 = np.asarray(cu), np.asarray(p0)
    runs = [(pure[p], pure[p + 1]) for p in spans]
    seq, pos = [], []
    for s, at in zip(np.asarray(ck.seq), np.asarray(ck.pos)):
        row = cu[s] + at - p0[s]
        if not any(a < row < b for a, b in runs):
            seq.append(s)
            pos.append(at)
    for a, b in runs:
        s = int(np.searchsorted(cu, a, side="right") - 1)
        for row in (a, b):
            seq.append(s)
            pos.append(int(p0[s]) + int(row - cu[s]))
    return CheckpointRows(seq=jnp.asarray(seq, jnp.int32), pos=jnp.asarray(pos, jnp.int32))


@pytest.mark.parametrize("case,impl", [
    ("shifted, empty, captures of -1", PALLAS), ("leading empty sequences", "xla"),
    pytest.param("leading empty sequences", PALLAS, marks=SLOW),
    pytest.param("the local stream's bound", PALLAS, marks=SLOW)])
def test_borrowed_chunks_are_the_cut_stream_bit_for_bit(fresh_rng, nan_scan_outputs, case,
                                                        impl):
    pieces, x, cu, p0, ck = _span_case(fresh_rng, case)
    delta0 = jnp.asarray(fresh_rng.standard_normal((cu.shape[0] - 1,) + (2, 16, 16)),
                         jnp.float32)
    kernel = kernel_options(impl)

    def both(*x):  # one program (one compile)
        return [_layer(pieces, x, cu, p0, delta0, ck, kernel, borrow=b) for b in (False, True)]
    own, borrowed = ([None if a is None else np.asarray(a) for a in o] for o in jax.jit(both)(*x))
    assert_outputs_equal(own, borrowed, int(cu[-1]), exact=True, names=NAMES)


@pytest.mark.parametrize("impl", [PALLAS, pytest.param("xla", marks=SLOW)])
def test_the_flow_over_borrowed_chunks_is_the_recurrence(fresh_rng, nan_scan_outputs, impl):
    """Checkpoints at the captured pieces' cuts and the sequences' ends against float64 token by
    token; the whole layer against the separate passes (the flow packed on its own grid)."""
    pieces, x, cu, p0, ck = _span_case(fresh_rng, "shifted, empty, captures of -1")
    delta0 = jnp.asarray(fresh_rng.standard_normal((cu.shape[0] - 1,) + (2, 16, 16)),
                         jnp.float32)
    kernel = kernel_options(impl)

    def both(*x):
        separate = qwen3_5_gdn.recurrent_core(
            x, cu, p0, delta0, qwen3_5_spans.for_layer(qwen3_5_spans.prepare(
                pieces, cu, T, KC, CHUNK), 0), checkpoint_at=ck, decode=False,
            packing=qwen3_5_spans.ragged_packing(cu, p0, T, chunk=CHUNK), **kernel)
        return separate, _layer(pieces, x, cu, p0, delta0, ck, kernel, borrow=True)
    separate, borrowed = ([None if a is None else np.asarray(a) for a in o]
                          for o in jax.jit(both)(*x))
    for name, a, b in zip(NAMES, separate, borrowed):  # checkpoints: off-grid in the separate
        if name != "checkpoints" and a is not None:    # pass (rounded), exact here: below
            rows = int(cu[-1]) if name == "core" else len(a)
            np.testing.assert_allclose(b[:rows], a[:rows], rtol=2e-5, atol=2e-5, err_msg=name)
    cu_np, p0_np = np.asarray(cu), np.asarray(p0)
    checked = 0
    for i, (s, pos) in enumerate(zip(np.asarray(ck.seq), np.asarray(ck.pos))):
        n = int(pos - p0_np[s])
        if not 0 < n <= cu_np[s + 1] - cu_np[s]:
            continue
        rows = slice(int(cu_np[s]), int(cu_np[s]) + n)
        _, states = gated_delta_reference(*(np.asarray(a)[None, rows] for a in x),
                                          np.asarray(delta0)[s:s + 1])
        np.testing.assert_allclose(borrowed[2][i], states[0, -1], rtol=1e-4, atol=1e-4,
                                   err_msg=f"checkpoint {i} (sequence {s}, {n} rows)")
        checked += 1
    assert checked >= 6, checked  # the pieces' starts and ends among them


def test_a_borrowing_unit_reads_its_lenders_chunks():
    """joint_packing's chunk_src: a cut's rows packed from a chunk's first slot, its chunks
    mapped onto the lender's one to one; every other chunk its own; checkpoint bounds at the
    cut and after it."""
    flow = joint.Pass(jnp.asarray([0, 150, 200], jnp.int32), jnp.asarray([10, 70], jnp.int32),
                      jnp.arange(200, dtype=jnp.int32),
                      cuts=joint.Cuts(jnp.asarray([40, 130, 500], jnp.int32),
                                      jnp.asarray([2, -1, -1], jnp.int32)))
    local = joint.Pass(jnp.asarray([0, 90], jnp.int32), jnp.zeros(1, jnp.int32),
                       jnp.arange(40, 130, dtype=jnp.int32))
    jp = jax.jit(lambda: joint.joint_packing([flow, local], 200, chunk=CHUNK))()  # (one compile)
    src, slot = np.asarray(jp["chunk_src"]), np.asarray(jp["slot_of"][0])
    assert slot[40] % CHUNK == 0  # the borrowed rows start a chunk
    lender = int(jp["first"][2])
    borrowed = np.arange(slot[40] // CHUNK, slot[129] // CHUNK + 1)
    np.testing.assert_array_equal(src[borrowed], lender + np.arange(borrowed.size))
    assert borrowed.size == int(jp["n_ch"][2]) == 2
    own = np.setdiff1d(np.arange(src.size), borrowed)
    np.testing.assert_array_equal(src[own], own)
    np.testing.assert_array_equal(np.asarray(jp["slot_of"][1]), slot[40:130] - (
        slot[40] - lender * CHUNK))  # the lender's rows in the same slots of its chunks
    # after the cut (row 130, position 140) the rows start a chunk at their own offset: 140 % 64
    assert slot[130] % CHUNK == 140 % CHUNK
    use, bound = joint.checkpoint_bounds(
        (jnp.asarray([0, 0, 0], jnp.int32), jnp.asarray([50, 140, 160], jnp.int32)),
        flow.pos0, jp, jp["src"].shape[0] // CHUNK)
    assert np.asarray(use).all()
    assert int(bound[0]) == slot[39] // CHUNK + 1  # at the cut: after the unit before it
    assert int(bound[1]) == borrowed[-1] + 1  # after the borrowed rows: their last chunk
    assert int(bound[2]) == slot[149] // CHUNK + 1  # the sequence's end


def test_the_capturing_step_lowers_for_cuda_with_borrowed_chunks(monkeypatch):
    """Qwen3.5-0.8B's widths (one GDN layer), rag's capturing step shapes, lowered for an H100
    with FLOW_BORROWS: the scan's chunk_src and the intra / output / pack kernels' live chunks
    reach Triton (the pack kernel, intra, scan, output and transition kernels of the layer)."""
    import re

    from tests.cuda_lowering import capturing_step_text
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(qwen3_5_joint, "FLOW_BORROWS", True)
    text = capturing_step_text()
    assert len(re.findall("xla.gpu.triton", text)) >= 5


def test_the_static_bound_holds_the_cut_flow(fresh_rng):
    """qwen3_5_joint.plan's static stream bound (+ one chunk a borrowed piece) holds the used
    chunks of random engine-like layouts at the host's own bounds (span_step.piece_bound,
    span_rows.local_chunk_bound): short spans at awkward offsets, riding rows, one-row
    sequences, shifted starts."""
    from serving.hybrid import span_rows, span_step
    from serving.model_contract import SpanPieces
    t, s = 512, 8
    g, local_bound = span_step.piece_bound(t, s), span_rows.local_chunk_bound(t, s)

    @jax.jit
    def used(piece_cu, row_span, cu, pos0):
        pieces = SpanPieces(row_span=row_span, piece_cu=piece_cu,
                            carry_local=jnp.zeros(s, bool), local_chunks=local_bound)
        jp = qwen3_5_joint.plan(pieces, jnp.zeros(s, jnp.int32), cu, pos0, t, CHUNK)["joint"]
        return jp["n_used"], jp["src"].shape[0] // CHUNK
    def check(lens, seg, span, pos0):
        p = qwen3_5_spans.pieces_from_segments(np.asarray(seg), t, g, np.asarray(span),
                                               np.zeros(s, bool))
        piece = np.searchsorted(np.asarray(p.piece_cu), np.arange(len(seg)), "right") - 1
        if span_step.step_local_chunks(piece, np.asarray(span)) > local_bound:
            return 0  # the host cuts such a step (span_rows.cut_local)
        cu = jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)
        n_used, n_chunks = used(p.piece_cu, p.row_span, cu, jnp.asarray(pos0, jnp.int32))
        assert int(n_used) <= n_chunks, (int(n_used), n_chunks, lens)
        return int(n_used)

    saved = qwen3_5_joint.FLOW_BORROWS
    qwen3_5_joint.FLOW_BORROWS = True
    try:  # the worst case: one-row spans inside cells (each takes three chunks for its cell)
        lens, seg, span = [64] * s, [], []
        for q in range(s):  # 4 one-row spans a sequence after 7 PDEP rows each: 32 pieces
            ids = np.repeat(np.arange(8), [7, 1, 7, 1, 7, 1, 7, 1 + 64 - 32])
            seg += (q * 8 + np.where(np.arange(64) < 32, (ids + 1) // 2, 4)).tolist()
            span += ([False] * 7 + [True]) * 4 + [False] * 32
        assert check(lens, seg, span, [3] * s) > 100  # (above the bound of one chunk a piece)
        checked = 0
        while checked < 24:
            lens = fresh_rng.multinomial(t - int(fresh_rng.integers(0, 40)), np.ones(s) / s)
            seg, span, base = [], [], 0
            for n in lens:
                k, sid = 0, 0
                while k < n:  # PDEP and span runs of 1..90 rows; a span starts a piece
                    run = min(int(fresh_rng.integers(1, 91)), n - k)
                    is_span = bool(fresh_rng.random() < 0.6)
                    sid += is_span or k == 0
                    seg += [base + sid] * run
                    span += [is_span] * run
                    k += run
                base += sid + 1
            checked += bool(check(lens, seg, span, fresh_rng.integers(0, 200, s)))
    finally:
        qwen3_5_joint.FLOW_BORROWS = saved


def test_only_span_runs_of_a_chunk_borrow(monkeypatch):
    """The engine's threshold (BORROW_MIN_ROWS, a chunk): a 100-row span's flow rows read its
    local piece's two chunks, a 30-row span's stay on the flow's grid (its cuts would add scan
    steps for less than a chunk of work)."""
    from serving.model_contract import SpanPieces
    monkeypatch.setattr(qwen3_5_joint, "BORROW_MIN_ROWS", 64)
    monkeypatch.setattr(qwen3_5_joint, "FLOW_BORROWS", True)
    # one sequence: PDEP 10, span 100 (+ 5 riding PDEP rows), span 30 (+ 15 riding)
    seg = np.repeat([0, 1, 2], [10, 105, 45])
    span = np.r_[np.zeros(10, bool), np.ones(100, bool), np.zeros(5, bool), np.ones(30, bool),
                 np.zeros(15, bool)]
    p = qwen3_5_spans.pieces_from_segments(seg, T, 8, span, np.zeros(1, bool))
    pieces = SpanPieces(row_span=p.row_span, piece_cu=p.piece_cu, carry_local=p.carry_local)
    jp = jax.jit(lambda: qwen3_5_joint.plan(
        pieces, jnp.zeros(1, jnp.int32), jnp.asarray([0, 160], jnp.int32),
        jnp.asarray([0], jnp.int32), T, CHUNK)["joint"])()
    src = np.asarray(jp["chunk_src"])
    borrowed = np.flatnonzero(src != np.arange(src.size))
    lender = int(jp["first"][1 + 1])  # the local pass's piece 1 (the 100-row span)
    np.testing.assert_array_equal(src[borrowed], [lender, lender + 1])
