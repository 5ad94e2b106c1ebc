"""Gated delta rule over a ragged batch (flat token stream, several sequences, per-sequence state).

Prefill packs the tokens into chunks: sequence s starts a fresh chunk and is shifted right by
`pos0[s] % C` no-op tokens (g = 0, beta = 0, k = q = v = 0: the state passes through unchanged), so
chunk boundaries fall on multiples of C of each sequence's *own* position. A state checkpoint at an
aligned position c is then computed by exactly the operations of a prefill that stopped at c.
So is one at the end of a sequence's rows in the batch, wherever it falls (the state after the
last chunk: the no-op slots that fill it change nothing).
Static bound on packed chunks: ceil(T / C) + 2 S, or floor((T + S (C - 1)) / C) when the caller
promises chunk-aligned starts (`aligned`: e.g. pieces run from a zero state, which are never
shifted; each sequence then pads less than one chunk). The state scan runs each sequence's packed
chunks from its initial state (the XLA path: one scan over all of them, restarting at each
sequence's first chunk; the kernels: one program per sequence, side by side).

When no sequence has more than one token (decode), a lax.cond takes the one-step recurrence
instead (no chunk padding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas.gated_delta import dots
from kernels_pallas.gated_delta.checkpoint_rows import as_rows
from kernels_pallas.gated_delta import ragged_xla, state_rows, stream_pack, stream_rows
from kernels_pallas.gated_delta.ragged_xla import take_rows
from kernels_pallas.gated_delta.state_rows import StateRows, as_array, rows_of, written_finals
# the packing's index work (ragged_packing.py), under the names callers use (ragged.packing, ...)
from kernels_pallas.gated_delta.ragged_packing import (break_rows, checkpoint_bounds,  # noqa: F401
                                                       chunk_layout, layout_fields,
                                                       packed_chunks, packing)


def _gathered(pairs, n_used, chunk: int, interpret: bool, live=None):
    """[1, NC * C, ...] packed stream of each (array, rows) pair: one gather per distinct pair
    (affine.ragged_maps passes k as q), by XLA (every slot) or with stream_pack.PACK_KERNEL
    by one kernel per distinct rows array (the used chunks only; with live [NC], those of them
    it marks: a borrowed chunk's slots are never read)."""
    distinct = {}
    for x, src in pairs:
        distinct.setdefault((id(x), id(src)), (x, src))
    if stream_pack.PACK_KERNEL:
        by_src = {}
        for key, (x, src) in distinct.items():
            by_src.setdefault(id(src), (src, []))[1].append(key)
        streams = {}
        for src, keys in by_src.values():
            got = stream_pack.pack([distinct[key][0] for key in keys], src, n_used,
                                   chunk=chunk, interpret=interpret, live=live)
            streams.update((key, a[None]) for key, a in zip(keys, got))
    else:
        streams = {key: take_rows(x, src)[None] for key, (x, src) in distinct.items()}
    return [streams[(id(x), id(src))] for x, src in pairs]


# The kernels' packed stream takes q and k in v's dtype where v is bf16 / f16 (ragged_triton.
# qk_in_v_dtype): the model L2-normalises them in float32 (as HF does), the kernels round them to
# the dot dtype in every dot, and the gathers that fill the static stream move half the q / k
# bytes (~40% of a row's). False gathers float32 q / k (the form before; A/B timing). Read when
# a step is traced.
STREAM_QK_IN_V_DTYPE = True
# The state scan's value-column block for a ragged step (`scan_block_v`): a stream of many
# sequences (its first pass's static sequences >= WIDE_SCAN_SEQS: the step's sequence bucket)
# has programs to spare, and each program reloads its chunks' W / KD, so it scans WIDE_BLOCK_V
# columns a program; fewer keep fused_triton.DEFAULTS' 16 (from an H200 sweep of one 32K
# sequence: 8 programs a head are the parallelism; a small-bucket step, one request's, keeps
# them). At rag's 1,024 tokens x 16 seats block_v 64 took a capturing (warm/4) step 10.32 ->
# 9.64 ms and a plain one 7.21 -> 6.96 (H100, session 35; H200 s35a: warm/4 busy 8.86 -> 7.96
# ms; 128, and programs walking every P-th sequence, were slower: that form is gone).
# SCAN_BLOCK_V: None (the rule) or an int for every ragged call (benchmarks' forms); read when
# a step is traced.
SCAN_BLOCK_V = None
WIDE_SCAN_SEQS, WIDE_BLOCK_V = 16, 64

# the kernel pipelines of ragged_triton.packed_gated_delta by implementation name (api.py's)
KERNEL_OPTIONS = {"pallas_fused": {}, "mosaic_intra": {"intra": "mosaic"},
                  "mosaic": {"intra": "mosaic", "output": "mosaic"}}


def ragged_prefill(q, k, v, g, beta, cu_q_lens, pos0, state0, *, checkpoint_at=None, scale=None,
                   chunk=64, implementation="xla", interpret=False, return_transition=False,
                   aligned=False, final_of=None, packing=None):
    """Chunked gated delta rule for a flat ragged batch.

    Args:
      q, k: [T, Hk, Dk] (L2-normalised); v: [T, Hv, Dv]; g, beta: [T, Hv].
      cu_q_lens: [S+1] int32 row offsets of each sequence (rows past cu_q_lens[-1] are padding).
      pos0: [S] int32 position (tokens already in the state) of each sequence's first new token.
      state0: [S, Hv, Dk, Dv] float32 state of each sequence before its new tokens, or
        [1, Hv, Dk, Dv]: one state for every sequence (a zero start costs no [S] buffer).
      checkpoint_at: None or [S, M] int32 absolute positions (multiples of chunk, or the
        sequence's end pos0 + len, within [pos0, pos0 + len]) whose states to return; -1 = none
        (returns state0 there); or checkpoint_rows.CheckpointRows (seq [K], pos [K]): the same
        as K flat rows, results [K, ...] (a step writes K states, not S M).
      implementation: "xla" (lax.scan), "pallas_fused" (ragged_triton.py, GPU; on CPU only
        with interpret=True) or "mosaic_intra" / "mosaic" (the same with the Mosaic GPU solve /
        solve and output: `KERNEL_OPTIONS`; bf16 / f16, chunk 64); api.ragged_prefill
        resolves "auto".
      return_transition: also return each sequence's transition over its new tokens (affine.py;
        identity for a sequence with none), so final = a_span state0 + final-from-zero. XLA only.
      aligned: the caller's promise that every pos0 is a multiple of chunk (zero, say): the
        packed stream is then sized floor((T + S (C - 1)) / C) chunks, not ceil(T / C) + 2 S
        (a wrong promise loses tokens; only callers that pass constant zeros set it).
      final_of: None or [K] int32 sequence ids: the final states of those only, [K, ...] (a
        step that needs a few of many sequences' states writes no [S] of them).
      packing: None, or `packing(...)` of this batch computed once by the caller (then
        cu_q_lens, pos0, aligned and final_of are read from it, not from the arguments; with its
        source_rows the inputs and the output are the stream's rows).
    Returns:
      out [T, Hv, Dv] float32, final [S, Hv, Dk, Dv] float32, ckpt [S, M, Hv, Dk, Dv] ([K, ...]
        for CheckpointRows) or None,
      and with return_transition a_span [S, Hv, Dk, Dk] float32. For a state0 StateRows with
      write_final, final is its source [P, Hv, Dk, Dv] with each sequence's final state
      written at its row (by the scan kernel in place where `finals_in_kernel`, else scattered).
    """
    with dots.exact_for(v.dtype):
        return _ragged_prefill(q, k, v, g, beta, cu_q_lens, pos0, state0, checkpoint_at, scale,
                               chunk, implementation, interpret, return_transition, aligned,
                               final_of, packing)


@functools.partial(jax.jit, static_argnames=("run", "options"))
def _packed_once(*args, run, options):
    """`run` (ragged_triton.packed_gated_delta, read at the call: benchmarks swap it) compiled,
    under its own jit: the GDN layers of a step call it with the same shapes, so its three
    kernels are traced and lowered once per step variant and each layer calls that one function
    (XLA inlines the call: the same program). Traced per layer they were most of Qwen3.5's
    trace and lower time on the host (benchmarks/lower_time.py)."""
    *arrays, n_used, first, n_ch, src, transitions, chunk_src = args
    return run(*arrays, interpret=False, n_used=n_used, seq_first=first, seq_chunks=n_ch,
               src=src, transitions=transitions, chunk_src=chunk_src, **dict(options))


def rows_states(use, states, state0, seq, shape, start=None):
    """Each checkpoint row's state: `states` [K, ...] where used, else the state its sequence
    starts from (one state0 row serves all when state0 has one; an array or a StateRows; or
    `start` [K, ...], those rows read already); [K] reshaped to `shape`."""
    if start is None:
        start = start_rows(state0, seq, states.shape)
    out = jnp.where(use[:, None, None, None], states, start)
    return out.reshape(tuple(shape) + out.shape[1:])


def start_rows(state0, seq, shape):
    """The state each of the rows' sequences `seq` [K] starts from, [K, ...] (`shape`)."""
    if state0.shape[0] > 1:
        return rows_of(state0, seq)
    return jnp.broadcast_to(rows_of(state0, jnp.zeros(1, jnp.int32)), shape)


def finals_in_kernel(state0, implementation: str) -> bool:
    """Whether the scan kernel writes a write_final StateRows' finals in place: the Pallas
    stream with its per-sequence scan reading the rows in place (else `_ragged_prefill`
    scatters them into the source after the scan: the same values)."""
    if not (isinstance(state0, StateRows) and state0.write_final
            and implementation in KERNEL_OPTIONS):
        return False
    from kernels_pallas.gated_delta import ragged_triton
    return ragged_triton.reads_rows_in_place()  # run_stream passes the switches as they are


def _ragged_prefill(q, k, v, g, beta, cu_q_lens, pos0, state0, checkpoint_at, scale, chunk,
                    implementation, interpret, return_transition, aligned, final_of, pk):
    n_tokens, dk = k.shape[0], k.shape[2]
    scale = dk ** -0.5 if scale is None else scale
    if pk is None:  # an off-grid checkpoint inside a sequence is a break (one a sequence)
        breaks = None
        if checkpoint_at is not None and not aligned:
            cu = jnp.asarray(cu_q_lens, jnp.int32)
            breaks = break_rows(as_rows(checkpoint_at)[0], pos0, cu[1:] - cu[:-1], chunk)
        pk = packing(cu_q_lens, pos0, n_tokens, chunk=chunk, aligned=aligned, final_of=final_of,
                     breaks=breaks, max_breaks=0 if breaks is None else breaks.shape[0])
    if pk["chunk"] != chunk:
        raise ValueError(f"ragged_prefill: packing made for chunk {pk['chunk']}, run at {chunk}")
    n_chunks = pk["src"].shape[0] // chunk
    ck_use = ck_bound = None
    if checkpoint_at is not None:  # flat rows (checkpoint_rows.py); results [K] or [S, M]
        ck_rows, ck_shape = as_rows(checkpoint_at)
        ck_use, ck_bound = checkpoint_bounds(ck_rows, pos0, pk, chunk, n_chunks)
    final_bound, has, fin = pk["final_bound"], pk["has_final"], pk["fin"]
    write_final = isinstance(state0, StateRows) and state0.write_final
    if write_final and (not pk["own_final"] or pk.get("empty_final_first") or return_transition):
        raise ValueError("ragged_prefill: a write_final StateRows needs one final per sequence "
                         "(no final_of, empty_final_first or return_transition)")
    in_kernel = finals_in_kernel(state0, implementation)
    if write_final and not in_kernel:  # the scan returns the finals; scattered below
        state0 = dataclasses.replace(state0, write_final=False)
    last_state = state0.shape[0] - 1  # 0 when one state0 serves every sequence
    seq_state = pk["seq_of_chunk"] if last_state else jnp.zeros_like(pk["seq_of_chunk"])
    if return_transition and implementation not in (None, "xla"):
        raise NotImplementedError("ragged_prefill: return_transition has the XLA path only "
                                  f"(implementation=None or 'xla'), got {implementation!r}")
    ck_start = None
    if in_kernel:  # the kernel writes the finals into the source: read what else it holds first
        n_fin = 0
        bounds = jnp.zeros(1, jnp.int32) if ck_bound is None else ck_bound  # 0: never stored
        if ck_bound is not None:
            ck_start = start_rows(state0, ck_rows.seq, (ck_rows.seq.shape[0],) + state0.shape[1:])
            ck_start, src = jax.lax.optimization_barrier((ck_start, state0.sources[0]))
            state0 = dataclasses.replace(state0, sources=(src,))
    else:
        n_fin = fin.shape[0]
        bounds = final_bound if ck_bound is None else jnp.concatenate([final_bound, ck_bound])
    out, bound_states, prod, written = run_stream(
        q, k, v, g, beta, pk, state0, seq_state, bounds, scale=scale, chunk=chunk,
        implementation=implementation, interpret=interpret, transition=return_transition)
    out = take_rows(out, pk["dest"]).astype(jnp.float32)  # [T, Hv, Dv]
    if in_kernel:
        final = written
    else:
        final = jnp.where(has[:, None, None, None], bound_states[:n_fin],
                          _state0_finals(state0, pk, fin))
        if write_final:
            final = written_finals(state0, final)
    ckpt = None
    if ck_bound is not None:
        ckpt = rows_states(ck_use, bound_states[n_fin:n_fin + ck_bound.shape[0]], state0,
                           ck_rows.seq, ck_shape, start=ck_start)
    if return_transition:
        eye = jnp.eye(dk, dtype=jnp.float32)
        return out, final, ckpt, jnp.where(has[:, None, None, None], prod[:n_fin], eye)
    return out, final, ckpt


def _state0_finals(state0, pk, fin):
    """The finals of sequences without tokens: the state each starts from ([K] or [S] rows)."""
    if pk.get("empty_final_first"):  # a caller's seq_of_chunk picks state0 rows, not sequences:
        return rows_of(state0, jnp.zeros(1, jnp.int32))  # an empty one ends in state0[0]
    if state0.shape[0] > 1 and not pk["own_final"]:  # [K]
        return rows_of(state0, fin)
    return as_array(state0)  # [S] or [1]


def scan_block_v(pk) -> int | None:
    """The scan's block_v for packing `pk` (SCAN_BLOCK_V's rule above), None: DEFAULTS'."""
    if SCAN_BLOCK_V is not None:
        return SCAN_BLOCK_V
    offsets = pk.get("seq_offset") or (0,)  # a joint stream: its first pass's (the flow's)
    seqs = offsets[1] if len(offsets) > 1 else pk["first"].shape[0]
    return WIDE_BLOCK_V if seqs >= WIDE_SCAN_SEQS else None


def run_stream(q, k, v, g, beta, pk, state0, seq_state, bounds, *, scale, chunk, implementation,
               interpret=False, transition=False, transitions=None):
    """The packed stream's kernels (or the XLA scan): q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta
    [T, Hv] rows of the source stream, gathered into the packed slots by pk["src"] (v by
    pk["src_v"] where a packing has one: joint.py's v = 0 rows); state0 [N, Hv, Dk, Dv] float32,
    seq_state [NC] the state0 row each chunk's sequence starts from (read at its first chunk);
    bounds [B] boundary indices (boundary j: the state after packed chunk j - 1); a packing's
    chunk_src (joint.joint_packing's borrowed chunks; None or absent: each chunk its own) makes
    the scan read chunk chunk_src[c]'s W, U, KD and decay at chunk c.
    transitions: None, or (first [M], count [M] int32, init): the maps' products of chunks
    first[m] .. + count[m] of this stream (a captured span piece's), from I (init None) or
    init's row m (a StateRows of M rows), over the stream's own W / KD
    (ragged_triton.packed_gated_delta's; Dk = Dv).
    Returns (out [NC * C, Hv, Dv] in the packed slots, the state at each bound [B, Hv, Dk, Dv]
    float32, with `transition` (XLA only) the chunk maps' product there [B, Hv, Dk, Dk], with
    `transitions` their products [M, Hv, Dk, Dk] float32, else None, and for a write_final
    StateRows (the kernels only) its source with the sequences' finals written in place, else
    None)."""
    if transition and transitions is not None:
        raise ValueError("run_stream: transition and transitions exclude each other")
    src_v = pk.get("src_v", pk["src"])
    chunk_src = pk.get("chunk_src")
    pairs = ((q, pk["src"]), (k, pk["src"]), (v, src_v), (g, pk["src"]), (beta, pk["src"]))
    if implementation in KERNEL_OPTIONS:
        from kernels_pallas.gated_delta import fused_triton, ragged_triton
        if STREAM_QK_IN_V_DTYPE:  # the XLA path below keeps float32 q / k
            q_low, k_low = ragged_triton.qk_in_v_dtype(q, k, v)
            pairs = ((q_low, pk["src"]), (k_low, pk["src"])) + pairs[2:]
        kinds = {**fused_triton.DEFAULTS, **KERNEL_OPTIONS[implementation]}
        srcs = None
        if stream_rows.STREAM_IN_KERNEL and (kinds["intra"], kinds["output"]) == ("blocked",
                                                                                "triton"):
            srcs = (pk["src"], src_v)  # the kernels read the source rows (stream_rows.py)
            packed = [x for x, _ in pairs]
        else:  # one gather per distinct (array, rows) (affine.ragged_maps passes k as q)
            live = None if chunk_src is None else ragged_triton.own_chunks(chunk_src)
            packed = _gathered(pairs, pk["n_used"], chunk, interpret, live)
        args = (*packed, pk["restart"], seq_state, state0, bounds)
        # everything the trace reads goes in the jit's static key (module switches included: a
        # benchmark flips them between calls of the same shapes; srcs or None changes the args)
        options = dict(scale=scale, chunk=chunk, seq_parallel=ragged_triton.SEQ_PARALLEL,
                       states_in_place=state_rows.STATES_IN_PLACE,
                       layout=fused_triton.DEFAULTS["layout"], **KERNEL_OPTIONS[implementation])
        block_v = scan_block_v(pk)
        if block_v is not None:
            options["block_v"] = block_v
        if interpret:  # as is: the interpreter's callbacks (mosaic_calls.one_kernel_per_shape)
            out, bound_states, *written = ragged_triton.packed_gated_delta(
                *args, interpret=True, n_used=pk["n_used"], seq_first=pk["first"],
                seq_chunks=pk["n_ch"], src=srcs, transitions=transitions, chunk_src=chunk_src,
                **options)
        else:
            out, bound_states, *written = _packed_once(
                *args, pk["n_used"], pk["first"], pk["n_ch"], srcs, transitions, chunk_src,
                run=ragged_triton.packed_gated_delta, options=tuple(sorted(options.items())))
        prod = None
        if transitions is not None:
            prod, *written = written
        return out[0], bound_states, prod, written[0] if written else None
    if implementation != "xla":
        raise ValueError(f"ragged_prefill: implementation must be 'xla' or one of "
                         f"{tuple(KERNEL_OPTIONS)}, got {implementation!r}")
    return ragged_xla.stream(q, k, pairs, pk, state0, seq_state, bounds, scale=scale,
                             chunk=chunk, transition=transition, transitions=transitions)
