"""The captured maps' transition pass (affine.ragged_maps' second pass: v = 0 from S0 = I) reads
only what its final states need (issue 29: a warm span step's work that produces nothing used).
Its outputs are dropped and q enters no state, so it passes k as q and a kernel pass gathers
k's packed stream once, not q's and k's (ragged.ragged_prefill gathers each distinct array once).
The values are test_gated_delta_span_passes.py's and test_gated_delta_affine.py's (float64
products of the token maps)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpr_walk import outer_eqns
from kernels_pallas.gated_delta import affine, stream_pack

HK, HV, DK, DV = 1, 2, 16, 16


def _qk_stream_gathers(select) -> int:
    """gathers of a [T, Hk, Dk] array (q or k) into a packed stream in one ragged_maps call:
    XLA gathers, or operands of the pack kernel (stream_pack.PACK_KERNEL, the default; it
    reads an operand [T, ...] as [T * tiles, BF] rows)."""
    lens = [20, 0, 37, 5]
    t = sum(lens) + 3
    cu = jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)
    q = k = jax.ShapeDtypeStruct((t, HK, DK), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((t, HV, DV), jnp.bfloat16)
    g = beta = jax.ShapeDtypeStruct((t, HV), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda *x: affine.ragged_maps(
        *x, cu, select=select, implementation="pallas_fused", interpret=True))(
        q, k, v, g, beta).jaxpr
    if not stream_pack.PACK_KERNEL:
        return sum(1 for e in outer_eqns(jaxpr) if e.primitive.name == "gather"
                   and tuple(e.invars[0].aval.shape) == (t, HK, DK))
    return sum(1 for e in outer_eqns(jaxpr) if e.primitive.name == "pallas_call"
               and e.params["name"] == stream_pack.NAME for x in e.invars
               if tuple(x.aval.shape) == (t * HK, DK))


@pytest.fixture(params=[True, False], ids=["pack_kernel", "xla_gathers"])
def gather_form(request, monkeypatch):
    monkeypatch.setattr(stream_pack, "PACK_KERNEL", request.param)


def test_transition_pass_gathers_k_once_for_q_and_k(gather_form):
    # plain pass: q and k; transition pass: k only (was q and k: 4)
    assert _qk_stream_gathers(None) == 3
    assert _qk_stream_gathers(jnp.asarray([3, -1], jnp.int32)) == 3
