"""Orbax cache of converted params, so the second load of a checkpoint skips conversion.

An entry is keyed by the folder's absolute path, the dtype, the family, and a fingerprint of the
checkpoint files (name, size, mtime), so editing or replacing a file invalidates it. Params are
stored as a flat dict of leaves and restored into the family's params structure.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import jax
import jax.numpy as jnp

FORMAT_VERSION = 2  # 2: params are Flax NNX pure dicts (entries of the dataclass layout are stale)


def default_cache_dir() -> pathlib.Path:
    env = os.environ.get("MINIPIC_JAX_CACHE_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "minipic_jax" / "params"


def cache_key(folder: pathlib.Path, files: list[pathlib.Path], dtype, family_name: str) -> str:
    stats = []
    for f in sorted(files):
        st = f.stat()
        stats.append([f.name, st.st_size, st.st_mtime_ns])
    blob = json.dumps([FORMAT_VERSION, str(folder.resolve()), jnp.dtype(dtype).name, family_name,
                       stats])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _flat(tree) -> dict:
    leaves = jax.tree.leaves(tree)
    return {f"p{i:05d}": leaf for i, leaf in enumerate(leaves)}


def save(path: pathlib.Path, params) -> None:
    import orbax.checkpoint as ocp
    path.parent.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path.resolve(), _flat(params), force=True)


def restore(path: pathlib.Path, abstract_params):
    """Params with `abstract_params`' structure (jax.ShapeDtypeStruct leaves), or None if the
    entry is absent or does not match."""
    import orbax.checkpoint as ocp
    if not path.exists():
        return None
    leaves, treedef = jax.tree.flatten(abstract_params)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            flat = ckptr.restore(path.resolve(), _flat(abstract_params))
    except Exception:  # a stale or partial entry is simply re-converted
        return None
    restored = [flat[k] for k in sorted(flat)]
    if len(restored) != len(leaves) or any(
            r.shape != a.shape or r.dtype != a.dtype for r, a in zip(restored, leaves)):
        return None
    return jax.tree.unflatten(treedef, restored)
