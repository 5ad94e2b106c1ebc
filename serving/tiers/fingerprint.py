"""A model's fingerprint for the persistent span store: config, dtype and every weight byte.

The KV a store holds depends on every weight, so every byte is hashed (xxh3-128): a
checkpoint's files through serving/tiers/weight_digests.py (cached by file identity in the store
folder, so only the first start on a checkpoint reads it again), and params that come from no
file leaf by leaf from their arrays. A preset's deterministic random weights are hashed from
their arrays, not from the preset name and seed: what `init_params` draws from a seed also
depends on the init code and on JAX's PRNG implementation (its version and flags), which the
name and seed do not pin. That costs a copy of the params to the host, a leaf at a time, at
each start with `kv_store_dir` (not measured on the H200 yet for the 8B preset).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import xxhash

from serving.tiers.weight_digests import file_digests


def params_digest(params, dtype) -> str:
    """xxh3-128 (hex) of every params leaf: its path, shape, dtype and bytes. Host (numpy)
    leaves are cast to `dtype` first, as loading casts them, so host params (what tensor
    parallelism streams) give the digest of the loaded ones."""
    h = xxhash.xxh3_128()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(leaf, dtype) if isinstance(leaf, np.ndarray) else np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}{a.shape}{a.dtype};".encode())
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # one leaf on the host
    return h.hexdigest()


def model_fingerprint(cfg, params, dtype, files=(), cache_dir=None) -> str:
    """sha256 (hex, 32 chars) of the model config, the compute dtype and the weights: every
    byte of `files` (the checkpoint the params were converted from; their digests cached in
    `cache_dir`) when given, else of the params' arrays (`params_digest`)."""
    h = hashlib.sha256()
    cfg_d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg)
    h.update(json.dumps(cfg_d, sort_keys=True, default=repr).encode())
    h.update(jnp.dtype(dtype).name.encode())
    if files:
        for f, digest in zip(files, file_digests(files, cache_dir)):
            h.update(f"file {pathlib.Path(f).name} {digest};".encode())
    else:
        h.update(f"params {params_digest(params, dtype)};".encode())
    return h.hexdigest()[:32]
