"""Scheduler + block manager on plain ints (no model): random workloads driven to completion with
fake sampled tokens, checking the invariants after every step."""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import given, settings, strategies as st

from minipic_jax.prompts import Prompt, Span, build_prompt
from minipic_jax.sampling_params import SamplingParams
from serving.cache.manager import CacheManager
from serving.cache.prefix_keys import PrefixKeys
from serving.config import Config
from serving.cache.hashing import make_hash_fn, root_hash
from serving.layout import build_layout
from serving.scheduler import Scheduler
from serving.sequence import Sequence, Status

PAD, SSEP, PDEP = 1023, 1022, 1021
B = 4


def make(policy, blocks, seqs=3, budget=16):
    cfg = Config(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=256,
                 block_size=B, num_kv_blocks=blocks, scheduling_policy=policy, isps_span_seats=2)
    h = make_hash_fn("xxhash64")
    keys = PrefixKeys(B, h, lambda s: root_hash(h, s), {"pad": PAD, "ssep": SSEP, "pdep": PDEP},
                      True)
    cache = CacheManager(cfg, blocks, keys)
    return cfg, cache.bm, Scheduler(cfg, cache)


def check_invariants(cfg, bm, sched, batch):
    assert sum(e.token_idx.size for e in batch) <= cfg.max_num_batched_tokens
    assert len(batch) <= cfg.num_seats
    assert len({id(e.seq) for e in batch}) == len(batch)
    refs = collections.Counter()
    for q in sched.running + sched.span_jobs:
        refs.update(q.block_table)
    for b in range(bm.num_blocks):
        assert bm.ref[b] == refs[b], b
        assert (b in bm.free) == (bm.ref[b] == 0), b
    for e in batch:  # queries never reach past a block someone else is still computing
        q = e.seq
        for j in range(e.new_computed // B):
            b = q.block_table[j]
            if j not in q.owned and bm.hash[b] != -1:
                assert bm.ready[b] or bm.owner[b] in (-1, q.seq_id), (j, b)
        assert not np.asarray(q.layout.is_pad)[e.token_idx[e.token_idx < q.num_prompt_tokens]].any()


workloads = st.lists(st.tuples(st.lists(st.tuples(st.sampled_from("PS"), st.integers(0, 3)),
                                        min_size=1, max_size=4),
                               st.integers(1, 12)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(workloads, st.sampled_from(["fcfs", "barrier", "isps"]), st.integers(14, 40),
       st.sampled_from([8, 48]))
def test_random_workloads_finish_with_all_outputs_and_no_leaks(work, policy, blocks, budget):
    cfg, bm, sched = make(policy, blocks, budget=budget)
    rng = np.random.default_rng(len(work) * 7 + blocks)
    docs = [[int(t) for t in rng.integers(0, 1000, 3 + 4 * d)] for d in range(4)]
    seqs = []
    for r, (segs, max_tokens) in enumerate(work):
        parts = [Span(docs[d]) if k == "S" else Prompt([int(t) for t in rng.integers(0, 1000, d + 1)])
                 for k, d in segs]
        ids = build_prompt(parts, block_size=B, pad_token_id=PAD, ssep_token_id=SSEP,
                           pdep_token_id=PDEP)
        if -(-(len(ids) + max_tokens) // B) > blocks:
            continue
        lay = build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
        q = Sequence(str(r), ids, lay, SamplingParams(max_tokens=max_tokens), B, seed=r)
        seqs.append(q)
        sched.add(q)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch, "no progress"
        check_invariants(cfg, bm, sched, batch)
        sched.advance(batch)
        for e in batch:
            if e.sample:
                e.seq.append_token(7)
                if e.seq.num_output_tokens >= e.seq.sampling_params.max_tokens:
                    sched.finish(e.seq)
    assert not sched.has_unfinished()
    assert all(q.status == Status.FINISHED for q in seqs)
    assert all(q.num_output_tokens == q.sampling_params.max_tokens for q in seqs)  # none lost
    assert bm.num_free == blocks and not any(bm.ref)


def test_preemption_recomputes_and_keeps_generated_tokens():
    cfg, bm, sched = make("fcfs", blocks=6, seqs=2, budget=16)
    qs = []
    for r in range(2):
        ids = [r + 1] * 7
        q = Sequence(str(r), ids, build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP),
                     SamplingParams(max_tokens=9), B, seed=r)
        sched.add(q)
        qs.append(q)
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.advance(batch)
        for e in batch:
            if e.sample:
                e.seq.append_token(100 + e.seq.num_output_tokens)
                if e.seq.num_output_tokens == 9:
                    sched.finish(e.seq)
        steps += 1
    assert sched.num_preemptions > 0
    assert max(q.num_preemptions for q in qs) > 0
    for q in qs:
        assert q.output_token_ids == list(range(100, 109))


def test_span_in_flight_is_waited_for_not_recomputed():
    cfg, bm, sched = make("fcfs", blocks=40, seqs=3, budget=64)
    doc = list(range(10, 21))  # SSEP + 11 tokens = 3 full blocks
    qs = []
    for r in range(3):
        ids = build_prompt([Prompt([r + 1, r + 2]), Span(doc), Prompt([5, 6, 7])], block_size=B,
                           pad_token_id=PAD, ssep_token_id=SSEP, pdep_token_id=PDEP)
        q = Sequence(str(r), ids, build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP),
                     SamplingParams(max_tokens=1), B, seed=r)
        sched.add(q)
        qs.append(q)
    computed = collections.Counter()
    while sched.has_unfinished():
        batch = sched.schedule()
        check_invariants(cfg, bm, sched, batch)
        for e in batch:
            for i in e.token_idx:
                if i < e.seq.num_prompt_tokens:
                    computed[tuple(e.seq.prompt_token_ids[i // B * B:(i // B + 1) * B])] += 1
        sched.advance(batch)
        for e in batch:
            if e.sample:
                e.seq.append_token(7)
                sched.finish(e.seq)
    span_blocks = {tuple(qs[0].prompt_token_ids[j * B:(j + 1) * B]) for j in (1, 2, 3)}
    for blk in span_blocks:  # every token of the shared span computed by one request only
        assert computed[blk] == sum(t != PAD for t in blk), blk
    assert [q.num_cached_tokens for q in qs] == [0, 3 * B, 3 * B]


def test_a_sequence_with_a_pending_restore_is_not_taken_as_a_decode_row():
    """A hybrid sequence resumed at n - 1 (its checkpoint one token before the prompt's end) whose
    restore has not run yet (the barrier held its chunk back) must get its last prompt token as a
    prefill row, where the restore rides (`HybridPrefixCache.annotate`); as a decode row its state
    slot would run without the restored state. A sequence without one is a decode row as before."""
    cfg, bm, sched = make("barrier", 40)
    ids = build_prompt([Prompt(list(range(10, 19)))], block_size=B, pad_token_id=PAD,
                       ssep_token_id=SSEP, pdep_token_id=PDEP)
    lay = build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    seqs = []
    for r in range(2):
        q = Sequence(str(r), ids, lay, SamplingParams(max_tokens=2), B, seed=r)
        q.status, q.num_computed = Status.RUNNING, len(ids) - 1
        sched.running.append(q)
        seqs.append(q)
    seqs[0].hybrid.restore_entry = object()  # resumed here, its restore still to run
    taken = [e.seq for e in sched._decodes()]
    assert seqs[1] in taken and seqs[0] not in taken


def test_admission_looks_past_waiting_requests_but_not_past_a_full_one(monkeypatch):
    """A request refused because work it needs is in flight (Refused.WAITS) keeps its place and
    up to LOOK_PAST_WAITING requests behind it may be admitted; one refused for room (FULL)
    stops admission, as FCFS does."""
    from serving import scheduler as scheduler_mod
    from serving.cache.manager import Refused
    cfg, bm, sched = make("fcfs", 200, seqs=8, budget=200)
    ids = build_prompt([Prompt(list(range(10, 19)))], block_size=B, pad_token_id=PAD,
                       ssep_token_id=SSEP, pdep_token_id=PDEP)
    lay = build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    seqs = [Sequence(str(r), ids, lay, SamplingParams(max_tokens=2), B, seed=r) for r in range(6)]
    for q in seqs:
        sched.add(q)
    admit = sched.cache.admit
    refusals = {"1": Refused.WAITS, "2": Refused.WAITS, "4": Refused.FULL}
    monkeypatch.setattr(sched.cache, "admit", lambda q, seats: refusals[q.request_id]
                        if q.request_id in refusals else admit(q, seats))  # (refusals are falsy)
    monkeypatch.setattr(scheduler_mod, "LOOK_PAST_WAITING", 2)
    sched.schedule()
    assert [q.request_id for q in sched.running] == ["0", "3"]  # 1, 2 wait; 4 is full: stop
    assert [q.request_id for q in sched.waiting] == ["1", "2", "4", "5"]
    monkeypatch.setattr(scheduler_mod, "LOOK_PAST_WAITING", 1)
    refusals = {"1": Refused.WAITS, "2": Refused.WAITS}
    sched.schedule()  # looks past one waiting request only: 2 waits in turn and stops it
    assert [q.request_id for q in sched.waiting] == ["1", "2", "4", "5"]
