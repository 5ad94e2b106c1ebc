"""Pallas (Triton) path for the ragged gated delta rule: the packed-chunk layout of ragged.py,
run through fused_triton's intra-chunk and output kernels plus a state scan that restarts from a
sequence's initial state at its first chunk.

Scan kernel, grid (Hv, Dv / BV, S): each program walks the packed chunks of one sequence only
(`seq_first[s]` .. + `seq_chunks[s]`), from its initial state, so the sequences of a step run side
by side and the dependent chain is the longest sequence's chunks, not the whole stream's. At chunk c
    state entering c -> states[c] (for the output kernel); V' = U - W s; s = dl s + KD^T V'
    state leaving c -> fp32 slot `slot[c + 1]` if asked (finals, checkpoints)
Each chunk's arithmetic is that of the serial scan (`SEQ_PARALLEL = False`: one program walks
every packed chunk and restarts from a sequence's initial state at its first chunk), so both give
the same bits. A boundary no sequence's chunks end at (one before any chunk, an empty sequence's)
is left unwritten: ragged.py reads the initial state there instead. The chunks past the last
sequence (the static bound: token bucket / C + 2 S) belong to no program; the intra-chunk and
output kernels skip them too (dots.chunks_below). The state layout ("kv" [Dk, BV] or "vk"
[BV, Dk]) and the other options follow fused_triton.DEFAULTS (see scan_fused.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta import fused_triton, scan_fused, state_rows, transition_scan
from kernels_pallas.gated_delta.state_rows import StateRows


# False: the serial scan (one program per head and value block walks every packed chunk), kept
# for A/B timing and as the form the per-sequence one must equal bit for bit
SEQ_PARALLEL = True
# None: the per-sequence scan runs a program per sequence; P: P programs, program p walking
# sequences p, p + P, ... (a span step's ~176 static sequences hold ~60 real ones: ~20K programs
# launched only to exit at block_v 16). Off until timed (same bits: test_span_finals_in_place).
SEQ_STRIDE = None


def _restart_scan_kernel(w_ref, u_ref, kd_ref, dl_ref, src_ref, restart_ref, seq_ref, s0_ref,
                         slot_ref, used_ref, vnew_ref, states_ref, bound_ref, *, n_chunks, chunk,
                         dot_dtype, layout):
    # serial: w/kd [T, Dk]; u/vnew [T, BV]; dl/src/restart/seq [NC] (src: the chunk whose W, U,
    # KD, decay chunk c reads: packed_gated_delta's chunk_src); slot [NC + 1]; used [1]; "kv":
    # s0 [S, Dk, BV], states [NC, Dk, BV], bound [M, Dk, BV] float32; "vk": last two axes swapped
    save = scan_fused.saver(slot_ref, bound_ref)

    def body(c, s):
        save(c, s)
        s = jnp.where(restart_ref[c] > 0, s0_ref[seq_ref[c]].astype(jnp.float32), s)
        states_ref[c] = s.astype(states_ref.dtype)
        return scan_fused.step(c, s, w_ref, u_ref, kd_ref, dl_ref, vnew_ref, chunk=chunk,
                               dot_dtype=dot_dtype, layout=layout, src=src_ref[c])

    used = jnp.minimum(used_ref[0], n_chunks)
    s = jax.lax.fori_loop(0, used, body, jnp.zeros(states_ref.shape[1:], jnp.float32))

    def save_only(c, s):  # boundaries past the last used chunk: the state no longer changes
        save(c, s)
        return s
    jax.lax.fori_loop(used, n_chunks + 1, save_only, s)


def _seq_scan_kernel(w_ref, u_ref, kd_ref, dl_ref, src_ref, first_ref, count_ref, seq_ref, *refs,
                     n_chunks, chunk, dot_dtype, layout, n_sources, block_v, write_final=False,
                     final_rows=False, stride=None):
    # per sequence (grid axis 2): first/count [S] its packed chunks; the rest as the serial one,
    # except: with n_sources the initial states are a StateRows (kind, index [N], then each
    # source's [P, Dk, BV] block: state_rows.load_tile), and bound [M, Dk, BV] is stored in the
    # "kv" order whatever the layout (no transposed copy after the kernel); with write_final
    # (StateRows.write_final: row sid is sequence sid's) the last output is the source aliased,
    # where the sequence's final state goes, in the "kv" order; with final_rows (after the
    # sources: StateRows.final_rows [S], then final_from's first chunk and count [S] each) the
    # source row each sequence's final goes to (-1: none), and where a count is >= 0 the final
    # is that run of chunks' state from zero instead (a carried span piece's, run again here:
    # its own program would write the slot this one reads, in no order)
    final_ref = dest_ref = from_first_ref = from_count_ref = kind_ref = index_ref = None
    if n_sources:
        kind_ref, index_ref = refs[:2]
        src_refs = refs[2:2 + n_sources]
        rest = refs[2 + n_sources:]
        if final_rows:
            dest_ref, from_first_ref, from_count_ref, *rest = rest
        slot_ref, vnew_ref, states_ref, bound_ref, *rest = rest
        final_ref = rest[0] if write_final else None
    else:
        s0_ref, slot_ref, vnew_ref, states_ref, bound_ref = refs
    j = pl.program_id(1)  # read here: the interpreter has no program_id under a pl.when
    p = pl.program_id(2)
    one = functools.partial(
        _scan_sequence, j=j, refs=(w_ref, u_ref, kd_ref, dl_ref, src_ref, first_ref, count_ref,
                                   seq_ref),
        srcs=(kind_ref, index_ref, src_refs) if n_sources else s0_ref, finals=(
            final_ref, dest_ref, from_first_ref, from_count_ref) if write_final else None,
        outs=(slot_ref, vnew_ref, states_ref, bound_ref), n_chunks=n_chunks, chunk=chunk,
        dot_dtype=dot_dtype, layout=layout, n_sources=n_sources, block_v=block_v,
        final_rows=final_rows)
    if stride is None:
        one(p)
        return

    def each(k, carry):  # sequences p, p + stride, ... (SEQ_STRIDE)
        one(p + k * stride)
        return carry
    jax.lax.fori_loop(0, (first_ref.shape[0] - p + stride - 1) // stride, each, 0)


def _scan_sequence(sid, *, j, refs, srcs, finals, outs, n_chunks, chunk, dot_dtype, layout,
                   n_sources, block_v, final_rows):
    """_seq_scan_kernel's work for sequence sid (value block j)."""
    w_ref, u_ref, kd_ref, dl_ref, src_ref, first_ref, count_ref, seq_ref = refs
    slot_ref, vnew_ref, states_ref, bound_ref = outs
    kind_ref, index_ref, src_refs = srcs if n_sources else (None,) * 3
    s0_ref = None if n_sources else srcs
    final_ref, dest_ref, from_first_ref, from_count_ref = finals or (None,) * 4
    vk = layout == "vk"
    start = jnp.minimum(first_ref[sid], n_chunks)
    end = jnp.minimum(start + count_ref[sid], n_chunks)  # a broken bound loses chunks, not memory
    if final_ref is not None:  # where this sequence's final goes (clipped: never outside)
        dest = _final_row(dest_ref if final_rows else index_ref, sid, final_ref)
        keep = (dest_ref[sid] >= 0) if final_rows else None

        def write_final_state(value):
            def store():
                final_ref[dest] = value.astype(final_ref.dtype)
            if keep is None:
                store()
            else:
                pl.when(keep)(store)

    def save(c, s):
        slot = slot_ref[c]

        @pl.when(slot >= 0)
        def _():
            bound_ref[slot] = s.T if vk and n_sources else s

    def body(c, s):
        states_ref[c] = s.astype(states_ref.dtype)
        s = scan_fused.step(c, s, w_ref, u_ref, kd_ref, dl_ref, vnew_ref, chunk=chunk,
                            dot_dtype=dot_dtype, layout=layout, src=src_ref[c])
        save(c + 1, s)
        return s

    @pl.when(end > start)
    def _():
        row = seq_ref[jnp.minimum(start, n_chunks - 1)]
        if n_sources:
            s0 = state_rows.load_tile(row, kind_ref, index_ref, src_refs, j=j,
                                      block_v=block_v, transpose=vk)
        else:
            s0 = s0_ref[row].astype(jnp.float32)
        s = jax.lax.fori_loop(start, end, body, s0)
        if final_rows:  # a carried piece's state, from zero, no outputs stored
            c0 = jnp.minimum(from_first_ref[sid], n_chunks)
            n = from_count_ref[sid]
            t = jax.lax.fori_loop(c0, jnp.minimum(c0 + jnp.maximum(n, 0), n_chunks),
                                  lambda c, t: scan_fused.step(
                                      c, t, w_ref, u_ref, kd_ref, dl_ref, None, chunk=chunk,
                                      dot_dtype=dot_dtype, layout=layout),
                                  jnp.zeros_like(s))
            s = jnp.where(n >= 0, t, s)
        if final_ref is not None:
            write_final_state(s.T if vk else s)

    if final_ref is not None:  # no tokens: a sequence starting from zeros ends there (with
        # final_rows the caller names only such empty sequences: StateRows.final_rows)
        empty_zero = end <= start
        if not final_rows:
            empty_zero = empty_zero & (kind_ref[sid] == state_rows.ZERO)

        @pl.when(empty_zero)
        def _():
            write_final_state(jnp.zeros(final_ref.shape[1:], jnp.float32))


def _final_operands(s0: StateRows, n_seq: int):
    """A StateRows' final_rows and final_from (first chunk, count) as the scan's [S] int32
    operands (final_from None: every count -1, each sequence its own final)."""
    first, count = (jnp.zeros(n_seq, jnp.int32), jnp.full(n_seq, -1, jnp.int32)) \
        if s0.final_from is None else s0.final_from
    return tuple(jnp.asarray(x, jnp.int32) for x in (s0.final_rows, first, count))


def _final_row(index_ref, sid, final_ref):
    """The source row sequence `sid`'s final state goes to (clipped: a bad index cannot write
    outside the source)."""
    return jnp.clip(index_ref[sid], 0, final_ref.shape[0] - 1)


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
                       transitions=None, seq_stride=None, chunk_src=None, **options):
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
        passes it: the switch is in the jit's key); seq_stride, states_in_place: the same for
        SEQ_STRIDE, state_rows.STATES_IN_PLACE (state0 a StateRows read in place, or built).
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
    hk, dk = k.shape[-2:]
    hv, dv = v.shape[-2:]
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
    n_b = bounds.shape[0]
    slot_map = jnp.full((nc + 1,), -1, jnp.int32).at[bounds].set(jnp.arange(n_b, dtype=jnp.int32))
    layout = opt["layout"]
    if layout not in scan_fused.LAYOUTS:
        raise ValueError(f"gated_delta packed_gated_delta: layout must be one of "
                         f"{scan_fused.LAYOUTS}, got {layout!r}")
    vk = layout == "vk"
    used = jnp.full((1,), nc, jnp.int32) if n_used is None else jnp.reshape(
        n_used, (1,)).astype(jnp.int32)
    per_seq = None  # the per-sequence scan, where the caller gives the sequences' chunks
    if (SEQ_PARALLEL if seq_parallel is None else seq_parallel) and seq_first is not None:
        per_seq = (jnp.asarray(seq_first, jnp.int32), jnp.asarray(seq_chunks, jnp.int32))
    s0 = _scan_states(state0, seq_first is not None
                      and reads_rows_in_place(seq_parallel, states_in_place), vk)
    v_new, states, bound, *written = _state_scan(
        w, u, kd, dl, restart.astype(jnp.int32), seq_of_chunk.astype(jnp.int32),
        s0, slot_map, used, per_seq, n_b=n_b, chunk=chunk, dot_dtype=dot_dtype, layout=layout,
        block_v=min(opt["block_v"], dv), num_warps=opt["scan_warps"],
        num_stages=opt["scan_stages"], interpret=interpret,
        stride=SEQ_STRIDE if seq_stride is None else seq_stride, chunk_src=chunk_src)
    out = _output(q, k, g, v_new, states, opt, scale=scale, chunk=chunk, dot_dtype=dot_dtype,
                  out_dtype=v.dtype, interpret=interpret, used=used_by,
                  src=None if src is None else src[0])
    if vk and not isinstance(s0, StateRows):
        bound = jnp.swapaxes(bound, -1, -2)
    winner = slot_map[bounds]  # duplicates share the slot that won the scatter
    products = () if transitions is None else (transition_scan.products(
        w, kd, dl, *transitions, chunk=chunk, dot_dtype=dot_dtype, options=opt,
        interpret=interpret),)
    return (out, bound[winner], *products, *written)  # written: the write_final source, if any


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


def _scan_states(state0, rows_in_place: bool, vk: bool):
    """The scan's initial states: a StateRows the per-sequence kernel reads in place (its bound
    states then come in the "kv" order), or the table built in the layout's axis order. A
    write_final StateRows needs the former (ragged.ragged_prefill falls back for others)."""
    if rows_in_place and isinstance(state0, StateRows):
        return state0
    if isinstance(state0, StateRows) and state0.write_final:
        raise ValueError("packed_gated_delta: a write_final StateRows needs the per-sequence "
                         "scan reading it in place (seq_first / seq_chunks, SEQ_PARALLEL and "
                         "STATES_IN_PLACE on)")
    s0 = state_rows.as_array(state0).astype(jnp.float32)
    return jnp.swapaxes(s0, -1, -2) if vk else s0


def _state_scan(w, u, kd, dl, restart, seq_of_chunk, s0, slot_map, used, per_seq, *, n_b, chunk,
                dot_dtype, layout, block_v, num_warps, num_stages, interpret, stride=None,
                chunk_src=None):
    """The scan kernel's call: serial (grid (Hv, Dv / BV)) or, with per_seq = (first, count)
    [S'] each, one program per sequence (grid (Hv, Dv / BV, S')). s0: the initial states in the
    layout's axis order, or (per_seq only) a StateRows read in place. Returns (v_new [1, T, Hv,
    Dv], states [1, Hv, NC, ...], bound [n_b, Hv, ...]) in the layout's axis order (bound in
    the "kv" order with a StateRows), and for a write_final StateRows its source, each
    sequence's final state written in place (StateRows.write_final). chunk_src: None or [NC]
    (packed_gated_delta's)."""
    _, t_len, hv, dk = w.shape
    dv = u.shape[-1]
    nc = t_len // chunk
    vk = layout == "vk"
    blk = (block_v, dk) if vk else (dk, block_v)
    st = (dv, dk) if vk else (dk, dv)
    rows_in = isinstance(s0, StateRows)
    write_final = False
    if per_seq is None or (stride is not None and stride >= per_seq[0].shape[0]):
        stride = None  # a program per sequence
    grid = (hv, dv // block_v) + (() if per_seq is None else (stride or per_seq[0].shape[0],))
    s_idx = (lambda j: (j, 0)) if vk else (lambda j: (0, j))
    seq_k = pl.BlockSpec((None, t_len, None, dk), lambda h, j, *_: (0, 0, h, 0))
    seq_v = pl.BlockSpec((None, t_len, None, block_v), lambda h, j, *_: (0, 0, h, j))
    whole = lambda n: pl.BlockSpec((n,), lambda h, j, *_: (0,))  # noqa: E731
    common = [seq_k, seq_v, seq_k, pl.BlockSpec((None, nc), lambda h, j, *_: (h, 0)), whole(nc)]
    if chunk_src is None:
        chunk_src = jnp.arange(nc, dtype=jnp.int32)
    n_sources, bound_blk, bound_st, bound_idx = 0, blk, st, s_idx
    if per_seq is None:
        state_in = pl.BlockSpec((s0.shape[0], None, *blk), lambda h, j, *_: (0, h, *s_idx(j)))
        kernel, operands = _restart_scan_kernel, (restart, seq_of_chunk, s0, slot_map, used)
        in_specs = common + [whole(nc), whole(nc), state_in, whole(nc + 1), whole(1)]
    else:
        n_seq = per_seq[0].shape[0]
        if rows_in:  # kind, index, then each source's (head, value block) of every row
            n_sources = len(s0.sources)
            bound_blk, bound_st, bound_idx = (dk, block_v), (dk, dv), (lambda j: (0, j))
            states_in = [whole(s0.kind.shape[0]), whole(s0.kind.shape[0])] + [
                state_rows.source_spec(src, s0.layer_of(i), dk, block_v)
                for i, src in enumerate(s0.sources)]
            state_ops = (s0.kind, s0.index, *s0.sources)
        else:
            states_in = [pl.BlockSpec((s0.shape[0], None, *blk),
                                      lambda h, j, *_: (0, h, *s_idx(j)))]
            state_ops = (s0,)
        write_final = rows_in and s0.write_final
        dests = write_final and s0.final_rows is not None
        if dests and s0.final_rows.shape[0] != n_seq:
            raise ValueError(f"gated_delta scan: final_rows needs one row per sequence, got "
                             f"{s0.final_rows.shape[0]} for {n_seq} sequences")
        if write_final and not dests and s0.kind.shape[0] != n_seq:
            raise ValueError(f"gated_delta scan: write_final needs one state row per sequence, "
                             f"got {s0.kind.shape[0]} rows for {n_seq} sequences")
        kernel = functools.partial(_seq_scan_kernel, n_sources=n_sources, block_v=block_v,
                                   write_final=write_final, final_rows=dests, stride=stride)
        if dests:  # after the sources (the alias index of the first source stays)
            state_ops += _final_operands(s0, n_seq)
            states_in = states_in + [whole(n_seq)] * 3
        operands = (*per_seq, seq_of_chunk, *state_ops, slot_map)
        in_specs = common + [whole(n_seq), whole(n_seq), whole(nc)] + states_in + [whole(nc + 1)]
    out_specs = [seq_v,
                 pl.BlockSpec((None, None, nc, *blk), lambda h, j, *_: (0, h, 0, *s_idx(j))),
                 pl.BlockSpec((n_b, None, *bound_blk), lambda h, j, *_: (0, h, *bound_idx(j)))]
    out_shape = [jax.ShapeDtypeStruct((1, t_len, hv, dv), dot_dtype),
                 jax.ShapeDtypeStruct((1, hv, nc, *st), dot_dtype),
                 jax.ShapeDtypeStruct((n_b, hv, *bound_st), jnp.float32)]
    aliases = {}
    if write_final:  # (per-sequence scan only) the source, in place: its (head, block) tiles
        src = s0.sources[0]
        out_specs.append(state_rows.source_spec(src, None, dk, block_v))
        out_shape.append(jax.ShapeDtypeStruct(src.shape, src.dtype))
        # operands: w, u, kd, dl, chunk_src, the per_seq pair, seq_of_chunk, kind, index, then
        # the source
        aliases = {5 + len(per_seq) + 1 + 2: len(out_shape) - 1}
    return pl.pallas_call(
        functools.partial(kernel, n_chunks=nc, chunk=chunk, dot_dtype=dot_dtype, layout=layout),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        **({"input_output_aliases": aliases} if aliases else {}),  # (tests wrap pallas_call)
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(w, u, kd, dl, chunk_src, *operands)
