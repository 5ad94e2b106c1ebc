"""Decode paged attention in Pallas Mosaic GPU (Hopper: TMA page loads, wgmma), RoPE at read.

EXPERIMENTAL: runs under the Mosaic GPU interpreter on CPU (tests/test_paged_attention_mgpu.py);
see benchmarks/RESULTS.md for whether it compiled and how fast it ran on the H200.

One CTA (one warpgroup) per (sequence, kv head); each sequence has exactly one query token.
The G query heads of the kv head are rows 0..G-1 of a 64-row wgmma tile (rows G..63 are zero).
Per step, `pages_per_step` pages are fetched by TMA (the block table is read as scalars), double
buffered: keys as their two rotary halves [BK, R/2] (two TMA boxes per page, so the halves land
in separate swizzled buffers and no register shuffle is needed for rotate-half), values [BK, D].
In position_free mode the halves are loaded to registers, rotated in float32 by each key's
logical position (block_pos_start + slot: a select chain over the step's pages), written back to
swizzled SMEM and contracted by two wgmmas (lo and hi halves). cos/sin: Cody-Waite reduction to
[-pi, pi], then the approximate SFU functions (approx_math).

Limits: bf16/f16; full rotary (R == D) with R/2 a multiple of 64, or rotated mode with D a
multiple of 128; pages_per_step * B a multiple of 64; SMEM within 227 KiB, so D = 128 only in
practice (D = 256 needs 266 KiB: it compiled only after the limit check said so, on 2026-11-30). Pad slots must hold finite values
(p = 0 times a NaN value is NaN inside the wgmma); the engine's cache starts zeroed and only
ever holds finite K/V.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_ROWS = 64  # wgmma M
_SMEM_LIMIT = 232448  # bytes per block on the H200, as Mosaic GPU reported it
_TWO_PI_HI = 6.28125
_TWO_PI_LO = 0.0019353071795864769


def mosaic_limits(q, k_pages, inv_freq, rotate_keys, pages_per_step):
    """Why this kernel cannot take these shapes ('' when it can)."""
    head_dim, page_size, half = q.shape[-1], k_pages.shape[1], inv_freq.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype != q.dtype:
        return f"needs bf16/f16 q and pages, got {q.dtype}/{k_pages.dtype}"
    if (pages_per_step * page_size) % _ROWS:
        return f"needs pages_per_step * page_size a multiple of {_ROWS}"
    if q.shape[1] // k_pages.shape[2] > _ROWS:
        return f"needs at most {_ROWS} query heads per kv head"
    if rotate_keys and (2 * half != head_dim or half % 64):
        return f"needs full rotary with R/2 a multiple of 64, got R={2 * half}, D={head_dim}"
    if head_dim % 128 and not rotate_keys:
        return f"needs head_dim a multiple of 128 in rotated mode, got {head_dim}"
    need = smem_bytes(head_dim, pages_per_step * page_size, q.dtype.itemsize)
    if need > _SMEM_LIMIT:
        return (f"needs {need} bytes of shared memory for head_dim {head_dim}, block "
                f"{pages_per_step * page_size}; the H200 has {_SMEM_LIMIT} per block")
    return ""


def smem_bytes(head_dim, block_k, itemsize):
    """SMEM of one CTA: q halves, inv_freq tile (f32), 2 stages of K halves + V, rotated K
    halves, output and probabilities."""
    half = head_dim // 2
    return (2 * _ROWS * half * itemsize + block_k * half * 4
            + 2 * (2 * block_k * half + block_k * head_dim) * itemsize
            + 2 * block_k * half * itemsize + _ROWS * head_dim * itemsize
            + _ROWS * block_k * itemsize + 1024)


def _kernel(q_ref, k_ref, v_ref, bt_ref, bps_ref, bnv_ref, nb_ref, qpos_ref, qwin_ref, inv_ref,
            o_ref, qa_smem, qb_smem, inv_smem, ka_smem, kb_smem, v_smem, ra_smem, rb_smem,
            o_smem, p_smem, q_bar, kv_bar, *, page_size, pages_per_step, half, rotate_keys, scaling,
            dtype):
    s = lax.axis_index("s")
    h = lax.axis_index("h")
    block_k = pages_per_step * page_size
    num_pages = k_ref.shape[0]
    max_blocks = bt_ref.shape[1]
    n_blocks = nb_ref[s]
    n_steps = (n_blocks + pages_per_step - 1) // pages_per_step
    q_pos = qpos_ref[s]
    q_win = qwin_ref[s]

    plgpu.copy_gmem_to_smem(q_ref.at[s, h, :, pl.ds(0, half)], qa_smem, q_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[s, h, :, pl.ds(half, half)], qb_smem, q_bar)
    plgpu.copy_gmem_to_smem(inv_ref, inv_smem, q_bar)

    def entry(step, p):
        b = jnp.minimum(step * pages_per_step + p, max_blocks - 1)
        return b, jnp.clip(bt_ref[s, b], 0, num_pages - 1)

    def issue(step, slot):
        for p in range(pages_per_step):
            _, page = entry(step, p)
            rows = pl.ds(p * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[page, :, h, pl.ds(0, half)],
                                    ka_smem.at[slot, rows], kv_bar.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[page, :, h, pl.ds(half, half)],
                                    kb_smem.at[slot, rows], kv_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[page, :, h], v_smem.at[slot, rows], kv_bar.at[slot])

    @pl.when(n_steps > 0)
    def _():
        issue(0, 0)

    plgpu.barrier_wait(q_bar)

    def key_info(step, idx):
        """idx: key index within the step (an iota) -> (logical position, valid)."""
        pos = jnp.zeros_like(idx)
        valid = idx < 0
        for p in range(pages_per_step):
            b, _ = entry(step, p)
            live = step * pages_per_step + p < n_blocks
            local = idx - p * page_size
            here = (local >= 0) & (local < page_size)
            pos = jnp.where(here, bps_ref[s, b] + local, pos)
            valid = jnp.where(here, (local < bnv_ref[s, b]) & live, valid)
        return pos, valid

    def step_fn(step, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(step, 2)

        @pl.when(step + 1 < n_steps)
        def _():
            issue(step + 1, 1 - slot)

        plgpu.barrier_wait(kv_bar.at[slot])
        if rotate_keys:
            row = plgpu.broadcasted_iota(jnp.int32, (block_k, half), 0, layout=plgpu.Layout.WGMMA)
            pos, _ = key_info(step, row)
            ang = pos.astype(jnp.float32) * inv_smem[...]  # [BK, R/2]
            n = jnp.round(ang * (1.0 / (2.0 * math.pi)))
            red = (ang - n * _TWO_PI_HI) - n * _TWO_PI_LO
            cos, sin = jnp.cos(red) * scaling, jnp.sin(red) * scaling
            lo = ka_smem[slot].astype(jnp.float32)
            hi = kb_smem[slot].astype(jnp.float32)
            ra_smem[...] = (lo * cos - hi * sin).astype(dtype)
            rb_smem[...] = (hi * cos + lo * sin).astype(dtype)
            plgpu.commit_smem()
            ka, kb = ra_smem, rb_smem
        else:
            ka, kb = ka_smem.at[slot], kb_smem.at[slot]

        def compute_qk(acc_ref):
            plgpu.wgmma(acc_ref, qa_smem, ka.transpose((1, 0)))
            plgpu.wgmma(acc_ref, qb_smem, kb.transpose((1, 0)))
            return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((_ROWS, block_k), jnp.float32))
        col = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_k), 1, layout=plgpu.Layout.WGMMA)
        k_pos, k_ok = key_info(step, col)
        mask = k_ok & (k_pos <= q_pos) & (k_pos >= q_win)
        log2e = math.log2(math.e)
        qk = jnp.where(mask, qk * log2e, -jnp.inf)
        m_new = jnp.maximum(m_i, qk.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_safe)
        p = jnp.exp2(qk - lax.broadcast_in_dim(m_safe, qk.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        # P goes through SMEM (not wgmma's register A operand) and into a fresh accumulator
        # (not run_state(ACC.init(acc))): the Mosaic GPU interpreter supports only SMEM operands
        # and the ref form of wgmma. Costs one 8 KiB SMEM round trip per step.
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()

        def compute_pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        pv = pl.run_scoped(compute_pv, plgpu.ACC((_ROWS, v_smem.shape[-1]), jnp.float32))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
        return acc, m_new, l_i

    head_dim = v_smem.shape[-1]
    m_i = plgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((_ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    acc, m_i, l_i = lax.fori_loop(0, n_steps, step_fn, (acc, m_i, l_i))
    l_i = jnp.where(l_i == 0.0, 1.0, l_i)
    o_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[s, h])
    plgpu.wait_smem_to_gmem(0)


def decode_attention_mosaic(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                            attention_scaling: float, sm_scale: float, pages_per_step: int = 4,
                            interpret=False):
    """Decode-only batches (sequence s's query is row cu_q_lens[s]); q_rot [T, H, D] rotated.

    interpret: False (compile for the GPU), True (Mosaic GPU interpreter on CPU; buffers start
    as NaN, so unwritten outputs show), or a plgpu.InterpretGPUParams (e.g. detect_races=True).
    Returns [T, H, D]; rows that are no sequence's query are zero.
    """
    tokens, heads, head_dim = q_rot.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    seqs = md.block_tables.shape[0]
    dtype = q_rot.dtype
    half = inv_freq.shape[0] if rotate_keys else head_dim // 2
    block_k = pages_per_step * page_size
    q_idx = jnp.clip(md.cu_q_lens[:-1], 0, tokens - 1)  # [S]
    q_seq = (q_rot[q_idx].astype(jnp.float32) * sm_scale).astype(dtype)  # [S, H, D]
    q_pad = jnp.zeros((seqs, kv_heads, _ROWS, head_dim), dtype)
    q_pad = q_pad.at[:, :, :group].set(q_seq.reshape(seqs, kv_heads, group, head_dim))
    inv = inv_freq.astype(jnp.float32) if rotate_keys else jnp.zeros((half,), jnp.float32)
    inv_tile = jnp.broadcast_to(inv[None, :], (block_k, half))
    sw = plgpu.SwizzleTransform(128)
    bf = (plgpu.TilingTransform((8, 64)), sw)
    f32 = (plgpu.TilingTransform((8, 32)), sw)
    scratch = [
        plgpu.SMEM((_ROWS, half), dtype, transforms=bf),  # q lo
        plgpu.SMEM((_ROWS, half), dtype, transforms=bf),  # q hi
        plgpu.SMEM((block_k, half), jnp.float32, transforms=f32),  # inv_freq per column
        plgpu.SMEM((2, block_k, half), dtype, transforms=bf),  # k lo (2 stages)
        plgpu.SMEM((2, block_k, half), dtype, transforms=bf),  # k hi
        plgpu.SMEM((2, block_k, head_dim), dtype, transforms=bf),  # v
        plgpu.SMEM((block_k, half), dtype, transforms=bf),  # rotated k lo
        plgpu.SMEM((block_k, half), dtype, transforms=bf),  # rotated k hi
        plgpu.SMEM((_ROWS, head_dim), dtype, transforms=bf),  # out
        plgpu.SMEM((_ROWS, block_k), dtype, transforms=bf),  # probabilities
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=3 * pages_per_step, num_barriers=2),
    ]
    kernel = functools.partial(
        _kernel, page_size=page_size, pages_per_step=pages_per_step, half=half,
        rotate_keys=rotate_keys, scaling=float(attention_scaling), dtype=dtype)
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((seqs, kv_heads, _ROWS, head_dim), dtype),
        grid=(seqs, kv_heads), grid_names=("s", "h"), scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret)
    q_win = md.q_window_start[q_idx]
    out = call(q_pad, k_pages, v_pages, md.block_tables, md.block_pos_start, md.block_num_valid,
               md.num_blocks, md.q_positions[q_idx], q_win, inv_tile)
    out = out[:, :, :group].reshape(seqs, heads, head_dim)
    has_q = md.cu_q_lens[1:] > md.cu_q_lens[:-1]
    res = jnp.zeros((tokens, heads, head_dim), dtype)
    return res.at[jnp.where(has_q, q_idx, tokens)].set(out, mode="drop")
