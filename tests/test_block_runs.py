"""Whole-list passes over a request's blocks (issue 28: a cached request has ~2,000 of them):
chunks.skip_shared, prefix_keys.indices_of_none and AdmissionPlan.hits give what one step per
block gave, on random pool states."""

from __future__ import annotations

import types

import numpy as np

from serving.cache.admission import AdmissionPlan
from serving.cache.block_manager import BlockManager
from serving.cache.chunks import skip_shared
from serving.cache.prefix_keys import indices_of_none


def _skip_shared_per_block(bm, seq, j, total, block_size):
    """The loop skip_shared replaced: one block per step."""
    while j * block_size < total and j not in seq.owned:
        b = seq.block_table[j]
        if not bm.ready[b] and bm.hash[b] != -1:
            break
        j += 1
    return j


def test_skip_shared_stops_where_the_per_block_loop_stops(fresh_rng):
    bs = 4
    for _ in range(400):
        n = int(fresh_rng.integers(1, 40))
        bm = BlockManager(n + 4, bs)
        table = [bm.allocate() for _ in range(n)]
        for b in table:  # ready, pending or unhashed, at random
            kind = int(fresh_rng.integers(0, 6))
            if kind:
                bm.register(b, 1000 + b, bytes(8 * bs), owner=3, ready=kind > 1)
        owned = {int(j) for j in fresh_rng.choice(n, int(fresh_rng.integers(0, n + 1)),
                                                  replace=False)}
        seq = types.SimpleNamespace(owned=owned, block_table=table,
                                    table_array=lambda t=table: np.asarray(t, np.int64))
        total = int(fresh_rng.integers(0, n * bs + 1))
        for j in range(n + 1):
            assert skip_shared(bm, seq, j, total, bs) == \
                _skip_shared_per_block(bm, seq, j, total, bs), (j, total)


def test_indices_of_none_and_hits_in_block_order(fresh_rng):
    for _ in range(200):
        n = int(fresh_rng.integers(0, 30))
        blocks = [None if fresh_rng.random() < 0.3 else int(b)
                  for b in fresh_rng.integers(0, 9, n)]
        misses = indices_of_none(blocks)
        assert misses == [j for j, b in enumerate(blocks) if b is None]
        plan = AdmissionPlan(list(blocks), misses, set())
        assert plan.hits() == [b for b in blocks if b is not None]
