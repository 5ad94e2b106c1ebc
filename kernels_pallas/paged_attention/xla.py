"""The XLA fallback of paged attention: a gather through the block tables, then dense attention
(memory O(T * NB * B * K * D)). It runs anywhere and takes every problem."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.registry import Implementation
from kernels_pallas.rope import apply_rope


@functools.partial(jax.named_call, name="xla_paged_attention")
def xla_paged_attention(q, k_pages, v_pages, md, inv_freq, *, kv_mode, attention_scaling,
                        sm_scale, q_rotated: bool = False):
    """Gather + dense attention (paged_attention's arguments; q_rotated: q comes rotated)."""
    tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    seqs, max_blocks = md.block_tables.shape
    group = heads // kv_heads
    n_keys = max_blocks * page_size

    offsets = jnp.arange(page_size, dtype=jnp.int32)
    key_pos = (md.block_pos_start[:, :, None] + offsets).reshape(seqs, n_keys)  # [S, N]
    in_use = jnp.arange(max_blocks)[None, :] < md.num_blocks[:, None]  # [S, NB]
    valid = ((offsets[None, None, :] < md.block_num_valid[:, :, None]) & in_use[:, :, None])
    valid = valid.reshape(seqs, n_keys)  # [S, N]

    keys = k_pages[md.block_tables].reshape(seqs, n_keys, kv_heads, head_dim)  # [S, N, K, D]
    values = v_pages[md.block_tables].reshape(seqs, n_keys, kv_heads, head_dim)
    values = jnp.where(valid[:, :, None, None], values, 0)  # pad slots may hold garbage (NaN)
    if kv_mode == "position_free":
        keys = apply_rope(keys.reshape(seqs * n_keys, kv_heads, head_dim), key_pos.reshape(-1),
                          inv_freq, attention_scaling).reshape(keys.shape)
    q_rot = q if q_rotated else apply_rope(q, md.q_positions, inv_freq, attention_scaling)

    seq = jnp.clip(md.q_seq, 0, seqs - 1)
    k_t = keys[seq].astype(jnp.float32)  # [T, N, K, D]
    v_t = values[seq].astype(jnp.float32)
    q_g = q_rot.astype(jnp.float32).reshape(tokens, kv_heads, group, head_dim)
    hi = jax.lax.Precision.HIGHEST  # fp32 means fp32 (GPUs default to TF32 for f32 dots)
    scores = jnp.einsum("tkgd,tnkd->tkgn", q_g, k_t, precision=hi) * sm_scale  # [T, K, G, N]
    kp = key_pos[seq]  # [T, N]
    mask = (valid[seq] & (kp <= md.q_positions[:, None]) & (kp >= md.q_window_start[:, None]))
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("tkgn,tnkd->tkgd", probs, v_t, precision=hi)
    out = out / jnp.where(denom == 0, 1.0, denom)
    return out.reshape(tokens, heads, head_dim).astype(q.dtype)


def _run(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys, attention_scaling, sm_scale,
         interpret=False):
    """The registry's calling convention (q already rotated) over xla_paged_attention."""
    del interpret
    kv_mode = "position_free" if rotate_keys else "rotated"
    return xla_paged_attention(q_rot, k_pages, v_pages, md, inv_freq, kv_mode=kv_mode,
                               attention_scaling=attention_scaling, sm_scale=sm_scale,
                               q_rotated=True)


IMPLEMENTATION = Implementation("xla", _run)
