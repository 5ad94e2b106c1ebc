"""The ragged gated delta rule's state scan kernels (ragged_triton.py calls `state_scan`).

Per-sequence form, grid (Hv, Dv / BV, S): each program walks the packed chunks of one sequence
only (`seq_first[s]` .. + `seq_chunks[s]`), from its initial state, so the sequences of a step run
side by side and the dependent chain is the longest sequence's chunks, not the whole stream's.
At chunk c (reading chunk src[c]'s W, U, KD and decay: a borrowed chunk's lender, joint.py)
    state entering c -> states[c] (for the output kernel); V' = U - W s; s = dl s + KD^T V'
    state leaving c -> fp32 slot `slot[c + 1]` if asked (finals, checkpoints)
Each chunk's arithmetic is that of the serial form (one program walks every packed chunk and
restarts from a sequence's initial state at its first chunk), so both give the same bits. A
boundary no sequence's chunks end at (one before any chunk, an empty sequence's) is left
unwritten: ragged.py reads the initial state there instead. The state layout ("kv" [Dk, BV] or
"vk" [BV, Dk]) and the other options follow fused_triton.DEFAULTS (see scan_fused.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta import scan_fused, state_rows
from kernels_pallas.gated_delta.state_rows import StateRows


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
                     final_rows=False):
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
    _scan_sequence(
        pl.program_id(2), j=j, refs=(w_ref, u_ref, kd_ref, dl_ref, src_ref, first_ref, count_ref,
                                   seq_ref),
        srcs=(kind_ref, index_ref, src_refs) if n_sources else s0_ref, finals=(
            final_ref, dest_ref, from_first_ref, from_count_ref) if write_final else None,
        outs=(slot_ref, vnew_ref, states_ref, bound_ref), n_chunks=n_chunks, chunk=chunk,
        dot_dtype=dot_dtype, layout=layout, n_sources=n_sources, block_v=block_v,
        final_rows=final_rows)


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


def scan_states(state0, rows_in_place: bool, vk: bool):
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


def _initial_states(s0, blk, s_idx, dk: int, block_v: int):
    """(in_specs, operands) of the per-sequence scan's initial states: a StateRows' kind, index
    and each source's (head, value block) of every row, read in place; else the table's
    (head, value block) tiles."""
    whole = lambda n: pl.BlockSpec((n,), lambda h, j, *_: (0,))  # noqa: E731
    if isinstance(s0, StateRows):
        return ([whole(s0.kind.shape[0]), whole(s0.kind.shape[0])]
                + [state_rows.source_spec(src, s0.layer_of(i), dk, block_v)
                   for i, src in enumerate(s0.sources)], (s0.kind, s0.index, *s0.sources))
    return ([pl.BlockSpec((s0.shape[0], None, *blk), lambda h, j, *_: (0, h, *s_idx(j)))],
            (s0,))


def state_scan(w, u, kd, dl, restart, seq_of_chunk, s0, slot_map, used, per_seq, *, n_b, chunk,
                dot_dtype, layout, block_v, num_warps, num_stages, interpret, chunk_src=None):
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
    grid = (hv, dv // block_v) + (() if per_seq is None else (per_seq[0].shape[0],))
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
        states_in, state_ops = _initial_states(s0, blk, s_idx, dk, block_v)
        if rows_in:  # kind, index, then each source's (head, value block) of every row
            n_sources = len(s0.sources)
            bound_blk, bound_st, bound_idx = (dk, block_v), (dk, dv), (lambda j: (0, j))
        write_final = rows_in and s0.write_final
        dests = write_final and s0.final_rows is not None
        if dests and s0.final_rows.shape[0] != n_seq:
            raise ValueError(f"gated_delta scan: final_rows needs one row per sequence, got "
                             f"{s0.final_rows.shape[0]} for {n_seq} sequences")
        if write_final and not dests and s0.kind.shape[0] != n_seq:
            raise ValueError(f"gated_delta scan: write_final needs one state row per sequence, "
                             f"got {s0.kind.shape[0]} rows for {n_seq} sequences")
        kernel = functools.partial(_seq_scan_kernel, n_sources=n_sources, block_v=block_v,
                                   write_final=write_final, final_rows=dests)
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
