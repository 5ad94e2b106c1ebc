"""The Mosaic GPU prefill kernel with the key axis split: few query rows over a long context.

mosaic_prefill.py gives each (query head, tile of 128 query rows) one CTA that walks all of the
tile's key steps. A step of a few dozen query tokens over a long cached context (the cached-span
request: 72 queries over 33K keys) then has 32 CTAs for 132 SMs, each walking ~260 key steps.
Here each tile's live key steps [lo, hi) are cut into up to `splits` ranges of at least
`min_steps` steps; every range is one CTA that writes its normalised partial output and base-2
log-sum-exp per row, and the partials of a tile are merged by log-sum-exp after the kernel (as
the decode kernels' split-K). The pre-pass (gather, rotation, key positions) is the kernel's.

Masked / unmasked step ranges are clipped to each split, so a split never runs an unmasked step
that needs a mask.

GQA packing (pack_gqa): the G query heads of a kv head are laid out as G rows per token, so the
grid runs over kv heads and one CTA serves a whole group: each kv head's keys are read once per
tile of 128 packed rows instead of once per query head, and a few query rows fill the tile G
times as much (the cached-span step's split prefill is the case it was built for:
benchmarks/RESULTS.md, RAG headline, and benchmarks/history/rag.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention.mosaic_prefill import prepare, run_kernel
from kernels_pallas.paged_attention.mosaic_prefill_paged import paged_prepare
from kernels_pallas.paged_attention.mosaic_prefill_prep import (TILE_HI, TILE_LO, TILE_MHI,
                                                                TILE_MLO, TILE_Q, TILE_Q0,
                                                                TILE_Q1, TILE_SEQ, TILE_START,
                                                                q_bounds)

MIN_STEPS = 8  # key steps (of 128 keys) per split at least


def split_schedule(sched, splits: int, min_steps: int = MIN_STEPS):
    """[NT, 8] tile schedule -> [NT * splits, 8] (tile-major) and a [NT * splits] bool of the
    entries that hold a key range (their partials count in the merge)."""
    n_tiles = sched.shape[0]
    lo, hi = sched[:, TILE_LO], sched[:, TILE_HI]
    steps = hi - lo
    n = jnp.clip(-(-steps // min_steps), 1, splits)  # [NT] splits used by each tile
    chunk = -(-steps // n)
    rep = jnp.repeat(sched, splits, axis=0)  # [E, 8]
    j = jnp.tile(jnp.arange(splits, dtype=jnp.int32), n_tiles)
    a = jnp.minimum(rep[:, TILE_LO] + j * jnp.repeat(chunk, splits), rep[:, TILE_HI])
    b = jnp.minimum(a + jnp.repeat(chunk, splits), rep[:, TILE_HI])
    mlo = jnp.clip(rep[:, TILE_MLO], a, b)
    mhi = jnp.maximum(mlo, jnp.clip(rep[:, TILE_MHI], a, b))
    used = (j < jnp.repeat(n, splits)) & (rep[:, TILE_SEQ] >= 0)
    out = rep.at[:, TILE_LO].set(a).at[:, TILE_MLO].set(mlo).at[:, TILE_MHI].set(mhi).at[:, TILE_HI].set(b)
    return out, used


def merge_split(part, lse, used, sched, splits: int, tokens: int):
    """Partials [E, H, TQ, D] and log-sum-exps [E, H, TQ] of split_schedule's entries -> [T, H, D]
    (rows of no sequence are zero)."""
    entries, heads, _, head_dim = part.shape
    n_tiles = entries // splits
    lse = jnp.where(used[:, None, None], lse, -jnp.inf).reshape(n_tiles, splits, heads, TILE_Q)
    m = jnp.max(lse, axis=1, keepdims=True)
    w = jnp.where(jnp.isfinite(lse), jnp.exp2(lse - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    part = jnp.where(used[:, None, None, None], part.astype(jnp.float32), 0.0)
    part = part.reshape(n_tiles, splits, heads, TILE_Q, head_dim)
    den = jnp.sum(w, axis=1)  # [NT, H, TQ]
    out = jnp.einsum("tjhr,tjhrd->thrd", w, part) / jnp.where(den == 0, 1.0, den)[..., None]
    tile = sched[::splits]  # [NT, 8]
    rows = tile[:, TILE_START, None] + jnp.arange(TILE_Q, dtype=jnp.int32)[None, :]  # [NT, TQ]
    own = (rows >= tile[:, TILE_Q0, None]) & (rows < tile[:, TILE_Q1, None]) & (tile[:, TILE_SEQ, None] >= 0)
    dest = jnp.where(own, rows, tokens).reshape(-1)
    # Each row's source (metadata only: one scatter per step, shared by the layers once XLA
    # merges their identical copies), then a gather that fuses with the merge's elementwise
    # tail; a scatter of the rows themselves would be its own kernels in every layer.
    entry = jnp.arange(dest.shape[0], dtype=jnp.int32)
    src = jnp.full((tokens,), -1, jnp.int32).at[dest].set(entry, mode="drop")  # [T]
    rows_out = jnp.moveaxis(out, 1, 2).reshape(n_tiles * TILE_Q, heads, head_dim)
    return jnp.where((src >= 0)[:, None, None], rows_out[jnp.maximum(src, 0)], 0.0)


@dataclasses.dataclass(frozen=True)
class _Packed:
    """The metadata fields the pre-pass and the tile schedule read, over packed rows."""
    q_positions: jax.Array  # [T * G]
    q_window_start: jax.Array  # [T * G]
    cu_q_lens: jax.Array  # unused placeholder (q_bounds gives the rows)
    q_bounds: tuple  # ([S] first row, [S] end row) in packed rows
    num_blocks: jax.Array
    block_tables: jax.Array
    block_pos_start: jax.Array
    block_num_valid: jax.Array


def pack_gqa(q_rot, md, group: int):
    """GQA packing: the `group` query heads of a kv head become rows. [T, H, D] -> [T * G, K, D]
    with row t * G + g of column k = head k * G + g, and the metadata over those rows (each
    token's position and window repeated G times, a sequence's rows [first * G, end * G))."""
    tokens, heads, head_dim = q_rot.shape
    kv = heads // group
    q = q_rot.reshape(tokens, kv, group, head_dim).transpose(0, 2, 1, 3)
    first, end = q_bounds(md)
    packed = _Packed(
        q_positions=jnp.repeat(md.q_positions, group),
        q_window_start=jnp.repeat(md.q_window_start, group),
        cu_q_lens=md.cu_q_lens, q_bounds=(first * group, end * group),
        num_blocks=md.num_blocks, block_tables=md.block_tables,
        block_pos_start=md.block_pos_start, block_num_valid=md.block_num_valid)
    return q.reshape(tokens * group, kv, head_dim), packed


def unpack_gqa(out, group: int):
    """pack_gqa's rows back: [T * G, K, D] -> [T, H, D]."""
    rows, kv, head_dim = out.shape
    out = out.reshape(rows // group, group, kv, head_dim).transpose(0, 2, 1, 3)
    return out.reshape(rows // group, kv * group, head_dim)


def prefill_attention_split(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                            attention_scaling: float, sm_scale: float, splits: int = 16,
                            min_steps: int = MIN_STEPS, direct_v: bool = False,
                            skip_idle: bool = False, paged=None, interpret=False):
    """prefill_attention_mosaic with each tile's key steps split over up to `splits` CTAs (see
    module doc). Same arguments and result ([T, H, D] in q's dtype, rows of no sequence zero).

    The query heads of a GQA group are packed into rows first (pack_gqa): a CTA then serves all
    heads of its kv head, so each kv head's keys and values are read once per tile of 128 packed
    rows, not once per query head, and few query rows fill the tile G times as much (72 queries
    x 4 heads: 3 tiles per kv head instead of one half-empty tile per query head).
    direct_v: the kernel reads values from the pages (mosaic_prefill.prepare: the pre-pass then
    gathers keys only; every page slot must hold finite values). skip_idle: a compute warpgroup
    that owns no row (the empty half of a sequence's last tile: 72 queries x 4 heads = 288 rows,
    the third tile's second 64) walks the barriers only (mosaic_prefill._kernel). paged:
    mosaic_prefill_paged.PagedOptions (no pre-pass: K and V from the pages, keys rotated in
    the kernel) or None."""
    group = q_rot.shape[1] // k_pages.shape[2]
    q_p, md_p = pack_gqa(q_rot, md, group)
    kw = dict(rotate_keys=rotate_keys, attention_scaling=attention_scaling, sm_scale=sm_scale)
    keys = None
    if paged is not None:
        (sched, *rest), keys = paged_prepare(q_p, k_pages, v_pages, md_p, inv_freq, paged, **kw)
    else:
        sched, *rest = prepare(q_p, k_pages, v_pages, md_p, inv_freq, live_gather=not interpret,
                               direct_v=direct_v, **kw)
    sched, used = split_schedule(sched, splits, min_steps)
    part, lse = run_kernel((sched, *rest), kv_heads=k_pages.shape[2], interpret=interpret,
                           split=True, skip_idle=skip_idle, keys=keys)
    out = merge_split(part, lse, used, sched, splits, q_p.shape[0])
    return unpack_gqa(out, group).astype(q_rot.dtype)
