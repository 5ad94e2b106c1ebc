"""The XLA path of ragged.run_stream: the packed chunks through chunked.py's intra-chunk and
output math and one lax.scan over every chunk, restarting at each sequence's first chunk (the
kernels' per-sequence programs give the same states: ragged_triton.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.gated_delta import chunked
from kernels_pallas.gated_delta.state_rows import as_array, rows_of


def take_rows(x, rows):
    """x [T, ...] -> [rows..., ...]: row rows[i] of x, zeros where out of range (>= T; indices
    are never negative here, so no wrap-around ops: one gather)."""
    return jnp.asarray(x).at[rows].get(mode="fill", fill_value=0, wrap_negative_indices=False)


def stream(q, k, pairs, pk, state0, seq_state, bounds, *, scale, chunk, transition,
                transitions):
    """ragged.run_stream's XLA path (lax.scan over the packed chunks; the same returns)."""
    hk, hv = k.shape[1], pairs[2][0].shape[1]
    chunk_src = pk.get("chunk_src")
    f32 = jnp.float32
    if hv != hk:
        q = jnp.repeat(q, hv // hk, axis=1)
        k = jnp.repeat(k, hv // hk, axis=1)
    pairs = ((q, pk["src"]), (k, pk["src"])) + pairs[2:]  # q, k with their heads repeated
    packed = [take_rows(x.astype(f32), src)[None] for x, src in pairs]
    qc, kc, vc, gc, bc = (chunked.to_chunks(x, chunk) for x in packed)  # [1, H, NC, C, ...]
    parts = chunked.intra_chunk(qc, kc, vc, gc, bc, scale=scale)
    scan_in = [parts[key] for key in ("w", "u", "kd", "decay_last")]
    if chunk_src is not None:  # borrowed chunks: their lender's
        scan_in = [jnp.take(x, chunk_src, axis=2) for x in scan_in]
    v_new, entering, before, *prod = _restart_scan(
        *scan_in, pk["restart"],
        seq_state, as_array(state0).astype(f32), transition=transition)
    out = chunked.chunk_output(parts["qg"], parts["attn"], v_new,
                               jnp.moveaxis(entering, 0, 1)[None])
    if transitions is not None:
        prod = [_chunk_products(parts["w"], parts["kd"], parts["decay_last"], *transitions)]
    elif transition:
        prod = [prod[0][bounds]]
    return (chunked.from_chunks(out)[0], before[bounds], prod[0] if prod else None,
            None)


def _restart_scan(w, u, kd, decay_last, restart, seq_of_chunk, state0, transition=False):
    """lax.scan over packed chunks; at a restart chunk the carry is replaced by state0[seq].

    w, kd [1, H, NC, C, Dk], u [1, H, NC, C, Dv], decay_last [1, H, NC], state0 [S, H, Dk, Dv].
    transition: also carry the product of the chunk maps (affine.py) since the sequence's first
    chunk, restarted at the identity like the state.
    Returns v_new [1, H, NC, C, Dv], entering [NC, H, Dk, Dv] (state entering each chunk),
    before [NC + 1, H, Dk, Dv] (the carry before any restart substitution: state at the end of
    chunk c - 1; entry NC is the end of the last chunk), and with transition the same for the
    product, [NC + 1, H, Dk, Dk].
    """
    dk = w.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), state0.shape[1:2] + (dk, dk))

    def step(carry, xs):
        s, p = carry
        w_c, u_c, kd_c, dl_c, rs_c, sq_c = xs
        s = jnp.where(rs_c, state0[sq_c], s)
        v_new = u_c - jnp.einsum("hcd,hde->hce", w_c, s)
        s_next = s * dl_c[:, None, None] + jnp.einsum("hcd,hce->hde", kd_c, v_new)
        if p is not None:
            p = jnp.where(rs_c, eye, p)
            p = p * dl_c[:, None, None] - jnp.einsum(
                "hcd,hce->hde", kd_c, jnp.einsum("hcd,hde->hce", w_c, p))
        return (s_next, p), (v_new, s, s_next, p)

    xs = tuple(jnp.moveaxis(x[0], 1, 0) for x in (w, u, kd, decay_last)) + (restart, seq_of_chunk)
    init = jnp.zeros(state0.shape[1:], jnp.float32)
    _, (v_new, entering, ends, p_ends) = jax.lax.scan(step, (init, eye if transition else None),
                                                      xs)
    before = jnp.concatenate([init[None], ends], axis=0)
    out = (jnp.moveaxis(v_new, 0, 1)[None], entering, before)
    if transition:
        out += (jnp.concatenate([eye[None], p_ends], axis=0),)
    return out


def _chunk_products(w, kd, decay_last, first, count, init):
    """XLA: [M, H, Dk, Dk] the product of the maps of packed chunks first[m] .. + count[m]
    (w, kd [1, H, NC, C, Dk], decay_last [1, H, NC]) from I (init None) or init's row m (a
    StateRows or [M, H, Dk, Dk]): the scan's state step with U = 0, every product carried
    through every chunk and changed in its own."""
    m, (hv, dk) = first.shape[0], w.shape[1:2] + w.shape[-1:]
    p0 = (jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (m, hv, dk, dk)) if init is None
          else rows_of(init, jnp.arange(m, dtype=jnp.int32)))
    end = first + jnp.maximum(count, 0)

    def step(p, xs):  # per product the scan's state step with U = 0 (the same dots)
        c, w_c, kd_c, dl_c = xs  # [H, C, Dk], [H, C, Dk], [H]
        nxt = []
        for i in range(m):
            v_new = -jnp.einsum("hcd,hde->hce", w_c, p[i])
            nxt.append(p[i] * dl_c[:, None, None] + jnp.einsum("hcd,hce->hde", kd_c, v_new))
        return jnp.where(((first <= c) & (c < end))[:, None, None, None], jnp.stack(nxt),
                         p), None

    xs = (jnp.arange(w.shape[2], dtype=jnp.int32),) + tuple(
        jnp.moveaxis(x[0], 1, 0) for x in (w, kd, decay_last))
    return jax.lax.scan(step, p0, xs)[0]
