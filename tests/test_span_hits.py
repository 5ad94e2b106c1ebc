"""SpanMapCache._span_hits: a span is skipped only when every block is a ready device hit whose
kept tokens match (one whole-span check), or sits in the KV host tier; a block not ready, a hash
collision or a block nowhere gives None. Host bookkeeping only (stubs for the block manager, the
prefix keys and the host tier)."""

from types import SimpleNamespace

import numpy as np
import pytest

from serving.hybrid.span_cache import SpanMapCache

BS = 4


def _setup(n_blocks=6, host=()):
    tokens = np.arange(100, 100 + n_blocks * BS, dtype=np.int64)
    raw = tokens.tobytes()
    hashes = [1000 + j for j in range(n_blocks)]
    step = 8 * BS
    bm = SimpleNamespace(table={h: 10 + j for j, h in enumerate(hashes) if j not in host},
                         ready=np.ones(32, bool), confirm=[None] * 32, confirms_are_blocks=True)
    for j in range(n_blocks):
        bm.confirm[10 + j] = raw[j * step:(j + 1) * step]
    keys = SimpleNamespace(hashes=lambda seq: hashes, token_bytes=lambda seq: raw,
                           confirm=lambda seq, j: raw[j * step:(j + 1) * step])
    offload = SimpleNamespace(contains=lambda h: h in {hashes[j] for j in host})
    mgr = SimpleNamespace(bm=bm, keys=keys, offload=offload)
    return SpanMapCache(store=None, block_size=BS), mgr


@pytest.mark.parametrize("case, want", [
    ("all ready", [("hit", 11), ("hit", 12), ("hit", 13)]),
    ("one not ready", None), ("one collides", None), ("one in the host tier", "host"),
    ("one nowhere", None)])
def test_span_hits(case, want):
    host = (2,) if case in ("one in the host tier", "one nowhere") else ()
    cache, mgr = _setup(host=host)
    if case == "one not ready":
        mgr.bm.ready[12] = False
    if case == "one collides":
        mgr.bm.confirm[13] = b"\0" * (8 * BS)
    if case == "one nowhere":
        mgr.offload = None
    got = cache._span_hits(mgr, None, 1 * BS, 4 * BS)
    if want == "host":
        assert got == [("hit", 11), ("host", None), ("hit", 13)]
    else:
        assert got == want


def _match_block_by_block(mgr, seq, bs):
    """HybridPrefixCache.match's rule, one block at a time (the form before the run check)."""
    bm, keys = mgr.bm, mgr.keys
    hashes, limit, raw, step = keys.hashes(seq), keys.hit_limit(seq), keys.token_bytes(seq), 8 * bs
    kinds, shared = [], 0
    for j in range(limit):
        b = bm.table.get(hashes[j])
        same = b is not None and bm.confirm[b] == raw[j * step:(j + 1) * step]
        host = b is None and mgr.offload is not None and mgr.offload.contains(hashes[j])
        if not (same or host):
            break
        if len(kinds) == j and (host or bm.ready[b]):
            kinds.append(("host", None) if host else ("hit", b))
        shared = j + 1
    return kinds, shared


def test_prefix_match_equals_the_block_by_block_rule(fresh_rng):
    """HybridPrefixCache.match checks the leading run of device blocks as a whole; on random
    pools (blocks missing, in the host tier, not ready, colliding) it gives the kinds and shared
    depth of the block-by-block rule."""
    from serving.hybrid.hybrid_prefix import HybridPrefixCache
    for trial in range(200):
        n = int(fresh_rng.integers(0, 12))
        cache, mgr = _setup(n_blocks=max(n, 1))
        hashes = mgr.keys.hashes(None)[:n]
        state = fresh_rng.integers(0, 6, size=n)  # 0-2 hit, 3 not ready, 4 collides, 5 gone
        host = set()
        for j, st in enumerate(state):
            if st == 3:
                mgr.bm.ready[10 + j] = False
            elif st == 4:
                mgr.bm.confirm[10 + j] = b"\1" * (8 * BS)
            elif st == 5:
                del mgr.bm.table[hashes[j]]
                if fresh_rng.random() < 0.5:
                    host.add(hashes[j])
        mgr.offload = SimpleNamespace(contains=host.__contains__) if trial % 3 else None
        mgr.keys.hit_limit = lambda seq, n=n: n
        want = _match_block_by_block(mgr, None, BS)
        got = HybridPrefixCache.match(SimpleNamespace(block_size=BS), mgr, None)
        assert got == want, (trial, state.tolist(), sorted(host))


def test_a_span_inside_the_prompts_match_is_not_looked_up_again():
    """The blocks HybridPrefixCache.match found (ready device hits or host-tier blocks, from the
    prompt's start) serve a span inside them as they are; a span reaching past them is looked
    up (here: nothing in the pool, so None)."""
    cache, mgr = _setup()
    matched = [("hit", 10), ("hit", 11), ("host", None), ("hit", 13)]
    mgr.bm.table = {}  # a lookup would find nothing
    assert cache._span_hits(mgr, None, 1 * BS, 4 * BS, matched) == matched[1:4]
    assert cache._span_hits(mgr, None, 2 * BS, 5 * BS, matched) is None


def _in_span_block_by_block(span, j):
    """The rule depths_outside_spans applies, one block at a time: block j is a span block (a
    generated block past the layout continues its last segment)."""
    if j < len(span):
        return bool(span[j])
    return bool(span[-1]) if len(span) else False


def test_depths_outside_spans_equal_the_block_by_block_rule():
    from serving.hybrid.span_rows import depths_outside_spans
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 12))
        span = rng.random(n) < rng.random()
        depth = int(rng.integers(0, n + 4))
        want = [k for k in range(depth, 0, -1) if not _in_span_block_by_block(span, k - 1)]
        got = depths_outside_spans(SimpleNamespace(span_block=span), depth)
        assert got == want, (span, depth)
