"""The local pass of a hybrid span step sized by what its span pieces can take (issue 29: where a
span step's extra cost goes). Its packed stream used to be sized for every piece of the piece
bound padded to a chunk (165 chunks = 10,560 rows at the rag bench's 1,024 tokens and 16 seats,
for ~1,000 span rows); its XLA gathers and buffers cost the whole stream in every GDN layer. Now
the scheduler keeps each chunk's span pieces within LOCAL_SLACK chunks of its rows
(span_rows.cut_local), so a step's fit `local_chunk_bound` (72 chunks there), which the runner
checks and the model's packing takes (SpanPieces.local_chunks), with the same outputs."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_inputs import gdn_inputs
from minipic_jax.models import qwen3_5_spans
from serving.hybrid import span_rows, span_step
from serving.layout import build_layout
from serving.sequence import Sequence

BS, PAD, SSEP, PDEP = 4, 0, 1, 2


def _seq(tokens):
    lay = build_layout(tokens, BS, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    return Sequence("r", tokens, lay, None, BS, seed=0)


# plain 0..3 | six 2-token spans (one block each: SSEP, a token, two pads) | PDEP 28..30
SHORT_SPANS = [5, 6, 7, 8] + [SSEP, 9, PAD, PAD] * 6 + [PDEP, 3, 4]


def test_the_host_counts_chunks_of_the_kernels_size():
    """The scheduler and the runner count the local pass's chunks in LOCAL_CHUNK rows and the
    model packs in qwen3_5.CHUNK rows: were the kernel's chunk smaller, a step within the host's
    bound would overflow the packed stream and lose tokens without a word."""
    from minipic_jax.models import qwen3_5
    assert span_rows.LOCAL_CHUNK == qwen3_5.CHUNK


def test_a_chunk_of_many_short_spans_is_cut_before_the_span_that_overflows():
    """19 rows, 6 span pieces of 2 rows: with 16-row chunks they take 6 chunks, more than
    ceil(19 / 16) + LOCAL_SLACK = 4, so the chunk ends before the 4th span (3 pieces always fit)
    and the next chunk takes the rest whole; with 4- or 2-row chunks (7 and 12 fit) nothing is
    cut."""
    seq = _seq(SHORT_SPANS)
    idx = np.flatnonzero(~seq.layout.is_pad)
    assert span_rows.local_chunks(seq, idx, BS, chunk=16) == 6
    got, frontier = span_rows.cut_chunk(seq, idx, 31, BS, chunk=16)
    assert frontier == 16 and got.tolist() == idx[idx < 16].tolist()  # spans at 4, 8, 12 kept
    assert span_rows.local_chunks(seq, got, BS, chunk=16) == 3 <= 1 + span_rows.LOCAL_SLACK
    for chunk in (2, 4):
        kept, end = span_rows.cut_chunk(seq, idx, 31, BS, chunk=chunk)
        assert end == 31 and kept.tolist() == idx.tolist(), chunk
    rest = idx[idx >= 16]
    seq.num_computed = 16
    kept, end = span_rows.cut_chunk(seq, rest, 31, BS, chunk=16)
    assert end == 31 and kept.tolist() == rest.tolist()


def test_rag_passages_never_cut_however_they_align():
    """rag's span pieces are an SSEP and 128 passage tokens: 129 rows, 3 chunks of 64 each (one
    row past two). Seven of them in one 910-row chunk take 21 chunks; 910 rows may give 15 + 2 +
    7: no cut, so the rag bench schedules as before (with LOCAL_SLACK alone, 17, it cut)."""
    passage = [SSEP] + [9] * 128 + [PAD] * 3  # 33 blocks of 4
    seq = _seq([5, 6, 7, 8] + passage * 7 + [PDEP, 3, 4])
    idx = np.flatnonzero(~seq.layout.is_pad)
    assert idx.size == 4 + 7 * 129 + 3
    assert span_rows.local_chunks(seq, idx, BS) == 21
    got, frontier = span_rows.cut_chunk(seq, idx, len(seq.layout.is_pad), BS)
    assert got.size == idx.size and frontier == len(seq.layout.is_pad)


def _entry(seq, idx):
    return types.SimpleNamespace(seq=seq, token_idx=np.asarray(idx), map_chain=(), map_caps=())


def test_the_runner_refuses_a_step_past_the_local_bound():
    """fill_rows counts the local pass's chunks exactly (each piece's span rows padded to 64)
    and names the bound a step of 64 rows and 1 sequence breaks (1 + 3 chunks: 6 spans given
    uncut)."""
    seq = _seq(SHORT_SPANS)
    idx = np.flatnonzero(~seq.layout.is_pad)
    piece, span_row, _ = span_rows.step_rows([_entry(seq, idx)], BS)
    assert span_step.step_local_chunks(piece, span_row) == 6
    t, s = 64, 1
    v = dict(piece_cu=np.zeros(span_step.piece_bound(t, s) + 1, np.int32),
             row_span=np.zeros(t, np.int32), carry_local=np.zeros(s, np.int32))
    with pytest.raises(RuntimeError, match="take 6 local-pass chunks, more than its bound 4"):
        span_step.fill_rows([_entry(seq, idx)], v, idx.size, BS, t, s)
    cut, _ = span_rows.cut_chunk(seq, idx, 31, BS)  # the scheduler's chunk: 64-row chunks fit
    span_step.fill_rows([_entry(seq, cut)], v, cut.size, BS, t, s)


def test_the_runner_counts_the_chunks_the_scheduler_counted(fresh_rng):
    """The runner's check (step_local_chunks over step_rows' pieces) and the scheduler's cut
    (span_rows.local_chunks over the sequence's spans) count one chunk alike, wherever it
    starts (mid-span: a long span's continued piece) or ends: were the runner's higher, a step
    the scheduler let through would stop the engine."""
    for _ in range(60):
        tokens = [5, 6]
        for _ in range(int(fresh_rng.integers(1, 6))):
            tokens += [SSEP] + [9] * int(fresh_rng.integers(1, 40))
            tokens += [PAD] * (-len(tokens) % BS)
        seq = _seq(tokens + [PDEP, 3, 4] * int(fresh_rng.integers(0, 2)))
        rows = np.flatnonzero(~seq.layout.is_pad)
        lo = int(fresh_rng.integers(0, rows.size))
        idx = rows[lo:int(fresh_rng.integers(lo + 1, rows.size + 1))]
        piece, span_row, _ = span_rows.step_rows([_entry(seq, idx)], BS)
        for chunk in (4, 16, 64):
            assert (span_step.step_local_chunks(piece, span_row, chunk)
                    == span_rows.local_chunks(seq, idx, BS, chunk)), (tokens, idx[0], chunk)


def _pieces(rng, t: int, s: int, g: int, longest: int):
    """(SpanPieces, cu_q_lens) of s sequences over t rows: each a PDEP head of 0-3 rows and 1-3
    spans of 3-`longest` rows."""
    seg, span, cu, base = [], [], [0], 0
    for _ in range(s):
        head = int(rng.integers(0, 4))
        lens = rng.integers(3, longest + 1, int(rng.integers(1, 4)))
        seg += [base] * head + sum(([base + 1 + i] * int(n) for i, n in enumerate(lens)), [])
        span += [False] * head + [True] * int(lens.sum())
        base += len(lens) + 1
        cu.append(len(seg))
    assert len(seg) <= t
    pieces = qwen3_5_spans.pieces_from_segments(seg, t, g, span, np.zeros(s, bool))
    return pieces, jnp.asarray(cu, jnp.int32)


def test_the_rag_step_hands_the_local_pass_its_bound_not_the_piece_bound():
    """At the rag bench's step (1,024 rows, 16 sequences) the runner's pieces size the local
    pass's packed stream at local_chunk_bound = 16 + 3 x 16 + 1024 / 128 chunks (4,608 rows, was
    165 chunks: 10,560 rows), and with captures both passes (maps_packing)."""
    t, s, g = 1024, 16, span_step.piece_bound(1024, 16)
    pieces, cu = _pieces(np.random.default_rng(0), t, s, g, 20)
    f = dict(row_span=pieces.row_span, piece_cu=pieces.piece_cu,
             carry_local=pieces.carry_local, cap_piece=jnp.full(8, -1, jnp.int32),
             cap_slot=jnp.full(8, -1, jnp.int32), cap_cont=jnp.zeros(8, jnp.int32))
    maps = types.SimpleNamespace(a=jnp.zeros((2, 1, 1, 1, 1)), b=jnp.zeros((2, 1, 1, 1, 1)),
                                 tail=jnp.zeros((2, 1, 1, 1)), count=jnp.zeros(2, jnp.int32))
    assert span_rows.local_chunk_bound(t, s) == 72
    for warm in (False, True):
        plan = qwen3_5_spans.prepare(span_step.pieces(f, maps, warm, t, s), cu, t, 4, 64)
        plain = plan["packings"][0] if warm else plan["packings"]
        assert plain["src"].shape == (72 * 64,)
        if warm:
            assert plan["packings"][1]["src"].shape[0] <= 72 * 64
    old = qwen3_5_spans.prepare(pieces, cu, t, 4, 64)["packings"]
    assert old["src"].shape == (165 * 64,)


# the XLA form runs end to end in the CPU engine tests; the default run checks the kernels' here
# (CI time: the suite is near its 10 minutes on a 2-core machine); --run-slow runs both
@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "pallas_fused"])
def test_the_bounded_local_pass_gives_the_same_bits(fresh_rng, impl):
    """The local pass (and its captured maps) packed to exactly the chunks its pieces need
    equals the worst-case packing bit for bit: outputs, final states, transitions."""
    t, s, g, chunk, hk, hv, dk, dv = 192, 3, 24, 16, 1, 2, 16, 16
    pieces, cu = _pieces(fresh_rng, t, s, g, 40)
    piece_cu = np.asarray(pieces.piece_cu)
    piece = np.searchsorted(piece_cu, np.arange(t), side="right") - 1
    need = span_step.step_local_chunks(piece, np.asarray(pieces.row_span), chunk)
    q, k, v, g_, beta = (jnp.asarray(x[0]) for x in gdn_inputs(fresh_rng, 1, t, hk, hv, dk, dv,
                                                                decay=0.05))
    kernel = dict(implementation=impl, interpret=impl != "xla")
    spans = [p for p in range(g) if piece_cu[p + 1] > piece_cu[p]
             and bool(pieces.row_span[piece_cu[p]])][:3]
    cap = jnp.asarray(spans + [-1] * (8 - len(spans)), jnp.int32)
    for base in (pieces, dataclasses.replace(pieces, capture=cap)):
        outs = []
        for bound in (None, need):
            plan = qwen3_5_spans.prepare(dataclasses.replace(base, local_chunks=bound), cu, t, 4,
                                         chunk)
            packed = plan["packings"][0] if base.capture is not None else plan["packings"]
            assert packed["src"].shape[0] == (need if bound else
                                              (t + g * (chunk - 1)) // chunk) * chunk
            run = jax.jit(lambda *x, p=plan: qwen3_5_spans.run_local(
                *x, p["packings"], plan=p, chunk=chunk, **kernel))
            outs.append(jax.tree_util.tree_leaves(run(q, k, v, g_, beta)))
        for a, b in zip(*outs):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
