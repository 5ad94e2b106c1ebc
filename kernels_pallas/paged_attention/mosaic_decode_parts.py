"""Pieces both Mosaic GPU decode kernels (mosaic_decode.py, mosaic_decode_ws.py) are made of:
one CTA's view of its sequence's pages (which page a step reads, where its keys sit, the TMA
loads of a step), the key rotation in shared memory, and one online-softmax step of QK^T and PV
by wgmma. Traced inside the kernels; plain functions of refs and values."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # wgmma M: the G query rows of a kv head are rows 0..G-1 of one tile
META_COLS = 64  # block table, block starts, valid counts: [S, 3, rows, 64] (TMA box dims <= 256)
_TWO_PI_HI = 6.28125
_TWO_PI_LO = 0.0019353071795864769
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Cta:
    """One CTA's sequence s and kv head h: its pages, their keys' positions, their TMA loads.
    meta_smem holds the sequence's block table (0), block starts (1) and valid counts (2): a
    scalar read from global memory would be a round trip to L2 on the TMA issue path."""
    s: jax.Array
    h: jax.Array
    meta_smem: object
    n_blocks: jax.Array
    k_ref: object
    v_ref: object
    rope_ref: object
    page_size: int
    pages_per_step: int
    half: int
    max_blocks: int
    table: bool  # position_free with cos | sin rows by TMA

    def meta(self, which, b):
        return self.meta_smem[which, b // META_COLS, b % META_COLS]

    def entry(self, step, p):
        """(table entry, page) of page p of a key step."""
        b = jnp.minimum(step * self.pages_per_step + p, self.max_blocks - 1)
        return b, jnp.clip(self.meta(0, b), 0, self.k_ref.shape[0] - 1)

    def key_info(self, step, idx):
        """idx: key index within the step (an iota) -> (logical position, valid). The page's
        start and valid count are picked per key by a chain of selects on its page index."""
        page = lax.div(idx, self.page_size)
        local = idx - page * self.page_size
        start = count = None
        for p in range(self.pages_per_step):
            b, _ = self.entry(step, p)
            live = step * self.pages_per_step + p < self.n_blocks
            p_start, p_count = self.meta(1, b), jnp.where(live, self.meta(2, b), 0)
            if p == 0:
                start, count = p_start, p_count
            else:
                here = page == p
                start, count = jnp.where(here, p_start, start), jnp.where(here, p_count, count)
        return start + local, local < count

    def issue(self, step, ka, kb, v, ca, cb, bar):
        """TMA loads of a key step into one ring slot (refs ka, kb, v, ca, cb; barrier bar):
        per page its keys' two rotary halves, its values and, with a table, its cos | sin rows
        (a page's slots sit at consecutive positions from its block start; the table's 8
        shifted copies let the box start at a multiple of 8, as TMA into tiled SMEM needs)."""
        half, size = self.half, self.page_size
        for p in range(self.pages_per_step):
            b, page = self.entry(step, p)
            rows = pl.ds(p * size, size)
            plgpu.copy_gmem_to_smem(self.k_ref.at[page, :, self.h, pl.ds(0, half)], ka.at[rows],
                                    bar)
            plgpu.copy_gmem_to_smem(self.k_ref.at[page, :, self.h, pl.ds(half, half)],
                                    kb.at[rows], bar)
            plgpu.copy_gmem_to_smem(self.v_ref.at[page, :, self.h], v.at[rows], bar)
            if self.table:
                start = jnp.clip(self.meta(1, b), 0, self.rope_ref.shape[1] - size)
                shift = lax.rem(start, 8)
                src = self.rope_ref.at[shift, pl.ds(pl.multiple_of(start - shift, 8), size)]
                plgpu.copy_gmem_to_smem(src.at[:, pl.ds(0, half)], ca.at[rows], bar)
                plgpu.copy_gmem_to_smem(src.at[:, pl.ds(half, half)], cb.at[rows], bar)

    def trig_cos_sin(self, step, inv_smem, scaling):
        """cos, sin [BK, R/2] of the step's key positions: Cody-Waite reduction, SFU cos/sin."""
        block_k = self.pages_per_step * self.page_size
        row = plgpu.broadcasted_iota(jnp.int32, (block_k, self.half), 0,
                                     layout=plgpu.Layout.WGMMA)
        pos, _ = self.key_info(step, row)
        red = cody_waite(pos.astype(jnp.float32) * inv_smem[...])
        return jnp.cos(red) * scaling, jnp.sin(red) * scaling


def split_steps(n_blocks, pages_per_step, splits, split):
    """[lo, hi): the key steps of split `split` of a sequence with n_blocks pages."""
    n_steps = (n_blocks + pages_per_step - 1) // pages_per_step
    per_split = (n_steps + splits - 1) // splits
    lo = split * per_split
    return lo, jnp.minimum(lo + per_split, n_steps)


def cody_waite(angle):
    """angle - 2 pi round(angle / 2 pi), in two steps (the SFU's cos/sin want |x| <= pi)."""
    n = jnp.round(angle * (1.0 / (2.0 * math.pi)))
    return (angle - n * _TWO_PI_HI) - n * _TWO_PI_LO


def rotate_in_place(ka, kb, cos, sin, dtype, math_dtype=jnp.float32):
    """Rotate-half RoPE of the keys in SMEM refs ka (lo half) and kb (hi half), then fence
    them for the wgmmas (async proxy)."""
    cos, sin = cos.astype(math_dtype), sin.astype(math_dtype)
    k_lo, k_hi = ka[...].astype(math_dtype), kb[...].astype(math_dtype)
    ka[...] = (k_lo * cos - k_hi * sin).astype(dtype)
    kb[...] = (k_hi * cos + k_lo * sin).astype(dtype)
    plgpu.commit_smem()


def initial_carry(head_dim):
    """(acc, m, l) of an online softmax over no keys yet, in wgmma layouts."""
    m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    return acc, m, l


def attend_step(carry, cta, step, q_pos, q_win, qa, qb, ka, kb, v, dtype, p_smem=None):
    """One key step of the online softmax (base 2; q pre-scaled): S = q k^T by two wgmmas (lo
    and hi halves), masked to the valid keys with window start <= position <= q_pos, then
    acc += P V. P feeds the PV wgmma from registers, or through p_smem when given (the
    interpreter's wgmma takes SMEM operands only; one 8 KiB round trip per step)."""
    acc, m_i, l_i = carry
    block_k = ka.shape[0]

    def compute_qk(acc_ref):
        plgpu.wgmma(acc_ref, qa, ka.transpose((1, 0)))
        plgpu.wgmma(acc_ref, qb, kb.transpose((1, 0)))
        return acc_ref[...]

    qk = pl.run_scoped(compute_qk, plgpu.ACC((ROWS, block_k), jnp.float32))
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 1, layout=plgpu.Layout.WGMMA)
    k_pos, k_ok = cta.key_info(step, col)
    mask = k_ok & (k_pos <= q_pos) & (k_pos >= q_win)
    qk = jnp.where(mask, qk * _LOG2E, -jnp.inf)
    m_new = jnp.maximum(m_i, qk.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_safe)
    p = jnp.exp2(qk - lax.broadcast_in_dim(m_safe, qk.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if p_smem is None:  # wgmma's register A operand, as mosaic_prefill does when compiled
        p16 = p.astype(dtype)
        acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))

        def accumulate_pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v)

        return pl.run_state(accumulate_pv)(plgpu.ACC.init(acc)), m_new, l_i
    p_smem[...] = p.astype(dtype)
    plgpu.commit_smem()

    def compute_pv(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v)
        return acc_ref[...]

    return acc + pl.run_scoped(compute_pv, plgpu.ACC(acc.shape, jnp.float32)), m_new, l_i


def store_partial(carry, o_smem, lse_smem, o_dst, lse_dst, out_rows, dtype):
    """Normalise and store the row tiles holding the G query rows, and their log-sum-exps. A
    partial that saw no visible key keeps l = 0: output 0 and log-sum-exp -inf (weight 0 in
    the merge). o_smem: a free [64, D] buffer (a V ring slot whose loads and wgmmas are done)."""
    acc, m_i, l_i = carry
    empty = l_i == 0.0
    l_i = jnp.where(empty, 1.0, l_i)
    lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_i)) * (1.0 / _LOG2E))
    o_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, out_rows)], o_dst)
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, out_rows)], lse_dst)
    plgpu.wait_smem_to_gmem(0)


def scratch_buffers(dtype, half, head_dim, pages_per_step, page_size, stages, table, trig, probs,
                    lse, meta_shape):
    """The SMEM buffers and barriers both kernels take, in their argument order: q halves; the
    ring (K halves, V, cos and sin rows); the inv_freq tile (trig); probability tiles of shape
    probs + (64, BK) (None: P stays in registers); log-sum-exps lse + (64,); the block-table
    copy; the q barrier (q, table copy, inv_freq) and the ring's barriers. A buffer the mode
    does not use takes 8 elements."""
    block_k = pages_per_step * page_size
    sw = plgpu.SwizzleTransform(128)
    bf = (plgpu.TilingTransform((8, 64)), sw)
    f32 = (plgpu.TilingTransform((8, 32)), sw)
    unused = plgpu.SMEM((8,), dtype)
    return [
        plgpu.SMEM((ROWS, half), dtype, transforms=bf),  # q lo
        plgpu.SMEM((ROWS, half), dtype, transforms=bf),  # q hi
        plgpu.SMEM((stages, block_k, half), dtype, transforms=bf),  # k lo ring
        plgpu.SMEM((stages, block_k, half), dtype, transforms=bf),  # k hi ring
        plgpu.SMEM((stages, block_k, head_dim), dtype, transforms=bf),  # v ring
        plgpu.SMEM((stages, block_k, half), dtype, transforms=bf) if table else unused,  # cos
        plgpu.SMEM((stages, block_k, half), dtype, transforms=bf) if table else unused,  # sin
        plgpu.SMEM((block_k, half), jnp.float32, transforms=f32) if trig else unused,  # inv
        unused if probs is None else plgpu.SMEM(probs + (ROWS, block_k), dtype, transforms=bf),
        plgpu.SMEM(lse + (ROWS,), jnp.float32),  # log-sum-exps
        plgpu.SMEM(meta_shape, jnp.int32),  # this sequence's block table etc.
        plgpu.Barrier(num_arrivals=3 + trig),
        plgpu.Barrier(num_arrivals=(5 if table else 3) * pages_per_step, num_barriers=stages),
    ]
