"""Chunked gated delta rule as three Pallas (Triton backend) kernels, no XLA transposes.

All tensors stay in the caller's [N, T, H, D] layout (BlockSpecs squeeze the head axis):
  1. `_intra_kernel`, grid (N, NT, Hv): per chunk, gc = cumsum(g); A = tril(beta K K^T Gamma, -1);
     X = (I + A)^-1 by forward substitution in registers (row i of X from rows < i, masked
     reductions; exact formula, no series); W = X (beta exp(gc) K), U = X (beta V),
     KD = K exp(gc_last - gc).
  2. `_scan_kernel`, grid (N * Hv, Dv / BV): the state S [Dk, BV] walks the chunks in registers
     (float32), writes the state entering each chunk (dot dtype, for 3), V' = U - W S, and fp32
     checkpoints at the boundaries asked for (as in scan_triton.py).
  3. `_output_kernel`, grid (N, NT, Hv): O = (scale Q exp(gc)) S + tril(scale Q K^T Gamma) V'.
Value head h reads key head h // (Hv // Hk) (GVA). T must be a multiple of C (api.py pads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _dot(a, b, dtype):
    return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _dot_t(a, b, dtype):  # a @ b.T
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _intra_kernel(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, gc_ref, *, chunk,
                  dot_dtype):
    # k_ref [C, Dk], v_ref [C, Dv], g_ref/beta_ref [C]; outputs w/kd [C, Dk], u [C, Dv], gc [C]
    k = k_ref[...].astype(jnp.float32)
    beta = beta_ref[...].astype(jnp.float32)
    gc = jnp.cumsum(g_ref[...].astype(jnp.float32))
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    diff = gc[:, None] - gc[None, :]
    gamma = jnp.exp(jnp.where(rows > cols, diff, -jnp.inf))  # strictly lower, 0 elsewhere
    a = _dot_t(k * beta[:, None], k, dot_dtype) * gamma  # [C, C]
    eye = (rows == cols).astype(jnp.float32)

    def substitute(i, x):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # row i of A, [C]
        x_i = -jnp.sum(a_i[:, None] * x, axis=0)  # -(A_i X), uses rows < i only
        return jnp.where(rows == i, x_i[None, :] + eye, x)

    x = jax.lax.fori_loop(1, chunk, substitute, eye)  # (I + A)^-1
    u_ref[...] = _dot(x, v_ref[...].astype(jnp.float32) * beta[:, None], dot_dtype
                      ).astype(u_ref.dtype)
    w_ref[...] = _dot(x, k * (beta * jnp.exp(gc))[:, None], dot_dtype).astype(w_ref.dtype)
    g_last = jnp.sum(jnp.where(jnp.arange(chunk) == chunk - 1, gc, 0.0))
    kd_ref[...] = (k * jnp.exp(g_last - gc)[:, None]).astype(kd_ref.dtype)
    gc_ref[...] = gc


def _scan_kernel(w_ref, u_ref, kd_ref, dl_ref, s0_ref, slot_ref, vnew_ref, states_ref, final_ref,
                 ckpt_ref, *, n_chunks, chunk, dot_dtype):
    # w/kd [T, Dk]; u/vnew [T, BV]; dl [NT]; s0/final [Dk, BV]; states [NT, Dk, BV];
    # slot [NT + 1]; ckpt [M, Dk, BV]
    def save_checkpoint(c, s):
        slot = slot_ref[c]

        @pl.when(slot >= 0)
        def _():
            ckpt_ref[slot] = s

    def body(c, s):
        states_ref[c] = s.astype(states_ref.dtype)
        save_checkpoint(c, s)
        rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        v_new = u_ref[rows, :].astype(jnp.float32) - _dot(w_ref[rows, :], s, dot_dtype)
        vnew_ref[rows, :] = v_new.astype(vnew_ref.dtype)
        upd = jax.lax.dot_general(kd_ref[rows, :].astype(dot_dtype), v_new.astype(dot_dtype),
                                  (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return s * dl_ref[c] + upd

    s = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(jnp.float32))
    final_ref[...] = s
    save_checkpoint(n_chunks, s)


def _scan_kernel_prefetch(w_ref, u_ref, kd_ref, dl_ref, s0_ref, slot_ref, vnew_ref, states_ref,
                          final_ref, ckpt_ref, *, n_chunks, chunk, dot_dtype):
    """`_scan_kernel` with chunk c+1's W/U/KD/decay/slot loaded while chunk c computes (carried
    in the loop state), so global-load latency leaves the sequential critical path."""
    def load(c):
        c = jnp.minimum(c, n_chunks - 1)
        rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        return (w_ref[rows, :].astype(dot_dtype), u_ref[rows, :].astype(jnp.float32),
                kd_ref[rows, :].astype(dot_dtype), dl_ref[c], slot_ref[c])

    def save_checkpoint(slot, s):
        @pl.when(slot >= 0)
        def _():
            ckpt_ref[slot] = s

    def body(c, carry):
        s, (w, u, kd, dl, slot) = carry
        nxt = load(c + 1)
        states_ref[c] = s.astype(states_ref.dtype)
        save_checkpoint(slot, s)
        v_new = u - jnp.dot(w, s.astype(dot_dtype), preferred_element_type=jnp.float32)
        vnew_ref[pl.ds(pl.multiple_of(c * chunk, chunk), chunk), :] = v_new.astype(vnew_ref.dtype)
        upd = jax.lax.dot_general(kd, v_new.astype(dot_dtype), (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        return s * dl + upd, nxt

    s, _ = jax.lax.fori_loop(0, n_chunks, body, (s0_ref[...].astype(jnp.float32), load(0)))
    final_ref[...] = s
    save_checkpoint(slot_ref[n_chunks], s)


def _output_kernel(q_ref, k_ref, gc_ref, vnew_ref, s_ref, o_ref, *, chunk, scale, dot_dtype):
    # q/k [C, Dk]; gc [C]; vnew [C, Dv]; s [Dk, Dv]; o [C, Dv]
    gc = gc_ref[...]
    q = q_ref[...].astype(jnp.float32) * scale
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    gamma = jnp.exp(jnp.where(rows >= cols, gc[:, None] - gc[None, :], -jnp.inf))
    attn = _dot_t(q, k_ref[...], dot_dtype) * gamma  # [C, C]
    o = _dot(q * jnp.exp(gc)[:, None], s_ref[...], dot_dtype) + _dot(attn, vnew_ref[...],
                                                                      dot_dtype)
    o_ref[...] = o.astype(o_ref.dtype)


def _specs(chunk, rep):
    def tok(d, heads_from_v=True):  # [C, d] block of head h of chunk c, layout [N, T, H, d]
        if heads_from_v:
            return pl.BlockSpec((None, chunk, None, d), lambda b, c, h: (b, c, h, 0))
        return pl.BlockSpec((None, chunk, None, d), lambda b, c, h: (b, c, h // rep, 0))
    return tok, pl.BlockSpec((None, chunk, None), lambda b, c, h: (b, c, h))


def intra_chunk_fused(k, v, g, beta, *, chunk=64, dot_dtype=None, interpret=False, num_warps=4):
    """Kernel 1 alone: (w, u, kd [N, T, Hv, D] in dot_dtype, gc [N, T, Hv] float32)."""
    n, t_len, hk, dk = k.shape
    hv, dv = v.shape[2:]
    nt = t_len // chunk
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    tok, gate_spec = _specs(chunk, hv // hk)
    return pl.pallas_call(
        functools.partial(_intra_kernel, chunk=chunk, dot_dtype=dot_dtype),
        grid=(n, nt, hv),
        in_specs=[tok(dk, False), tok(dv), gate_spec, gate_spec],
        out_specs=[tok(dk), tok(dv), tok(dk), gate_spec],
        out_shape=[jax.ShapeDtypeStruct((n, t_len, hv, dk), dot_dtype),
                   jax.ShapeDtypeStruct((n, t_len, hv, dv), dot_dtype),
                   jax.ShapeDtypeStruct((n, t_len, hv, dk), dot_dtype),
                   jax.ShapeDtypeStruct((n, t_len, hv), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(k, v, g.astype(jnp.float32), beta)


def output_fused(q, k, gc, v_new, states, *, scale, chunk, dot_dtype, out_dtype, interpret=False,
                 num_warps=4):
    """Kernel 3 alone: O [N, T, Hv, Dv] from q/k [N, T, Hk, Dk], gc [N, T, Hv], V' and the
    states entering each chunk [N, Hv, NT, Dk, Dv]."""
    n, t_len, hk, dk = k.shape
    hv, dv = v_new.shape[2:]
    tok, gate_spec = _specs(chunk, hv // hk)
    return pl.pallas_call(
        functools.partial(_output_kernel, chunk=chunk, scale=scale, dot_dtype=dot_dtype),
        grid=(n, t_len // chunk, hv),
        in_specs=[tok(dk, False), tok(dk, False), gate_spec, tok(dv),
                  pl.BlockSpec((None, None, None, dk, dv), lambda b, c, h: (b, h, c, 0, 0))],
        out_specs=tok(dv),
        out_shape=jax.ShapeDtypeStruct((n, t_len, hv, dv), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(q, k, gc, v_new, states)


def fused_gated_delta(q, k, v, g, beta, state0, ckpt_idx=None, *, scale, chunk=64, block_v=32,
                      dot_dtype=None, interpret=False, num_warps=4, prefetch=False):
    """Chunked gated delta rule; same contract as `chunked.chunked_gated_delta` (T % chunk == 0).

    dot_dtype: matmul operand dtype (default: v's dtype; bf16 inputs -> bf16 MMAs, fp32 acc).
    Intermediates (W, U, KD, V', per-chunk states) are stored in dot_dtype; the carried state,
    the final state and the checkpoints are float32. prefetch: use `_scan_kernel_prefetch`.
    """
    n, t_len, hk, dk = k.shape
    hv, dv = v.shape[2:]
    nt = t_len // chunk
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    inter = dot_dtype
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    tok, gate_spec = _specs(chunk, hv // hk)
    w, u, kd, gc = intra_chunk_fused(k, v, g, beta, chunk=chunk, dot_dtype=dot_dtype,
                                     interpret=interpret, num_warps=num_warps)

    decay_last = jnp.exp(gc[:, chunk - 1::chunk, :])  # [N, NT, Hv]
    dl = jnp.moveaxis(decay_last, 1, 2)  # [N, Hv, NT]
    n_ckpt = 1 if ckpt_idx is None else ckpt_idx.shape[1]
    slot_map = jnp.full((n, nt + 1), -1, jnp.int32)
    if ckpt_idx is not None:
        slot_map = slot_map.at[jnp.arange(n)[:, None], ckpt_idx].set(
            jnp.arange(n_ckpt, dtype=jnp.int32)[None, :])
    block_v = min(block_v, dv)
    seq_k = pl.BlockSpec((None, t_len, None, dk), lambda b, h, j: (b, 0, h, 0))
    seq_v = pl.BlockSpec((None, t_len, None, block_v), lambda b, h, j: (b, 0, h, j))
    state_spec = pl.BlockSpec((None, None, dk, block_v), lambda b, h, j: (b, h, 0, j))
    v_new, states, final, ckpt = pl.pallas_call(
        functools.partial(_scan_kernel_prefetch if prefetch else _scan_kernel, n_chunks=nt,
                          chunk=chunk, dot_dtype=dot_dtype),
        grid=(n, hv, dv // block_v),
        in_specs=[seq_k, seq_v, seq_k, pl.BlockSpec((None, None, nt), lambda b, h, j: (b, h, 0)),
                  state_spec, pl.BlockSpec((None, nt + 1), lambda b, h, j: (b, 0))],
        out_specs=[seq_v, pl.BlockSpec((None, None, nt, dk, block_v),
                                       lambda b, h, j: (b, h, 0, 0, j)),
                   state_spec, pl.BlockSpec((None, None, n_ckpt, dk, block_v),
                                            lambda b, h, j: (b, h, 0, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((n, t_len, hv, dv), inter),
                   jax.ShapeDtypeStruct((n, hv, nt, dk, dv), inter),
                   jax.ShapeDtypeStruct((n, hv, dk, dv), jnp.float32),
                   jax.ShapeDtypeStruct((n, hv, n_ckpt, dk, dv), jnp.float32)],
        compiler_params=params, interpret=interpret,
    )(w, u, kd, dl, state0.astype(jnp.float32), slot_map)

    out = output_fused(q, k, gc, v_new, states, scale=scale, chunk=chunk, dot_dtype=dot_dtype,
                       out_dtype=v.dtype, interpret=interpret, num_warps=num_warps)

    ckpt_states = None
    if ckpt_idx is not None:
        winner = jnp.take_along_axis(slot_map, ckpt_idx, axis=1)  # [N, M]
        ckpt_states = jnp.take_along_axis(ckpt, winner[:, None, :, None, None], axis=2)
        ckpt_states = jnp.moveaxis(ckpt_states, 2, 1)  # [N, M, Hv, Dk, Dv]
    return out, final, ckpt_states
