"""The triton_decode kernel (split-K decode, RoPE at read by trig or a cos | sin table) on the
shared kernel cases and its option runs; the table's host and in-graph builds agree; the table's
bounds and options are checked. Interpreted on CPU; MINIPIC_COMPILED=1 compiles them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_test_base import (DECODE, AttentionKernelTests, Case, make_inputs,
                                 pytest_generate_tests)  # noqa: F401 (the hook)
from kernels_pallas.paged_attention.api import paged_attention
from kernels_pallas.paged_attention.decode_common import rope_table
from kernels_pallas.paged_attention.random_inputs import inv_freq_for


def _case(i, dtype, kv_heads, group, head_dim, rotary_dim, page_size, kv_mode, scaling=1.0):
    return Case(f"decode{i}-{jnp.dtype(dtype).name}-K{kv_heads}G{group}-D{head_dim}R{rotary_dim}"
                f"-B{page_size}-{kv_mode}", dtype, kv_heads, group, head_dim, rotary_dim,
                page_size, kv_mode, tuple(DECODE), scaling=scaling, seed=11 + i)


# (case, options, slow): splits, kv heads per program, key steps; RoPE at read from trig or a
# float32 / bfloat16 table; packed (bf16x2) rotation on and off; max_position alone (the table
# by default); attention_scaling 0.8 where llama3 / linear would use 1.0 and YaRN not.
RUNS = (
    (_case(0, jnp.float32, 4, 2, 64, 16, 4, "position_free", 0.8),
     {"kv_group": 4, "splits": 3, "block_k": 16}, False),
    (_case(1, jnp.bfloat16, 2, 4, 128, 128, 8, "position_free"),
     {"kv_group": 1, "splits": 2, "block_k": 16}, True),
    (_case(2, jnp.float32, 2, 4, 64, 64, 4, "rotated"),
     {"kv_group": 2, "splits": 1, "block_k": 16}, False),
    (_case(3, jnp.float32, 4, 2, 64, 16, 4, "position_free", 0.8),
     {"kv_group": 2, "splits": 3, "block_k": 16, "rope": "table", "max_position": 64}, False),
    (_case(4, jnp.bfloat16, 2, 4, 128, 128, 8, "position_free"),
     {"kv_group": 2, "splits": 2, "block_k": 16, "rope": "table_bf16", "max_position": 40},
     False),
    (_case(5, jnp.float32, 2, 8, 64, 64, 4, "position_free"),
     {"kv_group": 2, "splits": 2, "block_k": 32, "rope": "trig"}, False),
    (_case(6, jnp.bfloat16, 2, 4, 128, 64, 4, "position_free", 0.8),
     {"kv_group": 2, "splits": 2, "block_k": 16, "rope": "trig"}, True),
    (_case(7, jnp.bfloat16, 2, 4, 128, 128, 8, "position_free", 0.8),
     {"kv_group": 2, "splits": 2, "block_k": 16, "rope": "table_bf16", "max_position": 40,
      "packed": True}, True),
    (_case(8, jnp.bfloat16, 2, 2, 64, 32, 8, "position_free"),
     {"kv_group": 1, "splits": 3, "block_k": 32, "packed": True}, False),
    (_case(9, jnp.bfloat16, 2, 4, 128, 128, 8, "position_free", 0.8),
     {"kv_group": 2, "splits": 2, "block_k": 16, "packed": False}, True),
    (_case(10, jnp.bfloat16, 4, 2, 64, 64, 4, "position_free"),
     {"kv_group": 4, "splits": 2, "block_k": 16, "max_position": 48}, True),
    (_case(11, jnp.float32, 2, 4, 64, 64, 4, "position_free", 0.8),
     {"kv_group": 2, "splits": 2, "block_k": 16, "max_position": 48}, False),
)


class TestTritonDecode(AttentionKernelTests):
    """Partial outputs start as NaN, so unwritten rows would show; rows of no query are 0."""

    implementation = "triton_decode"
    option_runs = RUNS
    zero_pad_rows = True
    slow_cases = ("bf16-K2G4-D128-B16-decode", "f16-K1G8-D128-B16-rotated-decode")


def test_decode_rope_table_host_matches_traced(fresh_rng):
    """The host-built cos|sin table (concrete inv_freq) equals the one built in the graph."""
    inv = jnp.asarray(inv_freq_for(64, theta=10000.0 * (1 + fresh_rng.random())))
    for dtype in (jnp.float32, jnp.bfloat16):
        host = rope_table(inv, 300, 0.8, dtype)
        traced = jax.jit(lambda i: rope_table(i, 300, 0.8, dtype))(inv)
        assert host.shape == traced.shape == (300, 64) and host.dtype == traced.dtype
        tol = 2e-6 if dtype == jnp.float32 else 8e-3  # float32 trig ulps / one bf16 rounding step
        np.testing.assert_allclose(np.asarray(host, np.float32), np.asarray(traced, np.float32),
                                   atol=tol, rtol=0)


def test_decode_rope_table_bounds():
    """rope='table' needs max_position above every query position."""
    q, k, v, md, inv = make_inputs(Case("bounds", jnp.float32, 2, 2, 16, 16, 4, "position_free",
                                        tuple(DECODE[:4]), seed=6))
    call = lambda **opts: paged_attention(q, k, v, md, inv, implementation="triton_decode",
                                          interpret=True, kernel_options=dict(rope="table", **opts))
    with pytest.raises(ValueError, match="max_position"):
        call()
    top = int(np.max(np.asarray(md.q_positions)[: int(md.cu_q_lens[-1])]))
    with pytest.raises(ValueError, match="max_position"):
        call(max_position=top)
    with pytest.raises(ValueError, match="packed=True"):  # bf16x2 rotation: bf16 inputs only
        call(max_position=64, packed=True)
    with pytest.raises(ValueError, match="needs rope in"):
        paged_attention(q, k, v, md, inv, implementation="triton_decode", interpret=True,
                        kernel_options=dict(rope="cordic"))
