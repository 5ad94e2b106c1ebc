"""A ragged batch packed into chunks for the gated delta rule (ragged.py's index work, computed
once per step): each sequence starts a fresh chunk, shifted right by `pos0 % C` no-op slots so
chunk boundaries fall on multiples of C of its own positions; a checkpoint off that grid may
break a sequence's chunks there (`break_rows`); `checkpoint_bounds` names the packed boundary
each checkpoint row's state is at. ragged.py re-exports these names."""

from __future__ import annotations

import jax.numpy as jnp


def chunk_layout(cu_q_lens, pos0, n_tokens, chunk, n_chunks, breaks=None, skip=None):
    """Where each token and chunk goes. Returns dict of int32 arrays (see ragged_prefill).
    breaks: None, or [S] int32 each sequence's break (`packing`): rows from it start a chunk,
    shifted by their own position (`shift2`) after `pre` rows in `n1` chunks. skip: None, or
    [S] bool: those sequences are packed as if they had no rows (their rows get no slot)."""
    seqs = cu_q_lens.shape[0] - 1
    lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    if skip is not None:
        lens = jnp.where(skip, 0, lens)
    shift = jnp.where(lens > 0, pos0 % chunk, 0)  # [S]
    pre = lens if breaks is None else jnp.where(breaks > 0, jnp.minimum(breaks, lens), lens)
    n1 = (shift + pre + chunk - 1) // chunk  # [S] chunks before the break (all without one)
    shift2 = (pos0 + pre) % chunk
    n_ch = n1 + jnp.where(lens > pre, (shift2 + lens - pre + chunk - 1) // chunk, 0)
    first = jnp.cumsum(n_ch) - n_ch  # [S] first packed chunk of each sequence
    rows = jnp.arange(n_tokens, dtype=jnp.int32)
    # compare_all: one small fusion each (the default method is a while loop, kernels per level)
    seq_of_row = jnp.clip(jnp.searchsorted(cu_q_lens, rows, side="right",
                                           method="compare_all") - 1, 0, seqs - 1)
    valid = rows < cu_q_lens[-1]
    if skip is not None:
        valid &= ~skip[seq_of_row]
    i = rows - cu_q_lens[seq_of_row]
    dest = first[seq_of_row] * chunk + shift[seq_of_row] + i
    if breaks is not None:
        after = i >= pre[seq_of_row]
        dest = jnp.where(after, (first[seq_of_row] + n1[seq_of_row]) * chunk
                         + shift2[seq_of_row] + i - pre[seq_of_row], dest)
    dest = jnp.where(valid, dest, n_chunks * chunk)  # out of range -> dropped
    chunk_ids = jnp.arange(n_chunks, dtype=jnp.int32)
    seq_of_chunk = jnp.clip(jnp.searchsorted(first + n_ch, chunk_ids, side="right",
                                             method="compare_all"), 0, seqs - 1)
    restart = (chunk_ids == first[seq_of_chunk]) & (n_ch[seq_of_chunk] > 0)
    out = dict(lens=lens, shift=shift, n_ch=n_ch, first=first, dest=dest,
               seq_of_chunk=seq_of_chunk, restart=restart)
    if breaks is not None:
        out.update(pre=pre, n1=n1, shift2=shift2)
    return out


def packing(cu_q_lens, pos0, n_tokens: int, *, chunk: int = 64, aligned: bool = False,
            final_of=None, source_rows=None, n_source: int | None = None,
            max_chunks: int | None = None, breaks=None, max_breaks: int = 0, skip=None):
    """Everything ragged_prefill derives from the batch's metadata alone, for callers that run
    several layers over the same rows: compute it once per step and pass it as `packing`.

    cu_q_lens [S+1], pos0 [S], n_tokens, chunk, aligned, final_of: as ragged_prefill's.
    breaks: None, or [S] int32: sequence s's rows from breaks[s] (0 < breaks[s] < its rows;
      else none) start a new chunk at their own position's offset in it, as if a prefill had
      stopped there and the next one continued (the chunk before it ends in no-op slots), so a
      checkpoint there is exact though it is off the chunk grid (`break_rows`); at most
      `max_breaks` (static) sequences have one: each may add a chunk.
    source_rows: None, or [n_tokens] int32: batch row j is row source_rows[j] of a larger stream
      of n_source rows that the layer holds (a gather of rows folded into the packing: the layer
      passes the stream's [n_source] arrays, and the output comes back in the stream's rows,
      zeros where no batch row comes from).
    skip: None, or [S] bool: sequences packed as if they had no rows (a step that runs them
      another way: minipic_jax/models/qwen3_5.py's one-row sequences); their finals are the
      states they start from, their rows' outputs zeros.
    max_chunks: None, or a static bound on the packed chunks tighter than `packed_chunks`'s worst
      case, which the caller promises the batch fits (the XLA gathers fill the whole packed
      stream, so its size is work; tokens past it are lost: callers check on the host).
    Returns a dict of int32 / bool arrays: src [NC*C] (the row each packed slot reads; out of
    range: a no-op slot), dest [n_source] (the slot each row's output is in; out of range: none),
    restart, seq_of_chunk [NC], fin, final_bound, has_final [K or S], n_used (scalar), lens,
    shift, first (checkpoints), n_ch [S] (each sequence's packed chunks: first .. + n_ch, so the
    kernel's scan runs the sequences side by side); and the static own_final, chunk. A caller
    that maps seq_of_chunk to other state0 rows may add the static empty_final_first: finals of
    empty sequences are then state0[0] (ragged_prefill gathers no [K] initial states for them).
    """
    cu_q_lens, pos0 = jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray(pos0, jnp.int32)
    seqs = cu_q_lens.shape[0] - 1
    n_chunks = packed_chunks(n_tokens, seqs, chunk, aligned) + max_breaks
    if max_chunks is not None:
        n_chunks = max(1, min(n_chunks, int(max_chunks)))
    pk = chunk_layout(cu_q_lens, pos0, n_tokens, chunk, n_chunks, breaks, skip)
    size = n_chunks * chunk
    rows = jnp.arange(n_tokens, dtype=jnp.int32)
    if source_rows is None:
        dest, n_source = pk["dest"], n_tokens
    else:  # the batch's rows in the stream's: rows no batch row reads get no slot
        stream_row = jnp.where(pk["dest"] < size, source_rows, n_source)
        dest = jnp.full(n_source, size, jnp.int32).at[stream_row].set(pk["dest"], mode="drop")
        rows = jnp.asarray(source_rows, jnp.int32)
    src = jnp.full(size, n_source, jnp.int32).at[pk["dest"]].set(rows, mode="drop")
    fin = jnp.arange(seqs, dtype=jnp.int32) if final_of is None else jnp.clip(
        jnp.asarray(final_of, jnp.int32), 0, seqs - 1)
    final_bound, has = pk["first"] + pk["n_ch"], pk["lens"] > 0
    if final_of is not None:
        final_bound, has = final_bound[fin], has[fin]
    return dict(src=src, dest=dest, restart=pk["restart"], seq_of_chunk=pk["seq_of_chunk"],
                fin=fin, final_bound=final_bound, has_final=has, n_used=jnp.sum(pk["n_ch"]),
                own_final=final_of is None, chunk=chunk, **layout_fields(pk))


def layout_fields(pk) -> dict:
    """The chunk layout's per-sequence fields that checkpoint_bounds reads."""
    keys = ("lens", "shift", "first", "n_ch", "pre", "n1", "shift2")
    return {k: pk[k] for k in keys if k in pk}


def break_rows(rows, pos0, lens, chunk: int, max_breaks: int | None = None):
    """[S] each sequence's break (`packing`): the row of its first checkpoint off the chunk grid
    strictly inside its rows (rows: as_rows' CheckpointRows; lens [S] the rows), else its row
    count (none).
    The host lets a chunk run past one such checkpoint per sequence only (the scheduler's
    chunk_stop), in at most `packing`'s max_breaks sequences; `max_breaks` keeps the first that
    many here too (the packed stream's static size holds no more: one past them would lose
    rows, where a missing break costs that checkpoint its exactness only)."""
    seq, at = rows
    lens = jnp.asarray(lens, jnp.int32)
    rel = at - jnp.asarray(pos0, jnp.int32)[seq]
    inside = (at >= 0) & (at % chunk != 0) & (rel > 0) & (rel < lens[seq])
    brk = lens.at[seq].min(jnp.where(inside, rel, lens[seq]), mode="drop")
    if max_breaks is None:
        return brk
    has = brk < lens
    return jnp.where(has & (jnp.cumsum(has) <= max_breaks), brk, lens)


def packed_chunks(n_tokens: int, seqs: int, chunk: int, aligned: bool = False) -> int:
    """Static bound on the packed chunks of a ragged batch (module doc)."""
    if aligned:  # sum ceil(len / C) <= (sum len + S (C - 1)) / C
        return max(1, (n_tokens + seqs * (chunk - 1)) // chunk)
    return -(-n_tokens // chunk) + 2 * seqs


def checkpoint_bounds(rows, pos0, pk, chunk: int, n_chunks: int):
    """(use [K], boundary index [K]: the state after packed chunk bound - 1) of each checkpoint
    row (checkpoint_rows.CheckpointRows). On the chunk grid the index is exact; off it only a
    sequence's start (the state it starts from, state0) and its end (rounded up: the no-op slots
    after its last row pass the state through) are states of the sequence."""
    seq, at = rows
    start = jnp.asarray(pos0, jnp.int32)[seq]
    lens = pk["lens"][seq]
    ck_rel = at - start + pk["shift"][seq]
    # at or before the start: state0 (as at an unused checkpoint)
    ck_use = (at >= 0) & (at > start) & (lens > 0)
    at_end = at == start + lens
    chunks = jnp.where(at_end, -(-ck_rel // chunk), ck_rel // chunk)
    if "pre" in pk:  # a break: exact at it (its chunks' end) and on the grid after it
        pre, rel = pk["pre"][seq], at - start
        chunks = jnp.where(rel == pre, -(-ck_rel // chunk), chunks)
        rel2 = rel - pre + pk["shift2"][seq]
        after = pk["n1"][seq] + jnp.where(at_end, -(-rel2 // chunk), rel2 // chunk)
        chunks = jnp.where(rel > pre, after, chunks)
    ck_bound = jnp.clip(jnp.where(ck_use, pk["first"][seq] + chunks, 0), 0, n_chunks)
    return ck_use, ck_bound
