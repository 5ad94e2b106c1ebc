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

Split-K (`splits`, flash-decoding for prefill tiles): a step of few query tiles over a long
context (a reordered span request's 121 tokens after 5,680 cached ones: 8 programs, 91 key steps
each) leaves most SMs idle, so each tile's key range is split over `splits` programs (a third
grid axis) that store their normalized partial output and log-sum-exp; a second kernel merges
them, reading only the splits that saw keys (triton_merge.py). Default: enough splits for
~TARGET_PROGRAMS programs, each at least MIN_SPLIT_STEPS key steps of the longest table.

Backend: Pallas' Triton lowering (deprecated in JAX 0.11, a stepping stone behind api.py). It is
the path of general (mixed prefill + decode) steps because it handles the whole ragged batch
(prefill tiles, decode, any G, partial rotary, fp32); see benchmarks/RESULTS.md, Attention:
prefill.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.paged_attention.triton_common import (NEG_INF, cos_sin, dot, dot_nt,
                                                          online_softmax, tile_rows,
                                                          triton_limits)
from kernels_pallas.paged_attention.triton_gather import gather_live, gather_live_limits
from kernels_pallas.paged_attention.triton_merge import merge_split_rows
from kernels_pallas.paged_attention.triton_tiles import tile_schedule, tile_step_range
from kernels_pallas.registry import Implementation
from kernels_pallas.rope import rope_f32


@dataclasses.dataclass(frozen=True)
class TritonRaggedOptions:
    """None = the kernel's default for the batch (`default_options`, by tokens and sequences);
    see ragged_paged_attention_triton."""

    block_q: int | None = None
    block_k: int | None = None
    kv_group: int = 1
    prerotate: bool | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    splits: int | None = None


def limits(problem, options: TritonRaggedOptions) -> str:
    """Why this kernel cannot take the problem with these options ('' when it can)."""
    if problem.kv_heads % options.kv_group:
        return f"needs kv_group dividing the {problem.kv_heads} kv heads, got {options.kv_group}"
    return triton_limits(problem, options.block_k or max(64, problem.block_size))

def out_rows(tokens: int, heads: int, kv_heads: int, block_q: int, kv_group: int = 1) -> int:
    """Rows of the flat output buffer: spare tile rows land past T * H (unique rows per tile)."""
    return (tokens + tile_rows(block_q, heads // kv_heads * kv_group)) * heads


def default_block_q(tokens: int, seqs: int, group: int) -> int:
    """Decode-only batches: one token per tile; otherwise 128 query rows per tile."""
    return max(1, 16 // group) if tokens <= seqs else max(1, 128 // group)


# Split-K (module doc): on by default; False = one program per (tile, kv head) (A/B, benchmarks)
RAGGED_SPLITS = True
TARGET_PROGRAMS = 264  # two per SM of an H100 / H200 (132 SMs)
MAX_SPLITS = 32
MIN_SPLIT_STEPS = 4


def default_splits(tokens: int, block_q: int, kv_programs: int, max_steps: int) -> int:
    """Splits of each tile's key range (module doc): enough for ~TARGET_PROGRAMS programs over
    the ceil(tokens / block_q) tiles a dense batch has, none shorter than MIN_SPLIT_STEPS of the
    longest table's max_steps key steps; 1 with RAGGED_SPLITS off."""
    if not RAGGED_SPLITS:
        return 1
    programs = max(1, -(-tokens // block_q) * kv_programs)
    return max(1, min(-(-TARGET_PROGRAMS // programs), MAX_SPLITS, max_steps // MIN_SPLIT_STEPS))


def default_options(tokens: int, seqs: int, group: int) -> dict:
    """Tile options picked by the H200 sweep (benchmarks/history/attention.md)."""
    if tokens <= seqs:
        return dict(block_q=default_block_q(tokens, seqs, group), block_k=64, num_warps=4,
                    num_stages=2)
    return dict(block_q=default_block_q(tokens, seqs, group), block_k=64, num_warps=4,
                num_stages=3)


def _kernel(tile_seq_ref, tile_start_ref, tile_lo_ref, tile_hi_ref, cu_ref, qpos_ref, qwin_ref,
            nb_ref, bt_ref, bps_ref,
            bnv_ref, inv_ref, q_ref, k_ref, v_ref, *rest, heads, kv_heads, head_dim, page_size,
            block_q, block_k, kv_group, half, rotate_keys, k_contiguous, scaling,
            fast_trig, cdtype, splits):
    o_ref, lse_ref = (rest[-1], None) if splits == 1 else rest[-2:]
    group = heads // kv_heads
    row_heads = group * kv_group  # query heads served by one program (kv_group kv heads)
    rows = tile_rows(block_q, row_heads)
    n_keys = block_k * kv_group  # key rows of one step: block_k keys x kv_group kv heads
    rot = 2 * half
    precise = cdtype == jnp.float32
    tile = pl.program_id(0)
    h0 = pl.program_id(1) * kv_group
    part = pl.program_id(2)  # split of the tile's key steps (read here: not under the when)
    seq = tile_seq_ref[tile]

    @pl.when(seq >= 0)
    def _():
        start = tile_start_ref[tile]
        end = cu_ref[seq + 1]
        r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
        tok = start + r // row_heads  # [M]
        row_ok = (tok < end) & (r < block_q * row_heads)  # rows past that pad the dot to 16
        tok_c = jnp.minimum(tok, end - 1)
        q_row = tok_c * heads + h0 * group + r % row_heads  # [M]
        row_kv = (r % row_heads) // group  # [M] kv head (within the group) of each row
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

        col = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
        d_ok = col < head_dim  # all true: gives the V load mask its full [N, D] shape
        n = lax.broadcasted_iota(jnp.int32, (n_keys,), 0)
        key, n_kv = n // kv_group, n % kv_group  # key rows are (key, kv head) interleaved
        pages_per_step = block_k // page_size
        max_blocks = bt_ref.shape[1]

        def key_meta(step, key):
            b = step * pages_per_step + key // page_size  # block-table entry of each key
            slot = key % page_size
            b_c = jnp.minimum(b, max_blocks - 1)
            pos = bps_ref[seq, b_c] + slot
            ok = (b < nb_ref[seq]) & (slot < bnv_ref[seq, b_c])
            return b_c, slot, pos, ok

        def body(step, carry):
            b_c, slot, k_pos, k_ok = key_meta(step, key)  # [N]
            mask = (k_ok[None, :] & row_ok[:, None] & (k_pos[None, :] <= q_pos[:, None])
                    & (k_pos[None, :] >= q_win[:, None]))  # [M, N]
            if kv_group > 1:
                mask &= row_kv[:, None] == n_kv[None, :]

            acc, m_i, l_i = carry
            page = jnp.where(k_ok, bt_ref[seq, b_c], 0)  # never follow an unused entry
            kv_row = (page * page_size + slot) * kv_heads + h0 + n_kv  # [N]
            k_row = kv_row
            if k_contiguous:  # keys pre-rotated into [S, NB, B, K, D]
                k_row = ((seq * max_blocks + b_c) * page_size + slot) * kv_heads + h0 + n_kv
            s = jnp.zeros((rows, n_keys), jnp.float32)
            if split:
                k_lo = k_ref[k_row, pl.ds(0, half)].astype(jnp.float32)  # [N, R/2]
                k_hi = k_ref[k_row, pl.ds(half, half)].astype(jnp.float32)
                if kv_group == 1:
                    ang = k_pos.astype(jnp.float32)[:, None] * inv[None, :]  # [N, R/2]
                    cos, sin = cos_sin(ang, fast_trig)
                else:  # one cos/sin per key, shared by the kv_group heads
                    kk = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
                    pos1 = key_meta(step, kk)[2]
                    ang = pos1.astype(jnp.float32)[:, None] * inv[None, :]  # [Nk, R/2]
                    cos, sin = cos_sin(ang, fast_trig)
                    shape = (block_k, kv_group, half)
                    cos = jnp.broadcast_to(cos[:, None, :], shape).reshape(n_keys, half)
                    sin = jnp.broadcast_to(sin[:, None, :], shape).reshape(n_keys, half)
                if scaling != 1.0:
                    cos, sin = cos * scaling, sin * scaling
                k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
                s += dot_nt(q_lo, k_lo.astype(cdtype), precise)
                s += dot_nt(q_hi, k_hi.astype(cdtype), precise)
            if not split or rot < head_dim:
                s += dot_nt(q_all, k_ref[k_row, :].astype(cdtype), precise)
            p, alpha, m_new, l_i = online_softmax(s, mask, m_i, l_i)
            # Masked load (pads may hold NaN; 0 * NaN would poison P @ V). A predicated load
            # feeds the dot directly, which keeps it pipelinable; a where() after it did not.
            v = pltriton.load(v_ref.at[kv_row[:, None], col], mask=k_ok[:, None] & d_ok,
                              other=0.0).astype(cdtype)  # [N, D]
            acc = acc * alpha[:, None] + dot(p.astype(cdtype), v, 0, precise)
            return acc, m_new, l_i

        acc = jnp.zeros((rows, head_dim), jnp.float32)
        m_i = jnp.full((rows,), NEG_INF, jnp.float32)
        l_i = jnp.zeros((rows,), jnp.float32)
        lo, hi = tile_lo_ref[tile], tile_hi_ref[tile]
        o_row = tok * heads + h0 * group + r % row_heads  # unclamped: spare rows stay unique
        if splits > 1:  # this program's share of the tile's key steps; partials by split
            per = jnp.maximum((hi - lo + splits - 1) // splits, MIN_SPLIT_STEPS)
            lo = lo + part * per
            hi = jnp.maximum(lo, jnp.minimum(hi, lo + per))
            o_row = o_row + part * (o_ref.shape[0] // splits)
        acc, m_i, l_i = lax.fori_loop(lo, hi, body, (acc, m_i, l_i))
        safe_l = jnp.where(l_i == 0.0, 1.0, l_i)
        out = acc / safe_l[:, None]
        store = jnp.broadcast_to(row_ok[:, None], out.shape)
        if splits == 1:
            # Both indices as arrays: the interpreter can discharge a masked store only so.
            pltriton.store(o_ref.at[o_row[:, None], col], out.astype(o_ref.dtype), mask=store)
        else:  # an empty share stores only its log-sum-exp (-inf: weight 0 in the merge)
            pltriton.store(lse_ref.at[o_row], jnp.where(l_i == 0.0, NEG_INF,
                                                        m_i + jnp.log(safe_l)), mask=row_ok)

            @pl.when(hi > lo)
            def _():
                pltriton.store(o_ref.at[o_row[:, None], col], out, mask=store)


# Pre-rotation writes only the key steps the kernel reads (triton_gather.gather_live); False:
# XLA's whole-table gather, every seat's max_model_len keys a layer (A/B, benchmarks).
LIVE_PREROTATE = True


def rotated_keys(k_pages, md, inv_freq, attention_scaling, block_k: int, interpret: bool):
    """The kernel's k_contiguous keys [S * NB * B * K, D]: prerotate_keys' layout, written by
    gather_live on the key steps (block_k keys) below each sequence's last block in use (the
    steps tile_step_range lets a tile visit; the rest stays undefined and is never read), or by
    prerotate_keys whole where gather_live cannot take the shapes or LIVE_PREROTATE is off."""
    seqs, max_blocks = md.block_tables.shape
    head_dim, n_pad = k_pages.shape[-1], max_blocks * k_pages.shape[1]
    if LIVE_PREROTATE and not gather_live_limits(k_pages, seqs, n_pad, block_k):
        keys, _ = gather_live(k_pages, k_pages, md, inv_freq, n_pad=n_pad, step_keys=block_k,
                              rotate_keys=True, attention_scaling=attention_scaling,
                              values=False, interpret=interpret)
        return keys.reshape(-1, head_dim)
    return prerotate_keys(k_pages, md, inv_freq, attention_scaling).reshape(-1, head_dim)


def prerotate_keys(k_pages, md, inv_freq, attention_scaling):
    """Gather each sequence's keys through its block table and rotate them by their logical
    positions (float32 math): [S, NB, B, K, D]. For prefill, where each key is read by many query
    tiles, rotating once here is cheaper than rotating per tile in the kernel."""
    page_size = k_pages.shape[1]
    keys = k_pages[jnp.clip(md.block_tables, 0, k_pages.shape[0] - 1)]  # [S, NB, B, K, D]
    pos = md.block_pos_start[:, :, None] + jnp.arange(page_size, dtype=jnp.int32)  # [S, NB, B]
    return rope_f32(keys, pos, inv_freq, attention_scaling, out_dtype=k_pages.dtype)


def ragged_paged_attention_triton(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                                  attention_scaling: float, sm_scale: float,
                                  block_q: int | None = None, block_k: int | None = None,
                                  kv_group: int = 1, prerotate: bool | None = None,
                                  num_warps: int | None = None, num_stages: int | None = None,
                                  splits: int | None = None, out=None, interpret: bool = False):
    """Pallas/Triton ragged paged attention. q_rot [T, H, D] already rotated by its positions.

    rotate_keys: keys are stored unrotated (position_free) and rotated by logical position.
    attention_scaling multiplies the keys' cos/sin (queries come rotated with the same scaling);
    sm_scale is folded into q. block_q: tokens per query tile (default: 1 token for decode-only
    batches, 64 / G otherwise); block_k: keys per step (a multiple of the page size);
    kv_group: kv heads per program through a block-diagonal tile (their K/V rows are adjacent;
    cos/sin once per key for all of them; slower than 1 on the H200, benchmarks/history/
    attention.md); prerotate: rotate keys once per sequence before the kernel (default: for
    prefill-shaped tiles, where every key is read by many query tiles); splits: programs per
    tile over its key range (default_splits; module doc).
    `out`, if given, is an [out_rows(...), D] buffer the kernel writes into (aliased; tests
    poison it); rows of no sequence keep its contents. Returns [T, H, D].
    """
    tokens, heads, head_dim = q_rot.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    if kv_heads % kv_group:
        raise ValueError(f"kv_group {kv_group} must divide kv heads {kv_heads}")
    defaults = default_options(tokens, md.num_seqs, group)
    block_q = defaults["block_q"] if block_q is None else block_q
    block_k = max(defaults["block_k"], page_size) if block_k is None else block_k
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    if prerotate is None:
        prerotate = block_q * group >= 64
    half = inv_freq.shape[0]
    if block_k % page_size:
        raise ValueError(f"block_k {block_k} must be a multiple of the page size {page_size}")
    tile_seq, tile_start = tile_schedule(md.cu_q_lens, tokens, block_q)
    tile_lo, tile_hi = tile_step_range(md, tile_seq, tile_start, block_q, block_k // page_size)
    if splits is None:
        splits = default_splits(tokens, block_q, kv_heads // kv_group,
                                -(-md.block_tables.shape[1] * page_size // block_k))
    cdtype = jnp.float32 if q_rot.dtype == jnp.float32 else q_rot.dtype
    q_flat = (q_rot.reshape(tokens * heads, head_dim).astype(jnp.float32) * sm_scale)
    q_flat = q_flat.astype(q_rot.dtype)
    k_contiguous = bool(rotate_keys and half and prerotate)
    if k_contiguous:
        k_flat = rotated_keys(k_pages, md, inv_freq, attention_scaling, block_k, interpret)
    else:
        k_flat = k_pages.reshape(num_pages * page_size * kv_heads, head_dim)
    v_flat = v_pages.reshape(num_pages * page_size * kv_heads, head_dim)
    n_out = out_rows(tokens, heads, kv_heads, block_q, kv_group)
    kernel = functools.partial(
        _kernel, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        block_q=block_q, block_k=block_k, kv_group=kv_group, half=half,
        rotate_keys=rotate_keys and not k_contiguous, k_contiguous=k_contiguous,
        scaling=float(attention_scaling),
        fast_trig=not interpret, cdtype=cdtype, splits=splits)
    args = [tile_seq, tile_start, tile_lo, tile_hi, md.cu_q_lens, md.q_positions,
            md.q_window_start, md.num_blocks,
            md.block_tables, md.block_pos_start, md.block_num_valid,
            inv_freq.astype(jnp.float32) if half else jnp.zeros((1,), jnp.float32),
            q_flat, k_flat, v_flat]
    aliases, out_shape = {}, jax.ShapeDtypeStruct((n_out, head_dim), q_rot.dtype)
    if splits > 1:  # normalized partials [splits * n_out, D] and their log-sum-exps
        out_shape = (jax.ShapeDtypeStruct((splits * n_out, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits * n_out,), jnp.float32))
    elif out is not None:
        aliases = {len(args): 0}
        args.append(out)
    res = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(tile_seq.shape[0], kv_heads // kv_group, splits),
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="ragged_paged_attention",
    )(*args)
    if splits > 1:  # rows of no sequence: `out`'s, as the unsplit kernel leaves them
        res = merge_split_rows(*res, md.cu_q_lens, splits=splits, tokens=tokens, heads=heads,
                               dtype=q_rot.dtype, out=out, interpret=interpret)
    return res[: tokens * heads].reshape(tokens, heads, head_dim)


IMPLEMENTATION = Implementation(
    "triton", ragged_paged_attention_triton, TritonRaggedOptions, limits=limits,
    backend="triton")
