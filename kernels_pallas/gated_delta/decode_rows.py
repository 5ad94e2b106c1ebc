"""A decode step's GDN core stepped in place in the state cache, and its per-sequence outputs
mapped to the step's rows (api.py re-exports these; the kernels are decode_triton.py's)."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.gated_delta.decode_triton import (decode_conv_layer_in_place,
                                                      decode_in_place, decode_layer_in_place)


def ragged_decode_in_place(q, k, v, g, beta, cu_q_lens, cache, slots, keep, *, scale=None,
                           interpret=False):
    """ragged_gated_delta's one-step branch with the state cache read and written in place
    (decode_triton.decode_in_place: no gather of the step's states, no scatter back): each
    sequence's one row (if it has one) steps the state in cache slot slots[i], from zeros where
    keep[i] is False. Returns (out [T, Hv, Dv] float32, the updated cache)."""
    rows, has = _decode_rows(cu_q_lens, q.shape[0])
    out_s, cache = decode_in_place(q[rows], k[rows], v[rows], g[rows], beta[rows], cache, slots,
                                   keep, has, scale=scale, interpret=interpret)
    return on_rows(out_s, cu_q_lens, q.shape[0], jnp.float32), cache


# True: one_rows_in_place's decode kernel reads each sequence's row of q, k, v, g, beta in the
# step's [T] arrays itself (decode_in_place's `rows`), where five gathers of [S] rows a GDN layer
# ran before it (H100, session 36: the plain step's +108 kernels with ONE_ROWS_IN_PLACE). The same
# bits. On since session 37 (H100: compiled tests pass; rag's 1,024-token plain step 7.49 -> 7.35
# ms, 730 -> 694 kernels; benchmarks/RESULTS.md, "Position-independent spans on hybrid
# models"). Read when a step is traced.
ROWS_IN_KERNEL = True


def one_rows_in_place(q, k, v, g, beta, cu_q_lens, one_row, cache, slots, keep, *, scale=None,
                      interpret=False):
    """decode_in_place for the sequences of a prefill step marked `one_row` [S] bool (each has
    one row this step, its first): their states stepped in the cache in place, every other
    sequence's state left as it is (a chunked pass packed them, `ragged.packing`'s skip, and
    may have written their finals there already). Inputs as ragged_decode_in_place's.
    Returns (out [S, Hv, Dv] float32: each marked sequence's output, zeros for the others,
    the updated cache)."""
    rows = _decode_rows(cu_q_lens, q.shape[0])[0]
    # an unmarked sequence keeps what the cache holds: not zeroed where its keep is False
    keep = keep | ~one_row
    if ROWS_IN_KERNEL:
        return decode_in_place(q, k, v, g, beta, cache, slots, keep, one_row, scale=scale,
                               interpret=interpret, rows=rows)
    return decode_in_place(q[rows], k[rows], v[rows], g[rows], beta[rows], cache, slots,
                           keep, one_row, scale=scale, interpret=interpret)


def _decode_rows(cu_q_lens, n_tokens: int):
    """A decode step's rows: each sequence's one row [S] and whether it has one."""
    return jnp.clip(cu_q_lens[:-1], 0, n_tokens - 1), cu_q_lens[1:] > cu_q_lens[:-1]


def seq_rows(x, n_seqs: int):
    """x [T, ...] of a step whose sequence i's one new row, if it has one, is row i (an engine's
    decode-only step: RecurrentMetadata.decode) as [S, ...] per sequence: a static slice, no
    gather (T >= S); rows of sequences with no token are undefined."""
    if x.shape[0] < n_seqs:
        raise ValueError(f"seq_rows: {x.shape[0]} rows hold no row per sequence of {n_seqs}")
    return x[:n_seqs]


def on_seq_rows(out_s, cu_q_lens, n_tokens: int, dtype):
    """on_rows of such a step: sequence i's output on row i (a static slice, zeros past the
    sequences' rows), no gather."""
    s = out_s.shape[0]
    got = out_s[:n_tokens] if s >= n_tokens else jnp.pad(
        out_s, [(0, n_tokens - s)] + [(0, 0)] * (out_s.ndim - 1))
    inside = (jnp.arange(n_tokens, dtype=jnp.int32) < cu_q_lens[-1]).reshape(
        (n_tokens,) + (1,) * (out_s.ndim - 1))
    return jnp.where(inside, got.astype(dtype), jnp.zeros((), dtype))


def on_rows(out_s, cu_q_lens, n_tokens: int, dtype):
    """Per-sequence outputs [S, ...] of a step whose sequences have <= 1 row each, as the step's
    rows [T, ...] in dtype (zeros on rows no sequence has). A gather and a select, which XLA fuses
    into their consumer, where a scatter into zeros is a kernel of its own (18 a decode step of
    Qwen3.5-0.8B; session 27)."""
    t = jnp.arange(n_tokens, dtype=jnp.int32)
    seq = jnp.sum(cu_q_lens[1:][None, :] <= t[:, None], axis=1)  # the sequence holding row t
    got = out_s[jnp.minimum(seq, out_s.shape[0] - 1)].astype(dtype)
    inside = (t < cu_q_lens[-1]).reshape((n_tokens,) + (1,) * (out_s.ndim - 1))
    return jnp.where(inside, got, jnp.zeros((), dtype))


def ragged_decode_layer_in_place(q, k, v, a, b, a_log, dt_bias, z, norm, cu_q_lens, cache,
                                 slots, keep, *, eps, interpret=False, to_rows=True,
                                 per_seq=False, proj=None):
    """ragged_decode_in_place with the GDN layer's glue in the kernel
    (decode_triton.decode_layer_in_place: q / k before their l2 norm, the gates' inputs a / b,
    the gated RMS norm's z and weight). Returns (the normed gated output [T, Hv, Dv] in z's
    dtype, zeros on rows no sequence steps, the updated cache); to_rows=False: the output per
    sequence [S, Hv, Dv] (undefined where a sequence has no row: `on_rows` maps it later).
    per_seq: q, k, v, a, b, z are already per sequence ([S, ...], `seq_rows`; with to_rows
    False: no gather at all); with per_seq, proj = (x, z_col) may give a, b, z (None) as
    columns of the step's fused projection x [T, W] (decode_triton.decode_layer_in_place)."""
    if proj is not None and not per_seq:
        raise ValueError("ragged_decode_layer_in_place: proj needs per_seq (row i sequence i)")
    if per_seq:
        if to_rows:
            raise ValueError("ragged_decode_layer_in_place: per_seq inputs hold no row count; "
                             "pass to_rows=False and map the output with on_seq_rows")
        has = cu_q_lens[1:] > cu_q_lens[:-1]
        out_s, cache = decode_layer_in_place(q, k, v, a, b, a_log, dt_bias, z, norm, cache,
                                             slots, keep, has, eps=eps, interpret=interpret,
                                             proj=proj)
        return out_s, cache
    rows, has = _decode_rows(cu_q_lens, q.shape[0])
    out_s, cache = decode_layer_in_place(q[rows], k[rows], v[rows], a[rows], b[rows], a_log,
                                         dt_bias, z[rows], norm, cache, slots, keep, has,
                                         eps=eps, interpret=interpret)
    if not to_rows:
        return out_s.astype(z.dtype), cache
    return on_rows(out_s, cu_q_lens, q.shape[0], z.dtype), cache


def ragged_decode_conv_layer_in_place(x, conv_w, conv_cache, a, b, a_log, dt_bias, z, norm,
                                      cu_q_lens, cache, slots, keep, *, eps, interpret=False):
    """ragged_decode_layer_in_place with the layer's causal conv in the kernel too
    (decode_triton.decode_conv_layer_in_place: x [T, C] the mixed projection, the conv state
    cache moved on in place). Returns (output [T, Hv, Dv], conv cache, state cache)."""
    rows, has = _decode_rows(cu_q_lens, x.shape[0])
    out_s, conv_cache, cache = decode_conv_layer_in_place(
        x[rows], conv_w, conv_cache, a[rows], b[rows], a_log, dt_bias, z[rows], norm, cache,
        slots, keep, has, eps=eps, interpret=interpret)
    return on_rows(out_s, cu_q_lens, x.shape[0], z.dtype), conv_cache, cache
