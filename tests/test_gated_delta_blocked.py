"""The two-level (blocked) state scan of the gated delta rule (scan_blocked.py), interpreted on
CPU, compiled on a GPU with MINIPIC_COMPILED=1: outputs, final state, checkpoints (on and between
segment boundaries, repeated, unsorted, 0 and the end) and the span transition against the
float64 recurrence and the float64 product of the token maps."""

import jax
import numpy as np
import pytest

from kernels_pallas.gated_delta import affine, api, reference, scan_blocked
from gdn_inputs import gdn_inputs
from tests.test_gated_delta_affine import INTERPRET, _rel, _token_product


@pytest.mark.parametrize("segments", [4, pytest.param(1, marks=[pytest.mark.slow] if INTERPRET
                                                      else [])])
def test_blocked_scan_matches_reference(fresh_rng, segments):
    """T = 125 padded to 8 chunks of 16 -> 4 segments of 2 chunks through `api.prefill` (the
    segment maps composed by the Pallas kernel), and 1 segment (composed in XLA); GVA 2."""
    n, t, hk, hv, dk, dv, chunk = 2, 125, 1, 2, 16, 16, 16
    q, k, v, g, beta = gdn_inputs(fresh_rng, n, t, hk, hv, dk, dv, decay=0.02)
    s0 = fresh_rng.standard_normal((n, hv, dk, dv)).astype(np.float32)
    ck = np.array([[0, 48, 125, 32, 48], [112, 16, 0, 64, 80]])
    run = jax.jit(lambda *x: api.prefill(
        *x, checkpoint_at=ck, chunk_size=chunk, implementation="pallas_fused", scan="blocked",
        return_transition=True, interpret=INTERPRET))
    if segments != 4:
        run = jax.jit(lambda *x: scan_blocked.blocked_gated_delta(
            *x, api._checkpoint_chunks(ck, n, t, chunk), scale=dk ** -0.5, chunk=chunk,
            segments=segments, interpret=INTERPRET, transition=True, compose_impl="xla"))
        pad = [(0, 0), (0, 3)]
        q, k, v, g, beta = (np.pad(x, pad + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    out, final, cks, a_span = run(q, k, v, g, beta, s0)
    ref_out, ref_states = reference.gated_delta_reference(q, k, v, g, beta, s0)
    np.testing.assert_allclose(np.asarray(out)[:, :t], ref_out[:, :t], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(final), ref_states[:, -1], atol=2e-5, rtol=0)
    for b in range(n):
        for m, c in enumerate(ck[b]):
            want = s0[b] if c == 0 else ref_states[b, c - 1]
            np.testing.assert_allclose(np.asarray(cks[b, m]), want, atol=2e-5)
    assert _rel(a_span, _token_product(k, g, beta, hv)) < 1e-5
    _, b_span, _, _ = run(q, k, v, g, beta, np.zeros_like(s0))
    np.testing.assert_allclose(np.asarray(final), np.asarray(affine.apply((a_span, b_span), s0)),
                               rtol=0, atol=1e-5)


def test_num_segments_divides_chunks():
    assert [scan_blocked.num_segments(nt, 16) for nt in (512, 8, 6, 1)] == [16, 8, 2, 1]
    with pytest.raises(ValueError, match="segments"):
        scan_blocked.num_segments(8, 0)
    with pytest.raises(ValueError, match="pallas_fused"):
        x = np.zeros((1, 16, 1, 8), np.float32)
        api.prefill(x, x, x, x[..., 0], x[..., 0], scan="blocked", implementation="xla")
