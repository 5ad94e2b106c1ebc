"""Pallas (Triton) path for the ragged gated delta rule: the packed-chunk layout of ragged.py,
run through fused_triton's intra-chunk and output kernels plus a state scan that restarts from a
sequence's initial state at its first chunk.

Scan kernel, grid (Hv, Dv / BV), one packed stream (N = 1): at chunk c
    boundary state (before any restart) -> fp32 slot `slot[c]` if asked (finals, checkpoints)
    s = state0[seq[c]] if restart[c] else s
    state entering c -> states[c] (for the output kernel); V' = U - W s; s = dl s + KD^T V'
The chunk loop stops at `n_used` (the packed chunks that hold tokens, a device scalar): the
static chunk count covers the worst case (token bucket / C + 2 S), and the no-op chunks past the
last sequence would cost a dependent step each (~6 us on the H200) without changing the state.
Their boundary slots still get the final state; their states / V' rows are left unwritten, and
the intra-chunk and output kernels skip them too (dots.chunks_below: their rows are never read),
so the worst-case bound costs nothing beyond the packed buffers.
The state layout ("kv" [Dk, BV] or "vk" [BV, Dk]) and the other kernel options follow
fused_triton.DEFAULTS (see scan_fused.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta import fused_triton, scan_fused


def _restart_scan_kernel(w_ref, u_ref, kd_ref, dl_ref, restart_ref, seq_ref, s0_ref, slot_ref,
                         used_ref, vnew_ref, states_ref, bound_ref, *, n_chunks, chunk, dot_dtype,
                         layout):
    # w/kd [T, Dk]; u/vnew [T, BV]; dl/restart/seq [NC]; slot [NC + 1]; used [1]; "kv": s0
    # [S, Dk, BV], states [NC, Dk, BV], bound [M, Dk, BV] float32; "vk": last two axes swapped
    save = scan_fused.saver(slot_ref, bound_ref)

    def body(c, s):
        save(c, s)
        s = jnp.where(restart_ref[c] > 0, s0_ref[seq_ref[c]].astype(jnp.float32), s)
        states_ref[c] = s.astype(states_ref.dtype)
        return scan_fused.step(c, s, w_ref, u_ref, kd_ref, dl_ref, vnew_ref, chunk=chunk,
                               dot_dtype=dot_dtype, layout=layout)

    used = jnp.minimum(used_ref[0], n_chunks)
    s = jax.lax.fori_loop(0, used, body, jnp.zeros(states_ref.shape[1:], jnp.float32))

    def save_only(c, s):  # boundaries past the last used chunk: the state no longer changes
        save(c, s)
        return s
    jax.lax.fori_loop(used, n_chunks + 1, save_only, s)


def _mosaic_operands(q, k, v):
    """q, k in v's dtype where it is bf16 / f16: a model L2-normalises q/k in float32 (as HF
    does); the Mosaic kernels take one dtype, and the Triton ones round q/k to the dot dtype
    inside their dots anyway. Others are left for the kernels' own check."""
    if v.dtype in (jnp.bfloat16, jnp.float16):
        return q.astype(v.dtype), k.astype(v.dtype)
    return q, k


def packed_gated_delta(q, k, v, g, beta, restart, seq_of_chunk, state0, bounds, *, scale,
                       chunk=64, dot_dtype=None, interpret=False, n_used=None, **options):
    """Packed stream of NC chunks (several sequences, each starting at a restart chunk).

    Args:
      q, k: [1, NC*C, Hk, Dk]; v: [1, NC*C, Hv, Dv]; g, beta: [1, NC*C, Hv] (no-op rows: zeros).
      restart, seq_of_chunk: [NC] int32; state0: [S, Hv, Dk, Dv] float32.
      bounds: [B] int32 boundary indices in [0, NC] whose pre-restart carry to return (boundary
        j = end of chunk j - 1).
      n_used: None or an int32 scalar: chunks [n_used, NC) hold no tokens (the scan stops
        there; their outputs are undefined). None: all NC.
      options: fused_triton.DEFAULTS keys (ckpt_store is ignored: bounds use a branch).
    Returns:
      out [1, NC*C, Hv, Dv] in v's dtype, bound_states [B, Hv, Dk, Dv] float32.
    """
    unknown = set(options) - set(fused_triton.DEFAULTS)
    if unknown:
        raise ValueError(f"gated_delta packed_gated_delta: unknown options {sorted(unknown)}")
    opt = {**fused_triton.DEFAULTS, **options}
    _, t_len, hk, dk = k.shape
    hv, dv = v.shape[2:]
    nc = t_len // chunk
    seqs = state0.shape[0]
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    if "mosaic" in (opt["intra"], opt["output"]):
        q, k = _mosaic_operands(q, k, v)
    w, u, kd, gc = fused_triton.intra(k, v, g, beta, chunk=chunk, dot_dtype=dot_dtype,
                                      interpret=interpret, kind=opt["intra"],
                                      num_warps=opt["intra_warps"], used=n_used)
    dl = jnp.exp(gc[0, chunk - 1::chunk, :]).T  # [Hv, NC]
    n_b = bounds.shape[0]
    slot_map = jnp.full((nc + 1,), -1, jnp.int32).at[bounds].set(jnp.arange(n_b, dtype=jnp.int32))
    block_v = min(opt["block_v"], dv)
    layout = opt["layout"]
    if layout not in scan_fused.LAYOUTS:
        raise ValueError(f"gated_delta packed_gated_delta: layout must be one of "
                         f"{scan_fused.LAYOUTS}, got {layout!r}")
    vk = layout == "vk"
    blk = (block_v, dk) if vk else (dk, block_v)
    s_idx = (lambda j: (j, 0)) if vk else (lambda j: (0, j))
    seq_k = pl.BlockSpec((None, t_len, None, dk), lambda h, j: (0, 0, h, 0))
    seq_v = pl.BlockSpec((None, t_len, None, block_v), lambda h, j: (0, 0, h, j))
    per_chunk = pl.BlockSpec((nc,), lambda h, j: (0,))
    st = (dv, dk) if vk else (dk, dv)
    s0 = jnp.swapaxes(state0, -1, -2) if vk else state0
    v_new, states, bound = pl.pallas_call(
        functools.partial(_restart_scan_kernel, n_chunks=nc, chunk=chunk, dot_dtype=dot_dtype,
                          layout=layout),
        grid=(hv, dv // block_v),
        in_specs=[seq_k, seq_v, seq_k, pl.BlockSpec((None, nc), lambda h, j: (h, 0)), per_chunk,
                  per_chunk, pl.BlockSpec((seqs, None, *blk), lambda h, j: (0, h, *s_idx(j))),
                  pl.BlockSpec((nc + 1,), lambda h, j: (0,)),
                  pl.BlockSpec((1,), lambda h, j: (0,))],
        out_specs=[seq_v, pl.BlockSpec((None, None, nc, *blk),
                                       lambda h, j: (0, h, 0, *s_idx(j))),
                   pl.BlockSpec((n_b, None, *blk), lambda h, j: (0, h, *s_idx(j)))],
        out_shape=[jax.ShapeDtypeStruct((1, t_len, hv, dv), dot_dtype),
                   jax.ShapeDtypeStruct((1, hv, nc, *st), dot_dtype),
                   jax.ShapeDtypeStruct((n_b, hv, *st), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=opt["scan_warps"],
                                             num_stages=opt["scan_stages"]),
        interpret=interpret,
    )(w, u, kd, dl, restart.astype(jnp.int32), seq_of_chunk.astype(jnp.int32),
      s0.astype(jnp.float32), slot_map,
      jnp.full((1,), nc, jnp.int32) if n_used is None else jnp.reshape(n_used, (1,)).astype(
          jnp.int32))
    if opt["output"] == "mosaic":
        from kernels_pallas.gated_delta import output_mosaic
        out = output_mosaic.output_mosaic(q, k, g, v_new, states, scale=scale, chunk=chunk,
                                          states_t=vk, interpret=interpret, used=n_used)
    else:
        out = fused_triton.output_fused(q, k, g, v_new, states, scale=scale, chunk=chunk,
                                        dot_dtype=dot_dtype, out_dtype=v.dtype,
                                        interpret=interpret, num_warps=opt["out_warps"],
                                        states_t=vk, used=n_used)
    if vk:
        bound = jnp.swapaxes(bound, -1, -2)
    winner = slot_map[bounds]  # duplicates share the slot that won the scatter
    return out, bound[winner]
