"""The ragged kernels' packed stream holds q and k in v's dtype where v is bf16 / f16
(ragged.STREAM_QK_IN_V_DTYPE: the model hands them over L2-normalised in float32; the kernels round
them to the dot dtype in their dots, so the gathers that fill the static stream need not move
float32). Float32 v keeps float32 q / k; the switch off keeps the float32 stream; q passed as k
(affine's transition maps) stays one gather. Interpret mode on CPU; `MINIPIC_COMPILED=1` compiles
the kernels on a GPU."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_inputs import gdn_inputs
from kernels_pallas.gated_delta import api, ragged, ragged_triton

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


def _batch(rng, v_dtype):
    lens, pos0 = [20, 9], [3, 0]
    q, k, v, g, beta = (x[0] for x in gdn_inputs(rng, 1, sum(lens) + 3, 1, 2, 16, 16))
    s0 = rng.standard_normal((2, 2, 16, 16)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return (q, k, jnp.asarray(v, v_dtype), g, beta, cu, np.array(pos0, np.int32), s0)


@pytest.mark.parametrize("v_dtype, switch, want", [
    (jnp.bfloat16, True, jnp.bfloat16), (jnp.bfloat16, False, jnp.float32),
    (jnp.float32, True, jnp.float32)])
def test_the_stream_takes_q_k_in_v_dtype(fresh_rng, monkeypatch, v_dtype, switch, want):
    seen = []

    def record(q, k, v, g, beta, restart, seq_of_chunk, state0, bounds, **kw):
        seen.append((q.dtype, k.dtype))
        return jnp.zeros(v.shape, v.dtype), jnp.zeros((bounds.shape[0],) + state0.shape[1:])

    monkeypatch.setattr(ragged, "STREAM_QK_IN_V_DTYPE", switch)
    monkeypatch.setattr(ragged_triton, "packed_gated_delta", record)
    jax.jit(lambda *a: api.ragged_gated_delta(  # jitted: eagerly an XLA program an op
        *a, implementation="pallas_fused", interpret=True, decode=False, chunk=16))(
        *_batch(fresh_rng, v_dtype))
    assert seen == [(want, want)]


def test_q_passed_as_k_stays_one_array():
    k = jnp.ones((4, 1, 8), jnp.float32)
    v = jnp.ones((4, 2, 8), jnp.bfloat16)
    q_low, k_low = ragged_triton.qk_in_v_dtype(k, k, v)
    assert q_low is k_low and k_low.dtype == jnp.bfloat16
    q_low, k_low = ragged_triton.qk_in_v_dtype(k + 1, k, v)
    assert q_low is not k_low


def test_bf16_stream_equals_the_recurrence_on_rounded_q_k(fresh_rng):
    """The kernels on the bf16 stream against the XLA path (float32 throughout) on q / k rounded
    to bf16 first: within 2 eps_bf16 of the largest value (the Mosaic path's bound,
    tests/test_engine_gdn_kernel.py), outputs and finals."""
    batch = _batch(fresh_rng, jnp.bfloat16)
    fn = jax.jit(lambda *a: api.ragged_gated_delta(
        *a, implementation="pallas_fused", interpret=INTERPRET, decode=False, chunk=16))
    got = fn(*batch)
    rounded = [x.astype(jnp.bfloat16).astype(jnp.float32) for x in batch[:2]] + list(batch[2:])
    want = api.ragged_gated_delta(*rounded, implementation="xla", decode=False, chunk=16)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for name, a, b in zip(("out", "final"), got[:2], want[:2]):
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0,
                                   atol=2 * eps * np.abs(b).max(), err_msg=name)
