"""Intra-chunk UT solve in 16-row sub-blocks (Pallas, Triton backend).

Same outputs as `fused_triton.intra_chunk_fused` (W, U, KD in dot dtype, gc float32, all in the
caller's [N, T, H, D] layout), but the unit lower-triangular system (I + A) [W | U] = [B_w | B_u]
of a chunk of C rows is solved in sub-blocks of S = 16 rows instead of by C sequential
row-substitution steps over a [C, C] tile:
  - A_ij = (beta_i K_i) K_j^T * exp(gc_i - gc_j) for the C/S (C/S + 1) / 2 blocks j <= i (strictly
    lower inside a diagonal block): small MMAs straight from the key rows (for float32 dots every
    exponent a direct sum of g, not a difference of two large cumulative sums: `_block_exponents`);
  - X_ii = (I + A_ii)^-1 by the exact product for a nilpotent matrix: with N = A_ii strictly lower
    (N^S = 0), (I + N)^-1 = (I - N)(I + N^2)(I + N^4)...(I + N^(S/2)) (float32 IEEE dots; exact
    algebra, no truncated series);
  - block forward substitution: W_i = X_ii (B_w,i - sum_{j<i} A_ij W_j), the same for U.
Sub-blocks are read from and written to the refs by row slices, so no register tile is sliced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta import stream_rows
from kernels_pallas.gated_delta.chunked import segment_sums
from kernels_pallas.gated_delta.dots import chunks_below, is_exact
from kernels_pallas.gated_delta.dots import dot as _dot, dot_t as _dot_t

_SUB = 16


def _unit_lower_inverse(n, sub):
    """(I + n)^-1 for strictly lower n [S, S] (S a power of 2): (I - n) prod (I + n^(2^k))."""
    eye = (jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
           == jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 1)).astype(jnp.float32)
    x = eye - n
    p = n
    power = 2
    while power < sub:
        p = _dot(p, p, jnp.float32)  # n^power
        x = x + _dot(x, p, jnp.float32)  # x (I + n^power)
        power *= 2
    return x


def _block_exponents(g_ref, rows, sub, exact):
    """The log decays of the solve, per sub-block i (row r of block i, column c of block j <= i):
    (gc, span, to_end) with gc[i] [S] g summed from the chunk start through r, span(i, j) [S, S]
    g over (c, r] (read where c < r) and to_end(i) [S] g over (r, C - 1].

    exact (float32 dots): every exponent a direct sum of g (`chunked.segment_sums`), a few eps32 of
    the segment itself. Otherwise differences of the chunk cumsum gc: their error, a few eps32 of
    |gc|, is far below bf16 / f16 rounding, and the per-block segment sums are the likely rest of
    the bf16 prefill's loss on the H200 against the kernels before them (benchmarks/RESULTS.md,
    Gated DeltaNet)."""
    f32 = jnp.float32
    last = jax.lax.broadcasted_iota(jnp.int32, (sub,), 0) == sub - 1
    if not exact:
        gcs, off = [], jnp.zeros((), f32)
        for r in rows:  # chunk-cumulative gates, one sub-block at a time
            gcs.append(jnp.cumsum(g_ref[r].astype(f32)) + off)
            off = jnp.sum(jnp.where(last, gcs[-1], 0.0))
        return gcs, lambda i, j: gcs[i][:, None] - gcs[j][None, :], lambda i: off - gcs[i]
    ri = jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
    head, seg, tail, total = [], [], [], []  # per block: g over [start, r], (c, r], (c, end], all
    for r in rows:
        g = g_ref[r].astype(f32)
        head.append(jnp.cumsum(g))
        seg.append(segment_sums(g))
        tail.append(jnp.sum(jnp.where(ri == sub - 1, seg[-1], 0.0), axis=0))
        total.append(jnp.sum(jnp.where(last, head[-1], 0.0)))

    def blocks(a, b):  # g summed over the whole blocks a .. b - 1
        return sum(total[a:b], jnp.zeros((), f32))

    def span(i, j):  # head of block i + blocks j+1 .. i-1 + tail of block j
        return seg[i] if i == j else head[i][:, None] + (blocks(j + 1, i) + tail[j])[None, :]
    return ([blocks(0, i) + head[i] for i in range(len(rows))], span,
            lambda i: tail[i] + blocks(i + 1, len(rows)))


def _intra_blocked_kernel(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, gc_ref, *, chunk,
                          sub, dot_dtype):
    # k_ref [C, Dk], v_ref [C, Dv], g_ref/beta_ref [C]; outputs w/kd [C, Dk], u [C, Dv], gc [C]
    f32 = jnp.float32
    rows = [pl.ds(i * sub, sub) for i in range(chunk // sub)]
    gcs, span, to_end = _block_exponents(g_ref, rows, sub, is_exact(dot_dtype))
    ri = jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 1)
    ks = [k_ref[r].astype(f32) for r in rows]
    ws, us = [], []
    for i, r in enumerate(rows):
        beta = beta_ref[r].astype(f32)
        kb = ks[i] * beta[:, None]
        gam = jnp.exp(jnp.where(ri > ci, span(i, i), -jnp.inf))
        x_ii = _unit_lower_inverse(_dot_t(kb, ks[i], dot_dtype) * gam, sub)
        rw = ks[i] * (beta * jnp.exp(gcs[i]))[:, None]  # [S, Dk]
        ru = v_ref[r].astype(f32) * beta[:, None]  # [S, Dv]
        for j in range(i):
            a_ij = _dot_t(kb, ks[j], dot_dtype) * jnp.exp(span(i, j))
            rw = rw - _dot(a_ij, ws[j], dot_dtype)
            ru = ru - _dot(a_ij, us[j], dot_dtype)
        ws.append(_dot(x_ii, rw, dot_dtype))
        us.append(_dot(x_ii, ru, dot_dtype))
        w_ref[r, :] = ws[i].astype(w_ref.dtype)
        u_ref[r, :] = us[i].astype(u_ref.dtype)
        kd_ref[r, :] = (ks[i] * jnp.exp(to_end(i))[:, None]).astype(kd_ref.dtype)
        gc_ref[r] = gcs[i]


def intra_chunk_blocked(k, v, g, beta, *, chunk=64, dot_dtype=None, interpret=False,
                        num_warps=4, num_stages=2, used=None, src=None):
    """Kernel 1 of the fused path, blocked solve.

    Args:
      k: [N, T, Hk, Dk]; v: [N, T, Hv, Dv]; g, beta: [N, T, Hv] (T a multiple of chunk).
      used: None or an int32 scalar: only chunks below it are solved (dots.chunks_below).
      src: None, or (src, src_v) [T'] int32 each: k, v, g, beta are then a ragged step's source
        rows (N = 1 dropped: [R, Hk, Dk], ...) read through them (stream_rows.py; v by src_v),
        and T = T' (the packed stream's slots).
    Returns:
      w, kd [N, T, Hv, Dk] and u [N, T, Hv, Dv] in dot_dtype (default v's dtype), gc [N, T, Hv]
      float32 (gates cumulated inside each chunk).
    """
    if src is not None:
        return _through_src(k, v, g, beta, src, chunk=chunk, dot_dtype=dot_dtype,
                            interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                            used=used)
    n, t_len, hk, dk = k.shape
    hv, dv = v.shape[2:]
    if t_len % chunk:
        raise ValueError(f"gated_delta intra_chunk_blocked: T={t_len} not a multiple of "
                         f"chunk={chunk}")
    sub = min(_SUB, chunk)
    if chunk % sub or sub & (sub - 1):
        raise ValueError(f"gated_delta intra_chunk_blocked: chunk={chunk} must be a multiple of "
                         f"{sub} (a power of 2)")
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    rep = hv // hk

    def tok(d, key=False):
        if key:
            return pl.BlockSpec((None, chunk, None, d), lambda b, c, h: (b, c, h // rep, 0))
        return pl.BlockSpec((None, chunk, None, d), lambda b, c, h: (b, c, h, 0))
    gate = pl.BlockSpec((None, chunk, None), lambda b, c, h: (b, c, h))
    kernel, used_spec, used_arg = chunks_below(functools.partial(
        _intra_blocked_kernel, chunk=chunk, sub=sub, dot_dtype=dot_dtype), 4, used, t_len // chunk)
    return pl.pallas_call(
        kernel,
        grid=(n, t_len // chunk, hv),
        in_specs=[tok(dk, True), tok(dv), gate, gate] + used_spec,
        out_specs=[tok(dk), tok(dv), tok(dk), gate],
        out_shape=[jax.ShapeDtypeStruct((n, t_len, hv, dk), dot_dtype),
                   jax.ShapeDtypeStruct((n, t_len, hv, dv), dot_dtype),
                   jax.ShapeDtypeStruct((n, t_len, hv, dk), dot_dtype),
                   jax.ShapeDtypeStruct((n, t_len, hv), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(k, v, g.astype(jnp.float32), beta, *used_arg)


def _through_src(k, v, g, beta, src, *, chunk, dot_dtype, interpret, num_warps, num_stages, used):
    """intra_chunk_blocked on a packed stream read through its source rows (`src`)."""
    src, src_v = src
    rows, hk, dk = k.shape
    hv, dv = v.shape[1:]
    t_len = src.shape[0]
    sub = min(_SUB, chunk)
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    rep = hv // hk
    ins = [stream_rows.flat_source(x) for x in (k, v, g.astype(jnp.float32), beta)]
    views = [(0, hk, rep, rows), (1, hv, 1, rows), (0, hv, 1, rows), (0, hv, 1, rows)]
    kernel, used_spec, used_arg = chunks_below(functools.partial(
        _intra_blocked_kernel, chunk=chunk, sub=sub, dot_dtype=dot_dtype), 4, used,
        t_len // chunk)
    tok = lambda d: pl.BlockSpec((None, chunk, None, d), lambda b, c, h: (b, c, h, 0))  # noqa: E731
    gate = pl.BlockSpec((None, chunk, None), lambda b, c, h: (b, c, h))
    return pl.pallas_call(
        stream_rows.through_rows(kernel, views, len(used_arg), chunk),
        grid=(1, t_len // chunk, hv),
        in_specs=[stream_rows.whole(x) for x in ins] + used_spec
        + [stream_rows.whole(src), stream_rows.whole(src_v)],
        out_specs=[tok(dk), tok(dv), tok(dk), gate],
        out_shape=[jax.ShapeDtypeStruct((1, t_len, hv, dk), dot_dtype),
                   jax.ShapeDtypeStruct((1, t_len, hv, dv), dot_dtype),
                   jax.ShapeDtypeStruct((1, t_len, hv, dk), dot_dtype),
                   jax.ShapeDtypeStruct((1, t_len, hv), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*ins, *used_arg, src, src_v)
