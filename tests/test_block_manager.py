"""Block manager and hashing on plain ints, against brute-force expectations."""

from __future__ import annotations

import numpy as np
import pytest

from serving.cache.block_manager import BlockManager
from serving.cache.hashing import block_keys, make_hash_fn, root_hash


def test_lru_free_list_reverse_order_and_hash_kept_until_reuse():
    bm = BlockManager(6, 4)
    a = [bm.allocate() for _ in range(3)]
    for j, b in enumerate(a):
        bm.register(b, 100 + j, (j,), owner=1)
        bm.mark_ready(b)
    bm.release(a, 1)  # freed last block first
    assert list(bm.free)[-3:] == a[::-1]
    assert bm.lookup(100, (0,)) == a[0]  # still cached while free
    got = [bm.allocate() for _ in range(4)]  # 3 never-used blocks first, then a[2] (LRU tail)
    assert got[3] == a[2] and bm.lookup(102, (2,)) is None and bm.num_evicted == 1
    assert bm.lookup(101, (1,)) == a[1]


def test_fresh_record_lists_each_allocated_block_once_until_taken():
    """Every block handed out is fresh (its pages are zeroed on the device before first use,
    serving/cache/page_zeroing.py) until the runner takes the record; a block freed and allocated again
    in between is listed once; a block a copy-in fills (`filled`) is not listed; sharing a
    cached block is no allocation."""
    bm = BlockManager(6, 4)
    a = [bm.allocate() for _ in range(3)]
    bm.register(a[0], 100, (0,), owner=1)
    bm.mark_ready(a[0])
    bm.release(a[1:], 1)
    again = bm.allocate()  # the first never-used block
    bm.filled([a[2]])
    assert bm.take_fresh() == a[:2] + [again] and bm.take_fresh() == []
    bm.release([a[0]], 1)
    bm.share(bm.lookup(100, (0,)))  # a hit: its written content is kept
    assert bm.take_fresh() == []
    reused = [bm.allocate() for _ in range(4)]  # every free block (not the shared hit)
    assert set(reused) == set(range(6)) - {a[0], again} and bm.take_fresh() == reused


def test_refcounts_sharing_and_confirm_tokens():
    bm = BlockManager(4, 4)
    b = bm.allocate()
    bm.register(b, 7, (1, 2, 3, 4), owner=1)
    bm.mark_ready(b)
    assert bm.lookup(7, (1, 2, 3, 5)) is None  # a hash collision is a miss
    bm.share(b)
    assert bm.ref[b] == 2
    bm.release([b], 1)
    assert b not in bm.free
    bm.release([b], 2)
    assert b in bm.free and bm.lookup(7, (1, 2, 3, 4)) == b
    bm.share(b)  # a hit on a free block takes it off the free list
    assert b not in bm.free and bm.num_free == 3
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.release([b], 3)
        bm.release([b], 3)


def test_pending_blocks_owner_and_unregister_when_unfinished():
    bm = BlockManager(4, 4)
    b = bm.allocate()
    bm.register(b, 9, (0,), owner=1)
    assert bm.is_pending(b) and bm.owner[b] == 1
    bm.share(b)  # a waiter
    bm.release([b], 1)  # owner preempted: block stays, ownerless, still pending
    assert bm.is_pending(b) and bm.owner[b] == -1
    bm.release([b], 2)  # nobody finished it: the half-written content is not cached
    assert bm.lookup(9, (0,)) is None


def test_first_publisher_wins_and_caching_off():
    bm = BlockManager(4, 4)
    b1, b2 = bm.allocate(), bm.allocate()
    bm.register(b1, 5, (1,), owner=1)
    bm.register(b2, 5, (1,), owner=2)
    assert bm.lookup(5, (1,)) == b1 and bm.hash[b2] == -1
    off = BlockManager(4, 4, enable_caching=False)
    c = off.allocate()
    off.register(c, 5, (1,), owner=1)
    assert off.lookup(5, (1,)) is None


@pytest.mark.parametrize("algo", ["xxhash64", "sha256"])
def test_span_keys_are_offset_free_and_prefix_keys_are_not(algo, fresh_rng):
    h = make_hash_fn(algo)
    h0 = root_hash(h, None)
    span = [int(t) for t in fresh_rng.integers(0, 1000, 8)]
    pre1, pre2 = [1] * 4, [2] * 8
    # blocks of 4: [pre | span span] and [pre pre | span span]
    k1 = block_keys(h, pre1 + span, 4, [False, True, True], [False, True, False], h0)
    k2 = block_keys(h, pre2 + span, 4, [False, False, True, True],
                    [False, False, True, False], h0)
    assert k1[1:] == k2[2:]  # same span -> same keys at any offset
    p1 = block_keys(h, pre1 + span, 4, [False] * 3, [False] * 3, h0)
    p2 = block_keys(h, pre2 + span, 4, [False] * 4, [False] * 4, h0)
    assert not set(p1) & set(p2)  # PDEP keys depend on the whole prefix
    assert root_hash(h, "tenant") != h0
    salted = block_keys(h, pre1 + span, 4, [False, True, True], [False, True, False],
                        root_hash(h, "tenant"))
    assert not set(salted) & set(k1)


@pytest.mark.parametrize("algo", ["xxhash64", "sha256"])
def test_pdep_key_after_spans_depends_on_every_token_before_it(algo):
    """The prefix chain steps over a span run in one hash (of its last span key): the PDEP block
    after two spans still changes with any token of either span and with their order; int64
    bytes give the same keys as the list."""
    h = make_hash_fn(algo)
    h0 = root_hash(h, None)
    a, b, q = list(range(1, 9)), list(range(11, 19)), [7, 7, 7, 7]
    sb, ss = [True] * 4 + [False], [True, False, True, False, False]

    def tail(toks):
        return block_keys(h, toks, 4, sb, ss, h0)[-1]
    base = tail(a + b + q)
    assert tail(b + a + q) != base  # order
    for k in range(16):  # one token of either span
        toks = a + b + q
        toks[k] += 100
        assert tail(toks) != base, k
    raw = np.asarray(a + b + q + [5], np.int64).tobytes()
    assert block_keys(h, raw, 4, sb, ss, h0) == block_keys(h, a + b + q + [5], 4, sb, ss, h0)


def _chain_reference(h, tokens, bs, span_block, span_start, h0):
    """The chained keys written out block by block (module docstring of serving/cache/hashing.py)."""
    keys, prefix, span = [], h0, h0
    n = len(tokens) // bs
    for j in range(n):
        blk = tokens[j * bs:(j + 1) * bs]
        if span_block[j]:
            span = h(h0 if span_start[j] else span, blk, b"S")
            keys.append(span)
            if j + 1 == n or not span_block[j + 1] or span_start[j + 1]:  # the run ends here
                prefix = h(prefix, span.to_bytes(8, "little"), b"J")
        else:
            prefix = h(prefix, blk, b"P")
            keys.append(prefix)
    return keys


def _add_segment(rng, docs, p_doc, max_blocks, toks, sb, ss):
    """Append one segment of 4-token blocks to toks and its span-block / span-start flags: with
    probability p_doc one of `docs` as a span, else 1..max_blocks random PDEP blocks."""
    if rng.random() < p_doc:
        d = docs[int(rng.integers(0, len(docs)))]
        toks += d
        sb += [True] * (len(d) // 4)
        ss += [True] + [False] * (len(d) // 4 - 1)
    else:
        k = int(rng.integers(1, max_blocks + 1))
        toks += [int(t) for t in rng.integers(0, 50, 4 * k)]
        sb += [False] * k
        ss += [False] * k


@pytest.mark.parametrize("algo", ["xxhash64", "sha256"])
def test_block_keys_with_span_memo_match_reference(algo, fresh_rng):
    """Random segment structures, repeated spans, two salts, one shared memo: same keys."""
    h = make_hash_fn(algo)
    memo = {}
    docs = [[int(t) for t in fresh_rng.integers(0, 50, int(fresh_rng.integers(1, 4)) * 4)]
            for _ in range(3)]
    for _ in range(40):
        h0 = root_hash(h, str(fresh_rng.integers(0, 2)))
        toks, sb, ss = [], [], []
        for _ in range(int(fresh_rng.integers(1, 5))):
            _add_segment(fresh_rng, docs, 0.6, 2, toks, sb, ss)
        toks += [7] * int(fresh_rng.integers(0, 4))  # partial last block: no key
        sb.append(False)
        ss.append(False)
        want = _chain_reference(h, toks, 4, sb, ss, h0)
        assert block_keys(h, toks, 4, sb, ss, h0, memo) == want
        assert block_keys(h, toks, 4, sb, ss, h0) == want
    assert memo  # the memo was used


def test_block_keys_of_long_prompts_match_reference(fresh_rng):
    """Prompts of hundreds of blocks (span runs found with array operations), flags given as
    numpy arrays or lists, bytes or ids: the keys written out block by block."""
    h = make_hash_fn("xxhash64")
    h0, memo = root_hash(h, None), {}
    docs = [[int(t) for t in fresh_rng.integers(0, 50, int(fresh_rng.integers(1, 40)) * 4)]
            for _ in range(4)]
    for _ in range(6):
        toks, sb, ss = [], [], []
        while len(sb) < 70:
            _add_segment(fresh_rng, docs, 0.7, 3, toks, sb, ss)
        toks += [7] * int(fresh_rng.integers(0, 4))
        want = _chain_reference(h, toks, 4, sb + [False], ss + [False], h0)
        raw = np.asarray(toks, np.int64).tobytes()
        assert block_keys(h, raw, 4, np.asarray(sb + [False]), np.asarray(ss + [False]), h0,
                          memo) == want
        assert block_keys(h, toks, 4, sb, ss, h0) == want

def _scrambled(fresh_rng, n=24):
    """A pool whose free list is in a random order, some blocks held (ref 1-2), some cached."""
    bm = BlockManager(n, 4)
    held = [bm.allocate() for _ in range(n)]
    for b in held:
        bm.register(b, 1000 + b, (b,), owner=7, ready=True)
    order = [int(b) for b in fresh_rng.permutation(held)]
    kept = order[:int(fresh_rng.integers(3, n // 2))]
    bm.release(order[len(kept):], 7)
    for b in kept[::2]:
        bm.share(b)
    return bm, kept


def _state(bm):
    return list(bm.free), list(bm.ref), dict(bm.table), list(bm.owner)


def test_share_many_equals_per_block_shares(fresh_rng):
    """Free and held blocks, repeats in one call (a span used twice in a request): same ref
    counts, same free-list order (so the same later evictions) as one `share` per block."""
    for _ in range(30):
        bm, _ = _scrambled(fresh_rng)
        twin = BlockManager(bm.num_blocks, 4)
        twin.ref, twin.free, twin.table = list(bm.ref), bm.free.copy(), dict(bm.table)
        twin.owner = list(bm.owner)
        blocks = [int(b) for b in fresh_rng.integers(0, bm.num_blocks,
                                                     int(fresh_rng.integers(0, 40)))]
        bm.share_many(blocks)
        for b in blocks:
            twin.share(b)
        assert _state(bm) == _state(twin), blocks
        got = [bm.allocate() for _ in range(bm.num_free)]
        assert got == [twin.allocate() for _ in range(twin.num_free)]


def test_share_many_that_raises_part_way_holds_none(fresh_rng):
    """A block the pool has lost (unreferenced, yet off the free list): share_many raises and
    the blocks it shared before are released, as undoing the per-block shares did."""
    bm, _ = _scrambled(fresh_rng)
    idle = next(b for b in range(bm.num_blocks) if bm.ref[b] == 0)
    del bm.free[idle]  # the broken invariant
    twin = BlockManager(bm.num_blocks, 4)
    twin.ref, twin.free, twin.table = list(bm.ref), bm.free.copy(), dict(bm.table)
    twin.owner = list(bm.owner)
    blocks = list(bm.free)[:3] + [int(b) for b in np.flatnonzero(bm.ref)][:2] + [idle, 0]
    with pytest.raises(KeyError):
        bm.share_many(blocks)
    for b in blocks[:5]:
        twin.share(b)
    twin.release(blocks[:5], -1)
    assert _state(bm) == _state(twin)
