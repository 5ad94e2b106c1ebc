"""The pool's distinctness check of a bulk share or release (serving/cache/block_manager.py
`_distinct`): right with repeats anywhere and whatever the scratch holds, and with no pass over
the whole pool (a 30K-block pool's bincount cost more than a cached request's check)."""

from __future__ import annotations

import numpy as np

from serving.cache import block_manager
from serving.cache.block_manager import BlockManager, _distinct


def test_distinct_finds_every_repeat(fresh_rng):
    scratch = fresh_rng.integers(-5, 5000, 1000)  # stale contents from earlier checks
    for _ in range(300):
        arr = fresh_rng.choice(1000, int(fresh_rng.integers(0, 200)), replace=False)
        assert _distinct(arr, scratch)
        if arr.size:
            dup = arr.copy()
            dup[int(fresh_rng.integers(dup.size))] = dup[int(fresh_rng.integers(dup.size))]
            assert _distinct(dup, scratch) == (np.unique(dup).size == dup.size)
            assert _distinct(dup[::-1], scratch) == (np.unique(dup).size == dup.size)


def test_bulk_share_and_release_scan_no_pool_sized_array(monkeypatch):
    """A 100K-block pool, 2,000 blocks shared and released whole: no bincount over the pool;
    the ref counts and free list end as they began."""
    bm = BlockManager(100_000, 16)
    blocks = list(range(5000, 7000))
    arr = np.asarray(blocks, np.int64)

    def no_bincount(*args, **kwargs):
        raise AssertionError("a pass over the whole pool")
    monkeypatch.setattr(block_manager.np, "bincount", no_bincount)
    free_before = list(bm.free)
    bm.share_many(blocks, arr)
    assert bm.ref[arr].tolist() == [1] * 2000 and bm.num_free == 98_000
    bm.release(blocks, -1, arr)
    assert not bm.ref.any() and bm.num_free == 100_000
    assert list(bm.free)[:5000] == free_before[:5000]
