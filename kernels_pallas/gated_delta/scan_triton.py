"""Pallas (Triton backend) kernel for the sequential half of the chunked gated delta rule.

One program per (sequence * value head, Dv block); it keeps its [Dk, BV] slice of the state in
registers (float32) and walks the chunks in order:
    v_new = u_c - w_c @ S ;  store S (state entering chunk c) and v_new
    S = decay_last_c * S + kd_c^T @ v_new
Same contract as `chunked.state_scan`. Dot operands are cast to `dot_dtype` (bf16 for the fast
path, like flash-linear-attention; float32 = IEEE for exact CPU / interpret checks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(w_ref, u_ref, kd_ref, dl_ref, s0_ref, slot_ref, vnew_ref, states_ref, final_ref,
            ckpt_ref, *, n_chunks, dot_dtype):
    # w_ref/kd_ref [NT, C, Dk]; u_ref/vnew_ref [NT, C, BV]; dl_ref [NT]; s0/final [Dk, BV]
    # states_ref [NT, Dk, BV]; slot_ref [NT + 1] int32 checkpoint slot of each boundary (-1: none)
    # ckpt_ref [M, Dk, BV] float32 (exact states, whatever states_ref's dtype)
    def save_checkpoint(c, s):
        slot = slot_ref[c]

        @pl.when(slot >= 0)
        def _():
            ckpt_ref[slot] = s

    def body(c, s):
        states_ref[c] = s.astype(states_ref.dtype)
        save_checkpoint(c, s)
        w = w_ref[c].astype(dot_dtype)
        v_new = u_ref[c].astype(jnp.float32) - jnp.dot(w, s.astype(dot_dtype),
                                                        preferred_element_type=jnp.float32)
        vnew_ref[c] = v_new.astype(vnew_ref.dtype)
        kd = kd_ref[c].astype(dot_dtype)
        upd = jax.lax.dot_general(kd, v_new.astype(dot_dtype), (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        return s * dl_ref[c] + upd

    s = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(jnp.float32))
    final_ref[...] = s
    save_checkpoint(n_chunks, s)


def state_scan(w, u, kd, decay_last, state0, ckpt_idx=None, *, block_v=32, dot_dtype=None,
               states_dtype=None, num_warps=4, num_stages=2, interpret=False):
    """Pallas version of `chunked.state_scan` (see there for shapes and the checkpoint contract).

    Args:
      block_v: Dv columns per program (power of 2).
      dot_dtype: dtype of the dot operands (default: w's dtype).
      states_dtype: dtype of the per-chunk states output (default float32).
    """
    n, h, nt, c, dk = w.shape
    dv = u.shape[-1]
    block_v = min(block_v, dv)
    if dv % block_v:
        raise ValueError(f"gated_delta scan_triton: Dv={dv} not a multiple of block_v={block_v}")
    dot_dtype = w.dtype if dot_dtype is None else dot_dtype
    states_dtype = w.dtype if states_dtype is None else states_dtype
    n_ckpt = 1 if ckpt_idx is None else ckpt_idx.shape[1]
    # slot_map[n, j] = the checkpoint slot that boundary j writes (-1: none); duplicates share one
    slot_map = jnp.full((n, nt + 1), -1, jnp.int32)
    if ckpt_idx is not None:
        rows = jnp.arange(n)[:, None]
        slot_map = slot_map.at[rows, ckpt_idx].set(jnp.arange(n_ckpt, dtype=jnp.int32)[None, :])
    slot_map = jnp.repeat(slot_map, h, axis=0)  # [N * H, NT + 1]
    nh = n * h
    w_, kd_ = w.reshape(nh, nt, c, dk), kd.reshape(nh, nt, c, dk)
    u_ = u.reshape(nh, nt, c, dv)
    dl = decay_last.reshape(nh, nt).astype(jnp.float32)
    s0 = state0.reshape(nh, dk, dv).astype(jnp.float32)
    grid = (nh, dv // block_v)
    seq_k = pl.BlockSpec((None, nt, c, dk), lambda i, j: (i, 0, 0, 0))
    seq_v = pl.BlockSpec((None, nt, c, block_v), lambda i, j: (i, 0, 0, j))
    kernel = functools.partial(_kernel, n_chunks=nt, dot_dtype=dot_dtype)
    v_new, states, final, ckpt = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[seq_k, seq_v, seq_k, pl.BlockSpec((None, nt), lambda i, j: (i, 0)),
                  pl.BlockSpec((None, dk, block_v), lambda i, j: (i, 0, j)),
                  pl.BlockSpec((None, nt + 1), lambda i, j: (i, 0))],
        out_specs=[seq_v, pl.BlockSpec((None, nt, dk, block_v), lambda i, j: (i, 0, 0, j)),
                   pl.BlockSpec((None, dk, block_v), lambda i, j: (i, 0, j)),
                   pl.BlockSpec((None, n_ckpt, dk, block_v), lambda i, j: (i, 0, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((nh, nt, c, dv), u.dtype),
                   jax.ShapeDtypeStruct((nh, nt, dk, dv), states_dtype),
                   jax.ShapeDtypeStruct((nh, dk, dv), jnp.float32),
                   jax.ShapeDtypeStruct((nh, n_ckpt, dk, dv), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(w_, u_, kd_, dl, s0, slot_map)
    ckpt_states = None
    if ckpt_idx is not None:
        ckpt = ckpt.reshape(n, h, n_ckpt, dk, dv)
        winner = jnp.take_along_axis(slot_map[::h], ckpt_idx, axis=1)  # [N, M] slot holding each
        ckpt_states = jnp.take_along_axis(ckpt, winner[:, None, :, None, None], axis=2)
        ckpt_states = jnp.moveaxis(ckpt_states, 2, 1)  # [N, M, H, Dk, Dv]
    return (v_new.reshape(n, h, nt, c, dv), states.reshape(n, h, nt, dk, dv),
            final.reshape(n, h, dk, dv), ckpt_states)
