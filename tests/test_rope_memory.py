"""The overflow step's key pre-rotation (triton_ragged.prerotate_keys: every seat's whole block
table gathered and rotated, [S, NB, B, K, D]) holds one gathered copy, not float32 halves: at
the tulu3 shape with max_model_len 33,792 those were 10 GiB per layer on top of the 4 GiB gather,
and the step no longer fit beside the default pool (XLA's rematerialisation warning)."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention.triton_ragged import prerotate_keys
from kernels_pallas.rope import rope_f32

SEQS, TABLE, PAGE, HEADS, DIM, PAGES = 8, 64, 16, 8, 128, 256


def _inputs(rng):
    k_pages = jnp.asarray(rng.standard_normal((PAGES, PAGE, HEADS, DIM)), jnp.bfloat16)
    md = types.SimpleNamespace(
        block_tables=jnp.asarray(rng.integers(0, PAGES, (SEQS, TABLE)), jnp.int32),
        block_pos_start=jnp.asarray(rng.integers(0, 4096, (SEQS, TABLE)) * PAGE, jnp.int32))
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, DIM, 2, dtype=jnp.float32) / DIM))
    return k_pages, md, inv_freq


def _step(k_pages, tables, starts, inv_freq):
    md = types.SimpleNamespace(block_tables=tables, block_pos_start=starts)
    return prerotate_keys(k_pages, md, inv_freq, 1.0)


def test_prerotated_keys_hold_one_gathered_copy_and_keep_their_values():
    k_pages, md, inv_freq = _inputs(np.random.default_rng(0))
    compiled = jax.jit(_step).lower(k_pages, md.block_tables, md.block_pos_start,
                                    inv_freq).compile()
    gathered = SEQS * TABLE * PAGE * HEADS * DIM * 2  # [S, NB, B, K, D] bf16
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 1.5 * gathered, (temp, gathered)  # float32 halves: 3x
    got = compiled(k_pages, md.block_tables, md.block_pos_start, inv_freq)

    @jax.jit
    def joined_then_cast(k_pages, tables, starts, inv_freq):  # the float32 array, then cast
        pos = starts[:, :, None] + jnp.arange(PAGE, dtype=jnp.int32)
        return rope_f32(k_pages[tables], pos, inv_freq).astype(jnp.bfloat16)
    want = joined_then_cast(k_pages, md.block_tables, md.block_pos_start, inv_freq)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
