"""Chunked gated delta rule in plain XLA (WY / UT form, chunk C, inter-chunk state by lax.scan).

Within a chunk (positions i, j in [0, C), gc = in-chunk cumulative log decay, Gamma_ij =
exp(gc_i - gc_j) for j <= i, its exponent summed directly as g over (j, i], see
`segment_sums`), the C delta-rule updates collapse into one unit lower-triangular system (the
UT transform):
    (I + tril(diag(beta) K K^T * Gamma, -1)) [U | W] = [diag(beta) V | diag(beta exp(gc)) K]
Then, with S the state entering the chunk:
    V' = U - W S                                  (what the old state does not yet predict)
    O  = (Q exp(gc)) S + tril(Q K^T * Gamma) V'   (inter + intra chunk)
    S  <- exp(gc_last) S + (K exp(gc_last - gc))^T V'
Everything except the last line is parallel over chunks; the last line is the scan. Chunk
boundaries are counted from the start of the given tokens, so the state after c tokens (c a
multiple of C) is computed by exactly the same operations whatever follows c: checkpoints taken
from a long prefill equal the final state of a prefill that stopped at c.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def to_chunks(x, chunk):
    """[N, T, H, ...] -> [N, H, NT, C, ...] (T a multiple of chunk)."""
    n, t_len, h = x.shape[:3]
    x = x.reshape(n, t_len // chunk, chunk, h, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def from_chunks(x):
    """[N, H, NT, C, ...] -> [N, T, H, ...]."""
    n, h, nt, c = x.shape[:4]
    return jnp.moveaxis(x, 1, 3).reshape(n, nt * c, h, *x.shape[4:])


def unit_lower_inverse(m, base=8):
    """Inverse of unit lower-triangular m [..., n, n] (n a power of 2) by block recursion:
    [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]], both halves inverted together.
    Uses the exact block formula (no Neumann series), so no cancellation beyond the inverse's own.
    """
    n = m.shape[-1]
    if n <= base:  # forward substitution, row by row (unrolled, elementwise)
        inv = jnp.eye(n, dtype=m.dtype) + jnp.zeros_like(m)
        for i in range(1, n):
            row = -jnp.einsum("...j,...jk->...k", m[..., i, :i], inv[..., :i, :])
            inv = inv.at[..., i, :i].set(row[..., :i])
        return inv
    h = n // 2
    halves = unit_lower_inverse(jnp.stack([m[..., :h, :h], m[..., h:, h:]]), base)
    a_inv, b_inv = halves[0], halves[1]
    x = -jnp.einsum("...ij,...jk,...kl->...il", b_inv, m[..., h:, :h], a_inv)
    top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
    bottom = jnp.concatenate([x, b_inv], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def segment_sums(g):
    """seg[.., i, j] = sum of g[.., m] over j < m <= i (0 where i <= j), g [.., C] -> [.., C, C].

    Summed directly (a cumulative sum down the rows of the masked [C, C] matrix), not as gc_i -
    gc_j: with all g <= 0 the error is a few eps32 of the segment itself, where the difference of
    two cumulative sums carries a few eps32 of |gc|, which after a hard reset (decays of -60 per
    token and more) is thousands, so exp(seg) would be ~1e-4 relative off."""
    chunk = g.shape[-1]
    later = (jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
             > jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1))  # [m, j]: m > j
    return jnp.cumsum(jnp.where(later, g[..., :, None], 0.0), axis=-2)  # also inside kernels


def intra_chunk(q, k, v, g, beta, *, scale, solve="blocked"):
    """The parallel (per-chunk) half: cumulative gates, UT solve, W, U and the masked scores.

    Args (already chunked, float32, k/q already expanded to Hv heads):
      q, k: [N, H, NT, C, Dk]; v: [N, H, NT, C, Dv]; g, beta: [N, H, NT, C].
    Returns dict of w [.., C, Dk], u [.., C, Dv], qg (scaled, decayed q) [.., C, Dk],
      kd (k decayed to chunk end) [.., C, Dk], attn (masked intra scores) [.., C, C],
      decay_last [N, H, NT] (exp of the chunk's total log decay).
    """
    chunk = g.shape[-1]
    gc = jax.lax.associative_scan(jnp.add, g, axis=-1)  # [N, H, NT, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))
    seg = segment_sums(g)
    gamma = jnp.exp(jnp.where(causal, seg, -jnp.inf))  # [.., C, C], 0 above the diagonal
    k_beta = k * beta[..., None]
    lower = jnp.einsum("...id,...jd->...ij", k_beta, k) * gamma
    system = jnp.where(jnp.tril(causal, -1), lower, 0.0) + jnp.eye(chunk, dtype=lower.dtype)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(gc)[..., None]], axis=-1)
    if solve == "trsm":
        sol = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True,
                                              unit_diagonal=True)
    elif solve == "blocked":
        sol = jnp.einsum("...ij,...jd->...id", unit_lower_inverse(system), rhs)
    else:
        raise ValueError(f"gated_delta: solve must be 'trsm' or 'blocked', got {solve!r}")
    dv = v.shape[-1]
    u, w = sol[..., :dv], sol[..., dv:]
    q_s = q * scale
    attn = jnp.einsum("...id,...jd->...ij", q_s, k) * gamma
    return dict(w=w, u=u, qg=q_s * jnp.exp(gc)[..., None], kd=k * jnp.exp(seg[..., -1, :, None]),
                attn=attn, decay_last=jnp.exp(gc[..., -1]))


def state_scan(w, u, kd, decay_last, state0, ckpt_idx=None, *, transition=False):
    """The sequential half: carry the state across chunks.

    Args:
      w, kd: [N, H, NT, C, Dk]; u: [N, H, NT, C, Dv]; decay_last: [N, H, NT]; state0 [N, H, Dk, Dv].
      ckpt_idx: None or [N, M] int32 boundaries j in [0, NT] (state after j chunks) to return.
      transition: also carry the span's transition A_span = A_{NT-1} ... A_0 (affine.py), updated
        like the state with no write: P <- exp(gc_last) P - KD^T (W P).
    Returns:
      v_new [N, H, NT, C, Dv], chunk_states [N, H, NT, Dk, Dv] (state entering each chunk),
      final_state [N, H, Dk, Dv] float32, checkpoint states [N, M, H, Dk, Dv] float32 (or None),
      and with transition=True a_span [N, H, Dk, Dk] float32.
    """
    def step(carry, xs):
        s, p = carry
        w_c, u_c, kd_c, dl_c = xs
        v_new = u_c - jnp.einsum("nhcd,nhde->nhce", w_c, s)
        s_next = s * dl_c[..., None, None] + jnp.einsum("nhcd,nhce->nhde", kd_c, v_new)
        if p is not None:
            p = p * dl_c[..., None, None] - jnp.einsum(
                "nhcd,nhce->nhde", kd_c, jnp.einsum("nhcd,nhde->nhce", w_c, p))
        return (s_next, p), (v_new, s)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (w, u, kd, decay_last))
    p0 = None
    if transition:
        dk = w.shape[-1]
        p0 = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), state0.shape[:2] + (dk, dk))
    (final, a_span), (v_new, states) = jax.lax.scan(step, (state0, p0), xs)
    v_new, states = jnp.moveaxis(v_new, 0, 2), jnp.moveaxis(states, 0, 2)
    ckpt = None
    if ckpt_idx is not None:
        all_states = jnp.concatenate([states, final[:, :, None]], axis=2)  # [N, H, NT + 1, ..]
        ckpt = jnp.take_along_axis(all_states, ckpt_idx[:, None, :, None, None], axis=2)
        ckpt = jnp.moveaxis(ckpt, 2, 1)
    return (v_new, states, final, ckpt) + ((a_span,) if transition else ())


def chunk_output(qg, attn, v_new, chunk_states):
    """O = (Q exp(gc)) S_chunk + tril(Q K^T Gamma) V' for every chunk at once: [N, H, NT, C, Dv]
    float32 (float32 accumulation whatever the operand dtype)."""
    f32 = jnp.float32
    return (jnp.einsum("nhtcd,nhtde->nhtce", qg, chunk_states, preferred_element_type=f32)
            + jnp.einsum("nhtij,nhtje->nhtie", attn, v_new.astype(attn.dtype),
                         preferred_element_type=f32))


def chunked_gated_delta(q, k, v, g, beta, state0, ckpt_idx=None, *, scale, chunk, scan_fn=None,
                        solve="blocked", inter_dtype=None, transition=False):
    """Chunked prefill over T = NT * chunk tokens (no padding here; api.py pads).

    Args:
      q, k: [N, T, Hk, Dk]; v: [N, T, Hv, Dv]; g, beta: [N, T, Hv]; state0 [N, Hv, Dk, Dv] f32.
      ckpt_idx: None or [N, M] int32 chunk boundaries in [0, NT] whose states to return.
      solve: "blocked" (block-recursive inverse, batched matmuls) or "trsm" (lax triangular_solve).
      inter_dtype: dtype of the intermediates fed to the scan and the output matmuls (default
        float32; bfloat16 halves their memory traffic, like flash-linear-attention).
      transition: also return the span's transition (scan_fn must take transition=True).
    Returns:
      out [N, T, Hv, Dv] float32, final state [N, Hv, Dk, Dv] float32, checkpoint states
      [N, M, Hv, Dk, Dv] float32 (state after ckpt_idx * C tokens) or None; with transition=True
      also a_span [N, Hv, Dk, Dk] float32 (final = a_span state0 + final-from-zero).
    """
    hk, hv = k.shape[2], v.shape[2]
    f32 = jnp.float32
    if hv != hk:  # GQA: value head h reads key head h // (hv // hk)
        q = jnp.repeat(q, hv // hk, axis=2)
        k = jnp.repeat(k, hv // hk, axis=2)
    qc, kc, vc = (to_chunks(x.astype(f32), chunk) for x in (q, k, v))
    gc, bc = (to_chunks(x.astype(f32), chunk) for x in (g, beta))
    parts = intra_chunk(qc, kc, vc, gc, bc, scale=scale, solve=solve)
    if inter_dtype is not None:
        parts = {name: x if name == "decay_last" else x.astype(inter_dtype)
                 for name, x in parts.items()}
    scan = state_scan if scan_fn is None else scan_fn
    res = scan(parts["w"], parts["u"], parts["kd"], parts["decay_last"], state0.astype(f32),
               ckpt_idx, **({"transition": True} if transition else {}))
    v_new, chunk_states, final, ckpt = res[:4]
    out = chunk_output(parts["qg"], parts["attn"], v_new, chunk_states.astype(parts["qg"].dtype))
    return (from_chunks(out), final, ckpt) + tuple(res[4:])


def recurrent_step(q, k, v, g, beta, state, *, scale):
    """One token per sequence (decode), float32.

    Args:
      q, k: [N, Hk, Dk]; v: [N, Hv, Dv]; g, beta: [N, Hv]; state [N, Hv, Dk, Dv].
    Returns:
      out [N, Hv, Dv] float32, new state [N, Hv, Dk, Dv] float32.
    """
    hk, hv = k.shape[1], v.shape[1]
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if hv != hk:
        q = jnp.repeat(q, hv // hk, axis=1)
        k = jnp.repeat(k, hv // hk, axis=1)
    s = state.astype(f32) * jnp.exp(g)[..., None, None]
    kv_mem = jnp.einsum("nhk,nhkv->nhv", k, s)
    delta = (v - kv_mem) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    out = jnp.einsum("nhk,nhkv->nhv", q * scale, s)
    return out, s
