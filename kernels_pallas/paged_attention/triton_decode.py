"""Decode paged attention in Pallas (Triton lowering): cos/sin once per key for several kv heads.

For batches where every sequence has at most one query token. The ragged kernel
(triton_ragged.py) rotates each key once per kv head, and that trigonometry made RoPE-at-read
decode 50-60% slower than the rotated kernel on the H200. Here one program walks a key tile for
`kv_group` kv heads in turn (per-head accumulators, unrolled), computing cos/sin for the tile's
keys once; the key range of a sequence is split over `splits` programs (flash-decoding) to keep
the GPU full, and the partial results are merged with their log-sum-exp outside the kernel.

Kernel option `rope` picks where the keys' cos/sin come from (see decode_paged_attention_triton):
per-key trig ("trig") or an L2-resident position table ("table", "table_bf16": the default when
the caller gives max_position). Turning the query per key instead of the key costs G times the
rotation work (G = H/K query heads per kv head) and does not map onto the dot, so keys are turned.
What RoPE-at-read cost here was the rotation's instruction count (unpack bf16 -> f32, 4 FMAs per
pair, repack), not table bytes or load pipelining (carrying key tiles one step ahead in registers
was 1.6-2x slower): option `packed` (default for bf16) rotates two lanes per bf16x2 PTX FMA.
Measured slower and removed (benchmarks/history/attention.md): a cos|sin|-sin table (one more L2
row per key costs more than negating the sin tile); loading the next step's table rows one step
early (+25%); "page" modes, where a key at base + slot scores (R(-base) q) . (R(slot) k) so that
keys turn by loop-invariant slot cos/sin and the queries (one row set per page of a tile) turn
back by each page start: +21-34% with trig or table bases; fusing the step's K/V write into the
kernel (1-3% slower than the separate row-copy kernel). Partial results
are stored by query token, so the split merge is one elementwise pass.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.paged_attention.decode_common import (check_max_position, merge_splits,
                                                          rope_table)
from kernels_pallas.paged_attention.triton_common import (NEG_INF, cos_sin, dot, dot_nt,
                                                          online_softmax, tile_rows,
                                                          triton_limits)
from kernels_pallas.registry import Implementation
ROPE_MODES = ("trig", "table", "table_bf16")


@dataclasses.dataclass(frozen=True)
class TritonDecodeOptions:
    """None = the default for the problem (`defaults`); see decode_paged_attention_triton."""

    kv_group: int | None = None
    splits: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    rope: str | None = None
    max_position: int | None = None
    packed: bool | None = None


def defaults(problem, options: TritonDecodeOptions) -> TritonDecodeOptions:
    """The best position_free config of the H200 sweep (benchmarks/history/attention.md):
    2 kv heads per program, 64-key steps, 4 warps, 2 stages; keys' cos | sin from a table when
    the caller bounds the positions (a table rope named without a bound gets the caller's
    max_position), bf16x2 rotation for bf16."""
    o = options
    max_position = o.max_position
    if max_position is None and o.rope is None:
        max_position = problem.table_bound
    elif max_position is None and o.rope.startswith("table"):
        max_position = problem.max_position
    bf16 = problem.dtype == jnp.bfloat16
    rope = o.rope or ("trig" if max_position is None else "table_bf16" if bf16 else "table")
    return dataclasses.replace(
        o, kv_group=min(o.kv_group or 2, problem.kv_heads), num_warps=o.num_warps or 4,
        num_stages=o.num_stages or 2, block_k=o.block_k or max(64, problem.block_size),
        rope=rope, max_position=max_position, packed=bf16 if o.packed is None else o.packed)


def limits(problem, options: TritonDecodeOptions) -> str:
    """Why this kernel cannot take the problem with these (filled) options ('' when it can)."""
    o = options
    if o.rope not in ROPE_MODES:
        return f"needs rope in {ROPE_MODES}, got {o.rope!r}"
    if o.rope != "trig" and problem.rotate_keys and o.max_position is None:
        return f"needs max_position with rope={o.rope!r} (a bound on the positions)"
    if o.packed and problem.dtype != jnp.bfloat16:
        return f"needs bfloat16 inputs for packed=True (bf16x2 rotation), got {problem.dtype}"
    if problem.kv_heads % o.kv_group:
        return f"needs kv_group dividing the {problem.kv_heads} kv heads, got {o.kv_group}"
    return triton_limits(problem, o.block_k)


def _kernel(cu_ref, qpos_ref, qwin_ref, nb_ref, bt_ref, bps_ref, bnv_ref, rope_ref, q_ref, k_ref,
            v_ref, lse_in_ref, o_ref, lse_ref, *, heads, kv_heads, head_dim, page_size, block_k,
            kv_group, splits, half, rotate_keys, rope, scaling, fast_trig, cdtype, packed):
    group = heads // kv_heads
    pages_per_step = block_k // page_size
    split_rot = rotate_keys and half > 0
    rows = tile_rows(1, group)
    rot = 2 * half
    precise = cdtype == jnp.float32
    s, hg, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tokens = qpos_ref.shape[0]
    max_blocks = bt_ref.shape[1]
    tok = jnp.minimum(cu_ref[s], tokens - 1)
    has_q = cu_ref[s + 1] > cu_ref[s]
    q_pos, q_win = qpos_ref[tok], qwin_ref[tok]
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    row_ok = (r < group) & has_q
    n_steps = (nb_ref[s] + pages_per_step - 1) // pages_per_step
    per_split = (n_steps + splits - 1) // splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_steps)
    j = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    if split_rot and rope != "table":
        inv = rope_ref[...].astype(jnp.float32)  # [R/2]

    def load_q(h):
        q_row = tok * heads + h * group + r % group  # [M] (rows >= G repeat, masked)
        if split_rot:
            q_lo = q_ref[q_row, pl.ds(0, half)]
            q_hi = q_ref[q_row, pl.ds(half, half)]
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

    def tile_keys(step):
        """A step's keys: logical position, valid, flat row of kv head 0, block index; [N]."""
        b = step * pages_per_step + j // page_size
        slot = j % page_size
        b_c = jnp.minimum(b, max_blocks - 1)
        k_pos = bps_ref[s, b_c] + slot
        k_ok = (b < nb_ref[s]) & (slot < bnv_ref[s, b_c])
        page = jnp.where(k_ok, bt_ref[s, b_c], 0)
        return k_pos, k_ok, (page * page_size + slot) * kv_heads

    def keycos_sin(k_pos):
        """cos/sin [N, R/2] of a tile's keys, computed once per tile for the kv_group heads.
        packed: (cos, sin, -sin) in bfloat16 for the bf16x2 rotation."""
        if rope == "table":
            idx = jnp.clip(k_pos, 0, rope_ref.shape[0] - 1)  # pads/future keys are masked
            cos, sin = rope_ref[idx, pl.ds(0, half)], rope_ref[idx, pl.ds(half, half)]
            if not packed:
                cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
        else:
            ang = k_pos.astype(jnp.float32)[:, None] * inv[None, :]
            cos, sin = cos_sin(ang, fast_trig)
            if scaling != 1.0:
                cos, sin = cos * scaling, sin * scaling
        if packed:
            cos, sin = cos.astype(jnp.bfloat16), sin.astype(jnp.bfloat16)
            return cos, sin, -sin
        return cos, sin

    def load_keys(row0):
        """Key tiles of a step as stored (halves when rotating) for the kv_group heads. Loading
        them one step ahead into registers (carried by the loop) measured 1.6-2x slower."""
        tiles = []
        for i in range(kv_group):
            kv_row = row0 + hg * kv_group + i  # [N]
            lo_hi = ((k_ref[kv_row, pl.ds(0, half)], k_ref[kv_row, pl.ds(half, half)])
                     if split_rot else ())
            full = (k_ref[kv_row, :],) if not split_rot or rot < head_dim else ()
            tiles.append(lo_hi + full)
        return tiles

    def turn_keys(k_lo, k_hi, cs):
        """Rotated halves of a key tile (f32 math, or bf16x2 FMAs when packed)."""
        if packed:
            cos, sin, nsin = cs
            return (_fma2_bf16(k_lo, cos, k_hi, nsin, fast_trig),
                    _fma2_bf16(k_hi, cos, k_lo, sin, fast_trig))
        cos, sin = cs
        k_lo, k_hi = k_lo.astype(jnp.float32), k_hi.astype(jnp.float32)
        return k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin

    def body(step, state):
        k_pos, k_ok, row0 = tile_keys(step)
        tiles = load_keys(row0)
        cs = keycos_sin(k_pos) if split_rot else ()
        mask = row_ok[:, None] & (k_ok & (k_pos <= q_pos) & (k_pos >= q_win))[None, :]  # [M, N]
        out = []
        for i in range(kv_group):
            h = hg * kv_group + i
            acc, m_i, l_i = state[i]
            q_lo, q_hi, q_all = qs[i]
            kv_row = row0 + h  # [N]
            sc = jnp.zeros((rows, block_k), jnp.float32)
            if split_rot:
                k_lo, k_hi = turn_keys(tiles[i][0], tiles[i][1], cs)
                sc += dot_nt(q_lo.astype(cdtype), k_lo.astype(cdtype), precise)
                sc += dot_nt(q_hi.astype(cdtype), k_hi.astype(cdtype), precise)
            if q_all is not None:
                sc += dot_nt(q_all, tiles[i][-1].astype(cdtype), precise)
            p, alpha, m_new, l_i = online_softmax(sc, mask, m_i, l_i)
            v = pltriton.load(v_ref.at[kv_row[:, None], col],
                              mask=k_ok[:, None] & (col < head_dim), other=0.0).astype(cdtype)
            acc = acc * alpha[:, None] + dot(p.astype(cdtype), v, 0, precise)
            out.append((acc, m_new, l_i))
        return tuple(out)

    init = tuple((jnp.zeros((rows, head_dim), jnp.float32),
                  jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32))
                 for _ in range(kv_group))
    qs = [load_q(hg * kv_group + i) for i in range(kv_group)]  # loop-invariant query rows
    carry = lax.fori_loop(lo, hi, body, init)
    for i in range(kv_group):
        acc, m_i, l_i = carry[i]
        h = hg * kv_group + i
        o_row = (split * tokens + tok) * heads + h * group + r  # rows >= G masked (not written)
        store = row_ok & (r < group)
        safe_l = jnp.where(l_i == 0.0, 1.0, l_i)
        pltriton.store(o_ref.at[o_row[:, None], col], acc / safe_l[:, None],
                       mask=jnp.broadcast_to(store[:, None], acc.shape))
        lse = jnp.where(l_i == 0.0, NEG_INF, m_i + jnp.log(safe_l))
        pltriton.store(lse_ref.at[o_row], lse, mask=store)


def _fma2_bf16(a, c, b, s, fast):
    """a * c + b * s on bfloat16 tiles, two lanes per instruction (mul.rn.bf16x2 then
    fma.rn.bf16x2): 2 instructions per 2 rotated elements instead of unpack, 2 float32 FMAs
    and repack per element. The product b * s is rounded to bf16 before the add. Interpret
    mode: the same roundings in jnp (bf16 x bf16 is exact in float32)."""
    if not fast:
        t = (b.astype(jnp.float32) * s.astype(jnp.float32)).astype(jnp.bfloat16)
        return (a.astype(jnp.float32) * c.astype(jnp.float32)
                + t.astype(jnp.float32)).astype(jnp.bfloat16)
    [out] = pltriton.elementwise_inline_asm(
        "{ .reg .b32 t; mul.rn.bf16x2 t, $3, $4; fma.rn.bf16x2 $0, $1, $2, t; }",
        args=[a, c, b, s], constraints="=r,r,r,r,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.bfloat16)])
    return out


# Default splits of few sequences up to 64 instead of 16 (a reordered span request's one decode
# row over 5,800 keys ran 16 programs: 48 us a layer on an H100); False: 16 (A/B, benchmarks).
WIDE_SPLITS = True


def decode_paged_attention_triton(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                                  attention_scaling: float, sm_scale: float, kv_group: int = 2,
                                  splits: int | None = None, block_k: int = 64,
                                  num_warps: int = 4, num_stages: int = 2, rope: str = "trig",
                                  max_position: int | None = None, packed: bool = False,
                                  interpret: bool = False):
    """Decode-only paged attention (each sequence has at most one query: row cu_q_lens[s]).
    The registry fills and checks the options (`defaults`, `limits`).

    q_rot [T, H, D] rotated by its positions; kv_group kv heads per program (cos/sin computed once
    per key for all of them; 8 with block_k 64 overflows SMEM at D=128); splits programs per
    sequence over its key range (default: enough for ~1024 programs, at most 64; WIDE_SPLITS).
    Returns [T, H, D]; rows that are no sequence's query are zero.

    rope (position_free only) picks how keys get their cos/sin:
      "trig": range reduction + SFU cos/sin of pos * inv_freq per key (shared by kv_group heads).
      "table", "table_bf16": gathered by key position from a [max_position, R] float32 / bfloat16
        table (cos | sin, attention_scaling folded in) built once per call (~4 MB f32 at 8192 x
        R 128: stays in L2). Needs max_position > every query position (visible keys are at most
        the query's position; checked when not tracing); bf16 adds ~2e-3 relative error to keys.
    packed (bf16 inputs): keys rotated two lanes per instruction (PTX mul/fma.rn.bf16x2, cos/sin
      in bf16) instead of unpacking to float32: the rotation was the cost of RoPE-at-read here.
    """
    packed = bool(packed) and rotate_keys and inv_freq.shape[0] > 0
    tokens, heads, head_dim = q_rot.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    seqs = md.block_tables.shape[0]
    if splits is None:
        programs = seqs * (kv_heads // kv_group)
        splits = max(1, min(64 if WIDE_SPLITS else 16, -(-1024 // programs)))
    half = inv_freq.shape[0]
    cdtype = jnp.float32 if q_rot.dtype == jnp.float32 else q_rot.dtype
    q_flat = (q_rot.reshape(tokens * heads, head_dim).astype(jnp.float32) * sm_scale)
    q_flat = q_flat.astype(q_rot.dtype)
    rows = tile_rows(1, heads // kv_heads)
    rope_in = inv_freq.astype(jnp.float32) if half else jnp.zeros((1,), jnp.float32)
    if rotate_keys and half and rope.startswith("table"):
        check_max_position(md, max_position, "triton_decode")
        rope_in = rope_table(inv_freq, max_position, attention_scaling,
                             jnp.bfloat16 if rope == "table_bf16" else jnp.float32)
    # Partial results are stored by query token ([splits, T, H] rows), so merging them is one
    # elementwise pass with no scatter. Partial log-sum-exps start as NaN (aliased in; out and lse
    # rows are stored under the same mask): a query row the kernel fails to write poisons the
    # result instead of passing silently, at the cost of a [n_out] fill rather than [n_out, D].
    n_out = splits * tokens * heads + rows  # spare rows past the end absorb masked lanes
    kernel = functools.partial(
        _kernel, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        block_k=block_k, kv_group=kv_group, splits=splits, half=half, rotate_keys=rotate_keys,
        rope="table" if rope.startswith("table") else rope, scaling=float(attention_scaling),
        fast_trig=not interpret, cdtype=cdtype,
        packed=packed and (interpret or block_k * half >= 4 * 32 * num_warps))  # >= 4 per lane
    lse_init = jnp.full((n_out,), jnp.nan, jnp.float32)
    k_flat, v_flat = k_pages.reshape(-1, head_dim), v_pages.reshape(-1, head_dim)
    args = [md.cu_q_lens, md.q_positions, md.q_window_start, md.num_blocks, md.block_tables,
            md.block_pos_start, md.block_num_valid, rope_in, q_flat, k_flat, v_flat, lse_init]
    out_shape = (jax.ShapeDtypeStruct((n_out, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((n_out,), jnp.float32))
    res = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        input_output_aliases={11: 1},
        grid=(seqs, kv_heads // kv_group, splits),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_paged_attention",
    )(*args)
    n = splits * tokens * heads
    return merge_splits(res[0][:n].reshape(splits, tokens, heads, head_dim),
                        res[1][:n].reshape(splits, tokens, heads), md).astype(q_rot.dtype)




IMPLEMENTATION = Implementation(
    "triton_decode", decode_paged_attention_triton, TritonDecodeOptions, defaults, limits,
    backend="triton", decode_only=True)
