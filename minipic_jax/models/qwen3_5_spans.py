"""SSEP spans inside a Qwen3.5 ragged step: the Gated DeltaNet side (docs/DESIGN.md section 5).

Attention layers need nothing new (their SSEP window is metadata.q_window_start). A GDN layer runs
two passes over the step's rows when spans are present:
  * the *flow* pass: each sequence's rows in order from its state (as without spans); every row
    feeds the recurrence the delta inputs it computed in its own context, so PDEP rows read the
    flow, and the state the sequence carries on is the flow;
  * the *local* pass: the step's rows cut into pieces (maximal runs of one segment of one
    sequence), each from a zero state and a zero conv window; span rows read their outputs here.
A span row's conv window is its piece's (zeros before the span start), a PDEP row's the flow's.
A span whose tokens are in the step is computed (its KV and its delta inputs); with
`pieces.capture` the step also returns the captured pieces' span maps (`captured_maps`: A, B, conv
tail), which the engine caches and later composes instead of computing the span again (the warm
path: serving/hybrid/span_cache.py, serving/hybrid/span_maps.py).

A sequence whose final segment is a span that starts in the step carries the span's local state
on (`carry_local`), so its generated tokens extend the span. A non-final span longer than a step
is computed in pieces over several steps (serving/hybrid/span_partial.py): each piece is a
captured one, and a piece that continues the span enters with the map captured so far
(`pieces.entry`): its local pass starts from that map's B, its conv window reads that map's tail
before the piece's first row, and its captured map composes with it (A_piece A_so_far; count
and tail run on), so the last piece leaves the whole span's map. Pieces otherwise start from zero.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.gated_delta.api import (maps_packing, ragged_maps, ragged_packing,
                                            ragged_prefill, take_rows)
from minipic_jax.models import qwen3_5_joint
from serving.model_contract import SpanPieces


def pieces_from_segments(seg_rows, num_rows: int, num_pieces: int, span_of_row, carry_local):
    """Host helper: SpanPieces from a segment id per real row (ids change where a piece ends;
    rows of different sequences must carry different ids), is-span per row and carry_local [S].

    seg_rows: [R] ints (R real rows); num_rows: T (rows padded to the bucket); num_pieces: the
    static bound G (>= pieces). Padding rows form no piece.
    """
    seg_rows = np.asarray(seg_rows)
    starts = np.flatnonzero(np.r_[True, seg_rows[1:] != seg_rows[:-1]]) if len(seg_rows) else []
    if len(starts) > num_pieces:
        raise ValueError(f"SpanPieces: {len(starts)} pieces exceed the bound {num_pieces}")
    cu = np.full(num_pieces + 1, len(seg_rows), np.int32)
    cu[:len(starts)] = starts
    row_span = np.zeros(num_rows, bool)
    row_span[:len(seg_rows)] = np.asarray(span_of_row, bool)
    return SpanPieces(row_span=jnp.asarray(row_span), piece_cu=jnp.asarray(cu),
                      carry_local=jnp.asarray(carry_local, bool))


def prepare(pieces: SpanPieces, cu_q_lens, n_rows: int, conv_kernel: int, chunk: int = 64,
            pos0=None, breaks=None, one_row=None):
    """Everything the GDN layers' span work derives from the step's metadata alone, computed once
    per step (forward_with_checkpoints) and read by every layer, so a layer runs its data
    movement and kernels only (a GPU launches each small op of each layer). Returns a dict:
    row_span [T]; conv_rows [T, Kc] (the rows of each row's conv window inside its piece, oldest
    first, the row itself last; out of range: zeros); packings (the local pass's: `_packings`);
    carry_rows [S, Kc-1], carry_use [S] (`carry_local`); with pieces.capture cap_rows
    [Mc, Kc-1], cap_count [Mc] (`captured_maps`); with pieces.entry also entry_use [Mc] and
    entry (`for_layer` picks each layer's maps), window rows before a continuing piece pointing
    at its entry tail in the `stream`, and the plain packing's initial states per piece.
    pos0: None, or the step's [S] first positions: the layer's passes then run as one stream
    (qwen3_5_joint: "joint" in place of "packings"), the flow's sequences with their `breaks`
    (None or [S]: ragged.packing's) and one_row (None or [S]: qwen3_5_joint.plan's)."""
    g = pieces.piece_cu.shape[0] - 1
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    # compare_all: one [T, G + 1] fusion (the default method loops, a few kernels per level)
    piece_of_row = jnp.clip(jnp.searchsorted(pieces.piece_cu, rows, side="right",
                                             method="compare_all") - 1, 0, g - 1)
    start = pieces.piece_cu[piece_of_row]
    fin = final_pieces(pieces, cu_q_lens, n_rows)
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    piece_len = pieces.piece_cu[1:] - pieces.piece_cu[:-1]
    carry = fin[:lens.shape[0]]
    k1 = conv_kernel - 1
    cap, use, piece_entry, oor = _entries(pieces, g, n_rows, k1)
    row_base = None if piece_entry is None else _entry_base(piece_entry[piece_of_row], n_rows, k1)
    plan = dict(row_span=pieces.row_span,
                conv_rows=_window_rows(start, rows + 1, conv_kernel, oor, row_base, k1),
                carry_rows=_window_rows(pieces.piece_cu[carry], pieces.piece_cu[carry]
                                        + piece_len[carry], k1, oor),
                carry_use=pieces.carry_local & (lens > 0))
    if pos0 is None:
        plan["packings"] = _packings(pieces, fin, n_rows, chunk, piece_entry)
    else:
        plan["joint"] = qwen3_5_joint.plan(pieces, fin, cu_q_lens, pos0, n_rows, chunk,
                                           piece_entry, use, breaks, one_row)
    if cap is not None:
        plan["cap_count"] = piece_len[cap]
        cap_base = None
        if use is not None:
            plan["cap_count"] = plan["cap_count"] + jnp.where(use, pieces.entry["count"], 0)
            cap_base = _entry_base(jnp.where(use, jnp.arange(use.shape[0]), -1), n_rows, k1)
            plan.update(entry_use=use, entry=pieces.entry)
        plan["cap_rows"] = _window_rows(pieces.piece_cu[cap], pieces.piece_cu[cap + 1], k1, oor,
                                        cap_base, k1)
    return plan


def _entries(pieces: SpanPieces, g: int, n_rows: int, k1: int):
    """(captured pieces [Mc] or None, entry use [Mc] or None, the entry each piece continues
    [G] (-1: none) or None, the out-of-range row of windows). With entries, windows read a stream
    of the step's rows then each capture's entry tail (K1 rows each): `stream`."""
    if pieces.capture is None:
        return None, None, None, n_rows
    cap = jnp.clip(pieces.capture, 0, g - 1)
    if pieces.entry is None:
        return cap, None, None, n_rows
    mc = cap.shape[0]
    use = pieces.entry["use"] & (pieces.capture >= 0)
    piece_entry = jnp.full(g, -1, jnp.int32).at[jnp.where(use, cap, g)].set(
        jnp.arange(mc, dtype=jnp.int32), mode="drop")
    return cap, use, piece_entry, n_rows + mc * k1


def _entry_base(entry, n_rows: int, k1: int):
    """The stream row of entry tail row 0 for each entry index (-1: none, stays -1)."""
    return jnp.where(entry >= 0, n_rows + entry * k1, -1)


def state_rows(conv, dtype):
    """Conv states [N, C, K1] as rows [N * K1, C] in `dtype` (each state's inputs oldest first):
    what a conv window gathers from besides the step's inputs."""
    return jnp.swapaxes(conv, -1, -2).reshape(-1, conv.shape[1]).astype(dtype)


def stream(mixed, plan):
    """The rows windows read (`prepare`): the step's layer inputs, then with entries each
    capture's entry tail (its last K1 inputs so far, oldest first) for this layer."""
    if "entry" not in plan:
        return mixed
    tail = plan["entry_tail"]  # [Mc, C, K1] this layer's (for_layer)
    return jnp.concatenate([mixed, state_rows(tail, mixed.dtype)], axis=0)


def for_layer(plan, layer: int):
    """The step's plan with GDN layer `layer`'s entry maps (b, a, tail) picked out."""
    if plan is None or "entry" not in plan:
        return plan
    e = plan["entry"]
    pick = lambda x: x[e["slot"], layer]  # noqa: E731 ([Mc, ...]: one gather per layer)
    return dict(plan, entry_b=pick(e["b"]), entry_a=pick(e["a"]), entry_tail=pick(e["tail"]),
                layer=layer)


def _window_rows(start, end, width: int, oor: int, entry_base=None, k1: int = 0):
    """[..., width] the rows end - width .. end - 1 (oldest first); those before `start`: oor
    (out of range, read as zeros), or where `entry_base` >= 0 ([...]: a piece that continues a
    span) the entry tail's rows in the `stream` for the k1 rows before `start`."""
    rows = end[..., None] + jnp.arange(-width, 0, dtype=jnp.int32)
    before = oor
    if entry_base is not None:
        back = rows - start[..., None]  # -k1 .. -1 just before the piece: the entry tail
        base = entry_base[..., None]
        before = jnp.where((base >= 0) & (back >= -k1), base + k1 + back, oor)
    return jnp.where(rows >= start[..., None], rows, before).astype(jnp.int32)


def _window(mixed, rows):
    """[..., C, width] the inputs of rows [..., width] (zeros where out of range)."""
    return jnp.swapaxes(take_rows(mixed, rows), -1, -2)


def _packings(pieces: SpanPieces, fin, n_rows: int, chunk: int, piece_entry=None):
    """The local pass's packings (maps_packing with pieces.capture, else ragged_packing):
    only span rows run, gathered to the front (see local_pass), folded into the packing as
    source rows, so a layer packs its q, k, v, g, beta with one gather each."""
    # compact row j <- row src[j] (past the span rows: none read); cu: the pieces' span rows
    src, _, cu = qwen3_5_joint.span_compaction(pieces.row_span, pieces.piece_cu, n_rows)
    bound = pieces.local_chunks  # the host's promise (SpanPieces): the stream's size is work
    if pieces.capture is not None:
        plain, sel = maps_packing(cu, n_rows, pieces.capture, fin, chunk=chunk, source_rows=src,
                                  n_source=n_rows, max_chunks=bound)
        if piece_entry is not None:  # a piece's initial state: 0 zero, 1 + m capture m's entry B
            e = piece_entry[plain["seq_of_chunk"]]
            # an empty piece ends in the zero state 0 (a continuing piece is never empty), not
            # in a [S + Mc] gather of initial states by piece id (ids the states are not keyed by)
            plain = dict(plain, seq_of_chunk=jnp.where(e >= 0, 1 + e, 0).astype(jnp.int32),
                         empty_final_first=True)
        return plain, sel
    n = pieces.piece_cu.shape[0] - 1
    return ragged_packing(cu, jnp.zeros(n, jnp.int32), n_rows, chunk=chunk, aligned=True,
                          final_of=fin, source_rows=src, n_source=n_rows, max_chunks=bound)


def with_windows(plan, flow_index, n_seqs: int, k1: int):
    """plan with "window_rows" [T, Kc]: each row's conv window, oldest first, as rows of
    `window_source` (the stream, then the K1 conv-state rows of each sequence, then zeros): a
    span row's inside its piece (`local_window`'s), any other row's the flow's (the conv state
    before the step, then the step's rows: qwen3_5_gdn.read_history's `flow_index`). Metadata
    only (once per step), so a layer gathers one window per row and runs one conv, not both
    over every row."""
    rows, seq, col, from_x = flow_index
    n_rows = rows.shape[0]
    length = n_rows + (plan["entry_use"].shape[0] * k1 if "entry" in plan else 0)
    zero = length + n_seqs * k1  # out of range: a zero row
    flow = jnp.concatenate([jnp.where(from_x, rows, length + seq * k1 + col),
                            jnp.arange(n_rows, dtype=jnp.int32)[:, None]], axis=1)
    local = jnp.where(plan["conv_rows"] >= length, zero, plan["conv_rows"])
    return dict(plan, window_rows=jnp.where(plan["row_span"][:, None], local, flow).astype(
        jnp.int32))


def window_rows(mixed, conv0, plan):
    """Every row's conv window (`with_windows`) as its Kc inputs [T, C] (oldest first), for
    qwen3_5_gdn.conv_rows_silu: gathers from the step's layer inputs (and entry tails) and the
    conv states conv0 [S, C, K1]."""
    src = jnp.concatenate([stream(mixed, plan), state_rows(conv0, mixed.dtype)], axis=0)
    rows = plan["window_rows"]
    return [take_rows(src, rows[:, i]) for i in range(rows.shape[1])]


def local_window(mixed, plan):
    """[T, C, Kc] each row's conv window inside its piece (zeros before the piece start), for
    qwen3_5_gdn.conv_silu."""
    return _window(stream(mixed, plan), plan["conv_rows"])


def final_pieces(pieces: SpanPieces, cu_q_lens, n_rows: int):
    """The pieces whose final local state a step reads: [S] the piece of each sequence's last
    row (carry_local), then [Mc] the captured pieces (captured_maps), if any."""
    g = pieces.piece_cu.shape[0] - 1
    last_row = jnp.clip(cu_q_lens[1:] - 1, 0, n_rows - 1)
    last = jnp.clip(jnp.searchsorted(pieces.piece_cu, last_row, side="right",
                                     method="compare_all") - 1, 0, g - 1).astype(jnp.int32)
    if pieces.capture is None:
        return last
    return jnp.concatenate([last, jnp.clip(pieces.capture, 0, g - 1).astype(jnp.int32)])


def local_pass(q, k, v, g, beta, pieces: SpanPieces, cu_q_lens, **kw):
    """Core outputs [T, Hv, Dv] of the span rows inside their piece from a zero state (other
    rows: zeros), the final states of `final_pieces` [S (+ Mc), Hv, Dk, Dv], and with
    `pieces.capture` each captured piece's transition [Mc, Hv, Dk, Dk] (else None).

    Only span rows run: they are gathered to the front (a piece is its span's rows, then rows
    of other segments riding in it, whose local outputs nobody reads; a final state read is a
    piece's that ends on a span row or a captured span's, which has no riders), so the pass
    costs the step's span rows, not all its rows. Then the chunked ragged prefill (one compiled
    branch, whatever the piece lengths; pieces start at zero, so the packed stream is sized for
    aligned starts, and only the states read are written); with `pieces.capture`
    ragged_maps, a second pass of the same kernels over the captured pieces' rows only,
    so a capturing step compiles no other recurrent path than a plain span step.
    (A layer runs `run_local` on the packings `prepare` computed once per step.)"""
    n_rows = q.shape[0]
    packings = _packings(pieces, final_pieces(pieces, cu_q_lens, n_rows), n_rows,
                         kw.get("chunk", 64))
    return run_local(q, k, v, g, beta, packings, **kw)


def run_local(q, k, v, g, beta, packings, plan=None, **kw):
    """local_pass on its packings (`prepare(...)["packings"]`: a pair with captures); with a
    plan holding entries (`for_layer`), continuing pieces start from their entry's B and their
    transitions compose with its A."""
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    x = (q, k, v, g, beta)
    if isinstance(packings, tuple):  # maps_packing: the captured pieces' maps too
        if plan is not None and "entry" in plan:
            use = plan["entry_use"]
            b0 = jnp.where(use[:, None, None, None], plan["entry_b"], 0.0)
            eye = jnp.eye(dk, dtype=jnp.float32)
            a0 = jnp.where(use[:, None, None, None], plan["entry_a"], eye)
            b0 = jnp.concatenate([jnp.zeros((1, hv, dk, dv), jnp.float32),
                                  b0.astype(jnp.float32)])
            return ragged_maps(*x, None, packings=packings, b0=b0, a0=a0, **kw)
        return ragged_maps(*x, None, packings=packings, **kw)
    out, final, _ = ragged_prefill(*x, None, None, jnp.zeros((1, hv, dk, dv), jnp.float32),
                                   packing=packings, **kw)
    return out, final, None


def captured_maps(mixed, plan, a_span, local_final):
    """The span maps of the captured pieces (serving/hybrid/span_maps.py's layout): a [Mc, Hv, Dk, Dk],
    b [Mc, Hv, Dk, Dv] (the piece's state from zero), tail [Mc, C, K1] (its last K1 layer
    inputs, right-aligned, zeros before), count [Mc] int32 (its rows). a_span and local_final
    come from local_pass ([Mc] transitions; final states [S + Mc], the captured ones last)."""
    mc = plan["cap_count"].shape[0]
    return dict(a=a_span, b=local_final[local_final.shape[0] - mc:],
                tail=_window(stream(mixed, plan), plan["cap_rows"]), count=plan["cap_count"])


def carry_local(mixed, plan, local_final, conv, delta, written: bool = False):
    """The states a sequence carries on: for carry_local ones, the local conv window and delta
    state at the end of its last piece (local_final[:S]: local_pass's final_pieces order); else
    the flow's `conv` [S, C, K1], `delta`. `written`: delta is the state cache with every final
    written already (qwen3_5_joint.FINALS_IN_PLACE), returned as it is."""
    use = plan["carry_use"]
    local_conv_end = _window(mixed, plan["carry_rows"]).astype(conv.dtype)
    conv = jnp.where(use[:, None, None], local_conv_end, conv)
    if written:
        return conv, delta
    return conv, jnp.where(use[:, None, None, None], local_final[:use.shape[0]], delta)
