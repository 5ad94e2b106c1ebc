"""Span maps of the gated delta rule (affine.py) and the tree scan (tree_scan.py).

Oracles: the token-by-token float64 recurrence (reference.py), and the float64 product of the
per-token maps A_t = exp(g_t) (I - beta_t k_t k_t^T) built here from the definition. Composition is
checked against a replay of the span-local inputs through the recurrence: the chunked layer (fp32)
run over the concatenated spans from the same entering state, and the float64 recurrence.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_inputs import gdn_inputs
from kernels_pallas.gated_delta import affine, api, ragged, reference, tree_scan

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


def _token_product(k, g, beta, hv):
    """float64 A_span = A_T ... A_1 from the definition (one [Dk, Dk] per batch x value head)."""
    k = np.repeat(np.asarray(k, np.float64), hv // k.shape[2], axis=2)
    n, t, _, dk = k.shape
    p = np.broadcast_to(np.eye(dk), (n, hv, dk, dk)).copy()
    for i in range(t):
        kk = k[:, i]  # [N, Hv, Dk]
        a_t = np.exp(g[:, i])[..., None, None] * (
            np.eye(dk) - beta[:, i][..., None, None] * kk[..., :, None] * kk[..., None, :])
        p = a_t @ p
    return p


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _compose_vs_replay(rng, lengths, **kw):
    """Relative errors of composing the spans' cached maps from a random entering state, against
    (1) the fp32 replay, (2) the float64 token recurrence over all spans (`span_maps_and_replay`).
    """
    a, b, s0, replay, final64 = span_maps_and_replay(rng, lengths, **kw)
    composed = affine.apply_chain(a, b, jnp.asarray(s0))
    return _rel(composed, replay), _rel(composed, final64)


def span_maps_and_replay(rng, lengths, chunk=64, hk=1, hv=2, dk=16, dv=16, decay=0.05):
    """The cached maps of spans of these lengths, a random entering state and what composing them
    must give: (a [n, 1, Hv, Dk, Dk], b [n, 1, Hv, Dk, Dv], s0 [1, Hv, Dk, Dv], the fp32 replay:
    each span's inputs run through the chunked layer from the state entering it (span-local chunk
    boundaries, as the engine would), the float64 token recurrence's final state over all spans).

    Each span is run at one common padded length (trailing no-op tokens: g = beta = 0, k = 0, the
    identity map), so one compile serves every span. Gentle decay (g scaled by `decay`) keeps
    the entering state alive across spans, so the A_span factors matter.
    """
    q, k, v, g, beta = gdn_inputs(rng, 1, sum(lengths), hk, hv, dk, dv, decay)
    s0 = rng.standard_normal((1, hv, dk, dv)).astype(np.float32)
    width = -(-max(lengths) // chunk) * chunk
    run = jax.jit(lambda *x: api.prefill(*x, chunk_size=chunk, return_transition=True)[1::2])
    a_list, b_list = [], []
    replay = jnp.asarray(s0)
    start = 0
    for n_tok in lengths:
        pad = [(0, 0), (0, width - n_tok)]
        span = [np.pad(x[:, start:start + n_tok], pad + [(0, 0)] * (x.ndim - 2))
                for x in (q, k, v, g, beta)]
        b_span, a_span = run(*span, jnp.zeros_like(replay))  # the cached map
        a_list.append(a_span)
        b_list.append(b_span)
        replay, _ = run(*span, replay)
        start += n_tok
    _, states64 = reference.gated_delta_reference(q, k, v, g, beta, s0)
    return jnp.stack(a_list), jnp.stack(b_list), s0, replay, states64[:, -1]


def test_composed_span_maps_equal_replay(fresh_rng):
    """Spans of 1..200 tokens (chunk-aligned and not) composed from a random entering state."""
    lengths = (1, 5, 64, 1, 63, 65, 200, 3, 128)
    rel32, rel64 = _compose_vs_replay(fresh_rng, lengths)
    print(f"lengths {lengths}: rel vs fp32 replay {rel32:.2e}, vs float64 recurrence {rel64:.2e}")
    assert rel32 < 1e-6 and rel64 < 1e-5


@pytest.mark.slow  # long spans: --run-slow
@pytest.mark.parametrize("lengths", [(8192,), (4096, 1, 2047, 2048)],
                         ids=lambda ls: "-".join(map(str, ls)))
def test_composed_long_span_maps_equal_replay(fresh_rng, lengths):
    rel32, rel64 = _compose_vs_replay(fresh_rng, lengths)
    print(f"lengths {lengths}: rel vs fp32 replay {rel32:.2e}, vs float64 recurrence {rel64:.2e}")
    assert rel32 < 1e-6 and rel64 < 1e-5


def test_apply_chain_skips_maps_past_count(fresh_rng):
    a = fresh_rng.standard_normal((3, 2, 4, 4)).astype(np.float32)
    b = fresh_rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
    s = fresh_rng.standard_normal((2, 4, 5)).astype(np.float32)
    got = np.asarray(affine.apply_chain(a, b, s, count=np.array([1, 3])))
    np.testing.assert_allclose(got[0], a[0, 0] @ s[0] + b[0, 0], rtol=1e-5, atol=1e-5)
    want = s[1].astype(np.float64)
    for i in range(3):
        want = a[i, 1] @ want + b[i, 1]
    np.testing.assert_allclose(got[1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas_fused", marks=[pytest.mark.slow] if INTERPRET else [])])
def test_tree_scan_matches_sequential_and_reference(fresh_rng, impl):
    """Tree scan: outputs, final state, every checkpoint and the span transition equal the
    float64 oracles' (GVA 2, T padded to the chunk): A_span is the product of the per-token maps
    and final = A_span S0 + (final from zero). Gentle decay keeps A_span far from float32
    underflow. (The sequential scan's transition is checked by the composition tests.)"""
    n, t, hk, hv, dk, dv, chunk = 2, 43, 1, 2, 16, 16, 16
    q, k, v, g, beta = gdn_inputs(fresh_rng, n, t, hk, hv, dk, dv, decay=0.02)
    s0 = fresh_rng.standard_normal((n, hv, dk, dv)).astype(np.float32)
    ck = np.array([[0, 32, 43, 16], [32, 16, 0, 43]])
    kw = dict(checkpoint_at=ck, chunk_size=chunk, implementation=impl, return_transition=True,
              interpret=impl != "xla" and INTERPRET)
    tree_fn = jax.jit(lambda *x: api.prefill(*x, scan="tree", **kw))
    tree = tree_fn(q, k, v, g, beta, s0)
    ref_out, ref_states = reference.gated_delta_reference(q, k, v, g, beta, s0)
    np.testing.assert_allclose(np.asarray(tree[0]), ref_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(tree[1]), ref_states[:, -1], atol=2e-5, rtol=0)
    for b in range(n):
        for m, c in enumerate(ck[b]):
            want = s0[b] if c == 0 else ref_states[b, c - 1]
            np.testing.assert_allclose(np.asarray(tree[2][b, m]), want, atol=2e-5)
    assert _rel(tree[3], _token_product(k, g, beta, hv)) < 1e-5
    _, b_span, _, a_span = tree_fn(q, k, v, g, beta, np.zeros_like(s0))
    np.testing.assert_allclose(np.asarray(tree[1]), np.asarray(affine.apply((a_span, b_span), s0)),
                               rtol=0, atol=1e-5)


def test_ragged_prefill_returns_each_sequence_transition(fresh_rng):
    """The engine's ragged layer (XLA path): per sequence, A_span over its new tokens (shifted
    chunk starts, an empty sequence) is the float64 product of the token maps, and the final
    state is A_span state0 + the final state from zero."""
    hk, hv, dk, dv, chunk = 1, 2, 16, 8, 16
    lens, pos0 = [20, 0, 37, 5], [3, 0, 16, 40]
    t = sum(lens) + 3
    q, k, v, g, beta = gdn_inputs(fresh_rng, 1, t, hk, hv, dk, dv, decay=0.02)
    s0 = fresh_rng.standard_normal((len(lens), hv, dk, dv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    run = jax.jit(lambda s: ragged.ragged_prefill(
        q[0], k[0], v[0], g[0], beta[0], cu, np.array(pos0, np.int32), s, chunk=chunk,
        return_transition=True))
    _, final, _, a_span = run(s0)
    _, b_span, _, _ = run(np.zeros_like(s0))
    for i in range(len(lens)):
        a, e = cu[i], cu[i + 1]
        want = _token_product(k[:, a:e], g[:, a:e], beta[:, a:e], hv)[0]
        assert _rel(a_span[i], want) < 1e-5, i
    np.testing.assert_allclose(np.asarray(final),
                               np.asarray(affine.apply((a_span, b_span), s0)), atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas_fused"])
def test_ragged_maps_of_each_piece(fresh_rng, impl):
    """The engine's captured maps (affine.ragged_maps: the plain pass from zero, then v = 0 from
    S0 = I), per piece: A is the float64 product of the token maps (an empty piece gives I), B
    and the outputs are the float64 recurrence's; on the XLA path and on the Triton kernels
    (interpreted on CPU)."""
    hk, hv, dk, dv, chunk = 1, 2, 16, 8, 16
    lens = [20, 0, 37, 5]
    q, k, v, g, beta = gdn_inputs(fresh_rng, 1, sum(lens) + 3, hk, hv, dk, dv, decay=0.02)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    out, b_span, a_span = jax.jit(lambda *x: affine.ragged_maps(
        *x, chunk=chunk, implementation=impl, interpret=impl != "xla" and INTERPRET))(
        q[0], k[0], v[0], g[0], beta[0], cu)
    zero = np.zeros((1, hv, dk, dv), np.float32)
    for i in range(len(lens)):
        a, e = cu[i], cu[i + 1]
        want = _token_product(k[:, a:e], g[:, a:e], beta[:, a:e], hv)[0]
        assert _rel(a_span[i], want) < 1e-5, (impl, i)
        if e > a:
            ref_out, ref_states = reference.gated_delta_reference(
                *(x[:, a:e] for x in (q, k, v, g, beta)), zero)
            np.testing.assert_allclose(np.asarray(out[a:e]), ref_out[0], atol=2e-5, rtol=0)
            np.testing.assert_allclose(np.asarray(b_span[i]), ref_states[0, -1], atol=2e-5)
        else:
            np.testing.assert_array_equal(np.asarray(b_span[i]), 0.0)


def test_choose_scan_by_shape(monkeypatch):
    assert tree_scan.choose_scan(1, 16, 512) == "sequential"  # measured: the tree is slower
    assert tree_scan.choose_scan(8, 16, 4, "tree") == "tree"
    monkeypatch.setattr(tree_scan, "TREE_MIN_CHUNKS", 128)
    assert tree_scan.choose_scan(1, 16, 512) == "tree"  # one long sequence, few heads
    assert tree_scan.choose_scan(8, 16, 512) == "sequential"  # enough independent scans
    assert tree_scan.choose_scan(1, 16, 4) == "sequential"  # short
    with pytest.raises(ValueError, match="scan must be"):
        tree_scan.choose_scan(1, 1, 1, "parallel")
