"""Host side of the warm span path (serving/hybrid/span_cache.py, span_rows.py) and the span-map pool's
host moves (serving/hybrid/span_maps.py): cheap checks without a model."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np

from serving.hybrid import span_maps, span_rows, span_step
from serving.hybrid.checkpoint_store import CheckpointStore
from serving.hybrid.hybrid_prefix import HybridPrefixCache
from serving.layout import build_layout
from serving.sequence import Sequence
from serving.hybrid.span_cache import SpanMapCache

BS, PAD, SSEP, PDEP = 4, 0, 1, 2


def _seq(tokens):
    lay = build_layout(tokens, BS, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    return Sequence("r", tokens, lay, None, BS, seed=0)


# plain 0..3 | span 4..11 (8 tokens, 2 blocks, 7 valid) | span 12..15 | PDEP 16..18
TOKENS = [5, 6, 7, 8] + [SSEP, 9, 9, 9, 9, 9, 9, PAD] + [SSEP, 7, PAD, PAD] + [PDEP, 3, 4]


def test_a_captured_span_piece_holds_its_rows_only():
    """Pieces change at a sequence start, a span start, and the first row after a span whose
    map the step captures (else later rows ride in the span's piece)."""
    seq = _seq(TOKENS)
    idx = np.flatnonzero(~seq.layout.is_pad)
    for caps, want in (((), [0, 4, 12]), (((12, 0),), [0, 4, 12, 16]),
                       (((4, 1),), [0, 4, 12])):
        batch = [types.SimpleNamespace(seq=seq, token_idx=idx, map_caps=caps)]
        piece, span_row, carry = span_rows.step_rows(batch, BS)
        starts = [int(idx[k]) for k in np.flatnonzero(np.r_[True, piece[1:] != piece[:-1]])]
        assert starts == want, caps
        assert span_row.tolist() == [False] * 4 + [True] * 9 + [False] * 3 and carry == [False]


def test_only_steps_with_span_work_take_the_span_variant():
    """A step takes the span variant (serving/span_step.step_has_spans) when a row starts a span
    or a sequence captures a span's map; decodes and chunks past the spans are plain steps (their
    rows all read the flow: `step_rows` marks no span row there), so they never compile a span
    variant of the decode step mid-run. So is a chunk that only enters with cached maps (the
    compose program before the step leaves its entry state in its slot)."""
    seq = _seq(TOKENS)

    def entry(idx, **kw):
        e = dict(seq=seq, token_idx=np.asarray(idx), map_chain=(), map_caps=())
        return types.SimpleNamespace(**{**e, **kw})

    for e, want in ((entry(range(0, 6)), True), (entry([12]), True), (entry([16, 17, 18]), False),
                    (entry([19]), False), (entry([16, 17], map_chain=(3,)), False),
                    (entry([5, 6], map_caps=((12, 0),)), True), (entry([]), False)):
        assert span_step.step_has_spans([e], BS) is want, e.token_idx
        if not want and e.token_idx.size:
            assert not span_rows.step_rows([e], BS)[1].any()
    plain = types.SimpleNamespace(seq=_seq([5, 6, 7, 8, 9]), token_idx=np.arange(5),
                                  map_chain=(), map_caps=())
    assert not span_step.step_has_spans([plain], BS)
    assert span_step.step_has_spans([plain, entry([12, 13])], BS)


def test_a_chunk_stops_before_a_skipped_span_once_it_has_rows():
    seq = _seq(TOKENS)
    seq.span.skips = [(12, 16)]
    idx = np.flatnonzero(~seq.layout.is_pad)
    got, frontier = span_rows.cut_chunk(seq, idx[idx >= 4], 19, BS)
    assert got.tolist() == [4, 5, 6, 7, 8, 9, 10] and frontier == 12
    rows = np.asarray([16, 17, 18])  # the chunk that starts after it is not cut
    seq.num_computed = 12
    got, frontier = span_rows.cut_chunk(seq, rows, 19, BS)
    assert got.tolist() == [16, 17, 18] and frontier == 19


def test_a_span_map_goes_when_one_of_its_blocks_does():
    spans = SpanMapCache(CheckpointStore(2, 0, 10), BS)
    cache = HybridPrefixCache(CheckpointStore(0, 0, 1), planner=None, block_size=BS,
                              spans=spans)
    assert spans.store.reserve(7, b"t", 0, (3, 7), 8.0) == 0
    cache.after_launch()
    assert spans.store.get(7, b"t") is not None
    cache.drop_dependent(3)  # the span's first block left the device for good
    assert spans.store.get(7, b"t") is None and spans.store.free_slots == [1, 0]
    seq = _seq(TOKENS)
    spans.drop(seq)  # a sequence that never took the span admission: nothing to release
    assert spans.store.reserve(8, b"u", 0, (8,), 4.0) >= 0
    cache.after_launch()
    e = spans.store.get(8, b"u")
    assert spans.store.acquire(e)
    seq.span.pins = {12: e}
    cache.drop_restore(seq)  # preempted before the step that composes it: unpinned
    assert e.pins == 0 and seq.span.pins == {}


def test_pool_moves_out_and_back_keep_the_map(fresh_rng):
    lg, hv, dk, dv, c, k1 = 2, 2, 3, 4, 5, 2
    pool = span_maps.allocate(3, lg, hv, dk, dv, c, k1)
    a = fresh_rng.standard_normal((lg, 1, hv, dk, dk)).astype(np.float32)
    b = fresh_rng.standard_normal((lg, 1, hv, dk, dv)).astype(np.float32)
    tail = fresh_rng.standard_normal((lg, 1, c, k1)).astype(np.float32)
    pool = span_maps.store(pool, jnp.asarray([1]), a, b, tail, jnp.asarray([9]))
    e = types.SimpleNamespace(host=None)
    pool = span_maps.apply_moves(pool, [(1, e)], [])
    assert e.host is not None
    pool = span_maps.apply_moves(pool, [], [(2, e)])
    assert e.host is None
    np.testing.assert_array_equal(np.asarray(pool.a[2]), a[:, 0])
    np.testing.assert_array_equal(np.asarray(pool.b[2]), b[:, 0])
    np.testing.assert_array_equal(np.asarray(pool.tail[2]), tail[:, 0])
    assert int(pool.count[2]) == 9


def test_the_first_span_start_is_where_a_reordered_request_resumes():
    """checkpoint_plan.first_span_start (issue 29): the first span's start after a PDEP prefix
    when a segment follows the span; none for a leading span or a prompt whose one span is
    final (never skipped). on_grid reads logical positions (pads take none): token 4 after
    three valid tokens and a pad is position 3."""
    from serving.hybrid.checkpoint_plan import first_span_start, on_grid

    def lay(tokens):
        return build_layout(tokens, BS, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    assert first_span_start(lay(TOKENS), len(TOKENS), BS) == 4
    assert first_span_start(lay([SSEP, 9, 9, PAD, PDEP, 3]), 6, BS) is None
    assert first_span_start(lay([5, 6, 7, PAD, SSEP, 9, 9]), 7, BS) is None
    padded = [5, 6, 7, PAD, SSEP, 9, PAD, PAD, PDEP, 3]
    assert first_span_start(lay(padded), len(padded), BS) == 4
    assert on_grid(lay(padded), [4, 8], 3).tolist() == [True, False]
    assert on_grid(lay(padded), [4, 8], 4).tolist() == [False, False]
