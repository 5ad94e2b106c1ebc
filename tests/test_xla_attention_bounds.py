"""The XLA paged attention (the CPU engine's kernel) does work of the step's size, not of the
cache's: keys are read only from the block-table columns in use, in chunks (online softmax), and
query rows attend per tile of one sequence. Small chunks and tiles (many loop steps, many tiles
per sequence) match the numpy reference as the defaults do, and rows of no query come back 0."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_test_base import CASES, check, make_inputs
from jaxpr_walk import outer_eqns
from kernels_pallas.paged_attention.random_inputs import inv_freq_for, random_batch
from kernels_pallas.paged_attention.reference import paged_attention_reference
from kernels_pallas.paged_attention.xla import xla_paged_attention

F32_CASES = [c for c in CASES if c.dtype == jnp.float32]


def _attend(case, q, k, v, md, inv, **kw):
    return xla_paged_attention(q, k, v, md, inv, kv_mode=case.kv_mode,
                               attention_scaling=case.scaling,
                               sm_scale=q.shape[-1] ** -0.5, **kw)


@pytest.mark.parametrize("case", F32_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("chunk,q_tile", [(1, 1), (1, 2), (2, 4), (3, 8)])
def test_small_chunks_and_tiles_match_reference(case, chunk, q_tile):
    q, k, v, md, inv = make_inputs(case)
    out = jax.jit(lambda *a: _attend(case, *a, chunk=chunk, q_tile=q_tile))(q, k, v, md, inv)
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode=case.kv_mode,
                                    attention_scaling=case.scaling)
    check(out, ref, md, case.dtype, zero_pad_rows=True)


def test_work_scales_with_the_context_in_use(fresh_rng):
    """A block table 128 columns wide (max_model_len 2048) of which 4 are in use: no array of
    the traced step holds a gather over the whole width (the old per-token gather held
    T x 2048 keys), and the output still matches the reference."""
    page, kv_heads, head_dim, cols = 16, 2, 64, 128
    specs = [(40, 1, 0), (12, 20, 0), (0, 33, 0), (50, 1, 5)]
    md, pages, tokens = random_batch(fresh_rng, specs, page_size=page, extra_table_cols=124,
                                     pad_tokens=6)
    assert md.block_tables.shape[1] == cols
    shape = (pages, page, kv_heads, head_dim)
    k, v = (jnp.asarray(fresh_rng.standard_normal(shape), jnp.float32) for _ in range(2))
    q = jnp.asarray(fresh_rng.standard_normal((tokens, 2 * kv_heads, head_dim)), jnp.float32)
    inv = jnp.asarray(inv_freq_for(head_dim))
    case = dataclasses.replace(CASES[0], kv_mode="position_free", scaling=1.0)

    jaxpr = jax.make_jaxpr(lambda *a: _attend(case, *a))(q, k, v, md, inv).jaxpr
    largest = max(math.prod(var.aval.shape) for eqn in outer_eqns(jaxpr)
                  for var in eqn.outvars if hasattr(var.aval, "shape"))
    whole_table = md.num_seqs * cols * page * kv_heads * head_dim  # keys of every column
    assert largest < whole_table // 8, f"an intermediate of {largest} elements"
    # keys are rotated with one cos per (key, R/2 angle), not per rotated dim (R)
    cos_elements = sum(math.prod(eqn.outvars[0].aval.shape) for eqn in outer_eqns(jaxpr)
                       if eqn.primitive.name == "cos")
    chunk_keys = 64  # xla._CHUNK_KEYS
    assert cos_elements <= tokens * head_dim + md.num_seqs * chunk_keys * head_dim // 2

    out = jax.jit(lambda *a: _attend(case, *a))(q, k, v, md, inv)
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode="position_free")
    check(out, ref, md, jnp.float32, zero_pad_rows=True)
    np.testing.assert_array_equal(np.asarray(out[int(md.cu_q_lens[-1]):]), 0)
