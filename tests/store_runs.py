"""Span-store test helpers shared by the store's file-layer tests: an identity and random runs."""

from __future__ import annotations

import numpy as np

from serving.tiers.disk_store import StoreIdentity


def store_identity(**kw) -> StoreIdentity:
    """A small store identity (block size 4, two [4, 2, 8] float32 leaves); fields overridable."""
    base = dict(model="m0", model_name="test", block_size=4, kv_mode="position_free",
                hash_algo="xxhash64", markers=(1, 2, 3), leaves=(((4, 2, 8), "float32"),) * 2)
    base.update(kw)
    return StoreIdentity(**base)


def random_run(rng, hashes):
    """(hashes, tokens bytes, leaves [n, 4, 2, 8] x 2) of a run."""
    n = len(hashes)
    tokens = np.stack([np.arange(h, h + 4) for h in hashes]).astype(np.int64).tobytes()
    return hashes, tokens, [rng.standard_normal((n, 4, 2, 8)).astype(np.float32)
                            for _ in range(2)]
