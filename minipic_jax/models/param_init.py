"""Deterministic random params from a pytree of shapes (shared by the model families)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def is_shape(x) -> bool:
    """A shape tuple leaf (ints only)."""
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


# Below this many parameters, numpy draws the weights (XLA's RNG compile dominates on CPU);
# above it, jax.random draws them on the default device.
_NUMPY_INIT_MAX = 64 << 20


def init_from_shapes(shapes, key, dtype):
    """Random params for a pytree of shape tuples: 1-D leaves are ones (norm weights), others
    normal(0, 0.02). Deterministic in `key`."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    total = sum(int(np.prod(s)) for s in leaves)
    if total <= _NUMPY_INIT_MAX and not isinstance(key, jax.core.Tracer):  # eval_shape traces
        rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
        out = [jnp.ones(s, dtype) if len(s) == 1 else
               jnp.asarray(0.02 * rng.standard_normal(s, np.float32), dtype) for s in leaves]
    else:
        keys = jax.random.split(key, len(leaves))
        out = [jnp.ones(s, dtype) if len(s) == 1 else _normal(kk, s, jnp.dtype(dtype))
               for kk, s in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype):
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
