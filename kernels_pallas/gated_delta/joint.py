"""Several ragged passes over one batch's rows as one packed stream: one kernel call.

A hybrid span step runs the same chunked kernels over its rows several times (the flow, the local
pass, the transition pass: minipic_jax/models/qwen3_5_spans.py), each a ragged batch over some of
the step's rows with its own initial states. Laid side by side as one batch of all their
sequences they are one stream: one gather per input, one intra-chunk, scan and output kernel, and
the scan's programs (one per sequence: ragged_triton) run every pass's sequences side by side. Each
chunk computes what it computed in its own pass (the packing puts a sequence's rows at the same
offsets inside its chunks), so the results are those of the separate passes.

    passes = [Pass(cu, pos0, rows), Pass(cu2, zeros, rows2, zero_v=True), ...]
    jp = joint_packing(passes, n_source=T, chunk=64, max_chunks=...)   # once per step
    bounds, has = final_bounds(jp, finals)                             # once per step
    out, final, ckpt, _, _ = run_joint(q, k, v, g, beta, jp, table, chunk_state, bounds)
    pass p's row i -> out[jp["slot_of"][p][i]]; sequence j of pass p -> jp["seq_offset"][p] + j
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.gated_delta import dots, ragged
from kernels_pallas.gated_delta.checkpoint_rows import as_rows


class Cuts(NamedTuple):
    """Rows of a pass where a packing unit starts (besides its sequences' starts and breaks).

    rows: [K] int32 offsets in the pass's rows (outside its rows: none); borrow: [K] int32, -1: a
    grid cut (the rows from it start a chunk at their own position's offset, as a break), j >= 0:
    the rows from it to the next cut are joint sequence j's, packed as j packs them (from a
    chunk's first slot), and the scan reads j's chunks there instead of its own (`joint_packing`:
    borrowed chunks)."""
    rows: jax.Array
    borrow: jax.Array


class Pass(NamedTuple):
    """One ragged pass over some rows of a source stream.

    cu: [n + 1] int32 offsets of its n sequences in its own rows (cu[0] = 0); pos0: [n] int32 each
    sequence's first position (chunk boundaries fall on multiples of the chunk of it); rows: [R]
    int32 the source row of each of its rows (R static; rows past cu[-1] are unused); zero_v:
    its rows read v = 0 (a transition pass: the state then carries the maps' product); breaks:
    None or [n] int32, its sequences' breaks (ragged.packing's); cuts: None or `Cuts`; skip: None
    or [n] bool, sequences packed as if they had no rows (ragged.packing's skip)."""
    cu: jax.Array
    pos0: jax.Array
    rows: jax.Array
    zero_v: bool = False
    breaks: jax.Array | None = None
    cuts: Cuts | None = None
    skip: jax.Array | None = None


def _units(p: Pass, chunk: int):
    """A pass's packing units in row order: (start [U] in its rows, shift [U] (the no-op slots
    before a unit's first row in its first chunk), seq [U] its sequence, borrow [U] (`Cuts`)).
    Every sequence starts a unit (an empty one's is empty); so do its break and its cuts; a
    borrowing cut sorts after a grid one at the same row (the earlier one is then empty)."""
    n = p.pos0.shape[0]
    cu, pos0 = jnp.asarray(p.cu, jnp.int32), jnp.asarray(p.pos0, jnp.int32)
    count = cu[-1]
    seqs = jnp.arange(n, dtype=jnp.int32)
    if p.breaks is None and p.cuts is None:  # its sequences, in order (no sort: fewer ops)
        return cu[:-1], pos0 % chunk, seqs, jnp.full(n, -1, jnp.int32)
    start, seq, borrow = [cu[:-1]], [seqs], [jnp.full(n, -1, jnp.int32)]
    if p.breaks is not None:
        b = jnp.asarray(p.breaks, jnp.int32)
        inside = (b > 0) & (b < cu[1:] - cu[:-1])
        start.append(jnp.where(inside, cu[:-1] + b, count))
        seq.append(seqs)
        borrow.append(jnp.full(n, -1, jnp.int32))
    if p.cuts is not None:
        r = jnp.asarray(p.cuts.rows, jnp.int32)
        r = jnp.where((r >= 0) & (r < count), r, count)
        start.append(r)
        seq.append(jnp.clip(jnp.searchsorted(cu, r, side="right", method="compare_all") - 1,
                            0, n - 1).astype(jnp.int32))
        borrow.append(jnp.where(r < count, jnp.asarray(p.cuts.borrow, jnp.int32), -1))
    start, seq, borrow = (jnp.concatenate(x) for x in (start, seq, borrow))
    order = jnp.argsort(start * 2 + (borrow >= 0), stable=True)
    start, seq, borrow = start[order], seq[order], borrow[order]
    shift = jnp.where(borrow >= 0, 0, (pos0[seq] + start - cu[seq]) % chunk)
    return start, shift, seq, borrow


def joint_packing(passes, n_source: int, *, chunk: int = 64, max_chunks: int | None = None,
                  max_breaks: int = 0, borrow: bool = True):
    """The packing of all passes' sequences back to back (ragged.packing's fields for
    run_stream: src, src_v, restart, seq_of_chunk, first, n_ch, lens, n_used, chunk), plus
    seq_offset (static: pass p's sequence j is sequence seq_offset[p] + j), slot_of (per pass
    [R]: the packed slot of each of its rows; out of range where unused), units (`_units`' in
    joint rows, with their chunks: `checkpoint_bounds`) and row0 (each sequence's first joint
    row).
    Each sequence is packed as its units back to back, each from a fresh chunk. With `borrow`
    and a borrowing cut, chunk_src [NC] is each chunk's source chunk: a borrowing unit's chunks
    read the chunks of the sequence it names (the same rows packed the same way: the same W,
    U, KD), so the intra, output and pack kernels skip them and the scan reads those instead
    (its state still runs through them: a flow over rows a span piece already has); else None.
    max_chunks: a static bound on the packed chunks the caller promises (ragged.packing's);
    max_breaks: the sequences with a break at most (each may add a chunk)."""
    counts = [jnp.asarray(p.cu[-1], jnp.int32) for p in passes]
    offs = [jnp.int32(0)]
    for c in counts[:-1]:
        offs.append(offs[-1] + c)
    total = offs[-1] + counts[-1]
    n_virtual = sum(int(p.rows.shape[0]) for p in passes)
    cu = jnp.concatenate([p.cu[:-1] + o for p, o in zip(passes, offs)]
                         + [total[None]]).astype(jnp.int32)
    seqs = sum(int(p.pos0.shape[0]) for p in passes)
    n_cuts = sum(int(p.cuts.rows.shape[0]) for p in passes if p.cuts is not None)
    # a cut starts a unit: up to two chunks more (max_chunks: the caller's tighter bound)
    n_chunks = ragged.packed_chunks(n_virtual, seqs, chunk) + max_breaks + 2 * n_cuts
    if max_chunks is not None:
        n_chunks = max(1, min(n_chunks, int(max_chunks)))
    starts, shifts, useq, borrows, seq_offset, first_seq = [], [], [], [], [], 0
    for p, o in zip(passes, offs):
        start, shift, seq, b = _units(p, chunk)
        starts.append(start + o)
        shifts.append(shift)
        useq.append(seq + first_seq)
        borrows.append(b)
        seq_offset.append(first_seq)
        first_seq += int(p.pos0.shape[0])
    ustart, useq, uborrow = (jnp.concatenate(x) for x in (starts, useq, borrows))
    skip = None  # per joint sequence
    if any(p.skip is not None for p in passes):
        skip = jnp.concatenate([jnp.zeros(p.pos0.shape[0], bool) if p.skip is None else p.skip
                                for p in passes])
    pk = ragged.chunk_layout(jnp.concatenate([ustart, total[None]]), jnp.concatenate(shifts),
                             n_virtual, chunk, n_chunks, skip=None if skip is None else skip[useq])
    chunk_ids = jnp.arange(n_chunks, dtype=jnp.int32)
    unit_of_chunk = pk["seq_of_chunk"]
    if all(p.breaks is None and p.cuts is None for p in passes):  # units are the sequences
        first, n_ch, seq_of_chunk, restart = (pk[k] for k in ("first", "n_ch", "seq_of_chunk",
                                                              "restart"))
    else:
        first = jnp.full(seqs, n_chunks, jnp.int32).at[useq].min(pk["first"])
        n_ch = jnp.zeros(seqs, jnp.int32).at[useq].add(pk["n_ch"])
        seq_of_chunk = useq[unit_of_chunk]
        restart = (chunk_ids == first[seq_of_chunk]) & (n_ch[seq_of_chunk] > 0)
    chunk_src = None
    if borrow and any(p.cuts is not None for p in passes):
        lender = jnp.maximum(uborrow, 0)  # (a lender of other chunks than the unit's: none)
        lend = (uborrow >= 0) & (pk["n_ch"] > 0) & (n_ch[lender] == pk["n_ch"])
        off = jnp.where(lend, first[lender] - pk["first"], 0)
        chunk_src = (chunk_ids + off[unit_of_chunk]).astype(jnp.int32)
    size = n_chunks * chunk
    vrow_src = jnp.full(n_virtual, n_source, jnp.int32)
    vrow_zero_v = jnp.zeros(n_virtual, bool)
    slot_of = []
    for p, o, c in zip(passes, offs, counts):
        i = jnp.arange(p.rows.shape[0], dtype=jnp.int32)
        at = jnp.where(i < c, o + i, n_virtual)  # this pass's rows in the joint rows
        vrow_src = vrow_src.at[at].set(jnp.asarray(p.rows, jnp.int32), mode="drop")
        vrow_zero_v = vrow_zero_v.at[at].set(p.zero_v, mode="drop")
        slot_of.append(pk["dest"].at[at].get(mode="fill", fill_value=size))
    src = jnp.full(size, n_source, jnp.int32).at[pk["dest"]].set(vrow_src, mode="drop")
    src_v = jnp.full(size, n_source, jnp.int32).at[pk["dest"]].set(
        jnp.where(vrow_zero_v, n_source, vrow_src), mode="drop")
    units = dict(start=ustart, lens=pk["lens"], shift=pk["shift"], first=pk["first"])
    lens = cu[1:] - cu[:-1] if skip is None else jnp.where(skip, 0, cu[1:] - cu[:-1])
    return dict(src=src, src_v=src_v, restart=restart, seq_of_chunk=seq_of_chunk,
                n_used=jnp.sum(n_ch), chunk=chunk, seq_offset=tuple(seq_offset),
                slot_of=slot_of, lens=lens, first=first, n_ch=n_ch, units=units,
                row0=cu[:-1], chunk_src=chunk_src)


def checkpoint_bounds(rows, pos0, jp, n_chunks: int):
    """(use [K], boundary index [K]) of each checkpoint row (checkpoint_rows.CheckpointRows of
    joint sequences with first positions pos0), as ragged.checkpoint_bounds over the units: a
    checkpoint is exact on its unit's chunk grid and at a unit's end (a cut, a break, the
    sequence's end: the no-op slots after a unit's last row pass the state through)."""
    seq, at = rows
    u = jp["units"]
    chunk = jp["chunk"]
    start = jnp.asarray(pos0, jnp.int32)[seq]
    ck_use = (at >= 0) & (at > start) & (jp["lens"][seq] > 0)
    # the state after the rows before it (one past the sequence's rows: its end)
    row = jp["row0"][seq] + jnp.minimum(at - start, jp["lens"][seq])
    k = jnp.clip(jnp.searchsorted(u["start"], row, side="left", method="compare_all") - 1,
                 0, u["start"].shape[0] - 1)  # the last unit starting before it
    rel = row - u["start"][k] + u["shift"][k]
    at_end = row == u["start"][k] + u["lens"][k]
    chunks = jnp.where(at_end, -(-rel // chunk), rel // chunk)
    return ck_use, jnp.clip(jnp.where(ck_use, u["first"][k] + chunks, 0), 0, n_chunks)


def final_bounds(jp, finals):
    """(boundary [F] of the state after the last chunk of joint sequences `finals` [F], has
    rows [F] bool): metadata, once per step (`run_joint` reads the bounds)."""
    return jp["first"][finals] + jp["n_ch"][finals], jp["lens"][finals] > 0


def run_joint(q, k, v, g, beta, jp, table, chunk_state, fin_bounds, *, checkpoint_at=None,
              pos0=None, scale=None, chunk=64, implementation="xla", interpret=False,
              first_states=None, transitions=None):
    """The joint stream's kernels. table [N, Hv, Dk, Dv] float32 or a StateRows: the initial
    states (first_states: the first pass's alone, where cheaper to read: its checkpoints';
    chunk_state [NC] the table row each chunk's sequence starts from (several sequences may
    share one); fin_bounds [F] (`final_bounds`) the boundaries whose states to return;
    checkpoint_at: None or CheckpointRows of the first pass's sequences (their ids are the joint
    ones; the table's first rows are their states), with pos0 that pass's [S] first positions.
    Returns (out [NC * C, Hv, Dv] in the packed slots: a pass's rows are
    take_rows(out, jp["slot_of"][p]); the states at fin_bounds [F, Hv, Dk, Dv] float32, undefined
    where a sequence has no rows (`final_bounds`' has: the caller's initial state); checkpoints
    [K, ...] (ragged_prefill's) or None; with `transitions` (run_stream's: chunks of the
    stream's own sequences, whose maps' products the caller wants) their products
    [M, Hv, Dk, Dk] float32, else None; for a write_final table (StateRows.final_rows: the
    kernels only, ragged.finals_in_kernel) its first source with the finals written in place,
    else None)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    n_chunks = jp["src"].shape[0] // jp["chunk"]
    bounds = fin_bounds
    start = table if first_states is None else first_states
    ck_start = None
    if checkpoint_at is not None:
        ck_rows, ck_shape = as_rows(checkpoint_at)
        ck_use, ck_bound = checkpoint_bounds(ck_rows, pos0, jp, n_chunks)
        bounds = jnp.concatenate([bounds, ck_bound])
        if getattr(table, "write_final", False):  # read the starts before the kernel writes
            ck_start = ragged.start_rows(start, ck_rows.seq,
                                         (ck_rows.seq.shape[0],) + table.shape[1:])
            ck_start, src = jax.lax.optimization_barrier((ck_start, table.sources[0]))
            table = dataclasses.replace(table, sources=(src,) + table.sources[1:])
    with dots.exact_for(v.dtype):
        out, states, products, written = ragged.run_stream(
            q, k, v, g, beta, jp, table, chunk_state, bounds, scale=scale, chunk=chunk,
            implementation=implementation, interpret=interpret, transitions=transitions)
    n_fin = fin_bounds.shape[0]
    ckpt = None
    if checkpoint_at is not None:
        ckpt = ragged.rows_states(ck_use, states[n_fin:], start, ck_rows.seq, ck_shape,
                                  start=ck_start)
    return out, states[:n_fin], ckpt, products, written
