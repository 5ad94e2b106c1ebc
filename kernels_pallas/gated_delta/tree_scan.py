"""The inter-chunk state recurrence as an associative scan over chunk maps (affine.py).

A chunk maps its entering state S to A_c S + B_c; the maps compose associatively, so
`jax.lax.associative_scan` gives every prefix map (P_c, Q_c) (chunks 0..c) in log2(NT) levels of
batched matmuls instead of NT dependent steps (jax.lax.associative_scan). The state after chunk c is P_c S0 + Q_c: every
chunk-boundary state comes out of the scan, so checkpoints are a gather, and the span transition
A_span = P_{NT-1} is the scan's last prefix. The work per level is Dk x Dk products (Dk^3 per
chunk pair, against the sequential scan's Dk^2 C per chunk) and the maps are as large as the
states, so the tree can pay off only where the sequential scan is latency bound: few (sequence,
head) pairs and many chunks (`choose_scan`; measured slower so far).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.gated_delta import affine

SCANS = (None, "sequential", "tree", "blocked")  # blocked: scan_blocked.py (pallas_fused only)
# The tree is chosen by shape only where it was measured faster. On the H200 the XLA associative
# scan over the fp32 [Dk, Dk] chunk maps is several times slower than the whole sequential Pallas
# pipeline (its ~8 passes over the maps are memory bound; benchmarks/RESULTS.md, Gated DeltaNet),
# so no measured shape picks it: None = never.
# Set TREE_MIN_CHUNKS (with TREE_MAX_PAIRS) once a faster tree exists.
TREE_MIN_CHUNKS = None
TREE_MAX_PAIRS = 64


def choose_scan(n, heads, n_chunks, scan=None):
    """'sequential' or 'tree' for N sequences x heads x n_chunks (scan: None = by shape)."""
    if scan not in SCANS:
        raise ValueError(f"gated_delta: scan must be one of {SCANS}, got {scan!r}")
    if scan is not None:
        return scan
    if TREE_MIN_CHUNKS is not None and n_chunks >= TREE_MIN_CHUNKS and n * heads <= TREE_MAX_PAIRS:
        return "tree"
    return "sequential"


def prefix_maps(a, b, axis, *, precision=None):
    """Inclusive prefix maps along `axis`: element c is chunks 0..c run in order."""
    return jax.lax.associative_scan(functools.partial(affine.then, precision=precision), (a, b),
                                    axis=axis)


def boundary_states(a, b, state0, axis, *, precision=None):
    """States entering each chunk and the final state, from chunk maps a [.., NT, Dk, Dk],
    b [.., NT, Dk, Dv] (chunk axis `axis`, batch dims of state0 [.., Dk, Dv] before it).

    Returns (entering [.., NT, Dk, Dv], final [.., Dk, Dv], a_span [.., Dk, Dk]), float32.
    """
    p, q = prefix_maps(a, b, axis, precision=precision)
    s0 = jnp.expand_dims(state0.astype(jnp.float32), axis)
    after = affine.apply((p, q), s0, precision=precision)  # state after chunk c
    entering = jnp.concatenate([s0, jax.lax.slice_in_dim(after, 0, a.shape[axis] - 1, axis=axis)],
                               axis=axis)
    final = jnp.take(after, a.shape[axis] - 1, axis=axis)
    return entering, final, jnp.take(p, a.shape[axis] - 1, axis=axis)


def _gather_checkpoints(entering, final, ckpt_idx, axis):
    """[N, M] boundary indices (NT = final) -> [N, M, ...] states (axis = chunk axis, >= 1)."""
    all_states = jnp.concatenate([entering, jnp.expand_dims(final, axis)], axis=axis)
    all_states = jnp.moveaxis(all_states, axis, 1)  # [N, NT + 1, ...]
    idx = ckpt_idx.reshape(ckpt_idx.shape + (1,) * (all_states.ndim - 2))
    return jnp.take_along_axis(all_states, idx, axis=1)


def state_scan(w, u, kd, decay_last, state0, ckpt_idx=None, *, transition=False,
               precision=None):
    """`chunked.state_scan`'s contract (chunked layout [N, H, NT, C, D]) by the tree.

    Returns v_new [N, H, NT, C, Dv], chunk_states [N, H, NT, Dk, Dv], final [N, H, Dk, Dv],
    checkpoints [N, M, H, Dk, Dv] or None, and with transition=True also a_span [N, H, Dk, Dk].
    """
    a, b = affine.chunk_maps(w, u, kd, decay_last, precision=precision)  # [N, H, NT, ...]
    entering, final, a_span = boundary_states(a, b, state0, 2, precision=precision)
    v_new = u.astype(jnp.float32) - jnp.einsum("nhtcd,nhtde->nhtce", w, entering.astype(w.dtype),
                                               preferred_element_type=jnp.float32,
                                               precision=precision)
    ckpt = None if ckpt_idx is None else _gather_checkpoints(entering, final, ckpt_idx, 2)
    v_new = v_new.astype(u.dtype)
    return (v_new, entering, final, ckpt) + ((a_span,) if transition else ())


def fused_tree_gated_delta(q, k, v, g, beta, state0, ckpt_idx=None, *, scale, chunk=64,
                           dot_dtype=None, interpret=False, precision=None, map_dtype=None):
    """fused_triton.fused_gated_delta with the sequential Pallas state scan replaced by the tree:
    the Pallas intra-chunk solve and output kernels ([N, T, H, D] layout, no transposes), the maps
    and their scan in XLA. map_dtype: the chunk maps' storage dtype in the scan (None: float32;
    bfloat16 halves the scan's memory traffic at bf16 rounding per level). Returns out
    [N, T, Hv, Dv] (v's dtype), final [N, Hv, Dk, Dv] f32, checkpoints [N, M, Hv, Dk, Dv] f32 or
    None, a_span [N, Hv, Dk, Dk] f32.
    """
    from kernels_pallas.gated_delta import fused_triton
    n, t_len, _, dk = k.shape
    hv, dv = v.shape[2:]
    nt = t_len // chunk
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    w, u, kd, gc = fused_triton.intra(k, v, g, beta, chunk=chunk, dot_dtype=dot_dtype,
                                      interpret=interpret, **_intra_options())
    blocks = lambda x: x.reshape(n, nt, chunk, hv, x.shape[-1])  # [N, NT, C, Hv, D]
    dl = jnp.moveaxis(jnp.exp(gc[:, chunk - 1::chunk, :]), 1, 2)  # [N, Hv, NT]
    f32 = jnp.float32
    a = (dl[..., None, None] * jnp.eye(dk, dtype=f32)
         - jnp.einsum("ntchd,ntche->nhtde", blocks(kd), blocks(w), preferred_element_type=f32,
                      precision=precision))
    b = jnp.einsum("ntchd,ntche->nhtde", blocks(kd), blocks(u), preferred_element_type=f32,
                   precision=precision)
    if map_dtype is not None:
        a, b = a.astype(map_dtype), b.astype(map_dtype)
    entering, final, a_span = boundary_states(a, b, state0, 2, precision=precision)
    final, a_span = final.astype(f32), a_span.astype(f32)
    states = entering.astype(dot_dtype)  # [N, Hv, NT, Dk, Dv]
    v_new = (blocks(u).astype(f32) - jnp.einsum("ntchd,nhtde->ntche", blocks(w), states,
                                                preferred_element_type=f32, precision=precision))
    v_new = v_new.reshape(n, t_len, hv, dv).astype(dot_dtype)
    out = fused_triton.output_fused(q, k, g, v_new, states, scale=scale, chunk=chunk,
                                    dot_dtype=dot_dtype, out_dtype=v.dtype, interpret=interpret)
    ckpt = None if ckpt_idx is None else _gather_checkpoints(entering.astype(f32), final,
                                                              ckpt_idx, 2)
    return out, final, ckpt, a_span


def _intra_options():
    from kernels_pallas.gated_delta import fused_triton
    return dict(kind=fused_triton.DEFAULTS["intra"], num_warps=fused_triton.DEFAULTS["intra_warps"])
