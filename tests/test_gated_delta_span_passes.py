"""The cheap forms of a hybrid span step's local passes (issue 19's step cost): the ragged prefill
sized for aligned starts (`aligned`), one shared state0, only some final states (`final_of`),
kernels that skip the unused packed chunks (Pallas, interpreted on CPU), and the captured maps'
transition pass over the captured pieces' rows only (`affine.ragged_maps(select=...)`).

Oracles: the float64 token recurrence (reference.py) and the float64 product of the token maps
(test_gated_delta_affine._token_product); the exact equality of the cheap and the full forms.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta import affine, ragged, reference
from gdn_inputs import gdn_inputs
from tests.test_gated_delta_affine import INTERPRET, _rel, _token_product

IMPLS = ["xla", "pallas_fused"]

def _kernel(impl):
    return dict(implementation=impl, interpret=impl != "xla" and INTERPRET)

def test_aligned_bound_holds_for_the_worst_lengths():
    """Every piece one token past a chunk: the most padding aligned starts can need."""
    chunk, seqs = 16, 7
    lens = [chunk + 1] * seqs
    need = sum(-(-n // chunk) for n in lens)
    assert ragged.packed_chunks(sum(lens), seqs, chunk, aligned=True) >= need
    assert ragged.packed_chunks(1024, 140, 64, aligned=True) == 153  # the rag bench's local pass
    assert ragged.packed_chunks(1024, 140, 64) == 296

@pytest.mark.parametrize("impl", IMPLS)
def test_aligned_shared_zero_state_and_some_finals(fresh_rng, impl):
    """Pieces from zero, packed for aligned starts, with one [1] zero state and the finals of a
    few pieces only: outputs and finals equal the float64 recurrence of each piece."""
    hk, hv, dk, dv, chunk = 1, 2, 16, 8, 16
    lens = [17, 0, 33, 16, 1, 17]  # one past a chunk (the worst padding), empty, exact, one
    t = sum(lens) + 4
    q, k, v, g, beta = gdn_inputs(fresh_rng, 1, t, hk, hv, dk, dv)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    fin = np.array([5, 0, 2, 1], np.int32)
    out, final, _ = jax.jit(lambda *x: ragged.ragged_prefill(
        *x, cu, jnp.zeros(len(lens), jnp.int32), jnp.zeros((1, hv, dk, dv), jnp.float32),
        chunk=chunk, aligned=True, final_of=jnp.asarray(fin), **_kernel(impl)))(
        q[0], k[0], v[0], g[0], beta[0])
    assert final.shape == (len(fin), hv, dk, dv)
    zero = np.zeros((1, hv, dk, dv), np.float32)
    for s in range(len(lens)):
        a, e = cu[s], cu[s + 1]
        if a == e:
            continue
        ro, rs = reference.gated_delta_reference(*(x[:, a:e] for x in (q, k, v, g, beta)), zero)
        np.testing.assert_allclose(np.asarray(out[a:e]), ro[0], atol=2e-5, rtol=0)
        for j in np.flatnonzero(fin == s):
            np.testing.assert_allclose(np.asarray(final[j]), rs[0, -1], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(final[list(fin).index(1)]), 0.0)  # empty piece


@pytest.mark.parametrize("impl", IMPLS)
def test_selected_maps_equal_the_full_pass(fresh_rng, impl):
    """ragged_maps(select=...) runs the transition pass over the selected pieces' rows only: each
    A equals the full pass's (same kernels, same chunking from zero) and the float64 product of
    the token maps to 1e-6 relative; -1 and an empty piece give I; B (final_of) the same."""
    hk, hv, dk, dv = 1, 2, 16, 8
    lens = [20, 0, 37, 5, 16, 9]
    q, k, v, g, beta = gdn_inputs(fresh_rng, 1, sum(lens) + 3, hk, hv, dk, dv, decay=0.02)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    sel = np.array([4, -1, 2, 1, 0], np.int32)
    fin = np.array([3, 4, 2], np.int32)
    x = (q[0], k[0], v[0], g[0], beta[0], cu)
    out_f, b_f, a_f = jax.jit(lambda *x: affine.ragged_maps(*x, **_kernel(impl)))(*x)
    out, b, a = jax.jit(lambda *x: affine.ragged_maps(
        *x, select=jnp.asarray(sel), final_of=jnp.asarray(fin), **_kernel(impl)))(*x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_f))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(b_f)[fin])
    eye = np.broadcast_to(np.eye(dk), (hv, dk, dk))
    for j, piece in enumerate(sel):
        if piece < 0 or lens[piece] == 0:
            np.testing.assert_array_equal(np.asarray(a[j]), eye)
            continue
        s, e = cu[piece], cu[piece + 1]
        want = _token_product(k[:, s:e], g[:, s:e], beta[:, s:e], hv)[0]
        assert _rel(a[j], want) < 1e-6, (impl, j)
        np.testing.assert_allclose(np.asarray(a[j]), np.asarray(a_f[piece]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("capture", [False, True])
def test_local_pass_runs_span_rows_only(fresh_rng, impl, capture):
    """qwen3_5_spans.local_pass over pieces [span rows][riders]: each span row's output, the
    finals read (each sequence's last piece ending on a span row, the captured pieces) and the
    captured transitions equal the float64 recurrence of the span's rows alone from zero;
    riders get zeros (the model reads their flow outputs)."""
    from minipic_jax.models.qwen3_5_spans import local_pass
    from serving.model_contract import SpanPieces
    hk, hv, dk, dv, chunk = 1, 2, 16, 8, 16
    # seq 0: riders, span (20) + riders (3), span (17); seq 1: one decode-like row; seq 2: span 5
    rows = [(0, 4, False), (1, 20, True), (1, 3, False), (2, 17, True), (3, 1, False),
            (4, 5, True)]
    seg = np.concatenate([[p] * n for p, n, _ in rows])
    span = np.concatenate([[s] * n for _, n, s in rows])
    t = len(seg) + 6
    q, k, v, g, beta = gdn_inputs(fresh_rng, 1, t, hk, hv, dk, dv, decay=0.05)
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    cu_p = np.full(9, len(seg), np.int32)
    cu_p[:len(starts)] = starts
    row_span = np.zeros(t, bool)
    row_span[:len(seg)] = span
    cu_q = np.array([0, 44, 45, 50], np.int32)
    cap = jnp.asarray([2, -1, 1], jnp.int32) if capture else None
    pieces = SpanPieces(row_span=jnp.asarray(row_span), piece_cu=jnp.asarray(cu_p),
                        carry_local=jnp.asarray([True, False, True]), capture=cap)
    out, final, a = jax.jit(lambda *x: local_pass(*x, pieces, jnp.asarray(cu_q), chunk=chunk,
                                                  **_kernel(impl)))(q[0], k[0], v[0], g[0],
                                                                    beta[0])
    out = np.asarray(out)
    zero = np.zeros((1, hv, dk, dv), np.float32)
    ref = {}
    for p in (1, 2, 4):
        s, e = cu_p[p], cu_p[p] + rows[[r[0] for r in rows].index(p)][1]
        ref[p] = reference.gated_delta_reference(*(x[:, s:e] for x in (q, k, v, g, beta)), zero)
        np.testing.assert_allclose(out[s:e], ref[p][0][0], atol=2e-5, rtol=0)
    assert np.all(out[~row_span] == 0)
    # final_pieces order: the piece of each sequence's last row (2, 3, 4), then the captured
    np.testing.assert_allclose(np.asarray(final[0]), ref[2][1][0, -1], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(final[2]), ref[4][1][0, -1], atol=2e-5, rtol=0)
    if capture:
        for j, p in ((3, 2), (5, 1)):
            np.testing.assert_allclose(np.asarray(final[j]), ref[p][1][0, -1], atol=2e-5)
        for j, p in ((0, 2), (2, 1)):
            s, e = cu_p[p], cu_p[p] + rows[[r[0] for r in rows].index(p)][1]
            assert _rel(a[j], _token_product(k[:, s:e], g[:, s:e], beta[:, s:e], hv)[0]) < 1e-6
        np.testing.assert_array_equal(np.asarray(a[1]), np.broadcast_to(np.eye(dk), (hv, dk, dk)))
    else:
        assert a is None
