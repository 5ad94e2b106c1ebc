"""A span step's GDN passes in one kernel call (kernels_pallas/gated_delta/joint.py).

qwen3_5_spans runs up to three ragged passes per GDN layer over a span step's rows: the flow
(every row from its sequence's state), the local pass (span rows per piece from zero, or from a
long span's entry map) and, in a capturing step, the transition pass (captured pieces' rows,
v = 0, from I or the entry's A). Each costs a gather per input and three kernels. Here they are
one stream of S + G + Mc sequences: their initial states are rows of one table
[delta0 (S) | zero | I | entry B (Mc) | entry A (Mc)], and the step's metadata (the packing, each
sequence's state row, each row's output slot) is computed once per step (`plan`), so a layer
gathers its inputs once and launches three kernels. Same results as the separate passes (each
chunk computes what it computed in its pass; tests/test_span_joint_pass.py).

Used where the passes can share a stream: Dk = Dv (a transition's A is a state-sized row), no
tensor-parallel mesh (the flow's shard_map recomputes its packing per shard) and a prefill step.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels_pallas.gated_delta.api import (EYE, ZERO, JointCuts, JointPass, StateRows,
                                            final_bounds,
                                            finals_in_kernel, joint_packing, packed_chunks,
                                            rows_of, run_joint, selected_rows, take_rows,
                                            written_finals)
from kernels_pallas.sharding import tp_mesh
from serving.model_contract import CHECKPOINT_BREAKS, SpanPieces

# False: every span step runs its passes separately (qwen3_5_spans.run_local): for A/B timing
# and as the form the joint stream must equal; read when a step is traced
ENABLED = True
# True: the transition pass is a pass of the stream (its rows gathered again, through the intra
# and output kernels, outputs dropped; its chunks in every warm step's static stream). False: a
# captured piece's map product is a second scan over the W / KD its local piece's chunks already
# have (transition_scan.py): no rows, intra or output work of its own, the same bits on CPU and
# within float32 summation order compiled. On since session 33 (H100, rag at 16 seats in one
# call: fcfs / pic_off zipf 0.771x -> 0.863x, multi 1.485x -> 1.552x; benchmarks/RESULTS.md).
# Read when a step is traced.
TRANSITIONS_IN_STREAM = False
# True: the scan kernel writes each flow sequence's final state into the layer's state cache in
# place (StateRows.final_rows), as a plain step's GDN_FINALS_IN_PLACE does: no [2 S] finals
# gathered, selected, carried and scattered back a GDN layer. A carry_local sequence's final
# (its last local piece's state) is computed again by the flow's own program from that piece's
# chunks (StateRows.final_from): written by the piece's program it raced the flow program's
# read of the slot (H100, session 33). The XLA path computes the same finals and scatters
# them. On since session 34 (H100, compiled tests pass; rag's warm/0 step 12.44 -> 11.69 ms,
# busy -0.54 ms: benchmarks/RESULTS.md); read when a step is traced.
FINALS_IN_PLACE = True
# True: a span step's flow packs each piece's span rows (a chunk of them at least) as the local
# piece packs them (from a chunk's first slot, a cut after them) and its scan reads the local
# piece's chunks there (kernels_pallas/gated_delta/joint.py: borrowed chunks), so the flow
# gathers, solves and outputs nothing of its own over those rows (their outputs were the local
# pass's anyway). The flow's state over them is the same chunk recurrence on the piece's chunk
# grid: float32 summation order differs from the flow packed on its own grid (FLOW_BORROWS
# False); checkpoints stay exact (at a span's start and end: a cut; the engine asks for none
# inside a span). Session 35 (H100): captured pieces only, rag 1.534x / 0.864x -> 1.629x /
# 0.906x; every span piece with block_v 64, 1.650x / 0.937x; pieces of a chunk at least since
# (shorter ones added scan steps: CPU count, benchmarks/RESULTS.md). Read when a step is traced.
FLOW_BORROWS = True
# True (with qwen3_5.ONE_ROWS_IN_PLACE): the flow's one-row sequences (not span rows, no
# checkpoint, no carried local state) leave the stream and the decode kernel steps them after it,
# as a plain step's do (`plan`'s one_row). The same bits elsewhere; theirs within float32
# rounding (tests/test_one_rows_in_place.py). Off: compiled, its tests pass, but rag's capturing
# step got slower (H100, session 37: 9.89 -> 10.32 ms, 796 -> 905 kernels, busy +0.60 ms).
ONE_ROWS = False
# the span rows a piece needs for its flow rows to borrow (a chunk: a shorter run adds up to two
# chunk steps to the flow's scan for less than a chunk of intra-chunk and output work); tests
# set 1 to borrow every span run. Read when a step is traced (not a program switch: an int).
BORROW_MIN_ROWS = 64


def usable(cfg, decode) -> bool:
    """Whether a span step's GDN passes run as one stream (module doc)."""
    return (ENABLED and not decode and tp_mesh() is None
            and cfg.linear_key_head_dim == cfg.linear_value_head_dim)


def span_compaction(row_span, piece_cu, n_rows: int):
    """The span rows gathered to the front (the local pass runs them only): (compact [T]: local
    row j is the step's row compact[j], row_local [T]: each row's index among the span rows,
    cu_local [G + 1]: the pieces' offsets in the local rows)."""
    before = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(row_span.astype(jnp.int32))])
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    compact = jnp.zeros(n_rows, jnp.int32).at[jnp.where(row_span, before[:-1], n_rows)].set(
        rows, mode="drop")
    return compact, before[:-1], before[piece_cu].astype(jnp.int32)


def plan(pieces: SpanPieces, local_final_of, cu_q_lens, pos0, n_rows: int, chunk: int = 64,
         piece_entry=None, entry_use=None, breaks=None, one_row=None):
    """The joint stream's metadata, once per step: dict joint (joint_packing: flow, local,
    transition passes in that order), dest [T] (each row's output slot: a span row's in the
    local pass, any other's in the flow), chunk_state [NC] (the state table row each packed
    chunk starts from: `_state_rows`), fin_bounds, has [F] (`final_bounds` of the flow's
    sequences, then local_final_of's pieces, then the transitions), the static counts seqs (S),
    mc (Mc), n_local, and with_entries (the table holds the entries' B and A).
    local_final_of: [S (+ Mc)] the pieces whose final local state the step reads
    (qwen3_5_spans.final_pieces); piece_entry [G] (the capture each piece continues, -1: none)
    and entry_use [Mc], or None without entries (qwen3_5_spans._entries); breaks: None or the
    flow's [S] (ragged.packing's), at most CHECKPOINT_BREAKS of them; one_row: None or [S]
    bool, flow sequences packed as if they had no rows (qwen3_5.ONE_ROWS_IN_PLACE: the decode
    kernel steps them after the stream; their final rows are then left as they are)."""
    seqs, g = cu_q_lens.shape[0] - 1, pieces.piece_cu.shape[0] - 1
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    compact, row_local, cu_local = span_compaction(pieces.row_span, pieces.piece_cu, n_rows)
    local_chunks = pieces.local_chunks or packed_chunks(n_rows, g, chunk, aligned=True)
    mc = 0 if pieces.capture is None else pieces.capture.shape[0]
    cuts = _borrowing_cuts(pieces, cu_local, seqs, n_rows) if FLOW_BORROWS else None
    passes = [JointPass(cu_q_lens, pos0, rows, breaks=breaks, cuts=cuts, skip=one_row),
              JointPass(cu_local, jnp.zeros(g, jnp.int32), compact)]
    n_breaks = CHECKPOINT_BREAKS * (breaks is not None)
    # a borrowed piece adds two chunks at most (its own, from a chunk's first slot, and the cell
    # its neighbours on the flow's grid then both hold), has a local chunk and BORROW_MIN_ROWS
    bound = packed_chunks(n_rows, seqs, chunk) + n_breaks + local_chunks + (
        2 * min(g, local_chunks, n_rows // max(1, BORROW_MIN_ROWS)) if cuts else 0)
    in_stream = TRANSITIONS_IN_STREAM
    if mc:
        if in_stream:
            sel, cu_sel = selected_rows(cu_local, pieces.capture, n_rows)
            passes.append(JointPass(cu_sel, jnp.zeros(mc, jnp.int32), compact[sel],
                                    zero_v=True))
            bound += min(local_chunks, packed_chunks(n_rows, mc, chunk, aligned=True))
    jp = joint_packing(passes, n_rows, chunk=chunk, max_chunks=bound, max_breaks=n_breaks)
    flow_slot, local_slot = jp["slot_of"][0], jp["slot_of"][1]
    dest = jnp.where(pieces.row_span, local_slot.at[row_local].get(mode="fill", fill_value=0),
                     flow_slot)
    state_row = _state_rows(seqs, g, mc, piece_entry, entry_use)
    finals = jnp.concatenate([jnp.arange(seqs, dtype=jnp.int32),
                              jp["seq_offset"][1] + local_final_of]
                             + ([jp["seq_offset"][2] + jnp.arange(mc, dtype=jnp.int32)]
                                if mc and in_stream else []))
    out = dict(joint=jp, dest=dest, seqs=seqs, mc=mc, n_local=local_final_of.shape[0],
               with_entries=entry_use is not None, trans_in_stream=in_stream,
               finals_in_place=FINALS_IN_PLACE)
    if mc and not in_stream:  # each capture's product over its local piece's chunks
        piece = jp["seq_offset"][1] + jnp.clip(pieces.capture, 0, g - 1)
        out.update(trans_first=jp["first"][piece],
                   trans_count=jnp.where(pieces.capture >= 0, jp["n_ch"][piece], 0))
    out["fin_bounds"], out["has"] = final_bounds(jp, finals)
    out["chunk_state"] = state_row[jp["seq_of_chunk"]]
    if FINALS_IN_PLACE:  # what the table's final_rows / final_from need (`_table`)
        out["state_row"], out["nonempty"] = state_row[:jp["lens"].shape[0]], jp["lens"] > 0
        out["carry_first"], out["carry_count"] = _carried_chunks(pieces, cu_q_lens, jp,
                                                                 local_final_of[:seqs])
    return out


def _borrowing_cuts(pieces: SpanPieces, cu_local, seqs: int, n_rows: int):
    """The flow's cuts (joint.Cuts) around each piece's span rows where they are
    BORROW_MIN_ROWS at least (a piece's first rows: a piece starts at a span start, and rows
    of other segments after the span ride in it, serving/hybrid/span_rows.py `step_rows`): at
    the first, borrowing the local piece's chunks (joint sequence seqs + piece, those rows:
    cu_local, `span_compaction`'s), and a grid cut after the last. A shorter run stays on the
    flow's grid."""
    start = pieces.piece_cu[:-1]
    n_span = cu_local[1:] - cu_local[:-1]
    lend = (n_span > 0) & (n_span >= BORROW_MIN_ROWS)
    seq = seqs + jnp.arange(start.shape[0], dtype=jnp.int32)
    return JointCuts(jnp.concatenate([jnp.where(lend, start, n_rows),
                                      jnp.where(lend, start + n_span, n_rows)]).astype(jnp.int32),
                     jnp.concatenate([jnp.where(lend, seq, -1),
                                      jnp.full_like(seq, -1)]).astype(jnp.int32))


def _carried_chunks(pieces: SpanPieces, cu_q_lens, jp, last_piece):
    """(first chunk, count) [joint sequences] of the packed chunks whose state from zero is a
    flow sequence's final: its last local piece's where it carries that piece's state on
    (carry_local, with rows in the step); count -1 elsewhere (the sequence's own final)."""
    seqs = cu_q_lens.shape[0] - 1
    n = jp["lens"].shape[0]
    carry = pieces.carry_local & (cu_q_lens[1:] > cu_q_lens[:-1])
    piece = jp["seq_offset"][1] + last_piece
    pad = n - seqs
    first = jnp.concatenate([jp["first"][piece], jnp.zeros(pad, jnp.int32)])
    count = jnp.concatenate([jnp.where(carry, jp["n_ch"][piece], -1),
                             jnp.full(pad, -1, jnp.int32)])
    return first.astype(jnp.int32), count.astype(jnp.int32)


def _table(delta0, layer_plan, finals=None):
    """The state table [delta0 (S) | zero | I | entry B (Mc) | entry A (Mc)] as a StateRows: the
    flow's rows where delta0 names them (the layer's cache) or delta0 itself, the entries' in the
    span-map pool's layer (layer_plan: for_layer's, with entries; None without), nothing copied.
    With finals (the `plan`; delta0 a write_final StateRows) each flow sequence's final goes
    to its cache row (StateRows.final_rows; an empty one's only where it starts from zeros,
    others keep their row), a carried one's from its last piece's chunks (final_from).
    Also the entries' A rows alone (a StateRows of the pool's A; None without entries): read
    through the whole table, each row would gather from every source."""
    if not isinstance(delta0, StateRows):  # an array [S, ...]: itself, row by row
        n = delta0.shape[0]
        delta0 = StateRows((delta0,), jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32))
    sources = list(delta0.sources)
    layers = list(delta0.layers or (None,) * len(sources))
    kind = [delta0.kind, jnp.asarray([ZERO, EYE], jnp.int32)]
    index = [delta0.index, jnp.zeros(2, jnp.int32)]
    entry_a = None
    if layer_plan is not None:
        e, use, n = layer_plan["entry"], layer_plan["entry_use"], len(sources)
        sources += [e["b"], e["a"]]
        layers += [layer_plan["layer"]] * 2
        kind += [jnp.where(use, n, ZERO).astype(jnp.int32),
                 jnp.where(use, n + 1, EYE).astype(jnp.int32)]
        index += [e["slot"], e["slot"]]
        entry_a = StateRows((e["a"],), jnp.where(use, 0, EYE).astype(jnp.int32), e["slot"],
                            (layer_plan["layer"],))
    kind = jnp.concatenate(kind)
    dests = {}
    if finals is not None:
        s, n = delta0.index.shape[0], finals["nonempty"].shape[0]
        # an empty one ends where it starts: in its state, written only if that is zeros
        ends = finals["nonempty"][:s] | (kind[finals["state_row"][:s]] == ZERO)
        rows = jnp.concatenate([jnp.where(ends, delta0.index, -1),
                                jnp.full(n - s, -1, jnp.int32)])
        dests = dict(write_final=True, final_rows=rows.astype(jnp.int32),
                     final_from=(finals["carry_first"], finals["carry_count"]))
    return StateRows(tuple(sources), kind, jnp.concatenate(index), tuple(layers),
                     **dests), entry_a


def _state_rows(s: int, g: int, mc: int, piece_entry, entry_use):
    """[S + G + Mc] the state table row of every joint sequence: a flow sequence its own, a
    local piece the zero row or (continuing a long span) its entry's B, a transition I or its
    entry's A (table: [delta0 (S) | zero | I | entry B (Mc) | entry A (Mc)])."""
    zero, eye = s, s + 1
    local = jnp.full(g, zero, jnp.int32)
    trans = jnp.full(mc, eye, jnp.int32)
    if entry_use is not None:
        local = jnp.where(piece_entry >= 0, s + 2 + piece_entry, zero).astype(jnp.int32)
        trans = jnp.where(entry_use, s + 2 + mc + jnp.arange(mc, dtype=jnp.int32), eye)
    return jnp.concatenate([jnp.arange(s, dtype=jnp.int32), local, trans])


def run(q, k, v, g, beta, delta0, pos0, p, layer_plan, checkpoint_at=None, **kernel):
    """The layer's three passes as one (module doc). q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta
    [T, Hv]; delta0 [S, Hv, Dk, Dv] float32 or a StateRows (with write_final: the plan's
    finals_in_place, the layer's cache written); p: `plan`; layer_plan: qwen3_5_spans's plan for
    this layer (entry maps picked by for_layer). Returns core [T, Hv, Dv] float32 (each row's
    output: the local pass's for span rows), the flow's final states [S] (with write_final: the
    cache with every sequence's final state written at its slot, a carry_local one's its last
    piece's), its checkpoints (as ragged_prefill's) or None, the local finals [S (+ Mc)]
    (final_pieces order; written in the kernel: [Mc], the captured pieces' only) and the
    captured pieces' transitions [Mc, Hv, Dk, Dk] (None without captures)."""
    s, mc, n_local = p["seqs"], p["mc"], p["n_local"]
    dk = k.shape[2]
    f32 = jnp.float32
    write = isinstance(delta0, StateRows) and delta0.write_final
    if write and not p["finals_in_place"]:
        raise ValueError("qwen3_5_joint.run: a write_final delta0 needs a plan made with "
                         "FINALS_IN_PLACE (the step's plan and its layers disagree)")
    table, entry_a = _table(delta0, layer_plan if p["with_entries"] else None,
                            p if write else None)
    in_kernel = write and finals_in_kernel(table, kernel.get("implementation", "xla"))
    if write and not in_kernel:  # the finals come back as bounds and are scattered below
        table = dataclasses.replace(table, write_final=False, final_rows=None)
    bounds, has = p["fin_bounds"], p["has"][:, None, None, None]
    if in_kernel:  # the kernel writes every final (a carried one's too): no [2 S] bounds
        bounds, has, n_local = bounds[2 * s:], has[2 * s:], n_local - s
    by_scan = mc and not p["trans_in_stream"]
    if by_scan:  # the captures' products: a scan over their local pieces' chunks
        kernel = dict(kernel, transitions=(p["trans_first"], p["trans_count"], entry_a))
    out, fin, ck, products, written = run_joint(
        q, k, v, g, beta, p["joint"], table, p["chunk_state"],
        bounds if bounds.shape[0] else jnp.zeros(1, jnp.int32),  # (0: never stored)
        checkpoint_at=checkpoint_at, pos0=pos0, chunk=p["joint"]["chunk"], first_states=delta0,
        **kernel)
    flow = written
    if not in_kernel:
        # a sequence with no rows ends where it starts: the flow in its state, a piece at zero
        # (a piece that continues a long span is never empty), a transition at I or its A
        flow = jnp.where(has[:s], fin[:s], rows_of(delta0, jnp.arange(s, dtype=jnp.int32)))
        fin, has = fin[s:], has[s:]
    local = jnp.where(has[:n_local], fin[:n_local], 0.0)
    if write and not in_kernel:  # the XLA path: the finals, carried ones swapped in, scattered
        carried = layer_plan["carry_use"][:, None, None, None]  # (qwen3_5_spans.prepare's)
        flow = written_finals(delta0, jnp.where(carried, local[:s], flow))
    a_span = products if by_scan else None  # an empty capture's is its initial row
    if mc and not by_scan:
        a0 = entry_a.materialize() if p["with_entries"] else jnp.eye(dk, dtype=f32)
        a_span = jnp.where(has[n_local:], fin[n_local:], a0)
    return take_rows(out, p["dest"]).astype(f32), flow, ck, local, a_span
