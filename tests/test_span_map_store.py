"""A warm span step's store of its captured maps (serving/hybrid/span_maps.store; issue 29: work in
a span step beyond what its tokens need). Every warm step stores MAX_CAPTURES maps of every GDN
layer, captured or not (slot -1: dropped); the store scatters them to (slot, layer) straight from
the model's per-layer arrays, with no transposed [S, Lg, ...] copy of them first, and (unless
span_maps.STORE_STACKED) no stacked [Lg, S, ...] one either."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpr_walk import outer_eqns, primitive_counts
from serving.hybrid import span_maps


def _maps(rng, lg, s, hv=2, dk=4, dv=3, c=5, k1=3):
    a = rng.standard_normal((lg, s, hv, dk, dk)).astype(np.float32)
    b = rng.standard_normal((lg, s, hv, dk, dv)).astype(np.float32)
    tail = rng.standard_normal((lg, s, c, k1)).astype(np.float32)
    return a, b, tail, rng.integers(1, 99, s).astype(np.int32)


@pytest.mark.parametrize("stacked", [False, True, "small"])
def test_store_scatters_layer_major_maps_without_a_transposed_copy(fresh_rng, monkeypatch,
                                                                   stacked):
    monkeypatch.setattr(span_maps, "STORE_STACKED", stacked is True)
    monkeypatch.setattr(span_maps, "STORE_SMALL_STACKED", stacked == "small")
    lg, s, slots = 3, 4, 6
    a, b, tail, count = _maps(fresh_rng, lg, s)
    a[1, 0, 1] = a[2, 3, 0] = a[0, 1, 1] = 0.0  # stored (0 -> slot 4, 3 -> slot 2) / dropped
    a[0, 2, 0, 1, 2] = 0.0  # one zero entry is no zero map
    pool = span_maps.allocate(slots, lg, 2, 4, 3, 5, 3)
    slot = jnp.asarray([4, -1, 0, 2], jnp.int32)
    per_layer = [list(x) for x in (a, b, tail)]  # as the model returns them
    # a fresh function: make_jaxpr caches a traced function, and STORE_STACKED is read in it
    jaxpr = jax.make_jaxpr(lambda *x: span_maps.store(*x))(pool, slot, *per_layer, count).jaxpr
    ops = primitive_counts(jaxpr)
    stacks = [e for e in outer_eqns(jaxpr)  # of the maps, not of scatter indices
              if e.primitive.name == "concatenate" and e.outvars[0].aval.size >= lg * s * 2]
    assert ops["transpose"] == 0, ops
    if stacked is True:  # one scatter a field (a, b, tail, zero_a stacked first)
        assert ops["scatter"] == 5 and len(stacks) == 4, ops
    elif stacked:  # a and b per layer, the tails and zero flags stacked, count's
        assert ops["scatter"] == 2 * lg + 3 and len(stacks) == 2, ops
    else:  # one a field and layer, and count's: nothing stacked
        assert ops["scatter"] == 4 * lg + 1 and not stacks, ops
    got = span_maps.store(pool, slot, *per_layer, count)
    for name, x in (("a", a), ("b", b), ("tail", tail)):
        want = np.zeros(getattr(pool, name).shape, np.float32)
        for j, sl in enumerate(np.asarray(slot)):
            if sl >= 0:
                want[sl] = x[:, j]
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), want)
    np.testing.assert_array_equal(np.asarray(got.count), [count[2], 0, count[3], 0, count[0], 0])
    zero = np.zeros((slots, lg, 2), bool)  # [slot, layer, head]
    zero[4, 1, 1] = zero[2, 2, 0] = True
    np.testing.assert_array_equal(np.asarray(got.zero_a), zero)


def test_the_store_writes_the_pool_after_the_layers_read_it_without_a_copy(fresh_rng):
    """A warm step's layers read their entries' maps from the pool and the store then writes it
    in place: the store orders itself after every read (its maps depend on them), so XLA keeps
    no copy of the pool's A and B to protect the reads (on an H100, 2 x 302 MiB a step at rag's
    16 slots). A chain of layers as the model runs them: each reads its layer of the pool and
    the next one's input depends on the last; compiled for the CPU, the pool donated."""
    lg, s, slots = 3, 4, 6
    pool = span_maps.allocate(slots, lg, 2, 4, 4, 5, 3)
    slot = jnp.asarray([4, -1, 0, 2], jnp.int32)

    def step(pool, slot, x):
        a, b, tail = [], [], []
        for layer in range(lg):  # entries read per layer, the layer's maps built from them
            x = jnp.tanh(x + pool.a[jnp.maximum(slot, 0), layer].sum())
            a.append(x * pool.a[jnp.maximum(slot, 0), layer])
            b.append(x * pool.b[jnp.maximum(slot, 0), layer])
            tail.append(jnp.broadcast_to(x[:1, :1, :1, 0].reshape(-1, 1, 1), (s, 5, 3)))
        return span_maps.store(pool, slot, a, b, tail, jnp.full(s, 3, jnp.int32))
    x = jnp.asarray(fresh_rng.standard_normal((s, 2, 4, 4)), jnp.float32)
    hlo = jax.jit(step, donate_argnums=0).lower(pool, slot, x).compile().as_text()
    copies = [ln for ln in hlo.splitlines() if " copy(" in ln
              and f"[{slots},{lg},2,4,4]" in ln.split("copy(")[0]]
    assert not copies, copies
