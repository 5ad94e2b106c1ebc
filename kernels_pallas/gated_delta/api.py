"""Gated delta rule (Qwen3.5 Gated DeltaNet core): chunked prefill with exact checkpoints, decode.

Callers pass q/k already L2-normalised (the model does it in float32, as HF does) and the gates in
their final form: g = log decay (<= 0), beta in (0, 1). The state is [Dk, Dv] per value head and is
always float32. Chunk boundaries are counted from the first given token; callers that resume a
sequence in the middle keep checkpoints exact by resuming only at multiples of `chunk_size` (or by
left-aligning with no-op tokens, see `noop_pad_left`).

Which implementation runs is decided here, once per call, by `choose_gated_delta` over the
registry `GATED_DELTA` (kernels_pallas/registry.py says how to add one): a named implementation,
or "auto", the first of `auto_order`'s list that takes the problem. A record's `run` is the
equal-length chunked prefill; the ragged entry points (ragged.py, affine.py) run the chosen
record's name. Models reach the op through this module only: it re-exports the ragged entry
points and their helpers (`ragged_prefill`, `ragged_maps`, `ragged_packing`, `maps_packing`,
`take_rows`, `apply_map`, `chain_apply`, `chain_in_place` with its row sources).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import registry
from kernels_pallas.gated_delta import affine, chunked, dots, ragged, tree_scan
from kernels_pallas.gated_delta.affine import apply as apply_map, maps_packing  # noqa: F401
from kernels_pallas.gated_delta.affine import COMPOSE_PRECISIONS, compose_precision  # noqa: F401
from kernels_pallas.gated_delta.chain_triton import chain_apply  # noqa: F401
from kernels_pallas.gated_delta.chain_in_place import (FROM_CHECKPOINT, FROM_SLOT, FROM_ZERO,  # noqa: F401
                                                       NO_WRITE, chain_in_place)
from kernels_pallas.gated_delta.affine import selected_rows  # noqa: F401
from kernels_pallas.gated_delta.checkpoint_rows import CheckpointRows, as_rows  # noqa: F401
from kernels_pallas.gated_delta.decode_rows import (on_rows, on_seq_rows, seq_rows,  # noqa: F401
                                                    one_rows_in_place,
                                                    ragged_decode_conv_layer_in_place,
                                                    ragged_decode_in_place,
                                                    ragged_decode_layer_in_place)
from kernels_pallas.gated_delta.joint import Cuts as JointCuts, Pass as JointPass  # noqa: F401
from kernels_pallas.gated_delta.joint import final_bounds, joint_packing, run_joint  # noqa: F401
from kernels_pallas.gated_delta.problem import Problem
from kernels_pallas.gated_delta.ragged import (break_rows, finals_in_kernel,  # noqa: F401
                                               packed_chunks, take_rows)
from kernels_pallas.gated_delta.ragged import packing as ragged_packing  # noqa: F401
from kernels_pallas.gated_delta.state_rows import (EYE, ZERO, StateRows, as_array,  # noqa: F401
                                                   from_cache, rows_of, written_finals)
from kernels_pallas.registry import Implementation

__all__ = ["GATED_DELTA", "IMPLEMENTATIONS", "JointCuts", "JointPass", "Problem", "apply_map",
           "auto_order",
           "break_rows", "chain_apply", "chain_in_place", "choose", "choose_gated_delta",
           "decode_step", "final_bounds", "joint_packing",
           "maps_packing", "packed_chunks", "prefill", "ragged_gated_delta", "ragged_maps",
           "ragged_packing", "ragged_prefill", "run_joint", "selected_rows", "take_rows"]


def _run_xla(q, k, v, g, beta, state0, ckpt, *, scale, chunk, kind, solve, inter_dtype,
             transition, interpret):
    """implementation="xla": lax.scan over chunks (chunked.py; the tree scan for kind "tree")."""
    del interpret
    scan_fn = tree_scan.state_scan if kind == "tree" else None
    res = chunked.chunked_gated_delta(
        q, k, v, g, beta, state0, ckpt, scale=scale, chunk=chunk, scan_fn=scan_fn,
        solve=solve, inter_dtype=inter_dtype, transition=transition)
    return (res[0].astype(v.dtype),) + tuple(res[1:])


def _run_pallas_fused(q, k, v, g, beta, state0, ckpt, *, scale, chunk, kind, solve,
                      inter_dtype, transition, interpret):
    """implementation="pallas_fused": the Triton-lowered chunk kernels (fused_triton.py; the
    two-level scan of scan_blocked.py for kind "blocked", the tree scan for "tree" or a
    transition)."""
    del solve
    from kernels_pallas.gated_delta import fused_triton, scan_blocked
    kw = dict(scale=scale, chunk=chunk, dot_dtype=inter_dtype, interpret=interpret)
    if kind == "blocked":
        return scan_blocked.blocked_gated_delta(q, k, v, g, beta, state0, ckpt,
                                                transition=transition, **kw)
    if kind == "tree" or transition:
        res = tree_scan.fused_tree_gated_delta(q, k, v, g, beta, state0, ckpt, **kw)
        return res[:3] + (res[3:] if transition else ())
    return fused_triton.fused_gated_delta(q, k, v, g, beta, state0, ckpt, **kw)


def _run_mosaic(q, k, v, g, beta, state0, ckpt, *, scale, chunk, kind, solve, inter_dtype,
                transition, interpret, output="mosaic"):
    """implementation="mosaic" / "mosaic_intra": pallas_fused's sequential pipeline with the
    intra-chunk solve on Mosaic GPU (intra_mosaic.py: bf16 / f16, chunk 64), the Triton scan,
    then the Mosaic output kernel (output_mosaic.py; "mosaic") or the Triton one
    ("mosaic_intra"). Opt-in until timed on the H200."""
    del kind, solve
    from kernels_pallas.gated_delta import fused_triton, intra_mosaic
    name = "mosaic" if output == "mosaic" else "mosaic_intra"
    why = intra_mosaic.limits(k, v, chunk, inter_dtype)
    if transition:
        why = "cannot return the span's transition (return_transition: xla or pallas_fused)"
    if why:
        raise ValueError(f"gated_delta.prefill: implementation={name!r} {why}")
    return fused_triton.fused_gated_delta(q, k, v, g, beta, state0, ckpt, scale=scale,
                                          chunk=chunk, dot_dtype=inter_dtype,
                                          interpret=interpret, intra="mosaic", output=output)


def _xla_limits(problem: Problem, options) -> str:
    del options
    if problem.scan == "blocked":
        return "cannot take scan='blocked' (a Pallas kernel: scan_blocked.py, 'pallas_fused')"
    return ""


def _pallas_fused_limits(problem: Problem, options) -> str:
    del options
    if problem.platform != "gpu" and not problem.interpret:
        return "needs a GPU, or interpret=True on CPU (Triton-lowered Pallas kernels)"
    if problem.ragged_transition:
        return "cannot return a ragged batch's transitions (return_transition: XLA only)"
    return ""


def _mosaic_limits(problem: Problem, options) -> str:
    if problem.platform != "gpu" and not problem.interpret:
        return "needs a GPU, or interpret=True on CPU (Mosaic GPU and Triton-lowered kernels)"
    if problem.ragged_transition:
        return "cannot return a ragged batch's transitions (return_transition: XLA only)"
    if problem.scan not in (None, "sequential"):
        return f"takes the sequential scan only, got scan={problem.scan!r}"
    if problem.dtype is not None:  # the model's facts (an engine at start)
        from kernels_pallas.gated_delta import intra_mosaic
        return intra_mosaic.shape_limits(problem.dtype, problem.key_dim, problem.value_dim,
                                         problem.chunk)
    return ""


GATED_DELTA: dict[str, Implementation] = {
    "xla": Implementation("xla", _run_xla, limits=_xla_limits),
    "pallas_fused": Implementation("pallas_fused", _run_pallas_fused,
                                   limits=_pallas_fused_limits, backend="triton"),
    "mosaic": Implementation("mosaic", _run_mosaic, limits=_mosaic_limits, backend="mosaic"),
    "mosaic_intra": Implementation("mosaic_intra", functools.partial(_run_mosaic,
                                                                     output="triton"),
                                   limits=_mosaic_limits, backend="mosaic"),
}
IMPLEMENTATIONS = ("auto",) + tuple(GATED_DELTA)


def auto_order(problem: Problem) -> tuple[str, ...]:
    """The default list, best first: on a GPU or when interpreting, the fused Triton-lowered
    chunk kernels (fused_triton.py / ragged_triton.py), then XLA; elsewhere XLA (lax.scan over
    chunks), which takes every problem but scan='blocked'."""
    if problem.interpret or problem.platform == "gpu":
        return ("pallas_fused", "xla")
    return ("xla",)


def choose_gated_delta(problem: Problem, implementation: str | None = "auto", options=None, *,
                       op: str = "gated_delta"):
    """(Implementation, filled options) that runs `problem`; ValueError naming why not (an
    unknown name, or one that cannot take the problem). None is "auto"."""
    return registry.choose(op, GATED_DELTA, auto_order(problem), problem,
                           implementation or "auto", options)


def choose(implementation: str | None, *, interpret: bool = False, op: str = "gated_delta",
           **facts) -> str:
    """The name `choose_gated_delta` picks on this backend (facts: more Problem fields), for
    callers that pass the choice down to the ragged entry points."""
    problem = Problem.here(interpret, **facts)
    return choose_gated_delta(problem, implementation, op=op)[0].name


def prefill(q, k, v, g, beta, state0=None, *, checkpoint_at=None, scale=None, chunk_size=64,
            implementation="xla", interpret=False, solve="blocked", inter_dtype=None, scan=None,
            return_transition=False):
    """Chunked gated delta rule over a batch of equal-length sequences.

    Args:
      q, k: [N, T, Hk, Dk]; v: [N, T, Hv, Dv] (Hv % Hk == 0; value head h reads key head
        h // (Hv // Hk)).
      g: [N, T, Hv] log decay; beta: [N, T, Hv].
      state0: [N, Hv, Dk, Dv] state before the first token (None: zeros).
      checkpoint_at: None, [M] or [N, M] int token offsets, multiples of chunk_size in [0, T]
        (a trailing offset T is allowed even when T is not a multiple). Static Python ints are
        validated here; traced values must be valid (invalid ones are clamped).
      scale: query scale, default Dk ** -0.5.
      chunk_size: C, the checkpoint granularity.
      implementation: "xla" (lax.scan; the default here, where callers compare variants),
        "pallas_fused" (three GPU kernels: intra-chunk UT solve, state scan, output; see
        fused_triton.py), "mosaic_intra" (the same with the solve on Mosaic GPU,
        intra_mosaic.py; bf16 / f16, chunk 64, sequential scan, no return_transition),
        "mosaic" (the solve and the output kernel on Mosaic GPU, output_mosaic.py; the same
        limits) or "auto" / None (`auto_order`).
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      solve: in-chunk UT solve, "blocked" (block-recursive inverse) or "trsm".
      inter_dtype: intermediates' dtype (None: float32; bfloat16 for speed with bf16 inputs).
      scan: inter-chunk state recurrence, "sequential", "tree" (associative scan over the chunk
        maps, tree_scan.py), "blocked" (two-level scan over segments of chunks, scan_blocked.py;
        pallas_fused only) or None (by shape: tree_scan.choose_scan).
      return_transition: also return the span's transition A_span (affine.py). With
        "pallas_fused" this takes the tree scan (its last prefix map is A_span).
    Returns:
      out [N, T, Hv, Dv] in v's dtype, final_state [N, Hv, Dk, Dv] float32, and
      checkpoint_states [N, M, Hv, Dk, Dv] float32 (None when checkpoint_at is None): the state
      after checkpoint_at[m] tokens; with return_transition also a_span [N, Hv, Dk, Dk] float32,
      so that final_state = a_span state0 + (final state from a zero state0).
    """
    with dots.exact_for(v.dtype):
        return _prefill(q, k, v, g, beta, state0, checkpoint_at, scale, chunk_size, implementation,
                        interpret, solve, inter_dtype, scan, return_transition)


def _prefill(q, k, v, g, beta, state0, checkpoint_at, scale, chunk_size, implementation,
             interpret, solve, inter_dtype, scan, return_transition):
    n, t_len, hk, dk = _validate(q, k, v, g, beta, state0)
    hv, dv = v.shape[2:]
    kind = tree_scan.choose_scan(n, hv, -(-t_len // chunk_size), scan)
    impl, options = choose_gated_delta(Problem.here(interpret, scan=kind), implementation,
                                       op="gated_delta.prefill")
    if scale is None:
        scale = dk ** -0.5
    ckpt = None
    if checkpoint_at is not None:
        ckpt = _checkpoint_chunks(checkpoint_at, n, t_len, chunk_size)
    if state0 is None:
        state0 = jnp.zeros((n, hv, dk, dv), jnp.float32)
    pad = (-t_len) % chunk_size
    if pad:  # trailing no-op tokens: g = 0 (no decay), beta = 0 and k = 0 (no write)
        q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                            for x in (q, k, v, g, beta))
    res = impl.run(q, k, v, g, beta, state0, ckpt, scale=scale, chunk=chunk_size, kind=kind,
                   solve=solve, inter_dtype=inter_dtype, transition=return_transition,
                   interpret=interpret, **impl.kwargs(options))
    return (res[0][:, :t_len],) + tuple(res[1:])


def decode_step(q, k, v, g, beta, state, *, scale=None):
    """One token per sequence.

    Args:
      q, k: [N, Hk, Dk]; v: [N, Hv, Dv]; g, beta: [N, Hv]; state: [N, Hv, Dk, Dv].
    Returns:
      out [N, Hv, Dv] in v's dtype, new state [N, Hv, Dk, Dv] float32.
    """
    _validate(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state)
    dk = k.shape[-1]
    with dots.exact_for(v.dtype):
        out, new = chunked.recurrent_step(q, k, v, g, beta, state,
                                          scale=dk ** -0.5 if scale is None else scale)
    return out.astype(v.dtype), new


def _checkpoint_chunks(checkpoint_at, n, t_len, chunk):
    """Token offsets -> [N, M] indices into the per-chunk states (index NT = final state)."""
    n_chunks = -(-t_len // chunk)
    if isinstance(checkpoint_at, (list, tuple)) or (
            hasattr(checkpoint_at, "dtype") and not isinstance(checkpoint_at, jax.core.Tracer)):
        import numpy as np
        arr = np.asarray(checkpoint_at)
        if arr.ndim not in (1, 2) or (arr.ndim == 2 and arr.shape[0] != n):
            raise ValueError(f"gated_delta.prefill: checkpoint_at must be [M] or [{n}, M], "
                             f"got shape {arr.shape}")
        bad = (arr < 0) | (arr > t_len) | ((arr % chunk != 0) & (arr != t_len))
        if bad.any():
            raise ValueError(f"gated_delta.prefill: checkpoint_at offsets {arr[bad].tolist()} "
                             f"are not multiples of chunk_size={chunk} in [0, {t_len}]")
    idx = jnp.asarray(checkpoint_at, jnp.int32)
    idx = jnp.where(idx >= t_len, n_chunks, idx // chunk)
    idx = jnp.clip(idx, 0, n_chunks)
    return jnp.broadcast_to(idx, (n, idx.shape[-1])) if idx.ndim == 1 else idx


def _validate(q, k, v, g, beta, state):
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"gated_delta: q and k must both be [N, T, Hk, Dk], got q{q.shape} "
                         f"k{k.shape}")
    n, t_len, hk, dk = k.shape
    if v.ndim != 4 or v.shape[:2] != (n, t_len):
        raise ValueError(f"gated_delta: v must be [{n}, {t_len}, Hv, Dv], got {v.shape}")
    hv = v.shape[2]
    if hv % hk:
        raise ValueError(f"gated_delta: value heads ({hv}) must be a multiple of key heads ({hk})")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (n, t_len, hv):
            raise ValueError(f"gated_delta: {name} must be [{n}, {t_len}, {hv}], got {x.shape}")
    if state is not None and state.shape != (n, hv, dk, v.shape[3]):
        raise ValueError(f"gated_delta: state must be [{n}, {hv}, {dk}, {v.shape[3]}], "
                         f"got {state.shape}")
    return n, t_len, hk, dk


def ragged_gated_delta(q, k, v, g, beta, cu_q_lens, pos0, state0, *, checkpoint_at=None,
                       scale=None, chunk=64, implementation="auto", interpret=False, decode=None,
                       packing=None):
    """The model's entry: `ragged.ragged_prefill` (its arguments and results), or the one-step
    recurrence when every sequence has <= 1 token (checkpoints, if asked, are then the state0 /
    final state as positions say). implementation: a name of GATED_DELTA or "auto" / None
    (`auto_order`).

    decode: which of the two runs, decided by a caller that knows the step on the host: True
    (every sequence has <= 1 token: the one-step recurrence), False (the chunked prefill, exact
    for any lengths) or None (decided on the device by a lax.cond on the lengths; XLA's GPU
    conditional copies its predicate to the host and blocks the stream, once per layer).
    packing: None or ragged.packing(cu_q_lens, pos0, T, chunk=chunk) computed once per step by a
    caller running several layers over the same rows (the prefill's index work)."""
    implementation = choose(implementation, interpret=interpret, op="ragged_gated_delta")
    cu_q_lens, pos0 = jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray(pos0, jnp.int32)
    seqs = cu_q_lens.shape[0] - 1
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    dk = k.shape[-1]
    scale_ = dk ** -0.5 if scale is None else scale

    def one_step(ops):
        q_, k_, v_, g_, b_, s0 = ops
        rows = jnp.clip(cu_q_lens[:-1], 0, q_.shape[0] - 1)  # [S] the one row of each sequence
        out_s, new = chunked.recurrent_step(q_[rows], k_[rows], v_[rows], g_[rows], b_[rows], s0,
                                            scale=scale_)
        has = lens > 0
        new = jnp.where(has[:, None, None, None], new, s0)
        out = on_rows(out_s, cu_q_lens, q_.shape[0], jnp.float32)
        ckpt = None
        if checkpoint_at is not None:  # flat rows (checkpoint_rows.py), [K] or [S, M] out
            rows, shape = as_rows(checkpoint_at)
            after = (rows.pos == (pos0 + lens)[rows.seq]) & has[rows.seq]
            ckpt = jnp.where(after[:, None, None, None], new[rows.seq], s0[rows.seq])
            ckpt = ckpt.reshape(tuple(shape) + ckpt.shape[1:])
        return out, new, ckpt

    def prefill(ops):
        return ragged.ragged_prefill(*ops[:5], cu_q_lens, pos0, ops[5], checkpoint_at=checkpoint_at,
                              scale=scale, chunk=chunk, implementation=implementation,
                              interpret=interpret, packing=packing)

    rows = isinstance(state0, StateRows) and decode is False  # the prefill reads it in place
    if isinstance(state0, StateRows) and state0.write_final and not rows:
        raise ValueError("ragged_gated_delta: a write_final StateRows (finals written into its "
                         f"source) needs decode=False (the chunked prefill), got {decode!r}")
    state0 = state0 if rows else jnp.asarray(as_array(state0), jnp.float32)
    ops = tuple(map(jnp.asarray, (q, k, v, g, beta))) + (state0,)
    del seqs
    with dots.exact_for(v.dtype):
        if decode is None:
            return jax.lax.cond(jnp.max(lens) <= 1, one_step, prefill, ops)
        return one_step(ops) if decode else prefill(ops)


def ragged_prefill(q, k, v, g, beta, cu_q_lens, pos0, state0, *, implementation="xla",
                   interpret=False, return_transition=False, **kw):
    """ragged.ragged_prefill (its arguments and results; kw: the others) with `implementation`
    resolved here: a name of GATED_DELTA or "auto" / None (`auto_order`)."""
    name = choose(implementation, interpret=interpret, op="gated_delta.ragged_prefill",
                  ragged_transition=return_transition)
    return ragged.ragged_prefill(q, k, v, g, beta, cu_q_lens, pos0, state0, implementation=name,
                                 interpret=interpret, return_transition=return_transition, **kw)


def ragged_maps(q, k, v, g, beta, cu_q_lens, select=None, final_of=None, packings=None, *,
                implementation="xla", interpret=False, **kernel):
    """affine.ragged_maps (its arguments and results; kernel: ragged_prefill's other options)
    with `implementation` resolved here, as in `ragged_prefill`."""
    name = choose(implementation, interpret=interpret, op="gated_delta.ragged_maps")
    return affine.ragged_maps(q, k, v, g, beta, cu_q_lens, select, final_of, packings,
                              implementation=name, interpret=interpret, **kernel)
