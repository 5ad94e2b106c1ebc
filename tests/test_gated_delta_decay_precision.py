"""Decay factors after a hard reset: float32 segment sums, not differences of cumsums.

Inside a chunk, Gamma_ij = exp(sum of g over (j, i]). Taken as gc_i - gc_j (gc the chunk's
cumulative log decay), its exponent carries an absolute error of a few eps32 * |gc|, whatever the
summation order: after tokens that decay by -50 .. -250 each, |gc| reaches thousands (ulp(4096)
= 4.9e-4), and a factor that should be exp(-0.01) comes out ~1e-4 .. 1e-3 relative off. Summing
g over (j, i] directly keeps the error to a few eps of the segment itself (all g <= 0).

On the H200 the same defect showed at the model's own decays (-60 per token, gc ~ -486): the
Triton scan (tl.cumsum, Hillis-Steele across lanes) rounded gc at a chunk's last real token and
at its last (padding, g = 0) row differently, so exp(g_last - gc_i) = exp(3.05e-5) instead of 1
on the dominant term of the final state (test_gated_delta.py's fixture-layout test, seed
3406335468: 4.88e-5 at atol 2e-5).

bf16 / f16 dots keep the differences in the blocked solve and the output kernel (their error is
far below bf16 rounding, and the segment sums cost prefill time on the H200): checked against
the float64 recurrence at a bf16 tolerance, and that only float32 kernels sum segments."""

import os

import jax
import numpy as np
import pytest

from jaxpr_walk import outer_eqns
from kernels_pallas.gated_delta import api, fused_triton, reference

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


def _reset_inputs(rng, n, t, hk, hv, dk, dv, chunk):
    """Random unit q/k, N(0, 1) v and state; in each chunk a reset: the tokens before a random
    row p in [4, chunk / 2) decay by -50 .. -250 each, those from p on by -0.001 .. -0.05."""
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((n, t, hk, dk))).astype(np.float32)
    k = unit(rng.standard_normal((n, t, hk, dk))).astype(np.float32)
    v = rng.standard_normal((n, t, hv, dv)).astype(np.float32)
    beta = rng.uniform(0.05, 1.0, (n, t, hv)).astype(np.float32)
    row = np.arange(t) % chunk
    reset_end = rng.integers(4, chunk // 2, (n, -(-t // chunk), 1, hv))
    before = row[None, :, None] < np.repeat(reset_end, chunk, axis=1)[:, :t, 0]
    g = np.where(before, -rng.uniform(50, 250, (n, t, hv)), -rng.uniform(0.001, 0.05, (n, t, hv)))
    s0 = rng.standard_normal((n, hv, dk, dv)).astype(np.float32)
    return q, k, v, g.astype(np.float32), beta, s0


@pytest.mark.parametrize("impl", ["xla", "pallas_fused", "pallas_fused-subst"])
def test_decay_after_a_reset_matches_float64(fresh_rng, impl):
    """Outputs, final state and a mid checkpoint within 2e-5 of the float64 recurrence, chunk 64
    (four 16-row sub-blocks in the blocked solve), GVA 2, T = 3 chunks."""
    chunk, t = 64, 192
    q, k, v, g, beta, s0 = _reset_inputs(fresh_rng, 2, t, 1, 2, 16, 16, chunk)
    ref_out, ref_states = reference.gated_delta_reference(q, k, v, g, beta, s0)
    if impl == "xla":
        # under jit, as a model calls it: one compile, not one per eager op (CI time)
        out, final, cks = jax.jit(lambda *a: api.prefill(
            *a, checkpoint_at=[128], chunk_size=chunk, implementation="xla"))(
                q, k, v, g, beta, s0)
    else:
        opts = dict(intra="subst") if impl.endswith("subst") else {}
        out, final, cks = jax.jit(lambda *a: fused_triton.fused_gated_delta(
            *a, scale=16 ** -0.5, chunk=chunk, interpret=INTERPRET, **opts))(
                q, k, v, g, beta, s0, np.array([[2], [2]], np.int32))
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(final), ref_states[:, -1], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(cks[:, 0]), ref_states[:, 127], atol=2e-5, rtol=0)


@pytest.mark.parametrize("intra", ["blocked", "subst"])
def test_bf16_kernels_after_a_reset_match_float64(fresh_rng, intra):
    """bf16 q/k/v/beta (float32 g and state): the blocked solve and the output kernel take the
    exponents as differences of the chunk cumsums (bf16 / f16 dots: `dots.is_exact`), whose
    ~eps32 |gc| error is far below bf16 rounding even after a reset. Oracle: the float64
    recurrence on the same bf16-rounded inputs. Tolerance 2 eps_bf16 (2^-7) of the largest
    reference value: W, U, KD, V', the chunk states and the outputs are each stored in bf16 and
    the MMAs take bf16 operands, every one a rounding of up to 2^-8 relative, so a few such errors
    add up to about eps_bf16 of the values' scale (measured at most 0.94 eps_bf16 over 20 seeds,
    outputs, final state and checkpoint)."""
    chunk, t, bf16 = 64, 192, jax.numpy.bfloat16
    q, k, v, g, beta, s0 = _reset_inputs(fresh_rng, 2, t, 1, 2, 16, 16, chunk)
    q, k, v, beta = (np.asarray(x, bf16) for x in (q, k, v, beta))
    wide = [x.astype(np.float32) for x in (q, k, v, beta)]
    ref_out, ref_states = reference.gated_delta_reference(*wide[:3], g, wide[3], s0)
    out, final, cks = jax.jit(lambda *a: fused_triton.fused_gated_delta(
        *a, scale=16 ** -0.5, chunk=chunk, interpret=INTERPRET, intra=intra))(
            q, k, v, g, beta, s0, np.array([[2], [2]], np.int32))
    assert out.dtype == bf16
    eps = float(jax.numpy.finfo(bf16).eps)
    for got, want in ((out, ref_out), (final, ref_states[:, -1]), (cks[:, 0], ref_states[:, 127])):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0,
                                   atol=2 * eps * np.abs(want).max())


def _all_eqns(jaxpr):
    """Every equation of `jaxpr` and its sub-jaxprs (kernel bodies included)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def _square_cumsums(dtype, intra):
    """Per Pallas kernel of the fused pipeline (intra, scan, output), in order: the shapes of the
    cumsums down a square tile in its body (segment sums; a gate cumsum is 1-D)."""
    x, gate = (jax.ShapeDtypeStruct((1, 128, 2, 16), dtype),
               jax.ShapeDtypeStruct((1, 128, 2), np.float32))
    jaxpr = jax.make_jaxpr(lambda *a: fused_triton.fused_gated_delta(
        *a, scale=0.25, chunk=64, interpret=True, intra=intra))(
            x, x, x, gate, gate.update(dtype=dtype), np.zeros((1, 2, 16, 16), np.float32)).jaxpr
    return [[e.invars[0].aval.shape for e in _all_eqns(k.params["jaxpr"])
             if e.primitive.name == "cumsum" and e.invars[0].aval.ndim == 2]
            for k in outer_eqns(jaxpr) if k.primitive.name == "pallas_call"]


@pytest.mark.parametrize("intra", ["blocked", "subst"])
def test_only_float32_kernels_sum_segments(intra):
    """The per-segment sums run for float32 dots only: the bf16 blocked solve and output kernel
    take cumsum differences (on the H200 the segment sums cost the 32K bf16 prefill 1.451 or
    1.467 ms against 1.348: benchmarks/RESULTS.md, Gated DeltaNet); the opt-in row-substitution
    solve sums its [C, C] segments for every dtype."""
    segs = [(64, 64)] if intra == "subst" else [(16, 16)] * 4  # four 16-row sub-blocks
    assert _square_cumsums(np.float32, intra) == [segs, [], [(64, 64)]]
    assert _square_cumsums(jax.numpy.bfloat16, intra) == [
        segs if intra == "subst" else [], [], []]
