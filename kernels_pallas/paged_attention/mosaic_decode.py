"""Decode paged attention in Pallas Mosaic GPU (Hopper: TMA page loads, wgmma), RoPE at read.

EXPERIMENTAL: runs under the Mosaic GPU interpreter on CPU (tests/test_paged_attention_mgpu.py)
and compiled on the H200 (benchmarks/RESULTS.md, decode runs 16-21): in rotated mode it matches
triton_decode (the kernel alone 262 vs 263 us at 64 x 4096, 2 stages, P in registers), but
RoPE at read costs +54-95% here: the rotated keys must go back to shared memory for the wgmma.
The decode default is mosaic_decode_mma.py (warp-level MMAs on registers, +1.8%), which shares
this file's inputs (decode_inputs), table and limits.

One CTA (one warpgroup) per (sequence, kv head, split): a sequence's key steps are split over
`splits` CTAs (flash-decoding) and their partial results merged by log-sum-exp afterwards
(`triton_decode.merge_splits`). The G query heads of the kv head are rows 0..G-1 of a 64-row
wgmma tile (the other rows are zero). Per step, `pages_per_step` pages are fetched by TMA (the
sequence's block table, block starts and valid counts are copied to SMEM once per CTA: a scalar
read from global memory is a round trip to L2 on the issue path) into a ring of `stages`
buffers, issued stages - 1 steps ahead: keys as their two rotary halves [BK, R/2] (two TMA
boxes per page, so the halves land in separate swizzled buffers and no register shuffle is
needed for rotate-half), values [BK, D].
In position_free mode each page also brings its cos and sin rows by TMA when a table is given
(`max_position`): a page's valid slots sit at consecutive positions from its block start, so
they are one [B, R/2] box per half of a cos | sin table (attention_scaling folded in). A TMA
box into a tiled SMEM buffer must start at a row that is a multiple of the 8-row tile, and
block starts are arbitrary positions, so the table is kept in 8 copies shifted by 0..7 rows
([8, positions, R]; row start + t of the table is row (start // 8) * 8 + t of copy start % 8).
Without a table, cos/sin come from Cody-Waite reduction and the approximate SFU functions. The
halves are loaded to registers, rotated in float32, written back in place to their ring slot
and contracted by two wgmmas (lo and hi halves). The output goes through the first V slot of
the ring (free once the loop is done); each CTA stores only the row tile holding its G query
rows (normalised, in the input dtype) and their log-sum-exps. Only the buffers a mode uses are
allocated, so that two CTAs fit on an SM where they can (rotated or trig with 2 stages: 86-102
KiB each at 8192 tokens; the table variant needs ~118 KiB there, so one CTA). The per-step
pieces (page entries, key positions, TMA loads, rotation, softmax step) are in
mosaic_decode_parts.py, shared with the warp-specialised kernel.

Limits: bf16/f16; full rotary (R == D) with R/2 a multiple of 64, or rotated mode with D a
multiple of 128; pages_per_step * B a multiple of 64; G <= 64; SMEM within 227 KiB (D = 128 in
practice). Pad slots must hold finite values (p = 0 times a NaN value is NaN inside the wgmma);
the engine's cache starts zeroed and only ever holds finite K/V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.paged_attention.mosaic_decode_parts import (META_COLS, ROWS, Cta,
                                                               attend_step, initial_carry,
                                                               rotate_in_place, scratch_buffers,
                                                               split_steps, store_partial)
from kernels_pallas.paged_attention.triton_decode import merge_splits, rope_table_in_graph


_SMEM_LIMIT = 232448  # bytes per block on the H200, as Mosaic GPU reported it


def shape_limits(q, k_pages, inv_freq, rotate_keys, pages_per_step, table_cols, rows=ROWS,
                 block_multiple=ROWS):
    """Why the Mosaic decode kernels cannot take these shapes ('' when they can): rows, the
    query rows of a CTA; block_multiple, what a key step's size must be a multiple of."""
    head_dim, page_size, half = q.shape[-1], k_pages.shape[1], inv_freq.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype != q.dtype:
        return f"needs bf16/f16 q and pages, got {q.dtype}/{k_pages.dtype}"
    if (pages_per_step * page_size) % block_multiple:
        return f"needs pages_per_step * page_size a multiple of {block_multiple}"
    if q.shape[1] // k_pages.shape[2] > rows:
        return f"needs at most {rows} query heads per CTA"
    if rotate_keys and (2 * half != head_dim or half % 64):
        return f"needs full rotary with R/2 a multiple of 64, got R={2 * half}, D={head_dim}"
    if head_dim % 128 and not rotate_keys:
        return f"needs head_dim a multiple of 128 in rotated mode, got {head_dim}"
    if table_cols > 256 * META_COLS:
        return f"needs block tables of at most {256 * META_COLS} entries, got {table_cols}"
    return ""


def smem_limit(q, k_pages, rotate_keys, pages_per_step, table_cols, stages, table, p_tiles,
               lse_tiles):
    """'' when a CTA's SMEM (smem_bytes plus the block-table copy) fits the H200, else why."""
    block_k = pages_per_step * k_pages.shape[1]
    need = smem_bytes(q.shape[-1], block_k, q.dtype.itemsize, stages, rotate_keys and table,
                      rotate_keys and not table, p_tiles, lse_tiles) + meta_bytes(table_cols)
    if need > _SMEM_LIMIT:
        return (f"needs {need} bytes of shared memory for head_dim {q.shape[-1]}, block "
                f"{block_k}, {stages} stages; the H200 has {_SMEM_LIMIT} per block")
    return ""


def mosaic_limits(q, k_pages, inv_freq, rotate_keys, pages_per_step, table_cols, stages=3,
                  table=True, p_in_registers=False):
    """Why this kernel cannot take these shapes and options ('' when it can)."""
    if stages < 2:
        return f"needs at least 2 stages, got {stages}"
    return (shape_limits(q, k_pages, inv_freq, rotate_keys, pages_per_step, table_cols)
            or smem_limit(q, k_pages, rotate_keys, pages_per_step, table_cols, stages, table,
                          0 if p_in_registers else 1, 1))


def meta_bytes(table_cols: int) -> int:
    """SMEM for one sequence's block table, block starts and valid counts."""
    return 3 * -(-table_cols // META_COLS) * META_COLS * 4


def smem_bytes(head_dim, block_k, itemsize, stages, table, trig, p_tiles=1, lse_tiles=1):
    """SMEM of one CTA: q halves, `stages` of K halves + V (+ cos/sin rows with a table), the
    inv_freq tile (f32, trig), p_tiles probability tiles (P through SMEM), lse_tiles
    log-sum-exp rows, barriers."""
    half = head_dim // 2
    stage = (2 * block_k * half + block_k * head_dim + (2 * block_k * half if table else 0))
    return (2 * ROWS * half * itemsize + stages * stage * itemsize
            + (block_k * half * 4 if trig else 0) + p_tiles * ROWS * block_k * itemsize
            + lse_tiles * ROWS * 4 + 512)


def _kernel(q_ref, k_ref, v_ref, meta_ref, info_ref, rope_ref,
            o_ref, lse_ref, qa_smem, qb_smem, ka_smem, kb_smem, v_smem, ca_smem, cb_smem,
            inv_smem, p_smem, lse_smem, meta_smem, q_bar, kv_bar, *, max_blocks, page_size,
            pages_per_step, half, rotate_keys, table, scaling, dtype, splits, stages, out_rows,
            p_in_registers):
    s, h, split = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("sp")
    n_blocks = info_ref[0, s]
    lo, hi = split_steps(n_blocks, pages_per_step, splits, split)
    cta = Cta(s, h, meta_smem, n_blocks, k_ref, v_ref, rope_ref, page_size, pages_per_step, half,
              max_blocks, rotate_keys and table)

    plgpu.copy_gmem_to_smem(q_ref.at[s, h, :, pl.ds(0, half)], qa_smem, q_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[s, h, :, pl.ds(half, half)], qb_smem, q_bar)
    if rotate_keys and not table:
        plgpu.copy_gmem_to_smem(rope_ref, inv_smem, q_bar)
    plgpu.copy_gmem_to_smem(meta_ref.at[s], meta_smem, q_bar)
    plgpu.barrier_wait(q_bar)  # the block table is read from SMEM from here on
    q_pos, q_win = info_ref[1, s], info_ref[2, s]  # once: a global load on every step costs

    def issue(step, slot):
        cta.issue(step, ka_smem.at[slot], kb_smem.at[slot], v_smem.at[slot], ca_smem.at[slot],
                  cb_smem.at[slot], kv_bar.at[slot])

    for ahead in range(stages - 1):  # the ring's first stages - 1 steps
        pl.when(lo + ahead < hi)(functools.partial(issue, lo + ahead, ahead))

    def step_fn(step, carry):
        slot = lax.rem(step - lo, stages)

        @pl.when(step + stages - 1 < hi)  # refill the slot step - 1 used (its wgmmas are done)
        def _():
            issue(step + stages - 1, lax.rem(step - lo + stages - 1, stages))

        plgpu.barrier_wait(kv_bar.at[slot])
        ka, kb = ka_smem.at[slot], kb_smem.at[slot]
        if rotate_keys:  # in place: the slot is refilled only after this step's wgmmas
            cos, sin = ((ca_smem[slot], cb_smem[slot]) if table else
                        cta.trig_cos_sin(step, inv_smem, scaling))
            rotate_in_place(ka, kb, cos, sin, dtype)
        return attend_step(carry, cta, step, q_pos, q_win, qa_smem, qb_smem, ka, kb,
                           v_smem.at[slot], dtype, None if p_in_registers else p_smem)

    carry = lax.fori_loop(lo, hi, step_fn, initial_carry(v_smem.shape[-1]))
    # Every TMA issued was waited on and every wgmma is done: V slot 0 is free for the output.
    o_smem = v_smem.at[0] if v_smem.shape[1] == ROWS else v_smem.at[0, pl.ds(0, ROWS)]
    store_partial(carry, o_smem, lse_smem, o_ref.at[split, s, h], lse_ref.at[split, s, h],
                  out_rows, dtype)


def decode_attention_mosaic(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                            attention_scaling: float, sm_scale: float, pages_per_step: int = 4,
                            splits: int | None = None, stages: int = 3,
                            max_position: int | None = None, p_in_registers: bool = False,
                            interpret=False):
    """Decode-only batches (sequence s's query is row cu_q_lens[s]); q_rot [T, H, D] rotated.

    splits: CTAs per (sequence, kv head) over its key steps (default: enough for ~2048 CTAs, at
    most 16); stages: depth of the TMA ring; max_position (position_free): bound on the
    positions, for a cos | sin table read by TMA with each page (else per-key SFU trig);
    p_in_registers (compiled only): the probabilities feed the PV wgmma from registers instead of
    an SMEM round trip (off by default, as the interpreter cannot run it; faster on the H200).
    interpret: False (compile for the GPU), True (Mosaic GPU interpreter on CPU; buffers start
    as NaN, so unwritten outputs show), or a plgpu.InterpretGPUParams (e.g. detect_races=True).
    Returns [T, H, D]; rows that are no sequence's query are zero.
    """
    if p_in_registers and interpret:
        raise ValueError("decode_attention_mosaic: p_in_registers needs the compiled kernel (the "
                         "Mosaic GPU interpreter takes SMEM wgmma operands only)")
    heads, head_dim = q_rot.shape[1:]
    page_size, kv_heads = k_pages.shape[1:3]
    seqs = md.block_tables.shape[0]
    dtype = q_rot.dtype
    table = rotate_keys and max_position is not None
    if splits is None:
        splits = max(1, min(16, -(-2048 // (seqs * kv_heads))))
    ins, half, out_rows = decode_inputs(q_rot, md, inv_freq, rotate_keys, attention_scaling,
                                        sm_scale, pages_per_step, page_size, kv_heads,
                                        max_position)
    scratch = scratch_buffers(dtype, half, head_dim, pages_per_step, page_size, stages, table,
                              rotate_keys and not table, probs=None if p_in_registers else (),
                              lse=(), meta_shape=ins[1].shape[1:])
    kernel = functools.partial(
        _kernel, max_blocks=md.block_tables.shape[1], page_size=page_size,
        pages_per_step=pages_per_step, half=half,
        rotate_keys=rotate_keys, table=table, scaling=float(attention_scaling), dtype=dtype,
        splits=splits, stages=stages, out_rows=out_rows, p_in_registers=p_in_registers)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((splits, seqs, kv_heads, out_rows, head_dim), dtype),
                  jax.ShapeDtypeStruct((splits, seqs, kv_heads, out_rows), jnp.float32)),
        grid=(seqs, kv_heads, splits), grid_names=("s", "h", "sp"), scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret)
    out, lse = call(*ins[:1], k_pages, v_pages, *ins[1:])
    return finish_partials(out, lse, md, heads, dtype)


def decode_inputs(q_rot, md, inv_freq, rotate_keys, attention_scaling, sm_scale, pages_per_step,
                  page_size, kv_heads, max_position, q_rows=ROWS):
    """The Mosaic decode kernels' inputs other than the pages: (q tiles [S, K, q_rows, D] with the G
    query rows of each kv head scaled by sm_scale, block tables, block starts and valid counts
    as [S, 3, rows, 64] (one TMA box per sequence), block counts, query positions and window
    starts as [3, S], then the shifted cos | sin table (position_free with max_position) or the
    inv_freq tile [BK, R/2]), R/2, and the rows each CTA stores (the 8-row tiles holding G)."""
    tokens, heads, head_dim = q_rot.shape
    group = heads // kv_heads
    seqs = md.block_tables.shape[0]
    dtype = q_rot.dtype
    half = inv_freq.shape[0] if rotate_keys else head_dim // 2
    q_idx = jnp.clip(md.cu_q_lens[:-1], 0, tokens - 1)  # [S]
    q_seq = (q_rot[q_idx].astype(jnp.float32) * sm_scale).astype(dtype)  # [S, H, D]
    q_pad = jnp.zeros((seqs, kv_heads, q_rows, head_dim), dtype)
    q_pad = q_pad.at[:, :, :group].set(q_seq.reshape(seqs, kv_heads, group, head_dim))
    if rotate_keys and max_position is not None:  # rows past max_position: masked pad slots
        rope_in = shifted_rope_table(inv_freq, max_position + page_size, attention_scaling,
                                     dtype)
    else:
        inv = inv_freq.astype(jnp.float32) if rotate_keys else jnp.zeros((half,), jnp.float32)
        rope_in = jnp.broadcast_to(inv[None, :], (pages_per_step * page_size, half))
    nb = md.block_tables.shape[1]
    rows = -(-nb // META_COLS)
    meta = jnp.stack([md.block_tables, md.block_pos_start, md.block_num_valid], axis=1)
    meta = jnp.pad(meta.astype(jnp.int32), ((0, 0), (0, 0), (0, rows * META_COLS - nb)))
    # block counts, query positions and window starts as one [3, S] array made here: Mosaic GPU
    # wants 256-byte aligned operands, and in the engine md.num_blocks is a view into the
    # step's packed metadata that is not (run 27)
    info = jnp.stack([md.num_blocks, md.q_positions[q_idx], md.q_window_start[q_idx]])
    ins = (q_pad, meta.reshape(seqs, 3, rows, META_COLS), info.astype(jnp.int32), rope_in)
    return ins, half, min(q_rows, -(-group // 8) * 8)


def finish_partials(out, lse, md, heads, dtype):
    """[P, S, K, rows, D] partials and [P, S, K, rows] log-sum-exps -> [T, H, D] (merged by
    log-sum-exp; rows that are no sequence's query are zero)."""
    parts, seqs, kv_heads, _, head_dim = out.shape
    group = heads // kv_heads
    out = out[:, :, :, :group].reshape(parts, seqs, heads, head_dim).astype(jnp.float32)
    lse = lse[:, :, :, :group].reshape(parts, seqs, heads)
    seq = jnp.clip(md.q_seq, 0, seqs - 1)  # partials by token (gathered into the merge)
    return merge_splits(out[:, seq], lse[:, seq], md).astype(dtype)


def shifted_rope_table(inv_freq, max_position: int, attention_scaling: float, dtype):
    """[8, P, R] with copy r, row j = rope_table row j + r (P >= max_position, a multiple of 8):
    any 8 consecutive-or-more rows from an arbitrary start are rows from a multiple of 8 of one
    copy, which is what a TMA box into a tiled SMEM buffer needs. Built in the graph, not as a
    host constant: a model calls the kernel once per layer, and each call would embed its own
    copy of the constant in the program (32 x 4 MB for Llama-3-8B at 2048 positions, which
    stalled the engine's compile, run 26); XLA computes the identical graphs once."""
    rows = -(-max_position // 8) * 8
    base = rope_table_in_graph(inv_freq, rows + 8, attention_scaling, dtype)
    return jnp.stack([base[r:r + rows] for r in range(8)])
