"""The pool's numpy free list (serving/cache/free_list.py) behaves as the OrderedDict it replaced,
and the pool's whole-array share_many / release (many distinct blocks) leave the state, the free
list's order and later evictions exactly as the per-block loops do."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from serving.cache.block_manager import BULK, BlockManager
from serving.cache.free_list import FreeList


def test_free_list_matches_an_ordered_dict_under_random_operations(fresh_rng):
    n = 40
    fl, od = FreeList(n, range(n)), collections.OrderedDict((b, None) for b in range(n))
    for step in range(3000):
        op, b = int(fresh_rng.integers(0, 5)), int(fresh_rng.integers(0, n))
        if op == 0 and od:
            assert fl.popitem(last=False) == od.popitem(last=False)
        elif op == 1:
            if b in od:
                del od[b], fl[b]
            else:
                with pytest.raises(KeyError):
                    del fl[b]
        elif op == 2:
            od[b] = fl[b] = None
        elif op == 3:  # bulk: take some free blocks, put some held ones back
            take = [x for x in od if fresh_rng.random() < 0.3]
            fl.take_many(np.asarray(take, np.int64))
            for x in take:
                del od[x]
        else:
            put = [int(x) for x in fresh_rng.permutation(n) if int(x) not in od][:7]
            fl.put_many(np.asarray(put, np.int64))
            od.update((x, None) for x in put)
        assert len(fl) == len(od) and list(fl) == list(od), step
        assert (b in fl) == (b in od)
        if step % 500 == 0:
            twin = fl.copy()
            twin.popitem() if od else None
            assert list(fl) == list(od)
    with pytest.raises(KeyError):
        FreeList(3).popitem()


def _pool(fresh_rng, n):
    """Blocks held once or twice, ready, pending (owned by 5) or unhashed, at random."""
    bm = BlockManager(n, 4)
    held = [bm.allocate() for _ in range(n)]
    for b in held:
        kind = int(fresh_rng.integers(0, 4))
        if kind:
            bm.register(b, 10 ** 20 + b, bytes(32), owner=5, ready=kind > 1)
    order = [int(b) for b in fresh_rng.permutation(held)]
    bm.release(order[: n // 3], 5)
    for b in order[n // 3: n // 2]:
        bm.share(b)
    return bm


def _twin(bm):
    twin = BlockManager(bm.num_blocks, 4)
    twin.ref, twin.owner, twin.ready = list(bm.ref), list(bm.owner), list(bm.ready)
    twin.hash, twin.confirm, twin.table = list(bm.hash), list(bm.confirm), dict(bm.table)
    twin.free = bm.free.copy()
    return twin


def _state(bm):
    return (list(bm.free), [int(r) for r in bm.ref], [int(o) for o in bm.owner],
            [bool(r) for r in bm.ready], list(bm.hash), dict(bm.table))


@pytest.mark.parametrize("seq_id", [5, -1])
def test_bulk_share_and_release_equal_the_per_block_loops(fresh_rng, seq_id):
    for _ in range(20):
        bm = _pool(fresh_rng, 4 * BULK)
        twin = _twin(bm)  # lists: the per-block loops
        idle = [int(b) for b in np.flatnonzero(bm.ref == 0)]
        blocks = [int(b) for b in fresh_rng.permutation(idle)[:BULK + 5]]
        bm.share_many(blocks)
        twin.share_many(blocks)
        assert _state(bm) == _state(twin)
        held = [int(b) for b in fresh_rng.permutation(np.flatnonzero(bm.ref > 0))][:2 * BULK]
        bm.release(held, seq_id)
        twin.release(held, seq_id)
        assert _state(bm) == _state(twin)
        assert [bm.allocate() for _ in range(bm.num_free)] == \
            [twin.allocate() for _ in range(twin.num_free)]


def test_bulk_release_of_a_block_held_by_none_raises_as_the_loop_does(fresh_rng):
    bm = _pool(fresh_rng, 4 * BULK)
    idle = int(np.flatnonzero(bm.ref == 0)[0])
    held = [int(b) for b in np.flatnonzero(bm.ref > 0)][:BULK] + [idle]
    with pytest.raises(RuntimeError, match=f"block {idle} freed twice"):
        bm.release(held, 5)
