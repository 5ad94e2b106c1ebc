"""Random paged-attention inputs for the attention benchmark: decode (S sequences x 1 token over
ctx cached keys) and prefill (S x new tokens over cached ones), block tables randomly permuted."""

from __future__ import annotations

import numpy as np


def decode_inputs(rng, seqs, ctx, heads, kv_heads, head_dim, page_size, dtype):
    """One query per sequence at position ctx - 1 over ctx cached keys: a decode step is the
    prefill shape with one new token after ctx - 1 cached ones."""
    return prefill_inputs(rng, seqs, 1, ctx - 1, heads, kv_heads, head_dim, page_size, dtype)


def prefill_inputs(rng, seqs, new, cached, heads, kv_heads, head_dim, page_size, dtype):
    import jax
    import jax.numpy as jnp
    from kernels_pallas.paged_attention.metadata import AttentionMetadata
    total = new + cached
    per_seq = total // page_size
    num_pages = seqs * per_seq + 8
    tables = rng.permutation(num_pages)[: seqs * per_seq].reshape(seqs, per_seq).astype(np.int32)
    pos = np.tile(np.arange(cached, total, dtype=np.int32), seqs)
    md = AttentionMetadata(
        q_positions=jnp.asarray(pos),
        q_window_start=jnp.zeros((seqs * new,), jnp.int32),
        q_seq=jnp.asarray(np.repeat(np.arange(seqs, dtype=np.int32), new)),
        cu_q_lens=jnp.asarray(np.arange(seqs + 1, dtype=np.int32) * new),
        num_blocks=jnp.full((seqs,), per_seq, jnp.int32),
        block_tables=jnp.asarray(tables),
        block_pos_start=jnp.asarray(np.tile(np.arange(per_seq, dtype=np.int32) * page_size,
                                            (seqs, 1))),
        block_num_valid=jnp.full((seqs, per_seq), page_size, jnp.int32),
        slot_mapping=jnp.full((seqs * new,), -1, jnp.int32),
    )
    key = jax.random.key(int(rng.integers(1 << 30)))
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (num_pages, page_size, kv_heads, head_dim)
    q = jax.random.normal(k1, (seqs * new, heads, head_dim), dtype)
    k = jax.random.normal(k2, shape, dtype)
    v = jax.random.normal(k3, shape, dtype)
    return q, k, v, md
