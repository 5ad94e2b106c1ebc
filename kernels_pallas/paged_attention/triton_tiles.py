"""The ragged Triton kernel's tiles (triton_ragged.py): which sequence and first token each query
tile has (tile_schedule) and which key steps each tile can see (tile_step_range), computed with
jnp from the metadata so a step stays jittable."""

from __future__ import annotations

import jax.numpy as jnp


def tile_step_range(md, tile_seq, tile_start, block_q: int, pages_per_step: int):
    """[lo, hi) key steps that can hold a key visible to some query of each tile.

    A step is live for a tile when some valid key in it has window_start_min <= pos <= q_pos_max
    over the tile's queries; steps outside the first..last live step are skipped by the loop
    bounds (no branch inside the loop, so Triton can pipeline the loads). With block positions
    ascending (the usual case) this is exactly causal + window block skipping.
    """
    seqs, max_blocks = md.block_tables.shape
    steps = -(-max_blocks // pages_per_step)
    pad = steps * pages_per_step - max_blocks
    start = jnp.pad(md.block_pos_start, ((0, 0), (0, pad)))
    n_valid = jnp.pad(md.block_num_valid, ((0, 0), (0, pad)))
    in_use = jnp.arange(steps * pages_per_step)[None, :] < md.num_blocks[:, None]
    used = in_use & (n_valid > 0)
    big = jnp.iinfo(jnp.int32).max
    lo_pos = jnp.where(used, start, big).reshape(seqs, steps, pages_per_step).min(-1)  # [S, St]
    hi_pos = jnp.where(used, start + n_valid - 1, -1).reshape(seqs, steps, pages_per_step).max(-1)
    tokens = md.q_positions.shape[0]
    seq = jnp.maximum(tile_seq, 0)
    rows = jnp.clip(tile_start[:, None] + jnp.arange(block_q)[None, :], 0, tokens - 1)  # [NT, Q]
    row_ok = tile_start[:, None] + jnp.arange(block_q)[None, :] < md.cu_q_lens[seq + 1][:, None]
    q_max = jnp.where(row_ok, md.q_positions[rows], -1).max(-1)  # [NT]
    w_min = jnp.where(row_ok, md.q_window_start[rows], big).min(-1)
    live = (lo_pos[seq] <= q_max[:, None]) & (hi_pos[seq] >= w_min[:, None])  # [NT, St]
    live &= (tile_seq >= 0)[:, None]
    idx = jnp.arange(steps, dtype=jnp.int32)
    lo = jnp.min(jnp.where(live, idx, steps), axis=1)
    hi = jnp.max(jnp.where(live, idx + 1, 0), axis=1)
    return lo.astype(jnp.int32), jnp.maximum(hi, lo).astype(jnp.int32)


def tile_schedule(cu_q_lens, num_tokens: int, block_q: int):
    """Tiles of block_q tokens per sequence -> (tile_seq [NT], tile_start [NT]); seq -1 = spare."""
    seqs = cu_q_lens.shape[0] - 1
    num_tiles = -(-num_tokens // block_q) + seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    n_tiles = (q_lens + block_q - 1) // block_q
    last = jnp.cumsum(n_tiles)  # [S] one past each sequence's last tile
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one fusion (the default method is a while loop: kernels per level, per layer)
    seq = jnp.searchsorted(last, tile, side="right", method="compare_all").astype(jnp.int32)
    live = seq < seqs
    seq_c = jnp.minimum(seq, seqs - 1)
    first = last[seq_c] - n_tiles[seq_c]
    start = cu_q_lens[seq_c] + (tile - first) * block_q
    return jnp.where(live, seq, -1), jnp.where(live, start, 0)
