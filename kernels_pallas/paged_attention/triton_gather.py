"""The Mosaic prefill pre-pass in Pallas (Triton lowering): gather only what the kernel reads.

`mosaic_prefill_prep.gather_kv` (XLA) gathers every sequence row's whole block table into the
contiguous K/V buffers [S, N, K, D] (N = table width x page size, i.e. max_model_len): at
max_model_len 33,792 that is 138 MB of keys and values per slot and layer, whether the slot is
live or not and however short its sequence. The kernel reads only the key steps (BLOCK_KV keys)
below each sequence's last live step (`tile_schedule` visits steps that hold a valid key; every
valid key lies in a block < num_blocks). So here one program per (sequence row, table entry):

  * entries in a key step the kernel may read: the page's rows (keys rotated by their logical
    position in position_free mode, float32 math), invalid rows and entries past num_blocks
    zeroed (pages may hold NaN in unused slots; a masked key still multiplies its V by 0);
  * every other entry (past the sequence's last live step, all of a dead slot): nothing is
    written, and nothing reads it.

Key positions stay in XLA (`key_positions`: [S, N] int32, small). Same result as gather_kv on
every key step below each sequence's live end; the rest of the buffers is undefined.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.paged_attention.triton_common import cos_sin


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _columns(inv_freq, head_dim: int, cols: int):
    """Per head column d (padded to `cols`): its angle frequency, the column it pairs with under
    rotate-half, and the sign of that partner (0: not rotated)."""
    half = inv_freq.shape[0]
    d = jnp.arange(cols, dtype=jnp.int32)
    lo = d < half
    hi = (d >= half) & (d < 2 * half)
    inv = jnp.asarray(inv_freq, jnp.float32)  # a host numpy constant too (the interpreted path)
    freq = jnp.where(lo | hi, inv[jnp.clip(jnp.where(lo, d, d - half), 0, max(half - 1, 0))], 0.0)
    partner = jnp.where(lo, d + half, jnp.where(hi, d - half, d))
    sign = jnp.where(lo, -1.0, jnp.where(hi, 1.0, 0.0)).astype(jnp.float32)
    return freq, partner, sign


def _kernel(tbl_ref, nblk_ref, start_ref, valid_ref, freq_ref, partner_ref, sign_ref, kp_ref,
            vp_ref, k_out, v_out=None, *, page_size, kv_heads, head_dim, cols, max_blocks, n_pad,
            step_keys, num_pages, rotate, scaling, interpret):
    """One program = one table entry (a page of B rows) of one sequence row, all kv heads; a
    head's [B, D] tile at a time (a whole [B, K * D] page would not fit in registers)."""
    s = pl.program_id(0)
    b = pl.program_id(1)
    nb = nblk_ref[s]
    live_end = (nb * page_size + step_keys - 1) // step_keys * step_keys  # keys the kernel reads

    @pl.when(b * page_size < live_end)
    def _():
        bb = jnp.minimum(b, max_blocks - 1)
        in_use = b < nb
        page = jnp.clip(jnp.where(in_use, tbl_ref[s, bb], 0), 0, num_pages - 1)
        n_valid = jnp.where(in_use, valid_ref[s, bb], 0)
        row = lax.broadcasted_iota(jnp.int32, (page_size,), 0)  # [B]
        col = lax.broadcasted_iota(jnp.int32, (cols,), 0)  # [Dp]
        width = kv_heads * head_dim
        ok = (row < n_valid)[:, None] & (col < head_dim)[None, :]  # [B, Dp]
        src = (page * page_size + row)[:, None] * width
        dst = (s * n_pad + b * page_size + row)[:, None] * width
        store_mask = (col < head_dim)[None, :] & jnp.ones((page_size, 1), jnp.bool_)
        if rotate:
            pos = (start_ref[s, bb] + row).astype(jnp.float32)  # [B] logical positions
            cos, sin = cos_sin(pos[:, None] * freq_ref[...][None, :], not interpret)  # [B, Dp]
            cos, sin = cos * scaling, sin * scaling
            sign = sign_ref[...][None, :]
            partner = partner_ref[...][None, :]
        for h in range(kv_heads):
            c = h * head_dim + col[None, :]
            x = pltriton.load(kp_ref.at[src + c], mask=ok, other=0).astype(jnp.float32)
            if rotate:
                xp = pltriton.load(kp_ref.at[src + h * head_dim + partner], mask=ok, other=0)
                x = jnp.where(sign != 0, x * cos + sign * xp.astype(jnp.float32) * sin, x)
            pltriton.store(k_out.at[dst + c], x.astype(k_out.dtype), mask=store_mask)
            if v_out is None:  # keys only (values=False)
                continue
            val = pltriton.load(vp_ref.at[src + c], mask=ok, other=0)
            pltriton.store(v_out.at[dst + c], val.astype(v_out.dtype), mask=store_mask)


def gather_live_limits(k_pages, seqs: int, n_pad: int, step_keys: int) -> str:
    """Why gather_live cannot take these shapes ('' when it can): offsets are int32."""
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    width = kv_heads * head_dim
    if n_pad % page_size:
        return f"needs the padded key count {n_pad} to be a multiple of page size {page_size}"
    if step_keys % page_size and page_size % step_keys:
        return f"needs page size {page_size} and key step {step_keys} to divide one another"
    if num_pages * page_size * width >= 2 ** 31:
        return f"{num_pages * page_size} x {width} page elements overflow int32 offsets"
    if seqs * n_pad * width >= 2 ** 31:
        return f"{seqs} x {n_pad} x {width} gathered elements overflow int32 offsets"
    if page_size & (page_size - 1):
        return f"needs a power-of-2 page size, got {page_size}"
    return ""


def gather_live(k_pages, v_pages, md, inv_freq, *, n_pad: int, step_keys: int, rotate_keys: bool,
                attention_scaling: float, values: bool = True, num_warps: int = 4,
                interpret: bool = False):
    """K and V [S, n_pad, K, D] of each sequence row through its block table (see module doc):
    keys rotated by position when rotate_keys; written only on the key steps (`step_keys` keys
    each) below each row's last block in use, elsewhere undefined. values False: V is neither
    read nor written, and None is returned in its place."""
    why = gather_live_limits(k_pages, md.block_tables.shape[0], n_pad, step_keys)
    if why:
        raise ValueError(f"gather_live: {why}")
    seqs, max_blocks = md.block_tables.shape
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    cols = _next_pow2(head_dim)
    freq, partner, sign = _columns(inv_freq, head_dim, cols)
    rotate = bool(rotate_keys and inv_freq.shape[0])
    kernel = functools.partial(
        _kernel, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim, cols=cols,
        max_blocks=max_blocks, n_pad=n_pad, step_keys=step_keys, num_pages=num_pages,
        rotate=rotate, scaling=float(attention_scaling), interpret=interpret)
    flat = seqs * n_pad * kv_heads * head_dim
    out_shape = [jax.ShapeDtypeStruct((flat,), k_pages.dtype)]
    if values:
        out_shape.append(jax.ShapeDtypeStruct((flat,), v_pages.dtype))
    bufs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(seqs, n_pad // page_size),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gather_live" if values else "gather_live_keys",
    )(md.block_tables.astype(jnp.int32), md.num_blocks.astype(jnp.int32),
      md.block_pos_start.astype(jnp.int32), md.block_num_valid.astype(jnp.int32), freq, partner,
      sign, k_pages.reshape(-1), v_pages.reshape(-1))
    shape = (seqs, n_pad, kv_heads, head_dim)
    k_buf = bufs[0].reshape(shape)
    return k_buf, (bufs[1].reshape(shape) if values else None)
