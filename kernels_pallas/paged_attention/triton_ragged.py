"""Ragged paged attention in Pallas (Triton lowering): prefill chunks and decodes in one launch.

Work split: grid (query tile, kv head). A query tile is `block_q` consecutive tokens of one
sequence times the G = H/K query heads that share the kv head, so one K/V tile read from HBM feeds
block_q * G query rows (rows r -> token r // G, head r % G). The tile schedule (which sequence and
first token each tile has) is computed with jnp from cu_q_lens, so it stays jittable; the grid has
the static upper bound ceil(T / block_q) + S tiles and spare tiles exit at once.

Each step gathers `block_k` keys (block_k / B pages, addressed through the block table) as rows of
the flat cache [P * B * K, D]. In position_free mode the rotated dims of a K tile are loaded as
their two halves, rotated in float32 by each key's logical position (block_pos_start + slot), and
contracted against the matching halves of the (already rotated) queries; the pass-through dims
(partial rotary) are a third product. Online softmax in float32.

Why Triton and not Mosaic GPU here: see README in this folder (kernel notes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_NEG_INF = float("-inf")


def tile_schedule(cu_q_lens, num_tokens: int, block_q: int):
    """Tiles of block_q tokens per sequence -> (tile_seq [NT], tile_start [NT]); seq -1 = spare."""
    seqs = cu_q_lens.shape[0] - 1
    num_tiles = -(-num_tokens // block_q) + seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    n_tiles = (q_lens + block_q - 1) // block_q
    last = jnp.cumsum(n_tiles)  # [S] one past each sequence's last tile
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(last, tile, side="right").astype(jnp.int32)
    live = seq < seqs
    seq_c = jnp.minimum(seq, seqs - 1)
    first = last[seq_c] - n_tiles[seq_c]
    start = cu_q_lens[seq_c] + (tile - first) * block_q
    return jnp.where(live, seq, -1), jnp.where(live, start, 0)


def tile_rows(block_q: int, group: int) -> int:
    """Query rows of a tile: block_q * G rounded up to a power of 2 >= 16 (Triton dot limits)."""
    rows = 16
    while rows < block_q * group:
        rows *= 2
    return rows


def out_rows(tokens: int, heads: int, kv_heads: int, block_q: int) -> int:
    """Rows of the flat output buffer: spare tile rows land past T * H (unique rows per tile)."""
    return (tokens + tile_rows(block_q, heads // kv_heads)) * heads


def default_block_q(tokens: int, seqs: int, group: int) -> int:
    """Decode-only batches: one token per tile; otherwise 64 query rows per tile."""
    return max(1, 16 // group) if tokens <= seqs else max(1, 64 // group)


def _dot(a, b, contract_b, precise):
    """a [M, C] . b (contracting b's dim contract_b) -> [M, N] float32."""
    precision = lax.Precision.HIGHEST if precise else None
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_nt(a, b, precise):
    """a [M, C] . b [N, C]^T in float32; tiny C (< 16) falls back to broadcast-sum."""
    if a.shape[1] >= 16:
        return _dot(a, b, 1, precise)
    return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :], axis=2)


def _kernel(tile_seq_ref, tile_start_ref, cu_ref, qpos_ref, qwin_ref, nb_ref, bt_ref, bps_ref,
            bnv_ref, inv_ref, q_ref, k_ref, v_ref, *rest, heads, kv_heads, head_dim, page_size,
            block_q, block_k, half, rotate_keys, scaling, skip_empty, cdtype):
    o_ref = rest[-1]
    group = heads // kv_heads
    rows = tile_rows(block_q, group)
    rot = 2 * half
    precise = cdtype == jnp.float32
    tile = pl.program_id(0)
    h = pl.program_id(1)
    seq = tile_seq_ref[tile]

    @pl.when(seq >= 0)
    def _():
        start = tile_start_ref[tile]
        end = cu_ref[seq + 1]
        r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
        tok = start + r // group  # [M]
        row_ok = (tok < end) & (r < block_q * group)  # rows past block_q * G pad the dot to 16
        tok_c = jnp.minimum(tok, end - 1)
        q_row = tok_c * heads + h * group + r % group  # [M]
        q_pos = qpos_ref[tok_c]
        q_win = qwin_ref[tok_c]

        split = rotate_keys and half > 0  # rotated dims as two halves, pass dims on their own
        if split:
            q_lo = q_ref[q_row, pl.ds(0, half)].astype(cdtype)  # [M, R/2]
            q_hi = q_ref[q_row, pl.ds(half, half)].astype(cdtype)
            inv = inv_ref[...].astype(jnp.float32)  # [R/2]
        if not split or rot < head_dim:
            q_all = q_ref[q_row, :]  # [M, D]
            if split:
                d = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 1)
                q_all = jnp.where(d >= rot, q_all, jnp.zeros_like(q_all))
            q_all = q_all.astype(cdtype)

        j = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        pages_per_step = block_k // page_size
        n_steps = (nb_ref[seq] + pages_per_step - 1) // pages_per_step
        max_blocks = bt_ref.shape[1]

        def body(step, carry):
            b = step * pages_per_step + j // page_size  # [N] block-table entry of each key
            slot = j % page_size
            b_c = jnp.minimum(b, max_blocks - 1)
            page = bt_ref[seq, b_c]
            k_pos = bps_ref[seq, b_c] + slot  # [N]
            k_ok = (b < nb_ref[seq]) & (slot < bnv_ref[seq, b_c])
            mask = (k_ok[None, :] & row_ok[:, None] & (k_pos[None, :] <= q_pos[:, None])
                    & (k_pos[None, :] >= q_win[:, None]))  # [M, N]

            def compute(carry):
                acc, m_i, l_i = carry
                k_row = (page * page_size + slot) * kv_heads + h  # [N]
                s = jnp.zeros((rows, block_k), jnp.float32)
                if split:
                    k_lo = k_ref[k_row, pl.ds(0, half)].astype(jnp.float32)  # [N, R/2]
                    k_hi = k_ref[k_row, pl.ds(half, half)].astype(jnp.float32)
                    ang = k_pos.astype(jnp.float32)[:, None] * inv[None, :]  # [N, R/2]
                    cos, sin = jnp.cos(ang) * scaling, jnp.sin(ang) * scaling
                    k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
                    s += _dot_nt(q_lo, k_lo.astype(cdtype), precise)
                    s += _dot_nt(q_hi, k_hi.astype(cdtype), precise)
                if not split or rot < head_dim:
                    s += _dot_nt(q_all, k_ref[k_row, :].astype(cdtype), precise)
                s = jnp.where(mask, s, _NEG_INF)
                m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
                m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
                p = jnp.exp(s - m_safe[:, None])
                alpha = jnp.exp(m_i - m_safe)
                l_i = l_i * alpha + jnp.sum(p, axis=1)
                v = v_ref[k_row, :].astype(cdtype)  # [N, D]
                acc = acc * alpha[:, None] + _dot(p.astype(cdtype), v, 0, precise)
                return acc, m_new, l_i

            if not skip_empty:
                return compute(carry)
            any_live = jnp.max(mask.astype(jnp.int32)) > 0
            return lax.cond(any_live, compute, lambda c: c, carry)

        acc = jnp.zeros((rows, head_dim), jnp.float32)
        m_i = jnp.full((rows,), _NEG_INF, jnp.float32)
        l_i = jnp.zeros((rows,), jnp.float32)
        acc, m_i, l_i = lax.fori_loop(0, n_steps, body, (acc, m_i, l_i))
        out = acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_row = tok * heads + h * group + r % group  # unclamped: padded output rows absorb spares
        col = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
        # Both indices as arrays: the interpreter can discharge a masked store only in that form.
        pltriton.store(o_ref.at[o_row[:, None], col], out.astype(o_ref.dtype),
                       mask=jnp.broadcast_to(row_ok[:, None], out.shape))


def ragged_paged_attention_triton(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                                  attention_scaling: float, sm_scale: float, block_q: int | None = None,
                                  block_k: int = 64, num_warps: int = 4, num_stages: int = 2,
                                  out=None, interpret: bool = False):
    """Pallas/Triton ragged paged attention. q_rot [T, H, D] already rotated by its positions.

    attention_scaling multiplies the keys' cos/sin (queries come rotated with the same scaling);
    sm_scale is folded into q. `out`, if given, is an [out_rows(...), D] buffer the kernel
    writes into (aliased; tests poison it); rows of no sequence keep its contents.
    Returns [T, H, D].
    """
    tokens, heads, head_dim = q_rot.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    if block_q is None:
        block_q = default_block_q(tokens, md.num_seqs, group)
    half = inv_freq.shape[0]
    tile_seq, tile_start = tile_schedule(md.cu_q_lens, tokens, block_q)
    cdtype = jnp.float32 if q_rot.dtype == jnp.float32 else q_rot.dtype
    q_flat = q_rot.reshape(tokens * heads, head_dim)
    k_flat = k_pages.reshape(num_pages * page_size * kv_heads, head_dim)
    v_flat = v_pages.reshape(num_pages * page_size * kv_heads, head_dim)
    q_flat = (q_flat.astype(jnp.float32) * sm_scale).astype(q_rot.dtype)
    n_out = out_rows(tokens, heads, kv_heads, block_q)
    kernel = functools.partial(
        _kernel, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        block_q=block_q, block_k=block_k, half=half, rotate_keys=rotate_keys,
        scaling=float(attention_scaling),
        skip_empty=block_q * group > 16, cdtype=cdtype)
    args = [tile_seq, tile_start, md.cu_q_lens, md.q_positions, md.q_window_start, md.num_blocks,
            md.block_tables, md.block_pos_start, md.block_num_valid,
            inv_freq.astype(jnp.float32) if half else jnp.zeros((1,), jnp.float32),
            q_flat, k_flat, v_flat]
    aliases = {}
    if out is not None:
        aliases = {len(args): 0}
        args.append(out)
    res = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_out, head_dim), q_rot.dtype),
        grid=(tile_seq.shape[0], kv_heads),
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*args)
    return res[: tokens * heads].reshape(tokens, heads, head_dim)
