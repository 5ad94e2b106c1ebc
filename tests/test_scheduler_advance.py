"""Scheduler.advance moves every running sequence's frontier and publishes their completed
blocks in one cache-manager call per step (CacheManager.advance_many), in batch order."""

from __future__ import annotations

from minipic_jax.sampling_params import SamplingParams
from serving.layout import build_layout
from serving.sequence import Sequence

from tests.test_scheduler import B, PAD, PDEP, SSEP, make


def test_one_advance_call_per_step_with_the_running_sequences_in_batch_order():
    cfg, bm, sched = make("fcfs", blocks=32, seqs=3, budget=64)
    calls = []
    inner = sched.cache.advance_many
    sched.cache.advance_many = lambda seqs: calls.append(list(seqs)) or inner(seqs)
    qs = []
    for r in range(3):
        ids = [r + 2] * (5 + r)
        q = Sequence(str(r), ids, build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP),
                     SamplingParams(max_tokens=2), B, seed=r)
        sched.add(q)
        qs.append(q)
    batch = sched.schedule()
    assert [e.seq for e in batch] == qs
    sched.finish(qs[1])  # not running any more: its frontier stays
    sched.advance(batch)
    assert calls == [[qs[0], qs[2]]]
    assert [q.num_computed for q in qs] == [5, 0, 7]
    assert bm.ready[qs[0].block_table[0]] and bm.ready[qs[2].block_table[0]]
