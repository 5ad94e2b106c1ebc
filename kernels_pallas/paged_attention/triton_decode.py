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
Measured slower and removed (benchmarks/RESULTS.md): a cos|sin|-sin table (one more L2 row per
key costs more than negating the sin tile, run 11); loading the next step's table rows one step
early (+25%, run 12); "page" modes, where a key at base + slot scores (R(-base) q) . (R(slot) k)
so that keys turn by loop-invariant slot cos/sin and the queries (one row set per page of a
tile) turn back by each page start: +21-34% with trig or table bases (runs 5, 14). Partial results are stored by query token, so the split merge is one
elementwise pass. Option `new_kv` fuses the step's K/V write into the kernel (measured 1-3%
slower than the separate row-copy kernel; kept for that measurement).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.paged_attention.triton_ragged import (_cos_sin, _dot, _dot_nt,
                                                           _online_softmax, tile_rows)

_NEG_INF = float("-inf")
ROPE_MODES = ("trig", "table", "table_bf16")


def _kernel(cu_ref, qpos_ref, qwin_ref, nb_ref, bt_ref, bps_ref, bnv_ref, rope_ref, q_ref, k_ref,
            v_ref, lse_in_ref, *refs, heads, kv_heads, head_dim, page_size, block_k, kv_group,
            splits, half, rotate_keys, rope, scaling, fast_trig, cdtype, packed, fused_write):
    if fused_write:  # the new token's K/V: written here, attended from the inputs (not the cache)
        slot_ref, kn_ref, kn_rot_ref, vn_ref, o_ref, lse_ref, k_out_ref, v_out_ref = refs
    else:
        o_ref, lse_ref = refs
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
    new_slot = jnp.where(has_q, slot_ref[tok], -1) if fused_write else -1
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
        if fused_write:  # its slot is stale until this kernel writes it: never read it
            k_ok &= bt_ref[s, b_c] * page_size + slot != new_slot
        page = jnp.where(k_ok, bt_ref[s, b_c], 0)
        return k_pos, k_ok, (page * page_size + slot) * kv_heads

    def key_cos_sin(k_pos):
        """cos/sin [N, R/2] of a tile's keys, computed once per tile for the kv_group heads.
        packed: (cos, sin, -sin) in bfloat16 for the bf16x2 rotation."""
        if rope == "table":
            idx = jnp.clip(k_pos, 0, rope_ref.shape[0] - 1)  # pads/future keys are masked
            cos, sin = rope_ref[idx, pl.ds(0, half)], rope_ref[idx, pl.ds(half, half)]
            if not packed:
                cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
        else:
            ang = k_pos.astype(jnp.float32)[:, None] * inv[None, :]
            cos, sin = _cos_sin(ang, fast_trig)
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
        cs = key_cos_sin(k_pos) if split_rot else ()
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
                sc += _dot_nt(q_lo.astype(cdtype), k_lo.astype(cdtype), precise)
                sc += _dot_nt(q_hi.astype(cdtype), k_hi.astype(cdtype), precise)
            if q_all is not None:
                sc += _dot_nt(q_all, tiles[i][-1].astype(cdtype), precise)
            p, alpha, m_new, l_i = _online_softmax(sc, mask, m_i, l_i)
            v = pltriton.load(v_ref.at[kv_row[:, None], col],
                              mask=k_ok[:, None] & (col < head_dim), other=0.0).astype(cdtype)
            acc = acc * alpha[:, None] + _dot(p.astype(cdtype), v, 0, precise)
            out.append((acc, m_new, l_i))
        return tuple(out)

    init = tuple((jnp.zeros((rows, head_dim), jnp.float32),
                  jnp.full((rows,), _NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32))
                 for _ in range(kv_group))
    qs = [load_q(hg * kv_group + i) for i in range(kv_group)]  # loop-invariant query rows
    carry = lax.fori_loop(lo, hi, body, init)
    if fused_write:  # one split per (sequence, kv heads) takes the new key: the last non-empty
        owner = has_q & (new_slot >= 0) & (lo <= n_steps - 1) & (n_steps - 1 < hi)
        carry = tuple(_attend_new_key(carry[i], q_ref, kn_rot_ref, vn_ref, k_out_ref, v_out_ref,
                                      kn_ref, tok, hg * kv_group + i, new_slot, owner, row_ok,
                                      group=group, heads=heads, kv_heads=kv_heads)
                      for i in range(kv_group))
    for i in range(kv_group):
        acc, m_i, l_i = carry[i]
        h = hg * kv_group + i
        o_row = (split * tokens + tok) * heads + h * group + r  # rows >= G masked (not written)
        store = row_ok & (r < group)
        safe_l = jnp.where(l_i == 0.0, 1.0, l_i)
        pltriton.store(o_ref.at[o_row[:, None], col], acc / safe_l[:, None],
                       mask=jnp.broadcast_to(store[:, None], acc.shape))
        lse = jnp.where(l_i == 0.0, _NEG_INF, m_i + jnp.log(safe_l))
        pltriton.store(lse_ref.at[o_row], lse, mask=store)


def _attend_new_key(state, q_ref, kn_rot_ref, vn_ref, k_out_ref, v_out_ref, kn_ref, tok, h,
                    new_slot, owner, row_ok, *, group, heads, kv_heads):
    """Fused write: fold the new token's key (rotated copy, for kv head h) into one head's online
    softmax state, and store its K/V rows (as given: unrotated in position_free mode) into the
    cache slot. Only the owner program does either; the others return state unchanged."""
    acc, m_i, l_i = state
    rows = acc.shape[0]
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    q_row = tok * heads + h * group + r % group
    q = q_ref[q_row, :].astype(jnp.float32)  # [M, D] (pre-scaled by sm_scale)
    kv = tok * kv_heads + h
    k_new = kn_rot_ref[kv, :].astype(jnp.float32)  # [D]
    v_new = vn_ref[kv, :].astype(jnp.float32)
    score = jnp.sum(q * k_new[None, :], axis=1)  # [M]
    take = owner & row_ok
    m_new = jnp.where(take, jnp.maximum(m_i, score), m_i)
    alpha = jnp.exp(m_i - m_new)  # m_i = -inf only if m_new is finite: alpha = 0
    p = jnp.where(take, jnp.exp(score - m_new), 0.0)
    acc = jnp.where(take[:, None], acc * alpha[:, None] + p[:, None] * v_new[None, :], acc)
    l_i = jnp.where(take, l_i * alpha + p, l_i)
    dst = jnp.maximum(new_slot, 0) * kv_heads + h
    every = jnp.broadcast_to(owner, (acc.shape[1],))
    pltriton.store(k_out_ref.at[dst], kn_ref[kv, :], mask=every)
    pltriton.store(v_out_ref.at[dst], vn_ref[kv, :], mask=every)
    return acc, m_new, l_i


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


def decode_paged_attention_triton(q_rot, k_pages, v_pages, md, inv_freq, *, rotate_keys: bool,
                                  attention_scaling: float, sm_scale: float, kv_group: int = 2,
                                  splits: int | None = None, block_k: int | None = None,
                                  num_warps: int = 4, num_stages: int = 2,
                                  rope: str | None = None, max_position: int | None = None,
                                  packed: bool | None = None, new_kv=None,
                                  interpret: bool = False):
    """Decode-only paged attention (each sequence has at most one query: row cu_q_lens[s]).

    q_rot [T, H, D] rotated by its positions; kv_group kv heads per program (cos/sin computed once
    per key for all of them); splits programs per sequence over its key range (default: enough
    for ~1024 programs, at most 16). Defaults are the best position_free config of the H200 run in
    benchmarks/RESULTS.md; kv_group 8 with block_k 64 overflows SMEM at D=128. Returns [T, H, D];
    rows that are no sequence's query are zero.

    rope (position_free only) picks how keys get their cos/sin (default: "table_bf16" for bf16
    inputs, "table" otherwise, when max_position is given; else "trig"):
      "trig": range reduction + SFU cos/sin of pos * inv_freq per key (shared by kv_group heads).
      "table", "table_bf16": gathered by key position from a [max_position, R] float32 / bfloat16
        table (cos | sin, attention_scaling folded in) built once per call (~4 MB f32 at 8192 x
        R 128: stays in L2). Needs max_position > every query position (visible keys are at most
        the query's position; checked when not tracing); bf16 adds ~2e-3 relative error to keys.
    packed (bf16 inputs; default on there): keys rotated two lanes per instruction (PTX
      mul/fma.rn.bf16x2, cos/sin in bf16) instead of unpacking to float32: the rotation was the
      cost of RoPE-at-read here.
    new_kv: None, or (k_new, k_new_rotated, v_new) [T, K, D] for a fused K/V write: each query
      token's new K/V (k_new as stored, k_new_rotated by the query's position for its score) go
      to slot md.slot_mapping[t], which must hold the query's own key (at its position) and be
      read by no other sequence of the batch. The kernel never reads that slot: one split per
      sequence folds the new key in from the inputs and stores the rows. Returns (out, k_pages,
      v_pages) then (pages updated in place when the caller donates them).
    """
    bf16 = q_rot.dtype == jnp.bfloat16
    if rope is None:
        rope = "trig" if max_position is None else "table_bf16" if bf16 else "table"
    if rope not in ROPE_MODES:
        raise ValueError(f"triton_decode: rope must be one of {ROPE_MODES}, got {rope!r}")
    if packed is None:
        packed = bf16
    packed = bool(packed) and rotate_keys and inv_freq.shape[0] > 0
    if packed and not bf16:
        raise ValueError(f"triton_decode: packed=True (bf16x2 key rotation) needs bfloat16 "
                         f"inputs, got {q_rot.dtype}")
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
    rope_in = inv_freq.astype(jnp.float32) if half else jnp.zeros((1,), jnp.float32)
    if rotate_keys and half and rope.startswith("table"):
        _check_max_position(md, max_position)
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
    out_shape = [jax.ShapeDtypeStruct((n_out, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((n_out,), jnp.float32)]
    aliases = {11: 1}
    if new_kv is not None:
        k_new, k_new_rot, v_new = (x.reshape(tokens * kv_heads, head_dim) for x in new_kv)
        args += [md.slot_mapping, k_new.astype(k_pages.dtype), k_new_rot.astype(cdtype),
                 v_new.astype(v_pages.dtype)]
        out_shape += [jax.ShapeDtypeStruct(k_flat.shape, k_flat.dtype),
                      jax.ShapeDtypeStruct(v_flat.shape, v_flat.dtype)]
        aliases.update({9: 2, 10: 3})
    res = pl.pallas_call(
        functools.partial(kernel, fused_write=new_kv is not None),
        out_shape=tuple(out_shape),
        input_output_aliases=aliases,
        grid=(seqs, kv_heads // kv_group, splits),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_paged_attention",
    )(*args)
    n = splits * tokens * heads
    out = merge_splits(res[0][:n].reshape(splits, tokens, heads, head_dim),
                       res[1][:n].reshape(splits, tokens, heads), md).astype(q_rot.dtype)
    if new_kv is None:
        return out
    return out, res[2].reshape(k_pages.shape), res[3].reshape(v_pages.shape)


def merge_splits(out, lse, md):
    """Log-sum-exp merge of the splits' partial results, one elementwise pass (splits unrolled).

    out [splits, T, H, D], lse [splits, T, H]; a split that saw no visible key has lse = -inf and
    weight 0. Rows that are no sequence's query (never written by the kernel) come back zero.
    """
    seq = jnp.clip(md.q_seq, 0, md.num_blocks.shape[0] - 1)
    t = jnp.arange(md.q_seq.shape[0], dtype=jnp.int32)
    is_query = (md.cu_q_lens[seq] == t) & (md.cu_q_lens[seq + 1] > t)  # [T]
    m = functools.reduce(jnp.maximum, list(lse))  # [T, H]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    num = den = 0.0
    for o_i, lse_i in zip(out, lse):
        w = jnp.exp(lse_i - m)[..., None]  # [T, H, 1]
        num = num + jnp.where(w > 0, o_i, 0.0) * w
        den = den + w
    merged = num / jnp.where(den == 0, 1.0, den)
    return jnp.where(is_query[:, None, None], merged, 0.0)


def rope_table_in_graph(inv_freq, max_position: int, attention_scaling: float, dtype):
    """rope_table's values computed by jnp ops (staged into the jitted graph)."""
    ang = jnp.arange(max_position, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq,
                                                                             jnp.float32)
    table = jnp.concatenate([jnp.cos(ang), jnp.sin(ang)], axis=1) * attention_scaling
    return table.astype(dtype)


def rope_table(inv_freq, max_position: int, attention_scaling: float, dtype):
    """[max_position, R] cos | sin of pos * inv_freq (angle formed in float32, as HF does).

    A concrete inv_freq (numpy, or an array closed over by the jitted function) gets a table
    built once on the host and reused by every call and layer; a traced one (e.g. jnp.asarray
    inside the jitted function) builds it in the graph on every call. The models pass numpy."""
    if isinstance(inv_freq, jax.core.Tracer):
        return rope_table_in_graph(inv_freq, max_position, attention_scaling, dtype)
    inv = np.asarray(inv_freq, np.float32)
    return jnp.asarray(_host_rope_table(inv.tobytes(), max_position, float(attention_scaling),
                                        jnp.dtype(dtype).name))  # a jit constant


@functools.lru_cache(maxsize=16)
def _host_rope_table(inv_bytes: bytes, max_position: int, scaling: float, dtype: str):
    """The traced branch of rope_table in numpy (float32 angle, cos/sin rounded once)."""
    inv = np.frombuffer(inv_bytes, np.float32)
    ang = np.arange(max_position, dtype=np.float32)[:, None] * inv  # float32, as HF forms it
    ang = ang.astype(np.float64)
    table = np.concatenate([np.cos(ang), np.sin(ang)], axis=1) * scaling
    table = table.astype(np.float32).astype(jnp.dtype(dtype))
    table.flags.writeable = False  # shared by every caller
    return table


def _check_max_position(md, max_position):
    """The table covers positions [0, max_position): every query (hence every key it sees)."""
    if not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"triton_decode: rope='table' needs kernel_options max_position (a "
                         f"positive int bounding the positions), got {max_position!r}")
    if isinstance(md.q_positions, jax.core.Tracer) or isinstance(md.cu_q_lens, jax.core.Tracer):
        return
    n = int(md.cu_q_lens[-1])
    pos, win = md.q_positions[:n], md.q_window_start[:n]
    if n and (int(jnp.max(pos)) >= max_position or int(jnp.min(win)) < 0):
        raise ValueError(f"triton_decode: rope='table' covers positions [0, {max_position}) "
                         f"(max_position) but queries span [{int(jnp.min(win))}, "
                         f"{int(jnp.max(pos))}]")
