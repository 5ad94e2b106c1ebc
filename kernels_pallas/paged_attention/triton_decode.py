"""Decode paged attention in Pallas (Triton lowering): cos/sin once per key for several kv heads.

For batches where every sequence has at most one query token. The ragged kernel
(triton_ragged.py) rotates each key once per kv head, and that trigonometry made RoPE-at-read
decode 50-60% slower than the rotated kernel on the H200. Here one program walks a key tile for
`kv_group` kv heads in turn (per-head accumulators, unrolled), computing cos/sin for the tile's
keys once; the key range of a sequence is split over `splits` programs (flash-decoding) to keep
the GPU full, and the partial results are merged with their log-sum-exp outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.paged_attention.triton_ragged import _cos_sin, _dot, _dot_nt, tile_rows

_NEG_INF = float("-inf")


def _kernel(cu_ref, qpos_ref, qwin_ref, nb_ref, bt_ref, bps_ref, bnv_ref, inv_ref, q_ref, k_ref,
            v_ref, o_in_ref, lse_in_ref, o_ref, lse_ref, *, heads, kv_heads, head_dim, page_size, block_k, kv_group,
            splits, half, rotate_keys, scaling, fast_trig, cdtype):
    group = heads // kv_heads
    rows = tile_rows(1, group)
    rot = 2 * half
    split_rot = rotate_keys and half > 0
    precise = cdtype == jnp.float32
    s, hg, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seqs = nb_ref.shape[0]
    tokens = qpos_ref.shape[0]
    max_blocks = bt_ref.shape[1]
    tok = jnp.minimum(cu_ref[s], tokens - 1)
    has_q = cu_ref[s + 1] > cu_ref[s]
    q_pos, q_win = qpos_ref[tok], qwin_ref[tok]
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    row_ok = (r < group) & has_q
    r_c = jnp.minimum(r, group - 1)
    pages_per_step = block_k // page_size
    n_steps = (nb_ref[s] + pages_per_step - 1) // pages_per_step
    per_split = (n_steps + splits - 1) // splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_steps)
    j = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    if split_rot:
        inv = inv_ref[...].astype(jnp.float32)  # [R/2]

    def load_q(h):
        q_row = tok * heads + h * group + r_c  # [M]
        if split_rot:
            q_lo = q_ref[q_row, pl.ds(0, half)].astype(cdtype)
            q_hi = q_ref[q_row, pl.ds(half, half)].astype(cdtype)
        else:
            q_lo = q_hi = None
        q_all = None
        if not split_rot or rot < head_dim:
            q_all = q_ref[q_row, :]
            if split_rot:
                d = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 1)
                q_all = jnp.where(d >= rot, q_all, jnp.zeros_like(q_all))
            q_all = q_all.astype(cdtype)
        return q_lo, q_hi, q_all

    def body(step, carry):
        b = step * pages_per_step + j // page_size
        slot = j % page_size
        b_c = jnp.minimum(b, max_blocks - 1)
        k_pos = bps_ref[s, b_c] + slot  # [N]
        k_ok = (b < nb_ref[s]) & (slot < bnv_ref[s, b_c])
        page = jnp.where(k_ok, bt_ref[s, b_c], 0)
        mask = row_ok[:, None] & (k_ok & (k_pos <= q_pos) & (k_pos >= q_win))[None, :]  # [M, N]
        if split_rot:  # once per key, shared by the kv_group heads below
            ang = k_pos.astype(jnp.float32)[:, None] * inv[None, :]
            cos, sin = _cos_sin(ang, fast_trig)
            if scaling != 1.0:
                cos, sin = cos * scaling, sin * scaling
        out = []
        for i in range(kv_group):
            h = hg * kv_group + i
            acc, m_i, l_i = carry[i]
            q_lo, q_hi, q_all = load_q(h)
            kv_row = (page * page_size + slot) * kv_heads + h  # [N]
            sc = jnp.zeros((rows, block_k), jnp.float32)
            if split_rot:
                k_lo = k_ref[kv_row, pl.ds(0, half)].astype(jnp.float32)
                k_hi = k_ref[kv_row, pl.ds(half, half)].astype(jnp.float32)
                k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
                sc += _dot_nt(q_lo, k_lo.astype(cdtype), precise)
                sc += _dot_nt(q_hi, k_hi.astype(cdtype), precise)
            if q_all is not None:
                sc += _dot_nt(q_all, k_ref[kv_row, :].astype(cdtype), precise)
            sc = jnp.where(mask, sc, _NEG_INF)
            m_new = jnp.maximum(m_i, jnp.max(sc, axis=1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            p = jnp.exp(sc - m_safe[:, None])
            alpha = jnp.exp(m_i - m_safe)
            l_i = l_i * alpha + jnp.sum(p, axis=1)
            v = pltriton.load(v_ref.at[kv_row[:, None], col],
                              mask=k_ok[:, None] & (col < head_dim), other=0.0).astype(cdtype)
            acc = acc * alpha[:, None] + _dot(p.astype(cdtype), v, 0, precise)
            out.append((acc, m_new, l_i))
        return tuple(out)

    init = tuple((jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _NEG_INF, jnp.float32),
                  jnp.zeros((rows,), jnp.float32)) for _ in range(kv_group))
    carry = lax.fori_loop(lo, hi, body, init)
    for i in range(kv_group):
        acc, m_i, l_i = carry[i]
        h = hg * kv_group + i
        o_row = (split * seqs + s) * heads + h * group + r  # rows >= G are masked (not written)
        safe_l = jnp.where(l_i == 0.0, 1.0, l_i)
        pltriton.store(o_ref.at[o_row[:, None], col], acc / safe_l[:, None],
                       mask=jnp.broadcast_to(row_ok[:, None], acc.shape))
        lse = jnp.where(l_i == 0.0, _NEG_INF, m_i + jnp.log(safe_l))
        pltriton.store(lse_ref.at[o_row], lse, mask=row_ok)


def decode_paged_attention_triton(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                                  attention_scaling: float, sm_scale: float, kv_group: int = 2,
                                  splits: int | None = None, block_k: int | None = None,
                                  num_warps: int = 4, num_stages: int = 2,
                                  interpret: bool = False):
    """Decode-only paged attention (each sequence has at most one query: row cu_q_lens[s]).

    q_rot [T, H, D] rotated by its positions; kv_group kv heads per program (cos/sin computed once
    per key for all of them); splits programs per sequence over its key range (default: enough
    for ~1024 programs, at most 16). Defaults are the best position_free config of the H200 run in
    benchmarks/RESULTS.md; kv_group 8 with block_k 64 overflows SMEM at D=128. Returns [T, H, D];
    rows that are no sequence's query are zero.
    """
    tokens, heads, head_dim = q_rot.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    seqs = md.block_tables.shape[0]
    kv_group = min(kv_group, kv_heads)
    block_k = max(64, page_size) if block_k is None else block_k
    if kv_heads % kv_group or block_k % page_size:
        raise ValueError(f"kv_group {kv_group} must divide {kv_heads} kv heads and block_k "
                         f"{block_k} be a multiple of the page size {page_size}")
    if splits is None:
        programs = seqs * (kv_heads // kv_group)
        splits = max(1, min(16, -(-1024 // programs)))
    half = inv_freq.shape[0]
    cdtype = jnp.float32 if q_rot.dtype == jnp.float32 else q_rot.dtype
    q_flat = (q_rot.reshape(tokens * heads, head_dim).astype(jnp.float32) * sm_scale)
    q_flat = q_flat.astype(q_rot.dtype)
    rows = tile_rows(1, heads // kv_heads)
    n_out = splits * seqs * heads + rows  # spare rows past the end absorb masked lanes
    kernel = functools.partial(
        _kernel, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        block_k=block_k, kv_group=kv_group, splits=splits, half=half, rotate_keys=rotate_keys,
        scaling=float(attention_scaling), fast_trig=not interpret, cdtype=cdtype)
    # Partial outputs start as NaN (aliased in): a row the kernel fails to write poisons the
    # merged result instead of passing silently. Costs one small fill per call.
    o_init = jnp.full((n_out, head_dim), jnp.nan, jnp.float32)
    lse_init = jnp.full((n_out,), jnp.nan, jnp.float32)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n_out, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((n_out,), jnp.float32)),
        input_output_aliases={11: 0, 12: 1},
        grid=(seqs, kv_heads // kv_group, splits),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_paged_attention",
    )(md.cu_q_lens, md.q_positions, md.q_window_start, md.num_blocks, md.block_tables,
      md.block_pos_start, md.block_num_valid,
      inv_freq.astype(jnp.float32) if half else jnp.zeros((1,), jnp.float32),
      q_flat, k_pages.reshape(-1, head_dim), v_pages.reshape(-1, head_dim), o_init, lse_init)
    n = splits * seqs * heads
    out = out[:n].reshape(splits, seqs, heads, head_dim)
    lse = lse[:n].reshape(splits, seqs, heads)
    # A split that saw no visible key wrote l = 0, lse = -inf: it gets weight 0 below.
    q_len = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    m = jnp.max(lse, axis=0)  # [S, H]
    w = jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0)[None])  # [splits, S, H]
    num = jnp.sum(jnp.where(w[..., None] > 0, out, 0.0) * w[..., None], axis=0)
    den = jnp.sum(w, axis=0)[..., None]
    merged = (num / jnp.where(den == 0, 1.0, den)).astype(q_rot.dtype)  # [S, H, D]
    dest = jnp.where(q_len > 0, md.cu_q_lens[:-1], tokens)
    res = jnp.zeros((tokens, heads, head_dim), q_rot.dtype)
    return res.at[dest].set(merged, mode="drop")
