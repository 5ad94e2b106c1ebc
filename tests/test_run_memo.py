"""A cached span found whole before is found again as a whole (serving/cache/run_memo.py): the
same blocks, ref counts, table and sequence state as the per-block admission, whatever changed
in the pool since (blocks evicted, reused, re-registered with other tokens), and no per-block
table lookup for its blocks."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import test_admission_bulk as bulk
from list_guards import NoSlices
from minipic_jax.prompts import Prompt, Span, build_prompt
from minipic_jax.sampling_params import SamplingParams
from serving.cache import run_memo
from serving.layout import build_layout
from serving.sequence import Sequence
from test_scheduler import B, PAD, PDEP, SSEP, make


@pytest.mark.parametrize("trial", range(3))
def test_remembered_runs_admit_as_per_block_admission(trial, fresh_rng, monkeypatch):
    """Random pools (tests/test_admission_bulk.py: collisions, odd kept tokens, host tier,
    faults) whose earlier admissions remembered their spans (every run, however short): an
    admission through the remembered runs leaves the state the per-block admission leaves."""
    monkeypatch.setattr(run_memo, "MIN_RUN_BLOCKS", 1)
    pools, used = 0, 0
    while pools < 25 or (used < 5 and pools < 200):
        pools += 1
        sched, docs = bulk.random_pool(fresh_rng)
        sched.cfg.watermark_blocks = int(fresh_rng.choice([0, 0, sched.cache.bm.num_free - 4]))
        seq = bulk.request(fresh_rng, docs, "new")
        fault_at = int(fresh_rng.integers(1, 6)) if fresh_rng.random() < 0.3 else 0
        a, b = copy.deepcopy((sched, seq)), copy.deepcopy((sched, seq))
        runs = a[0].cache.keys.runs
        before = runs.hits
        got = bulk.admit(*a, lambda s, q, seats: s.cache.admit(q, seats), fault_at)
        want = bulk.admit(*b, bulk.reference_admit, fault_at)
        assert bulk.state(*a, got) == bulk.state(*b, want)
        used += runs.hits - before
    assert used >= 5, (pools, used)


class CountingTable(dict):
    """The pool's key -> block table, counting lookups."""
    lookups = 0

    def get(self, *args):
        CountingTable.lookups += 1
        return super().get(*args)


def _run_to_end(sched, seq) -> None:
    sched.add(seq)
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.advance(batch)
        for e in batch:
            if e.sample:
                e.seq.append_token(7)
                sched.finish(e.seq)


def _request(name, docs, question):
    ids = build_prompt([Prompt([5, 6, 7])] + [Span(list(d)) for d in docs] + [Prompt(question)],
                       block_size=B, pad_token_id=PAD, ssep_token_id=SSEP, pdep_token_id=PDEP)
    lay = build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    return Sequence(name, ids, lay, SamplingParams(max_tokens=1), B, seed=0)


def test_a_cached_span_is_not_looked_up_block_by_block(fresh_rng):
    """Three spans of 12 blocks, cached by a first request; a second one holding them in
    another order (new lists) takes them whole: its table lookups are those of its few other
    blocks, and every span block is a hit."""
    cfg, bm, sched = make("fcfs", 400, seqs=2, budget=64)
    docs = [[int(t) for t in fresh_rng.integers(0, 1000, 12 * B - 1)] for _ in range(3)]
    _run_to_end(sched, _request("first", docs, [9, 10]))
    _run_to_end(sched, _request("again", docs[::-1], [11, 12]))  # remembered whole here
    bm.table = CountingTable(bm.table)
    seq = _request("third", [docs[1], docs[0], docs[2]], [13, 14, 15])
    assert sched.cache.admit(seq, [0])
    span_blocks = int(seq.layout.span_block.sum())
    assert span_blocks == 36
    assert seq.num_cached_tokens >= span_blocks * B
    assert CountingTable.lookups < 6, CountingTable.lookups
    assert sched.cache.keys.runs.hits >= 3


def test_a_changed_block_makes_its_run_looked_up_again(fresh_rng):
    """A block of a remembered run evicted and reused for other tokens: the next request finds
    the run's other blocks one by one and computes that block (no stale hit)."""
    cfg, bm, sched = make("fcfs", 400, seqs=2, budget=64)
    docs = [[int(t) for t in fresh_rng.integers(0, 1000, 12 * B - 1)] for _ in range(2)]
    _run_to_end(sched, _request("first", docs, [9, 10]))
    _run_to_end(sched, _request("again", docs, [11, 12]))
    seq = _request("probe", docs, [13, 14])
    keys = sched.cache.keys.hashes(seq)
    victim = bm.table[keys[5]]  # block 5: inside the first span
    bm.unregister(victim)
    bm.register(victim, keys[5], bytes(8 * B), -1, ready=True)  # its key, other tokens
    hits = sched.cache.keys.runs.hits
    assert sched.cache.admit(seq, [0])
    assert sched.cache.keys.runs.hits == hits + 1  # only the second span taken whole
    assert seq.block_table[5] != victim and 5 in seq.owned
    others = [j for j in range(len(keys)) if j != 5 and seq.layout.span_block[j]]
    assert all(bm.hash[seq.block_table[j]] == keys[j] for j in others)
    assert np.all(bm.ref[[seq.block_table[j] for j in others]] >= 1)


def test_table_array_seeded_around_a_new_span(fresh_rng):
    """Cached spans (remembered whole) around a new one: the table array seeded at admission
    (the hits' array with the misses put between) is the block table, misses in the middle or
    only at the end."""
    cfg, bm, sched = make("fcfs", 600, seqs=2, budget=64)
    docs = [[int(t) for t in fresh_rng.integers(0, 1000, 20 * B - 1)] for _ in range(4)]
    _run_to_end(sched, _request("first", docs[:3], [9, 10]))
    _run_to_end(sched, _request("again", docs[:3], [11, 12]))
    for name, order in (("middle", [docs[0], docs[3], docs[1]]), ("end", docs[1:3])):
        seq = _request(name, order, [13, 14])
        assert sched.cache.admit(seq, [0])
        assert seq.memo.table_array is not None  # seeded, not converted from the list
        assert seq.table_array().tolist() == list(seq.block_table)
        sched.cache.release(seq)


def test_span_jobs_copy_their_spans_only(fresh_rng, monkeypatch):
    """isps span jobs of a waiting request take their spans' ids, not a copy of the whole
    prompt per job (Sequence.prompt_token_ids is never read); each job holds its span."""
    from serving.cache import span_jobs
    cfg, bm, sched = make("isps", 400, seqs=2, budget=64)
    docs = [[int(t) for t in fresh_rng.integers(0, 1000, 12 * B - 1)] for _ in range(3)]
    seq = _request("waiting", docs, [9, 10])

    def whole_copy(self):
        raise AssertionError("a copy of the whole prompt")
    monkeypatch.setattr(Sequence, "prompt_token_ids", property(whole_copy))
    jobs = span_jobs.jobs_for(seq, B, sched.cache.keys, bm, None,
                              sched.cache.keys.markers)
    assert [j.token_ids[1:] for j in jobs] == docs and len(jobs) == 3


def test_remembered_runs_stay_within_the_pool_least_recent_out():
    """Runs of 10 blocks remembered in a 30-block pool: three at most (the blocks remembered
    never outnumber the pool's), the least recently found going first."""
    from serving.cache.block_manager import BlockManager
    bm, memo, step = BlockManager(30, B), run_memo.RunMemo(), 8 * B
    raw = bytes(np.arange(10 * step, dtype=np.uint8))
    keys = [[1000 * r + i for i in range(10)] for r in range(5)]
    for r in range(3):
        memo.remember(bm, [(0, 10)], keys[r], raw, step, list(range(10)), [])
    assert memo.known(bm, [(0, 10)], keys[0], raw, step)  # run 0 found: now the most recent
    memo.remember(bm, [(0, 10)], keys[3], raw, step, list(range(10)), [])  # run 1 goes
    assert [bool(memo.known(bm, [(0, 10)], keys[r], raw, step)) for r in range(4)] == \
        [True, False, True, True]
    assert memo._num_blocks == 30


def test_run_with_its_keys_list_is_found_without_a_copy():
    """A run given with its keys' list (hashing.block_keys_and_tail's runs: the span-chain
    memo's list, the same object for a span seen again) is found by that list's identity, its
    keys neither sliced nor compared; an equal other list is compared, an unequal one misses."""
    from serving.cache.block_manager import BlockManager
    bm, memo, step = BlockManager(30, B), run_memo.RunMemo(), 8 * B
    raw = bytes(np.arange(10 * step, dtype=np.uint8))
    chain = [7000 + i for i in range(10)]
    memo.remember(bm, [(0, 10, chain)], NoSlices(chain), raw, step, list(range(10)), [])
    found = memo.known(bm, [(0, 10, chain)], NoSlices(chain), raw, step)
    assert [f[:3] for f in found] == [(0, 10, list(range(10)))]
    assert memo.known(bm, [(0, 10, list(chain))], list(chain), raw, step)
    other = chain[:5] + [1] + chain[6:]
    assert not memo.known(bm, [(0, 10, other)], other, raw, step)
