"""Admission with whole-request operations (`PrefixKeys.admission_plan`, `BlockManager.share_many`,
`CacheManager.fill_table`) against the plain per-block admission written out here: on random pools
(cached, held, pending and host-tier blocks, hash collisions, a span twice in one request, kept
tokens that are not a full block's bytes) both leave the same blocks, ref counts, free-list order,
hash table, host copy-ins and sequence state, also when an allocation faults part way."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from minipic_jax.prompts import Prompt, Span, build_prompt
from minipic_jax.sampling_params import SamplingParams
from serving.layout import build_layout
from serving.sequence import Sequence, Status
from test_scheduler import B, PAD, PDEP, SSEP, make


class HostTier:
    def __init__(self, hashes):
        self.hashes = set(hashes)

    def contains(self, h):
        return h is not None and h in self.hashes


def reference_admit(sched, seq, seats) -> bool:
    """Admission one block at a time (the scheduler's code before the bulk operations)."""
    bm, keys, step = sched.cache.bm, sched.cache.keys, 8 * B
    hashes, n = keys.hashes(seq), seq.num_blocks_needed
    lim, raw = max(0, min(keys.hit_limit(seq), n)), keys.token_bytes(seq)
    plan = []
    for j in range(n):
        b = bm.table.get(hashes[j]) if j < lim and bm.enable_caching else None
        if b is not None and bm.confirm[b] != raw[j * step:(j + 1) * step]:
            b = None  # a collision
        host = b is None and j < lim and sched.cache.offload is not None \
            and sched.cache.offload.contains(hashes[j])
        plan.append(("hit", b) if b is not None else ("host" if host else "new", None))
    hits = [b for kind, b in plan if kind == "hit"]
    need = len(plan) - len(hits) + sum(bm.ref[b] == 0 for b in hits)
    if need > bm.num_free - sched.cfg.watermark_blocks * (not seq.is_span_job):
        return False
    shared = []
    try:
        for b in hits:
            bm.share(b)
            shared.append(b)
        for j, (kind, b) in enumerate(plan):
            if kind == "hit":
                seq.block_table.append(b)
                if not seq.ever_admitted:
                    seq.num_cached_tokens += B
                continue
            b = bm.allocate()
            seq.block_table.append(b)
            h = hashes[j] if j < len(hashes) else None
            if kind == "host" and sched.cache.offload.contains(h):
                bm.register(b, h, keys.confirm(seq, j), seq.seq_id, ready=True)
                if bm.hash[b] == h:
                    sched.cache.pending_copy_in.append((b, h))
                    seq.num_cached_tokens += B * (not seq.ever_admitted)
                    continue
            seq.owned.add(j)
            if h is not None:
                bm.register(b, h, keys.confirm(seq, j), seq.seq_id)
    except BaseException:
        mine = set(seq.block_table)
        for b, h in [x for x in sched.cache.pending_copy_in if x[0] in mine]:
            if bm.hash[b] == h:
                bm.unregister(b)
        sched.cache.pending_copy_in = [x for x in sched.cache.pending_copy_in if x[0] not in mine]
        new = [b for j, b in enumerate(seq.block_table) if plan[j][0] != "hit"]
        bm.release(new + shared, seq.seq_id)
        seq.block_table, seq.owned = [], set()
        seq.num_cached_tokens = 0 if not seq.ever_admitted else seq.num_cached_tokens
        raise
    seq.seat, seq.synced_blocks, seq.status = seats.pop(), 0, Status.RUNNING
    seq.needs_reset, seq.ready_ptr, seq.ever_admitted = True, 0, True
    return True


def request(rng, docs, name):
    parts = []
    for _ in range(int(rng.integers(1, 6))):
        if rng.random() < 0.7:  # a span, often one used already in this request
            parts.append(Span(docs[int(rng.integers(len(docs)))]))
        else:
            parts.append(Prompt([int(t) for t in rng.integers(0, 1000, int(rng.integers(1, 9)))]))
    ids = build_prompt(parts, block_size=B, pad_token_id=PAD, ssep_token_id=SSEP,
                       pdep_token_id=PDEP)
    lay = build_layout(ids, B, pad_id=PAD, ssep_id=SSEP, pdep_id=PDEP)
    return Sequence(name, ids, lay, SamplingParams(max_tokens=2), B, seed=0)


def random_pool(rng):
    """A scheduler whose pool went through random requests: some finished (cached, free in LRU
    order), some still running (held; pending blocks); then collisions, odd kept tokens, and a
    host tier holding some of the keys."""
    cfg, bm, sched = make("fcfs", int(rng.integers(60, 160)), seqs=4, budget=24)
    docs = [[int(t) for t in rng.integers(0, 1000, int(rng.integers(3, 30)))] for _ in range(5)]
    sched._seen = [request(rng, docs, f"w{r}") for r in range(int(rng.integers(2, 9)))]
    for q in sched._seen:
        sched.add(q)
    for _ in range(int(rng.integers(1, 60))):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        sched.advance(batch)
        for e in batch:
            if e.sample:
                e.seq.append_token(7)
                if e.seq.num_output_tokens >= 2:
                    sched.finish(e.seq)
    seen_keys = {h for q in sched._seen for h in (q.block_hashes or [])}
    cached = sorted(bm.table.items())
    for h, b in cached:
        u = rng.random()
        if u < 0.08:  # another block's tokens under this key: a 64-bit collision
            bm._keep(b, bytes(rng.integers(0, 256, 8 * B, dtype=np.uint8)))
        elif u < 0.1:
            bm._keep(b, tuple(range(B)))  # kept tokens that are not int64 bytes
    if rng.random() < 0.5:  # some keys of these requests' blocks, cached or evicted since
        sched.cache.offload = HostTier([h for h in sorted(seen_keys) if rng.random() < 0.4])
    return sched, docs


def state(sched, seq, outcome):
    bm = sched.cache.bm
    return (outcome, list(bm.ref), list(bm.free), dict(bm.table), list(bm.hash), list(bm.confirm),
            list(bm.ready), list(bm.owner), bm.num_evicted, bm.num_odd_confirms,
            list(sched.cache.pending_copy_in), list(seq.block_table), sorted(seq.owned),
            seq.num_cached_tokens, seq.seat, seq.status, seq.ever_admitted)


def admit(sched, seq, how, fault_at):
    calls = [0]
    real = sched.cache.bm.allocate

    def allocate():
        calls[0] += 1
        if calls[0] == fault_at:
            raise RuntimeError("injected")
        return real()
    sched.cache.bm.allocate = allocate
    try:
        got = how(sched, seq, [0, 1, 2])
        return got if got is True else False  # a refusal (CacheManager's falsy Refused) as False
    except RuntimeError as err:
        return str(err)
    finally:
        sched.cache.bm.allocate = real


def events(sched, seq, outcome) -> set:
    """What an admission met (so the test can show it covered each case)."""
    bm, hashes, raw, step = sched.cache.bm, sched.cache.keys.hashes(seq), sched.cache.keys.token_bytes(seq), 8 * B
    met = {"refused"} if outcome is False else {"fault"} if isinstance(outcome, str) else set()
    cand = [(j, bm.table.get(h)) for j, h in enumerate(hashes)]
    if any(b is not None and bm.confirm[b] != raw[j * step:(j + 1) * step] for j, b in cand):
        met.add("collision")
    if not bm.confirms_are_blocks:
        met.add("odd kept tokens")
    hits = [b for _, b in cand if b is not None]
    if len(hits) != len(set(hits)):
        met.add("block twice")
    if sched.cache.pending_copy_in:
        met.add("host tier")
    return met


@pytest.mark.parametrize("trial", range(4))
def test_bulk_admission_equals_per_block_admission(trial, fresh_rng):
    """25 random pools at least, more (up to 200) until every case below has occurred, so the
    coverage holds for any seed."""
    need, met, pools = {"refused", "fault", "collision", "block twice", "host tier"}, set(), 0
    while pools < 25 or (not met >= need and pools < 200):
        pools += 1
        sched, docs = random_pool(fresh_rng)
        sched.cfg.watermark_blocks = int(fresh_rng.choice([0, 0, sched.cache.bm.num_free - 4]))
        seq = request(fresh_rng, docs, "new")
        if sched.cache.offload is not None:  # the host tier also holds some of its blocks
            sched.cache.offload.hashes |= {h for h in sched.cache.keys.hashes(seq) if fresh_rng.random() < 0.5}
        fault_at = int(fresh_rng.integers(1, 6)) if fresh_rng.random() < 0.3 else 0
        a, b = copy.deepcopy((sched, seq)), copy.deepcopy((sched, seq))
        got = admit(*a, lambda s, q, seats: s.cache.admit(q, seats), fault_at)
        want = admit(*b, reference_admit, fault_at)
        assert state(*a, got) == state(*b, want)
        met |= events(*b, want)
    print(pools, sorted(met))
    assert met >= need
