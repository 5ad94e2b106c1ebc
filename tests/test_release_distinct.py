"""A cached request's release skips the pool's duplicate check when its block table is known to
hold no block twice (`Memos.distinct_table`, serving/cache/manager.py): its hits were shared as
distinct blocks and every other block was allocated. A table with a block twice (a span twice in
one request), a preempted and readmitted request, and a table replaced since are still checked;
each release leaves the same pool state the checked release leaves."""

from __future__ import annotations

import copy

import numpy as np

from minipic_jax.prompts import Prompt, Span, build_prompt
from minipic_jax.sampling_params import SamplingParams
from serving.cache import block_manager
from serving.cache.hashing import make_hash_fn, root_hash
from serving.cache.manager import CacheManager
from serving.cache.prefix_keys import PrefixKeys
from serving.config import Config
from serving.layout import build_layout
from serving.sequence import Sequence

PAD, SSEP, PDEP, B = 1023, 1022, 1021, 4


def make_cache(blocks=600):
    cfg = Config(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=2048, block_size=B,
                 num_kv_blocks=blocks)
    h = make_hash_fn("xxhash64")
    keys = PrefixKeys(B, h, lambda s: root_hash(h, s), {"pad": PAD, "ssep": SSEP, "pdep": PDEP},
                      True)
    return CacheManager(cfg, blocks, keys)


def request(segments, name):
    ids = build_prompt(segments, block_size=B, pad_token_id=PAD, ssep_token_id=SSEP,
                       pdep_token_id=PDEP)
    lay = build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    return Sequence(name, ids, lay, SamplingParams(max_tokens=1), B, seed=0)


def cache_spans(cache, segments):
    """Admit a request over `segments`, publish its blocks as computed, release it: its spans'
    blocks are then cached (free, ready)."""
    seq = request(segments, "warm")
    assert cache.admit(seq, [0])
    for b in seq.block_table:
        if cache.bm.hash[b] != -1:
            cache.bm.mark_ready(b)
    cache.release(seq)


def pool_state(bm):
    return (bm.ref.tolist(), list(bm.free), dict(bm.table), list(bm.hash), bm.ready.tolist(),
            bm.owner.tolist())


def release_counting(cache, seq, monkeypatch) -> int:
    """Release `seq`; how many duplicate checks ran."""
    calls = [0]
    real = block_manager._distinct

    def counted(arr, scratch):
        calls[0] += 1
        return real(arr, scratch)
    monkeypatch.setattr(block_manager, "_distinct", counted)
    cache.release(seq)
    monkeypatch.setattr(block_manager, "_distinct", real)
    return calls[0]


def checked_release_state(cache, seq):
    """The pool after a release with the duplicate check (the memo cleared on copies)."""
    cache, seq = copy.deepcopy((cache, seq))
    seq.memo.distinct_table = None
    cache.release(seq)
    return pool_state(cache.bm)


def docs(rng, n=2, length=300):
    return [[int(t) for t in rng.integers(0, 1000, length)] for _ in range(n)]


def test_distinct_cached_table_released_without_check(fresh_rng, monkeypatch):
    d = docs(fresh_rng)
    cache = make_cache()
    cache_spans(cache, [Prompt([5, 6]), Span(d[0]), Span(d[1]), Prompt([7])])
    seq = request([Prompt([9]), Span(d[1]), Span(d[0]), Prompt([8, 8])], "cached")
    assert cache.admit(seq, [0])
    assert seq.memo.distinct_table is seq.block_table and len(seq.block_table) > 140
    cache.append_block(seq)  # decode growth keeps the table distinct
    want = checked_release_state(cache, seq)
    assert release_counting(cache, seq, monkeypatch) == 0
    assert pool_state(cache.bm) == want and not cache.bm.ref.any()
    # preempted and readmitted: a new table, known distinct again, released the same way
    assert cache.admit(seq, [0]) and seq.memo.distinct_table is seq.block_table
    want = checked_release_state(cache, seq)
    assert release_counting(cache, seq, monkeypatch) == 0
    assert pool_state(cache.bm) == want


def test_table_with_a_block_twice_is_checked(fresh_rng, monkeypatch):
    d = docs(fresh_rng)
    cache = make_cache()
    cache_spans(cache, [Span(d[0]), Prompt([7])])
    seq = request([Prompt([9]), Span(d[0]), Span(d[0]), Prompt([8])], "twice")
    assert cache.admit(seq, [0])
    table = np.asarray(seq.block_table)
    assert np.unique(table).size < table.size  # the span's blocks are held twice
    assert seq.memo.distinct_table is None
    want = checked_release_state(cache, seq)
    assert release_counting(cache, seq, monkeypatch) >= 1
    assert pool_state(cache.bm) == want and not cache.bm.ref.any()


def test_replaced_table_is_checked(fresh_rng, monkeypatch):
    d = docs(fresh_rng)
    cache = make_cache()
    cache_spans(cache, [Span(d[0]), Prompt([7])])
    seq = request([Prompt([9]), Span(d[0]), Prompt([8])], "replaced")
    assert cache.admit(seq, [0])
    seq.block_table = list(seq.block_table)  # another list: not the one known distinct
    assert release_counting(cache, seq, monkeypatch) == 1
    assert not cache.bm.ref.any()
