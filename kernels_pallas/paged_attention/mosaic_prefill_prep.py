"""Glue around the Mosaic GPU prefill kernel (mosaic_prefill.py), in plain jnp on device.

gather_kv: the pre-pass (contiguous per-sequence K/V, keys rotated in position_free mode, key
positions); compiled on a GPU its K/V part runs as triton_gather.gather_live (only the key
steps the kernel reads are written). tile_schedule: which rows each CTA owns and which key steps
it visits (with or without a mask). scatter_tails: the rows of partial tiles from the kernel's
side buffer into place.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from kernels_pallas.paged_attention.mosaic_common import META_COLS
from kernels_pallas.paged_attention.triton_gather import gather_live, gather_live_limits
from kernels_pallas.rope import rope_f32

BLOCK_Q = 64  # query rows per compute warpgroup (wgmma M)
TILE_Q = 2 * BLOCK_Q  # query tokens per CTA
BLOCK_KV = 128  # keys per step
_SENTINEL = 1 << 30  # position of pad / unused key slots: after every query
_ALIGN = 8  # query tiles start at rows that are multiples of this (TMA box / SMEM tiling)
_LOG2E = math.log2(math.e)
_TABLE_ROWS = 128  # direct_v: rows of META_COLS page ids in SMEM at most
# Columns of the per-tile schedule (int32 [NT, 8]).
TILE_SEQ, TILE_START, TILE_LO, TILE_MLO, TILE_MHI, TILE_HI, TILE_Q0, TILE_Q1 = range(8)


STAGES = 2  # K/V ring depth
_SMEM_LIMIT = 232448  # bytes per block on the H200, as Mosaic GPU reported it


def smem_bytes(head_dim: int, itemsize: int, interpret: bool = False) -> int:
    """SMEM of one CTA: Q/O tiles, the K and V ring, positions, (P tiles when interpreted)."""
    q = 2 * BLOCK_Q * head_dim * itemsize
    kv = 2 * STAGES * BLOCK_KV * head_dim * itemsize
    pos = STAGES * BLOCK_KV * 4 + 2 * 2 * BLOCK_Q * 4
    p = 2 * BLOCK_Q * BLOCK_KV * itemsize if interpret else 0
    return q + kv + pos + p + 1024


def mosaic_prefill_limits(q, k_pages) -> str:
    """Why this kernel cannot take these shapes ('' when it can)."""
    head_dim = q.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype != q.dtype:
        return f"needs bf16/f16 q and pages of the same dtype, got {q.dtype}/{k_pages.dtype}"
    if head_dim not in (64, 128):
        return f"needs head_dim 64 or 128, got {head_dim}"
    need = smem_bytes(head_dim, q.dtype.itemsize)
    if need > _SMEM_LIMIT:
        return f"needs {need} bytes of shared memory; the H200 has {_SMEM_LIMIT} per block"
    return ""


# Compiled pre-pass: the Triton live-only gather (False: XLA's whole-table gather). It cannot
# lower without a GPU, so the CUDA lowering test on a CPU-only machine turns it off.
LIVE_GATHER = True


def _positions(md, page_size: int):
    """(valid [S, NB, B] bool, pos [S, NB, B] int32) of every table slot."""
    max_blocks = md.block_tables.shape[1]
    slot = jnp.arange(page_size, dtype=jnp.int32)
    in_use = jnp.arange(max_blocks)[None, :] < md.num_blocks[:, None]  # [S, NB]
    valid = (slot[None, None, :] < md.block_num_valid[:, :, None]) & in_use[:, :, None]
    return valid, md.block_pos_start[:, :, None] + slot


def key_positions(md, page_size: int, n_pad: int):
    """[S, n_pad] int32 logical position of each gathered key (_SENTINEL: pad / unused)."""
    valid, pos = _positions(md, page_size)
    seqs = valid.shape[0]
    key_pos = jnp.where(valid, pos, _SENTINEL).reshape(seqs, -1)
    key_pos = jnp.pad(key_pos, ((0, 0), (0, n_pad - key_pos.shape[1])),
                      constant_values=_SENTINEL)
    return key_pos.astype(jnp.int32)


def gather_kv(k_pages, v_pages, md, inv_freq, *, rotate_keys: bool, attention_scaling: float,
              live: bool = False, values: bool = True):
    """Contiguous per-sequence K/V and key positions (the pre-pass).

    Returns k, v [S, N, K, D] (keys rotated when rotate_keys; pad slots zero) and key_pos [S, N]
    int32 (_SENTINEL for pad slots and unused entries), N = NB * B rounded up to BLOCK_KV.
    live (compiled on a GPU): K/V by triton_gather.gather_live, defined only on the key steps
    below each sequence's last block in use (all the kernel reads). values False: v is None
    (the kernel reads values from the pages, page_table).
    """
    seqs, max_blocks = md.block_tables.shape
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    n = max_blocks * page_size
    n_pad = -(-n // BLOCK_KV) * BLOCK_KV
    key_pos = key_positions(md, page_size, n_pad)
    if live:
        if not gather_live_limits(k_pages, seqs, n_pad, BLOCK_KV):
            keys, vals = gather_live(k_pages, v_pages, md, inv_freq, n_pad=n_pad,
                                     step_keys=BLOCK_KV, rotate_keys=rotate_keys,
                                     attention_scaling=attention_scaling, values=values)
            return keys, vals, key_pos
    valid, pos = _positions(md, page_size)
    tables = jnp.clip(md.block_tables, 0, num_pages - 1)
    keys = k_pages[tables]  # [S, NB, B, K, D]
    if rotate_keys and inv_freq.shape[0]:
        keys = rope_f32(keys, pos, inv_freq, attention_scaling, out_dtype=k_pages.dtype)
    ok = valid[..., None, None]
    keys = jnp.where(ok, keys, 0).astype(k_pages.dtype)  # pads may hold NaN

    def lay_out(x):  # [S, NB, B, K, D] -> [S, N_pad, K, D]
        x = x.reshape(seqs, n, kv_heads, head_dim)
        return jnp.pad(x, ((0, 0), (0, n_pad - n), (0, 0), (0, 0)))

    if not values:
        return lay_out(keys), None, key_pos
    vals = jnp.where(ok, v_pages[tables], 0).astype(v_pages.dtype)
    return lay_out(keys), lay_out(vals), key_pos


def direct_v_limits(page_size: int, table_cols: int) -> str:
    """Why the kernel cannot read values straight from the pages ('' when it can): a page is
    one TMA box of a key step (page size a multiple of 8 that divides BLOCK_KV) and the page
    table of a sequence (table_cols entries, padded to whole key steps) fits one TMA box of
    _TABLE_ROWS rows in SMEM (32 KiB next to the kernel's ~163 KiB: 8192 entries, 128K
    positions at page size 16)."""
    if page_size % _ALIGN or BLOCK_KV % page_size:
        return f"needs a page size that is a multiple of {_ALIGN} and divides {BLOCK_KV}"
    entries = -(-table_cols * page_size // BLOCK_KV) * BLOCK_KV // page_size
    if entries > _TABLE_ROWS * META_COLS:
        return f"{entries} table entries exceed {_TABLE_ROWS} rows of {META_COLS} in SMEM"
    return ""


def page_table(md, num_pages: int, page_size: int, n_pad: int):
    """[S, R, META_COLS] int32: the page of each table entry of a sequence's gathered key axis
    (n_pad keys, n_pad / page_size entries <= R * META_COLS). Entries past the table or its
    blocks in use point at a clipped page: their keys are masked (sentinel positions), and a
    finite value times p = 0 adds nothing."""
    seqs, max_blocks = md.block_tables.shape
    rows = -(-(n_pad // page_size) // META_COLS)
    table = jnp.clip(md.block_tables.astype(jnp.int32), 0, num_pages - 1)
    table = jnp.pad(table, ((0, 0), (0, rows * META_COLS - max_blocks)))
    return table.reshape(seqs, rows, META_COLS)


def q_bounds(md):
    """(first row [S], end row [S]) of each sequence's queries: from cu_q_lens, or the explicit
    bounds of a compacted batch (mosaic_mixed.py: rows of other sequences lie in between)."""
    bounds = getattr(md, "q_bounds", None)
    if bounds is not None:
        return bounds
    return md.cu_q_lens[:-1], md.cu_q_lens[1:]


def tile_rows(bounds):
    """First row of each sequence's first tile (its first row rounded down to _ALIGN) and its
    tile count."""
    first, end = bounds
    base = first // _ALIGN * _ALIGN  # [S]
    n_tiles = jnp.where(end > first, (end - base + TILE_Q - 1) // TILE_Q, 0)
    return base, n_tiles


def tile_schedule(md, key_pos, num_tokens: int):
    """int32 [NT, 8]: per tile (seq or -1, first row, lo, mlo, mhi, hi key steps, the sequence's
    first and end rows); see module doc.

    A sequence's tiles are TILE_Q rows starting at its first row rounded down to _ALIGN (a tile
    may hold a few rows of the neighbouring sequences: computed, never stored); NT is a static
    bound. Heavy tiles (late in their sequence) come first so the causal tail of the grid is short.
    """
    seqs = md.block_tables.shape[0]
    q0, q1 = q_bounds(md)
    num_tiles = -(-(num_tokens + _ALIGN * seqs) // TILE_Q) + seqs
    base, n_tiles = tile_rows((q0, q1))
    last = jnp.cumsum(n_tiles)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one fusion (the default method is a while loop: kernels per level, per layer)
    seq = jnp.searchsorted(last, tile, side="right", method="compare_all").astype(jnp.int32)
    live_tile = seq < seqs
    seq = jnp.minimum(seq, seqs - 1)
    start = base[seq] + (tile - (last[seq] - n_tiles[seq])) * TILE_Q
    start = jnp.where(live_tile, start, 0)

    steps = key_pos.shape[1] // BLOCK_KV
    kp = key_pos.reshape(seqs, steps, BLOCK_KV)
    ok = kp < _SENTINEL
    big = jnp.iinfo(jnp.int32).max
    k_min = jnp.where(ok, kp, big).min(-1)  # [S, St]
    k_max = jnp.where(ok, kp, -1).max(-1)
    full = ok.all(-1)
    rows = start[:, None] + jnp.arange(TILE_Q, dtype=jnp.int32)[None, :]  # [NT, TQ]
    own = (rows >= q0[seq][:, None]) & (rows < q1[seq][:, None]) & live_tile[:, None]
    rows = jnp.clip(rows, 0, num_tokens - 1)
    qp, qw = md.q_positions[rows], md.q_window_start[rows]
    q_max = jnp.where(own, qp, -1).max(-1)[:, None]
    q_min = jnp.where(own, qp, big).min(-1)[:, None]
    w_min = jnp.where(own, qw, big).min(-1)[:, None]
    w_max = jnp.where(own, qw, -1).max(-1)[:, None]
    live = (k_min[seq] <= q_max) & (k_max[seq] >= w_min)  # [NT, St]
    no_mask = full[seq] & (k_max[seq] <= q_min) & (k_min[seq] >= w_max) & live
    idx = jnp.arange(steps, dtype=jnp.int32)[None, :]
    lo = jnp.min(jnp.where(live, idx, steps), axis=1)
    hi = jnp.maximum(jnp.max(jnp.where(live, idx + 1, 0), axis=1), lo)
    any_live = hi > lo
    lo, hi = jnp.where(any_live, lo, 0), jnp.where(any_live, hi, 0)
    in_range = (idx >= lo[:, None]) & (idx < hi[:, None])
    mlo = jnp.min(jnp.where(in_range & no_mask, idx, steps), axis=1)
    mlo = jnp.minimum(mlo, hi)
    mhi = jnp.min(jnp.where((idx >= mlo[:, None]) & ~no_mask, idx, steps), axis=1)
    mhi = jnp.minimum(mhi, hi)
    sched = jnp.stack([jnp.where(live_tile, seq, -1), start, lo, mlo, mhi, hi, q0[seq],
                       q1[seq]], axis=1).astype(jnp.int32)
    return sched[::-1]  # heavy (late) tiles first; spare tiles (seq -1) were last


def scatter_tails(out, side, md, tokens: int):
    """Rows of the warpgroups that were not whole (first and last tile of a sequence) from the
    side buffer into place; out [T8, H, D] -> [T, H, D]."""
    seqs, _, heads, _, head_dim = side.shape
    rows_out = out.shape[0]
    q0, q1 = q_bounds(md)
    base, n_tiles = tile_rows((q0, q1))
    first = jnp.stack([base, base + jnp.maximum(n_tiles - 1, 0) * TILE_Q], 1)  # [S, 2]
    r = jnp.arange(TILE_Q, dtype=jnp.int32)
    tok = first[:, :, None] + r  # [S, 2, TQ]
    chunk = first[:, :, None] + r // BLOCK_Q * BLOCK_Q
    lo, hi = q0[:, None, None], q1[:, None, None]
    take = (tok >= lo) & (tok < hi) & ((chunk < lo) | (chunk + BLOCK_Q > hi))
    take &= jnp.array([True, False])[None, :, None] | (n_tiles > 1)[:, None, None]
    dest = jnp.where(take, tok, tokens).reshape(-1)
    rows = jnp.moveaxis(side, 2, 3).reshape(seqs * 2 * TILE_Q, heads, head_dim)
    out = out[:tokens] if rows_out != tokens else out
    return out.at[dest].set(rows, mode="drop")


def prepare(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys, attention_scaling, sm_scale,
            live_gather: bool = False, direct_v: bool = False):
    """Everything before mosaic_prefill's kernel: (sched, q_in, k, v, key_pos, q_pos, q_win, v_table).
    live_gather (compiled): K/V written only where the kernel reads (gather_kv).
    direct_v: values are not gathered; v is the page pool itself and v_table the page of each
    table entry (page_table; the kernel reads V through it by TMA). Its
    precondition, as mosaic_decode's: every page slot holds a finite value (a masked key's p = 0
    times a NaN value is NaN); the engine zeroes every page it hands out before first use
    (serving/cache/page_zeroing.py), so unwritten slots hold 0.
    Without direct_v, v_table is None."""
    tokens = q_rot.shape[0]
    if direct_v:
        why = direct_v_limits(k_pages.shape[1], md.block_tables.shape[1])
        if why:
            raise ValueError(f"direct_v: {why}")
    k_buf, v_buf, key_pos = gather_kv(k_pages, v_pages, md, inv_freq, rotate_keys=rotate_keys,
                                      attention_scaling=attention_scaling,
                                      live=live_gather and LIVE_GATHER,
                                      values=not direct_v)
    v_table = None
    if direct_v:
        v_buf, v_table = v_pages, page_table(md, k_pages.shape[0], k_pages.shape[1],
                                             key_pos.shape[1])
    sched = tile_schedule(md, key_pos, tokens)
    q_in, q_pos, q_win = queries_in(q_rot, md, sm_scale)
    return sched, q_in, k_buf, v_buf, key_pos, q_pos, q_win, v_table


def queries_in(q_rot, md, sm_scale):
    """(q scaled by sm_scale * log2(e), positions, window starts), padded: row counts of tiled
    GMEM arrays must be multiples of _ALIGN, and a tile's tail rows past T read zeros and
    position -1 (they see no key)."""
    tokens = q_rot.shape[0]
    extra = -(-tokens // _ALIGN) * _ALIGN - tokens + TILE_Q
    q_in = jnp.pad((q_rot.astype(jnp.float32) * (sm_scale * _LOG2E)).astype(q_rot.dtype),
                   ((0, extra), (0, 0), (0, 0)))
    q_pos = jnp.pad(md.q_positions, (0, extra), constant_values=-1)
    q_win = jnp.pad(md.q_window_start, (0, extra))
    return q_in, q_pos, q_win
