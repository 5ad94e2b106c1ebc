"""A span computed in pieces over several steps (minipic_jax/models/qwen3_5_spans.py,
SpanPieces.entry; serving/hybrid/span_partial.py) equals the span computed whole: each piece
enters with the map captured so far (its local pass from that B, its conv window reading that
tail, its transition composed with that A), so the span rows' outputs and conv windows match
the whole span's rows, and the last piece's map (A, B, tail, count) is the whole span's. Pieces
of 20, 2 (shorter than the conv tail) and 23 rows, beside riders and a fresh capture of another
sequence; the XLA and the Pallas (interpreted) kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_inputs import gdn_inputs
from minipic_jax.models import qwen3_5_spans as spans
from serving.model_contract import SpanPieces
from tests.test_gated_delta_affine import INTERPRET, _rel

HK, HV, DK, DV, C, KC, CHUNK, G, MC = 1, 2, 16, 8, 6, 4, 16, 6, 2


def _kernel(impl):
    return dict(implementation=impl, interpret=impl != "xla" and INTERPRET)


S = 2  # sequences per step: a step with fewer has empty ones after its last (as the engine pads)


def _step(x, mixed, pieces_rows, cu_q, caps, entry, impl):
    """One step: pieces_rows [(rows, is_span)] in order; cu_q the step's sequence bounds (at
    most S sequences); caps [MC] piece ids (-1 none); entry None or (use [MC], slot [MC], pool
    dict). Returns (outputs, conv windows, captured maps)."""
    t = x[0].shape[0]
    starts = np.cumsum([0] + [n for n, _ in pieces_rows])
    cu_p = np.full(G + 1, starts[-1], np.int32)
    cu_p[:len(pieces_rows)] = starts[:-1]
    cu_s = np.full(S + 1, cu_q[-1], np.int32)
    cu_s[:len(cu_q)] = cu_q
    row_span = np.zeros(t, bool)
    for (n, s), a in zip(pieces_rows, starts):
        row_span[a:a + n] = s
    ent = None
    if entry is not None:
        use, slot, pool = entry
        ent = dict(use=jnp.asarray(use), slot=jnp.asarray(slot, jnp.int32),
                   count=pool["count"][np.asarray(slot)], a=pool["a"], b=pool["b"],
                   tail=pool["tail"])
    pieces = SpanPieces(row_span=jnp.asarray(row_span), piece_cu=jnp.asarray(cu_p),
                        carry_local=jnp.zeros(S, bool),
                        capture=jnp.asarray(caps, jnp.int32), entry=ent)
    return _run(x, mixed, pieces, jnp.asarray(cu_s), impl=impl)


# every step of a test has the same shapes (the sequence bounds an argument, padded to S): one
# compile per impl with an entry and one without, not one per step (CI time)
@functools.partial(jax.jit, static_argnames="impl")
def _run(x, mixed, pieces, cu_q, *, impl):
    t = x[0].shape[0]
    plan = spans.for_layer(spans.prepare(pieces, cu_q, t, KC, CHUNK), 0)
    out, final, a = spans.run_local(*x, plan["packings"], plan=plan, chunk=CHUNK, **_kernel(impl))
    return out, spans.local_window(mixed, plan), spans.captured_maps(mixed, plan, a, final)


def _pool(maps):
    """A one-layer pool holding the captured maps in slots 0.. (as span_maps.store lays it)."""
    return dict(a=maps["a"][:, None], b=maps["b"][:, None], tail=maps["tail"][:, None],
                count=maps["count"])


# the XLA form runs end to end in the CPU engine tests; the default run checks the kernels' here
# (CI time: the suite is near its 10 minutes on a 2-core machine); --run-slow runs both
@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "pallas_fused"])
def test_a_span_in_three_pieces_equals_the_span_whole(fresh_rng, impl):
    n1, n2, n3 = 20, 2, 23
    n = n1 + n2 + n3
    t = n + 16
    q, k, v, g, beta = gdn_inputs(fresh_rng, 1, t, HK, HV, DK, DV, decay=0.05)
    x = tuple(a[0] for a in (q, k, v, g, beta))
    mixed = jnp.asarray(fresh_rng.standard_normal((t, C)), jnp.float32)
    # whole: rows 0..n-1 one span piece, captured from zero
    out_w, win_w, map_w = _step(x, mixed, [(n, True)], [0, 0, n], [0, -1], None, impl)

    def take(*parts):  # a step's rows: ranges of the stream (span rows 0..n-1, others after)
        idx = np.concatenate([np.arange(lo, hi) for lo, hi in parts])
        idx = np.r_[idx, np.full(t - idx.size, t - 1)]  # padding rows
        return tuple(a[idx] for a in x), mixed[idx]

    # step 1: 3 riders of another segment, then the span's first piece (captured into slot 0)
    x1, m1 = take((n, n + 3), (0, n1))
    _, _, map1 = _step(x1, m1, [(3, False), (n1, True)], [0, 3 + n1], [1, -1], None, impl)
    # step 2: a fresh span of 7 rows of another sequence (slot 1), then the 2-row piece
    x2, m2 = take((n + 3, n + 10), (n1, n1 + n2))
    out2, win2, map2 = _step(x2, m2, [(7, True), (n2, True)], [0, 7, 7 + n2], [0, 1],
                             ([False, True], [1, 0], _pool(map1)), impl)
    assert int(map2["count"][1]) == n1 + n2 and int(map2["count"][0]) == 7
    # step 3: the last piece first (continuing slot 0, where step 2 stored it), then 4 riders
    x3, m3 = take((n1 + n2, n), (n + 10, n + 14))
    pool = _pool({key: jnp.stack([map2[key][1], map2[key][0]]) for key in map2})
    out3, win3, map3 = _step(x3, m3, [(n3, True), (4, False)], [0, n3 + 4], [0, -1],
                             ([True, False], [0, 1], pool), impl)
    # the pieces' rows: outputs and conv windows (the first rows read the entry tail)
    for out, win, lo, hi, at in ((out2, win2, n1, n1 + n2, 7), (out3, win3, n1 + n2, n, 0)):
        np.testing.assert_allclose(np.asarray(out[at:at + hi - lo]), np.asarray(out_w[lo:hi]),
                                   atol=2e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(win[at:at + hi - lo]), np.asarray(win_w[lo:hi]))
    # the last piece's map is the whole span's
    assert int(map3["count"][0]) == n == int(map_w["count"][0])
    np.testing.assert_array_equal(np.asarray(map3["tail"][0]), np.asarray(map_w["tail"][0]))
    assert _rel(map3["a"][0], np.asarray(map_w["a"][0], np.float64)) < 1e-5
    np.testing.assert_allclose(np.asarray(map3["b"][0]), np.asarray(map_w["b"][0]), atol=2e-5)
