"""Pallas (Triton) path for the ragged gated delta rule: the packed-chunk layout of ragged.py,
run through fused_triton's intra-chunk and output kernels plus a state scan that restarts from a
sequence's initial state at its first chunk (seq_scan.py: one program per sequence, side by
side, or the serial form). The chunks past the last sequence (the static bound: token bucket / C
+ 2 S) belong to no program; the intra-chunk and output kernels skip them too
(dots.chunks_below), and the chunks that borrow another's W, U, KD (`chunk_src`).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.gated_delta import (fused_triton, scan_fused, seq_scan, state_rows,
                                         transition_scan)
from kernels_pallas.gated_delta.state_rows import StateRows


# False: the serial scan (one program per head and value block walks every packed chunk), kept
# for A/B timing and as the form the per-sequence one must equal bit for bit
SEQ_PARALLEL = True


def qk_in_v_dtype(q, k, v):
    """q, k in v's dtype where it is bf16 / f16: a model L2-normalises q/k in float32 (as HF
    does); the Mosaic kernels take one dtype, and the Triton ones round q/k to the dot dtype
    inside their dots anyway. Others are left for the kernels' own check. q is k (affine's
    transition maps) stays one array."""
    if v.dtype not in (jnp.bfloat16, jnp.float16):
        return q, k
    k_low = k.astype(v.dtype)
    return (k_low if q is k else q.astype(v.dtype)), k_low


def packed_gated_delta(q, k, v, g, beta, restart, seq_of_chunk, state0, bounds, *, scale,
                       chunk=64, dot_dtype=None, interpret=False, n_used=None, seq_first=None,
                       seq_chunks=None, seq_parallel=None, states_in_place=None, src=None,
                       transitions=None, chunk_src=None, **options):
    """Packed stream of NC chunks (several sequences, each starting at a restart chunk).

    Args:
      q, k: [1, NC*C, Hk, Dk]; v: [1, NC*C, Hv, Dv]; g, beta: [1, NC*C, Hv] (no-op rows: zeros).
      restart, seq_of_chunk: [NC] int32; state0: [S, Hv, Dk, Dv] float32.
      bounds: [B] int32 boundary indices in [0, NC] whose pre-restart carry to return (boundary
        j = end of chunk j - 1).
      n_used: None or an int32 scalar: chunks [n_used, NC) hold no tokens (the scan stops
        there; their outputs are undefined). None: all NC.
      seq_first, seq_chunks: None, or [S'] int32 each sequence's first packed chunk and chunk
        count (ragged.packing's first, n_ch): the scan then runs one program per sequence
        (`SEQ_PARALLEL`); a boundary no sequence ends at is undefined (read state0 there).
      seq_parallel: None (`SEQ_PARALLEL`) or a bool: whether it does (a caller under a jit
        passes it: the switch is in the jit's key); states_in_place: the same for
        state_rows.STATES_IN_PLACE (state0 a StateRows read in place, or built).
      src: None, or (src, src_v) [NC*C] int32: q, k, v, g, beta are the step's source rows
        ([R, Hk, Dk], ...), read by intra "blocked" and output "triton" (stream_rows.py).
      transitions: None, or (first [M], count [M] int32, init): also the product of the maps
        of packed chunks first[m] .. + count[m] (chunks of the stream's own sequences: a
        captured span piece's, whose map the caller wants) from I (init None) or init's row m
        (a StateRows of M rows), by a second scan over the same W / KD (no stream rows, intra
        or output work of their own; transition_scan.py). Needs Dk = Dv.
      chunk_src: None, or [NC] int32 each chunk's source chunk (joint.joint_packing's borrowed
        chunks): the scan reads chunk chunk_src[c]'s W, U, KD and decay at chunk c (storing V'
        and the entering state at c as always); the intra-chunk and output kernels skip the
        chunks that read another's (`own_chunks`; the Mosaic ones compute them unread).
      options: fused_triton.DEFAULTS keys (ckpt_store is ignored: bounds use a branch).
    Returns:
      out [1, NC*C, Hv, Dv] in v's dtype, bound_states [B, Hv, Dk, Dv] float32, with
      transitions their products [M, Hv, Dk, Dk] float32, and where state0 is a write_final
      StateRows its source with every sequence's final state written in place (the source
      aliased to the scan kernel's last output).
    """
    unknown = set(options) - set(fused_triton.DEFAULTS)
    if unknown:
        raise ValueError(f"gated_delta packed_gated_delta: unknown options {sorted(unknown)}")
    opt = {**fused_triton.DEFAULTS, **options}
    t_len = k.shape[1] if src is None else src[0].shape[0]
    nc = t_len // chunk
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    if src is not None and (opt["intra"], opt["output"]) != ("blocked", "triton"):
        raise ValueError(f"packed_gated_delta: src needs intra / output blocked / triton: {opt}")
    if "mosaic" in (opt["intra"], opt["output"]):
        q, k = qk_in_v_dtype(q, k, v)
    used_by = n_used  # what the intra and output kernels run: chunks below n_used (own ones)
    if chunk_src is not None:
        chunk_src = jnp.asarray(chunk_src, jnp.int32)
        used_by = (jnp.int32(nc) if n_used is None else n_used, own_chunks(chunk_src))
    w, u, kd, gc = fused_triton.intra(k, v, g, beta, chunk=chunk, dot_dtype=dot_dtype,
                                      interpret=interpret, kind=opt["intra"],
                                      num_warps=opt["intra_warps"], used=used_by, src=src)
    dl = jnp.exp(gc[0, chunk - 1::chunk, :]).T  # [Hv, NC]
    per_seq = None  # the per-sequence scan, where the caller gives the sequences' chunks
    if (SEQ_PARALLEL if seq_parallel is None else seq_parallel) and seq_first is not None:
        per_seq = (jnp.asarray(seq_first, jnp.int32), jnp.asarray(seq_chunks, jnp.int32))
    in_place = seq_first is not None and reads_rows_in_place(seq_parallel, states_in_place)
    v_new, states, bound, written = _scan(
        w, u, kd, dl, restart, seq_of_chunk, state0, bounds, opt, n_used=n_used,
        per_seq=per_seq, in_place=in_place, chunk=chunk, dot_dtype=dot_dtype,
        interpret=interpret, chunk_src=chunk_src)
    out = _output(q, k, g, v_new, states, opt, scale=scale, chunk=chunk, dot_dtype=dot_dtype,
                  out_dtype=v.dtype, interpret=interpret, used=used_by,
                  src=None if src is None else src[0])
    products = () if transitions is None else (transition_scan.products(
        w, kd, dl, *transitions, chunk=chunk, dot_dtype=dot_dtype, options=opt,
        interpret=interpret),)
    return (out, bound, *products, *written)  # written: the write_final source, if any


def _scan(w, u, kd, dl, restart, seq_of_chunk, state0, bounds, opt, *, n_used, per_seq,
          in_place, chunk, dot_dtype, interpret, chunk_src):
    """packed_gated_delta's state scan (seq_scan.state_scan): (V', the states entering each
    chunk, the states at `bounds` [B, Hv, Dk, Dv] float32, [the write_final source] or [])."""
    nc = w.shape[1] // chunk
    n_b = bounds.shape[0]
    slot_map = jnp.full((nc + 1,), -1, jnp.int32).at[bounds].set(jnp.arange(n_b, dtype=jnp.int32))
    layout = opt["layout"]
    if layout not in scan_fused.LAYOUTS:
        raise ValueError(f"gated_delta packed_gated_delta: layout must be one of "
                         f"{scan_fused.LAYOUTS}, got {layout!r}")
    vk = layout == "vk"
    used = jnp.full((1,), nc, jnp.int32) if n_used is None else jnp.reshape(
        n_used, (1,)).astype(jnp.int32)
    s0 = seq_scan.scan_states(state0, in_place, vk)
    v_new, states, bound, *written = seq_scan.state_scan(
        w, u, kd, dl, restart.astype(jnp.int32), seq_of_chunk.astype(jnp.int32),
        s0, slot_map, used, per_seq, n_b=n_b, chunk=chunk, dot_dtype=dot_dtype, layout=layout,
        block_v=min(opt["block_v"], u.shape[-1]), num_warps=opt["scan_warps"],
        num_stages=opt["scan_stages"], interpret=interpret, chunk_src=chunk_src)
    if vk and not isinstance(s0, StateRows):
        bound = jnp.swapaxes(bound, -1, -2)
    winner = slot_map[bounds]  # duplicates share the slot that won the scatter
    return v_new, states, bound[winner], written


def _output(q, k, g, v_new, states, opt, *, scale, chunk, dot_dtype, out_dtype, interpret, used,
            src):
    """The output kernel opt["output"] names: Mosaic GPU or Triton (with `src`: reading the
    step's source rows, stream_rows.py)."""
    vk = opt["layout"] == "vk"
    if opt["output"] == "mosaic":
        from kernels_pallas.gated_delta import output_mosaic
        return output_mosaic.output_mosaic(q, k, g, v_new, states, scale=scale, chunk=chunk,
                                           states_t=vk, interpret=interpret, used=used)
    return fused_triton.output_fused(q, k, g, v_new, states, scale=scale, chunk=chunk,
                                     dot_dtype=dot_dtype, out_dtype=out_dtype,
                                     interpret=interpret, num_warps=opt["out_warps"],
                                     states_t=vk, used=used, src=src)


def own_chunks(chunk_src):
    """[NC] int32, 1 where a chunk reads its own W, U, KD (chunk_src[c] = c): the chunks whose
    stream slots, intra-chunk and output work anyone reads."""
    return (chunk_src == jnp.arange(chunk_src.shape[0], dtype=jnp.int32)).astype(jnp.int32)


def reads_rows_in_place(seq_parallel=None, states_in_place=None) -> bool:
    """Whether the scan reads a StateRows where its rows live (its per-sequence form, given the
    sequences' chunks, with STATES_IN_PLACE): what writing finals in place needs
    (ragged.finals_in_kernel). None: the module switch."""
    return bool((SEQ_PARALLEL if seq_parallel is None else seq_parallel)
                and (state_rows.STATES_IN_PLACE if states_in_place is None else states_in_place))


