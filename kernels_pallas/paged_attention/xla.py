"""The XLA fallback of paged attention: gathers through the block tables, then dense attention
over the keys in use. It runs anywhere and takes every problem (the CPU engine's kernel).

Two bounds keep the work at the size of the step rather than of the cache:
  * keys: the block-table width NB is the static max_model_len / B, but a step's sequences use
    only max(num_blocks) columns, so keys are read in chunks of columns under a loop whose trip
    count is that maximum (a device value); chunks combine by the online softmax (running max,
    sum and weighted values), and a context of one chunk computes exactly the plain softmax;
  * queries: a sequence's query rows are contiguous (cu_q_lens), so they are cut into tiles of
    `q_tile` rows that each belong to one sequence (at most T / q_tile + S tiles); a tile reads
    its sequence's keys once and attends with one [q_tile * G, D] x [D, keys] product per KV
    head, instead of every token gathering its own copy of the keys. Decode-shaped steps (about
    one query per sequence) take tiles of one row, i.e. one per token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention.decode_common import rope_table
from kernels_pallas.registry import Implementation
from kernels_pallas.rope import apply_rope, rope_f32, rotate_f32

# Keys per loop step at most (block-table columns * B): small chunks waste little past the
# longest context, and a loop step costs little on CPU (smaller was faster down to 32-64 keys at
# the SmolLM2-135M shape, for decode and prefill steps alike).
_CHUNK_KEYS = 64
_MAX_Q_TILE = 16  # query rows per tile at most


def q_tile_rows(tokens: int, seqs: int) -> int:
    """Query rows per tile: about the mean query rows per sequence slot (a power of two in
    [1, 16]), so decode steps get one row per tile and prefill steps few tiles per sequence."""
    rows = 1
    while rows * 2 <= min(_MAX_Q_TILE, max(1, tokens // max(seqs, 1))):
        rows *= 2
    return rows


def _tiles(md, tokens: int, rows: int):
    """Tile layout of the query rows: (seq [I], row [I, Q], row_ok [I, Q]), I tiles of Q rows;
    a tile's rows are consecutive rows of one sequence, row_ok False past its end."""
    seqs = md.num_seqs
    n_tiles = min(tokens, tokens // rows + seqs) if rows > 1 else tokens
    lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]  # [S]
    tile_cu = jnp.cumsum(-(-lens // rows))  # [S] tiles up to and including each sequence
    tile = jnp.arange(n_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_cu, tile, side="right"), seqs - 1)  # [I]
    first = tile_cu[seq] - -(-lens[seq] // rows)  # the sequence's first tile
    start = md.cu_q_lens[seq] + (tile - first) * rows  # [I]
    row = start[:, None] + jnp.arange(rows, dtype=jnp.int32)  # [I, Q]
    row_ok = (tile < tile_cu[-1])[:, None] & (row < md.cu_q_lens[seq + 1][:, None])
    return seq, jnp.where(row_ok, row, 0), row_ok


@functools.partial(jax.named_call, name="xla_paged_attention")
def xla_paged_attention(q, k_pages, v_pages, md, inv_freq, *, kv_mode, attention_scaling,
                        sm_scale, q_rotated: bool = False, chunk: int | None = None,
                        q_tile: int | None = None, max_position: int | None = None):
    """Gather + dense attention (paged_attention's arguments; q_rotated: q comes rotated;
    chunk: block-table columns per loop step and q_tile: query rows per tile, None = their
    defaults; max_position: a bound on every query position, so position_free keys read their
    cos | sin from a host table of that many rows instead of computing them: see XlaOptions).
    Rows past the real tokens (beyond cu_q_lens[-1]) come back zero."""
    tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    seqs, max_blocks = md.block_tables.shape
    group = heads // kv_heads
    cols = chunk or max(1, min(max_blocks, _CHUNK_KEYS // page_size))
    n_chunks = -(-max_blocks // cols)
    pad = n_chunks * cols - max_blocks  # padded columns hold no valid slot

    def padded(x):
        return jnp.pad(x, ((0, 0), (0, pad))) if pad else x

    tables, pos_start = padded(md.block_tables), padded(md.block_pos_start)
    in_use = jnp.arange(n_chunks * cols)[None, :] < md.num_blocks[:, None]  # [S, NB']
    num_valid = jnp.where(in_use, padded(md.block_num_valid), 0)
    q_rot = q if q_rotated else apply_rope(q, md.q_positions, inv_freq, attention_scaling)
    rows = q_tile or q_tile_rows(tokens, seqs)
    tile_seq, row, row_ok = _tiles(md, tokens, rows)  # [I], [I, Q], [I, Q]
    n_tiles = tile_seq.shape[0]
    q_t = q_rot.astype(jnp.float32)[row].reshape(n_tiles, rows, kv_heads, group, head_dim)
    q_t = q_t.transpose(0, 2, 1, 3, 4).reshape(n_tiles, kv_heads, rows * group, head_dim)
    q_pos, q_win = md.q_positions[row], md.q_window_start[row]  # [I, Q]
    offsets = jnp.arange(page_size, dtype=jnp.int32)
    n_keys = cols * page_size
    hi = jax.lax.Precision.HIGHEST  # fp32 means fp32 (GPUs default to TF32 for f32 dots)
    cos_sin = None if max_position is None or kv_mode != "position_free" else rope_table(
        inv_freq, max_position, attention_scaling, jnp.float32)  # [max_position, R]

    def step(c, carry):
        run_max, run_sum, acc = carry  # [I, K, QG, 1], [I, K, QG, 1], [I, K, QG, D]

        def cols_of(x):
            return jax.lax.dynamic_slice_in_dim(x, c * cols, cols, axis=1)  # [S, C]

        table = cols_of(tables)
        key_pos = (cols_of(pos_start)[:, :, None] + offsets).reshape(seqs, n_keys)  # [S, N]
        valid = (offsets[None, None, :] < cols_of(num_valid)[:, :, None]).reshape(seqs, n_keys)
        keys, values = _gather_pages(k_pages, v_pages, table)  # [S, N, K, D] each
        values = jnp.where(valid[:, :, None, None], values, 0)  # pad slots may hold NaN
        keys = keys.astype(jnp.float32)
        if kv_mode == "position_free":
            keys = _rotate_keys(keys, key_pos, inv_freq, attention_scaling, cos_sin)
        k_t = keys.transpose(0, 2, 1, 3)[tile_seq]  # [I, K, N, D]
        v_t = values.astype(jnp.float32).transpose(0, 2, 1, 3)[tile_seq]
        key_pos, valid = key_pos[tile_seq], valid[tile_seq]  # [I, N]
        scores = jnp.einsum("ikqd,iknd->ikqn", q_t, k_t, precision=hi) * sm_scale
        kp = key_pos[:, None, :]  # [I, 1, N]
        mask = (valid[:, None, :] & row_ok[:, :, None] & (kp <= q_pos[:, :, None])
                & (kp >= q_win[:, :, None]))  # [I, Q, N]
        mask = jnp.repeat(mask, group, axis=1)[:, None]  # [I, 1, QG, N]
        scores = jnp.where(mask, scores, -jnp.inf)
        new_max = jnp.maximum(run_max, jnp.max(scores, axis=-1, keepdims=True))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(scores - safe_max)
        scale = jnp.exp(run_max - safe_max)  # 0 while nothing was seen (run_max -inf)
        run_sum = run_sum * scale + jnp.sum(probs, axis=-1, keepdims=True)
        acc = acc * scale + jnp.einsum("ikqn,iknd->ikqd", probs, v_t, precision=hi)
        return new_max, run_sum, acc

    shape = (n_tiles, kv_heads, rows * group, 1)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((n_tiles, kv_heads, rows * group, head_dim), jnp.float32))
    used = jnp.clip(-(-jnp.max(md.num_blocks) // cols), 0, n_chunks)  # chunks with a key in use
    _, run_sum, acc = jax.lax.fori_loop(0, used, step, init)
    out = acc / jnp.where(run_sum == 0, 1.0, run_sum)  # [I, K, QG, D]
    out = out.reshape(n_tiles, kv_heads, rows, group, head_dim).transpose(0, 2, 1, 3, 4)
    dest = jnp.where(row_ok, row, tokens).reshape(-1)  # rows off the tiles: dropped
    return jnp.zeros((tokens, heads, head_dim), q.dtype).at[dest].set(
        out.reshape(n_tiles * rows, heads, head_dim).astype(q.dtype), mode="drop",
        unique_indices=True)


@dataclasses.dataclass(frozen=True)
class XlaOptions:
    """max_position: a bound on every query position (the engine's max_model_len), filled in by
    default from the problem's (up to problem.TABLE_MAX_POSITION). With it, position_free keys
    take cos | sin from a [max_position, R] table built once on the host (a jit constant every
    layer reads) instead of computing them per key, per layer, per step: on CPU the trig was
    67 of 86 ms of attention in a batch-16 decode step of SmolLM2-135M (30 layers). None: trig."""

    max_position: int | None = None


def _defaults(problem, options: XlaOptions) -> XlaOptions:
    if options.max_position is None and problem.rotate_keys:
        return dataclasses.replace(options, max_position=problem.table_bound)
    return options


def _gather_pages(k_pages, v_pages, table):
    """Pages table [S, C] of k_pages, v_pages [P, B, K, D] -> [S, C * B, K, D] each, gathered
    whole and alone: fused with the rotation / mask / transpose that follow, XLA on CPU gathered
    element by element (SmolLM2-135M, batch-16 decode, 30 layers of this loop: 42 -> 17 ms)."""
    keys, values = jax.lax.optimization_barrier((k_pages[table], v_pages[table]))
    seqs, cols, page_size, kv_heads, head_dim = keys.shape
    shape = (seqs, cols * page_size, kv_heads, head_dim)
    return keys.reshape(shape), values.reshape(shape)


def _rotate_keys(keys, key_pos, inv_freq, attention_scaling, cos_sin):
    """keys [S, N, K, D] float32 at key_pos [S, N] rotated: cos | sin read from the table
    cos_sin [M, R] when there is one (keys a query sees are at positions below M; pad slots,
    clipped, are masked later), else computed (R/2 angles per key: half of apply_rope's)."""
    if cos_sin is None:
        return rope_f32(keys, key_pos, inv_freq, attention_scaling)
    half = inv_freq.shape[-1]
    cs = cos_sin[jnp.clip(key_pos, 0, cos_sin.shape[0] - 1)]  # [S, N, R]
    return rotate_f32(keys, cs[..., :half], cs[..., half:])


def _run(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys, attention_scaling, sm_scale,
         interpret=False, max_position=None):
    """The registry's calling convention (q already rotated) over xla_paged_attention."""
    del interpret
    kv_mode = "position_free" if rotate_keys else "rotated"
    return xla_paged_attention(q_rot, k_pages, v_pages, md, inv_freq, kv_mode=kv_mode,
                               attention_scaling=attention_scaling, sm_scale=sm_scale,
                               q_rotated=True, max_position=max_position)


IMPLEMENTATION = Implementation("xla", _run, options=XlaOptions, defaults=_defaults)
