"""A model's fingerprint for the persistent span store: config, dtype and a weights sample.

Hashing every weight of an 8B model would read 16 GB; instead each params leaf contributes its
path, shape, dtype and its first and last 256 elements (one jitted gather, a few KB back to the
host). Two checkpoints or two preset seeds differ there, so their KV never mixes on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

_SAMPLE = 256


@jax.jit
def _samples(params):
    def ends(x):
        flat = jnp.ravel(x)
        n = min(_SAMPLE, flat.size)
        return jnp.concatenate([flat[:n], flat[flat.size - n:]]).astype(jnp.float32)
    return [ends(x) for x in jax.tree.leaves(params)]


def _host_samples(params, dtype):
    """_samples of host (numpy, e.g. memory-mapped) params, cast to `dtype` as loading does;
    only the sampled elements are read."""
    def ends(x):
        n = min(_SAMPLE, x.size)
        flat = np.concatenate([np.arange(n), np.arange(x.size - n, x.size)])
        return np.asarray(np.asarray(x[np.unravel_index(flat, x.shape)], dtype), np.float32)
    return [ends(x) for x in jax.tree.leaves(params)]


def model_fingerprint(cfg, params, dtype) -> str:
    """sha256 (hex, 32 chars) of the model config, the compute dtype and the weights sample.
    Host params (tensor parallelism streams them later) give the fingerprint of the loaded ones."""
    h = hashlib.sha256()
    cfg_d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg)
    h.update(json.dumps(cfg_d, sort_keys=True, default=repr).encode())
    h.update(jnp.dtype(dtype).name.encode())
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    host = all(isinstance(leaf, np.ndarray) for _, leaf in paths)
    samples = _host_samples(params, dtype) if host else _samples(params)
    for (path, leaf), sample in zip(paths, samples):
        leaf_dtype = jnp.dtype(dtype) if host else leaf.dtype
        h.update(f"{jax.tree_util.keystr(path)}{tuple(leaf.shape)}{leaf_dtype}".encode())
        h.update(np.asarray(sample).tobytes())
    return h.hexdigest()[:32]
