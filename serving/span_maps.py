"""Cached span maps of a hybrid model's recurrent layers, and the entry state they compose to.

A span (SSEP segment) leaves in every Gated DeltaNet layer an affine map of the delta state,
(A_span [Hv, Dk, Dk], B_span [Hv, Dk, Dv]) (kernels_pallas/gated_delta/affine.py), and the last
Kc - 1 layer inputs it saw (its conv tail). Both depend on the span's tokens only, so one entry per
span serves every request at any offset. A PDEP segment enters each layer with the state of the
recurrence run over all earlier segments: the maps applied in order to the state before them, and
the conv window shifted by each tail (docs/DESIGN.md section 5). `entry_states` does that on device,
inside the jitted step: one gather from the pool, then one batched matmul per map in the chain.

Shape letters: P pool slots, Lg GDN layers, S sequences, L maps per sequence (padded with -1),
Hv/Dk/Dv delta heads and dims, C conv channels, K1 = Kc - 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.gated_delta import affine


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpanMapPool:
    a: jax.Array  # [P, Lg, Hv, Dk, Dk] transition (state dtype)
    b: jax.Array  # [P, Lg, Hv, Dk, Dv] state the span leaves from zero (state dtype)
    tail: jax.Array  # [P, Lg, C, K1] last K1 layer inputs, right-aligned, zeros before (conv dtype)
    count: jax.Array  # [P] int32 the span's non-pad tokens (a span shorter than K1 shifts less)


def map_nbytes(hv, dk, dv, conv_channels, k1, gdn_layers, *, state_dtype=jnp.float32,
               conv_dtype=jnp.float32) -> dict:
    """Exact bytes of one cached span (all GDN layers), as the pool holds it."""
    st, cv = jnp.dtype(state_dtype).itemsize, jnp.dtype(conv_dtype).itemsize
    per_layer = dict(a=hv * dk * dk * st, b=hv * dk * dv * st, tail=conv_channels * k1 * cv)
    layer = sum(per_layer.values())
    return dict(per_layer, per_layer_total=layer, layers=gdn_layers, total=gdn_layers * layer + 4)


def allocate(slots, gdn_layers, hv, dk, dv, conv_channels, k1, *, state_dtype=jnp.float32,
             conv_dtype=jnp.float32) -> SpanMapPool:
    """A zeroed pool of `slots` span maps."""
    return SpanMapPool(a=jnp.zeros((slots, gdn_layers, hv, dk, dk), state_dtype),
                       b=jnp.zeros((slots, gdn_layers, hv, dk, dv), state_dtype),
                       tail=jnp.zeros((slots, gdn_layers, conv_channels, k1), conv_dtype),
                       count=jnp.zeros((slots,), jnp.int32))


def store(pool: SpanMapPool, slot, a, b, tail, count) -> SpanMapPool:
    """Write the maps of S spans into their slots (slot [S] int32, -1 = skip).

    a [Lg, S, Hv, Dk, Dk], b [Lg, S, Hv, Dk, Dv], tail [Lg, S, C, K1], count [S] (layer-major, as
    the model returns per-layer states)."""
    p = pool.a.shape[0]
    dest = jnp.where(slot >= 0, slot, p)  # out of range: dropped
    put = lambda buf, x: buf.at[dest].set(x.astype(buf.dtype), mode="drop")  # noqa: E731
    return SpanMapPool(a=put(pool.a, jnp.moveaxis(a, 0, 1)), b=put(pool.b, jnp.moveaxis(b, 0, 1)),
                       tail=put(pool.tail, jnp.moveaxis(tail, 0, 1)),
                       count=put(pool.count, count))


def shift_window(window, tail, n):
    """The conv window after n more inputs whose last K1 are `tail` (right-aligned).

    window, tail [..., C, K1]; n [...] int32 >= 0. Position j of the result holds tail[j] when it
    is one of the n new inputs (j >= K1 - n), else window[j + n]."""
    k1 = window.shape[-1]
    j = jnp.arange(k1, dtype=jnp.int32)
    n = jnp.asarray(n, jnp.int32)[..., None, None]
    older = jnp.take_along_axis(window, jnp.broadcast_to(jnp.clip(j + n, 0, k1 - 1),
                                                         window.shape), axis=-1)
    return jnp.where(j >= k1 - n, tail.astype(window.dtype), older)


def entry_states(pool: SpanMapPool, slots, conv0, delta0):
    """Entry states of S segments, each after its chain of cached spans.

    Args:
      pool: the span maps.
      slots: [S, L] int32 pool slots in order (the first map runs first); -1 ends a chain.
      conv0: [Lg, S, C, K1] conv windows before the chain; delta0: [Lg, S, Hv, Dk, Dv] float32.
    Returns:
      conv [Lg, S, C, K1] (conv0's dtype), delta [Lg, S, Hv, Dk, Dv] float32.
    """
    n_maps = jnp.sum(jnp.cumprod(slots >= 0, axis=1), axis=1)  # [S] chain lengths
    idx = jnp.clip(slots, 0, pool.a.shape[0] - 1)
    a = jnp.moveaxis(pool.a[idx], (1, 2), (0, 1))  # [L, Lg, S, Hv, Dk, Dk]
    b = jnp.moveaxis(pool.b[idx], (1, 2), (0, 1))  # [L, Lg, S, Hv, Dk, Dv]
    delta = affine.apply_chain(a, b, delta0, count=n_maps[None, :, None])
    tails = jnp.moveaxis(pool.tail[idx], (1, 2), (0, 1))  # [L, Lg, S, C, K1]
    counts = pool.count[idx].T  # [L, S]

    def conv_step(win, xs):
        i, tail, n = xs
        nxt = shift_window(win, tail, n[None, :])
        return jnp.where((i < n_maps)[None, :, None, None], nxt, win), None

    steps = jnp.arange(slots.shape[1], dtype=jnp.int32)
    conv, _ = jax.lax.scan(conv_step, conv0, (steps, tails, counts))
    return conv, delta
