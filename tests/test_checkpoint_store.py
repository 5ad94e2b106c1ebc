"""The hybrid checkpoint store (tiers, pins, LRU, dependency eviction), the device pool's moves,
and per-prompt placement (candidates with pads, strategies, dp against brute force)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from planner import expected_recompute
from serving.hybrid import checkpoint_pool
from serving.hybrid.checkpoint_plan import CheckpointPlanner, candidates, positions_of
from serving.hybrid.checkpoint_store import CheckpointStore
from serving.layout import build_layout


def _reserve(store, key, deps=()):
    slot = store.reserve(key, b"k%d" % key, 64, deps)
    store.after_launch()
    return slot


def test_store_lru_offloads_then_evicts_and_confirms_by_tokens():
    store = CheckpointStore(device_slots=2, host_slots=1, nbytes=100)
    assert [_reserve(store, k) for k in (1, 2)] == [0, 1]
    assert store.reserve(1, b"k1", 64, ()) == -1  # already stored
    assert store.get(1, b"other tokens") is None  # a hash collision is a miss
    e1 = store.get(1, b"k1")
    assert store.acquire(e1)  # a hit refreshes 1: 2 is now the LRU entry
    store.release(e1)
    assert _reserve(store, 3) == 1  # 2 -> host (slot 1 reused)
    out, inn = store.take_moves()
    assert [(s, e.key) for s, e in out] == [(1, 2)] and inn == []
    assert _reserve(store, 4) == 0  # 1 -> host, 2 dropped (host holds one)
    assert store.get(2, b"k2") is None and store.get(1, b"k1").slot == -1
    st = store.stats()
    assert (st["checkpoints_offloaded"], st["checkpoints_evicted"]) == (2, 1)
    assert (st["checkpoint_device_bytes"], st["checkpoint_host_bytes"]) == (200, 100)
    e1 = store.get(1, b"k1")
    assert store.acquire(e1) and e1.slot == 1  # back from the host into 3's slot
    out, inn = store.take_moves()
    assert [(s, e.key) for s, e in out] == [(0, 1), (1, 3)]
    assert [(s, e.key) for s, e in inn] == [(1, 1)]


def test_an_entry_is_restorable_only_once_the_step_writing_it_is_launched():
    """The step reads restore rows before the model runs and writes its checkpoints after: a
    request admitted behind the one that reserved an entry, in the same schedule, must not
    resume from it (it would read the slot's old contents)."""
    store = CheckpointStore(device_slots=2, host_slots=0, nbytes=1)
    assert store.reserve(1, b"k1", 64, ()) == 0
    assert store.contains(1) and store.get(1, b"k1") is None  # being written
    assert store.reserve(1, b"k1", 64, ()) == -1  # and not reserved twice
    store.after_launch()
    assert store.get(1, b"k1") is not None


def test_a_fault_drops_what_was_not_written():
    """serving/recovery.py: a step never launched leaves no entry of its own and no pin; a
    failed device step leaves no entry at all (the pool's contents are unknown)."""
    store = CheckpointStore(device_slots=3, host_slots=1, nbytes=1)
    assert _reserve(store, 1, deps=(10,)) == 0
    e1 = store.get(1, b"k1")
    assert store.acquire(e1)
    store.hand_to_launch(e1)  # the step restores 1 and writes 2
    assert store.reserve(2, b"k2", 64, (10,)) == 1
    store.abandon_launch()
    assert e1.pins == 0 and not store.contains(2) and store.deps[10] == {1}
    assert store.reserve(2, b"k2", 64, ()) == 1  # its slot is free again
    store.after_launch()
    store.clear()
    assert not store.device and not store.host and not store.deps
    assert sorted(store.free_slots) == [0, 1, 2]


def test_pinned_entries_are_never_evicted_and_release_twice_raises():
    store = CheckpointStore(device_slots=1, host_slots=0, nbytes=1)
    assert store.reserve(1, b"k1", 64, ()) == 0
    assert store.reserve(2, b"k2", 64, ()) == -1  # 1 is written by the step being built
    store.after_launch()
    e = store.get(1, b"k1")
    assert store.acquire(e)
    assert _reserve(store, 2) == -1  # pinned by a restore
    store.release(e)
    with pytest.raises(RuntimeError, match="released twice"):
        store.release(e)


def test_dropping_a_block_drops_the_checkpoints_above_it():
    store = CheckpointStore(device_slots=4, host_slots=0, nbytes=1)
    _reserve(store, 10, deps=(100, 101))
    _reserve(store, 11, deps=(100, 101, 102))
    _reserve(store, 12, deps=(200,))
    store.drop_dependent(101)
    assert store.get(10, b"k10") is None and store.get(11, b"k11") is None
    assert store.get(12, b"k12") is not None and len(store.free_slots) == 3
    assert 100 not in store.deps  # no dangling index entries


def test_checkpoint_bytes_are_every_recurrent_layers_conv_and_float32_delta():
    layout = (2, (6, 3), jnp.bfloat16, (2, 4, 4))  # (Lg, conv [C, Kc-1], dtype, delta)
    assert checkpoint_pool.checkpoint_nbytes(layout) == 2 * (18 * 2 + 32 * 4)


def test_candidates_are_block_boundaries_at_chunk_positions_with_pads():
    toks = [1] * 40 + [9] * 8 + [2] * 100  # 8 pads (id 9) at 40..47: positions lag by 8
    lay = build_layout(toks, 8, pad_id=9, ssep_id=None, pdep_id=None)
    cand = candidates(lay, len(toks), 8, 16)
    assert positions_of(lay, cand).tolist() == [16, 32, 48, 64, 80, 96, 112, 128]
    assert cand.tolist() == [16, 32, 56, 72, 88, 104, 120, 136]


def _plain(n):
    return build_layout(list(range(n)), 16, pad_id=None, ssep_id=None, pdep_id=None)


def test_rule_strategies_per_prompt():
    lay = _plain(700)
    kw = dict(per_prompt=3, block_tokens=128, max_len=1024, chunk=64)
    assert CheckpointPlanner("none", **kw).prompt_positions(lay, 700, 16) == []
    assert CheckpointPlanner("last", **kw).prompt_positions(lay, 700, 16) == [640]
    assert CheckpointPlanner("block", **kw).prompt_positions(lay, 700, 16) == [128, 256, 384]
    assert CheckpointPlanner("balanced", **kw).prompt_positions(lay, 700, 16) == [128, 320, 512]


def _blocks(tokens, bs=16):
    return [hash(tuple(tokens[:(j + 1) * bs])) for j in range(len(tokens) // bs)]


def _lcp_blocks(a, b, bs=16):
    n = 0
    while (n + 1) * bs <= min(len(a), len(b)) and a[n * bs:(n + 1) * bs] == b[n * bs:(n + 1) * bs]:
        n += 1
    return n


def _feed(planner, prompts, bs=16):
    """Admit prompts in order as the engine does (plan, then observe); a prompt's match is its
    longest full-block common prefix with an earlier prompt (the hit limit ignored)."""
    plans, seen = [], []
    for p in prompts:
        shared, origin = 0, None
        for q in seen:
            k = _lcp_blocks(p, q, bs)
            if k > shared:
                shared, origin = k, len(q)
        plans.append(planner.prompt_plan(_plain(len(p)), len(p), bs, _blocks(p, bs), shared))
        planner.observe(_blocks(p, bs), shared, origin)
        seen.append(p)
    return plans


def test_prompt_pmf_against_brute_force_sharing_counts():
    """Oracle (no decay): a request R_i that matched m_i blocks adds to P's mass of sharing at
    least j blocks iff j <= min(m_i, lcp(R_i, P)); extensions (a match reaching a chunk that no
    earlier match went through) set the rate and tails of the part read from P's end."""
    rng = np.random.default_rng(5)
    heads = [rng.integers(0, 50, int(n)).tolist() for n in (200, 450, 700)]
    prompts = [heads[rng.integers(3)] + rng.integers(50, 99, rng.integers(5, 60)).tolist()
               for _ in range(30)]
    planner = CheckpointPlanner("dp", 2, 512, 2048, 64, half_life=1e12)
    _feed(planner, prompts)
    p = heads[1] + [7] * 40
    n, bs = len(p), 16
    shared_of, ext, tails = [], 0, [32]  # the prior: one extension with a tail of 32
    for i, r in enumerate(prompts):
        m, origin = 0, None
        for q in prompts[:i]:
            if _lcp_blocks(r, q) > m:
                m, origin = _lcp_blocks(r, q), len(q)
        if m * bs >= 64 and not any(min(shared_of[k], _lcp_blocks(prompts[k], r)) >= m
                                    for k in range(i)):
            ext += 1
            tails.append(origin - m * bs)
        shared_of.append(m)
    total = 1 + len(prompts)
    ge = [sum(min(m, _lcp_blocks(r, p)) >= j for m, r in zip(shared_of, prompts))
          for j in range(1, n // bs + 2)]
    want = np.zeros(n + 1)
    for j in range(1, n // bs + 1):
        want[j * bs] = (ge[j - 1] - ge[j]) / total
    d = max(j for j in range(n // bs + 1) if j == 0 or ge[j - 1] > 0) * bs
    hist = np.full(2049, 1 / 2049)  # the tail histogram's smoothing: one observation, uniform
    np.add.at(hist, tails, 1.0)
    cond = hist[:n - d]
    want[d + 1:] += (1 + ext) / total * cond[::-1] / cond.sum()
    got = planner.prompt_pmf(n, _blocks(p), _lcp_blocks(p, heads[1] + [999]))
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-9, atol=1e-12)
    cand = range(64, n + 1, 64)
    best = min(expected_recompute(got, c) for c in itertools.combinations(cand, 2))
    pos = planner.prompt_positions(_plain(n), n, 16, _blocks(p), 28)
    assert expected_recompute(got, pos) == pytest.approx(best, rel=1e-12)


def test_each_prompt_checkpoints_where_its_own_prefix_is_shared():
    """Two system prompts (1480 and 3090 tokens) and short questions: once seen, every request
    of each takes its single checkpoint at the deepest chunk boundary of its own prompt (1472,
    3072); the other prompt's depths do not pull it (the global depth histogram did: 1408)."""
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, 50, n).tolist() for n in (1480, 3090)]
    prompts = [systems[i % 2] + rng.integers(50, 99, rng.integers(15, 40)).tolist()
               for i in range(24)]
    plans = _feed(CheckpointPlanner("dp", 1, 512, 8192, 64), prompts)
    assert [pos for pos, _ in plans[4:]] == [[1472], [3072]] * 10


def test_replan_follows_drift():
    planner = CheckpointPlanner("dp", 1, 512, 1024, 64, half_life=16, every=10**6, tv=0.2)
    for _ in range(64):
        planner.observe(list(range(19)), 19)  # depth 304
    assert planner.plan == [256]
    for _ in range(64):
        planner.observe(list(range(50)), 50)  # depth 800
    assert planner.plan == [768] and planner.replanner.replans >= 3


def test_eviction_keeps_valuable_entries_until_they_age_out():
    """GreedyDual: a deep checkpoint (value 100) outlives newer shallow ones (value 1); the clock
    rises with each eviction, so once newer entries are worth more it goes too."""
    store = CheckpointStore(device_slots=2, host_slots=0, nbytes=1)
    for key, value in ((1, 100.0), (2, 1.0), (3, 1.0), (4, 1.0)):
        assert store.reserve(key, b"k%d" % key, 64, (), value) >= 0
        store.after_launch()
    assert store.get(1, b"k1") is not None and store.get(4, b"k4") is not None
    for key in range(5, 200):
        store.reserve(key, b"k%d" % key, 64, (), 1.0)
        store.after_launch()
    assert store.get(1, b"k1") is None and store.clock >= 100.0


def test_checkpoint_value_is_the_mass_it_serves_times_the_gap_it_closes():
    pmf = np.random.default_rng(1).random(1001)
    pmf /= pmf.sum()
    v256, v640 = CheckpointPlanner.values(pmf, [256, 640])
    assert v640 == pytest.approx(pmf[640:].sum() * (640 - 256))
    assert v256 == pytest.approx(pmf[256:640].sum() * 256)


def test_a_hit_revalues_an_entry_and_resets_its_priority():
    store = CheckpointStore(device_slots=2, host_slots=0, nbytes=1)
    for key, value in ((1, 100.0), (2, 50.0)):
        store.reserve(key, b"k%d" % key, 64, (), value)
        store.after_launch()
    e1 = store.get(1, b"k1")
    assert store.acquire(e1)
    store.revalue(e1, 1.0)  # used by an extension: now worth a recurrence only
    store.release(e1)
    _reserve(store, 3)
    assert store.get(1, b"k1") is None and store.get(2, b"k2") is not None


def test_unshared_tails_put_a_checkpoint_just_before_each_prompts_own_suffix():
    """Requests that share all of a cached prompt but its last 40 tokens (another question):
    a new prompt of any length gets its single checkpoint at the last chunk boundary before
    that."""
    rng = np.random.default_rng(2)
    prompts = []
    for _ in range(30):
        doc = rng.integers(0, 99, 1000).tolist()
        prompts += [doc + [1] * 40, doc + [2] * 40]
    planner = CheckpointPlanner("dp", 1, 512, 4096, 64)
    _feed(planner, prompts)
    assert planner.prompt_positions(_plain(1040), 1040, 16) == [960]
    assert planner.prompt_positions(_plain(3000), 3000, 16) == [2944]


def _sparse_pmf(seed: int, n: int, k: int) -> np.ndarray:
    """A depth pmf over 0..n: mass at depth 0 and at k random depths."""
    rng = np.random.default_rng(seed)
    pmf = np.zeros(n + 1)
    pmf[rng.choice(np.arange(1, n + 1), k, replace=False)] = rng.random(k)
    pmf[0] = 1.0
    return pmf / pmf.sum()


def test_priced_dp_is_the_brute_force_optimum_of_recompute_plus_extra_checkpoints():
    """Each checkpoint past one per chunk costs `extra_price` (a chunk split): over every subset
    of at most per_prompt candidates, dp minimises E[recompute] + price * max(|C| - chunks, 0)
    (here the prompt is one chunk)."""
    n = 640
    pmf = _sparse_pmf(7, n, 12)
    cand = list(range(64, n + 1, 64))
    for price in (0.0, 5.0, 40.0, 1e4):
        planner = CheckpointPlanner("dp", 3, 512, n, 64, extra_price=price, step_tokens=n)
        planner.prompt_pmf = lambda n_, blocks, shared=0: pmf
        got = planner.prompt_positions(_plain(n), n, 16)
        score = lambda c: expected_recompute(pmf, c) + price * max(len(c) - 1, 0)  # noqa: E731
        best = min(score(c) for m in (1, 2, 3) for c in itertools.combinations(cand, m))
        assert score(got) == pytest.approx(best, rel=1e-12, abs=1e-12), price
        assert len(got) == 1 or price < 1e4


def test_a_plan_among_allowed_candidates_is_their_brute_force_optimum():
    """`allowed` (span prompts: only positions after a PDEP block are addressable) restricts the
    dp to those candidates, and its plan is the optimum among them; planning over every
    candidate and dropping the unaddressable ones afterwards (before session 37) lost
    checkpoints and scored worse."""
    n = 1280
    pmf = _sparse_pmf(11, n, 20)
    ok = lambda c: (c < 320) | (c > 1024)  # noqa: E731 -- a span over tokens 320..1024
    allowed = [c for c in range(64, n + 1, 64) if ok(c)]
    planner = CheckpointPlanner("dp", 3, 512, n, 64, step_tokens=n)
    planner.prompt_pmf = lambda n_, blocks, shared=0: pmf
    got, _ = planner.prompt_plan(_plain(n), n, 16, allowed=ok)
    assert all(ok(c) for c in got)
    best = min(expected_recompute(pmf, c) for m in (1, 2, 3)
               for c in itertools.combinations(allowed, m))
    assert expected_recompute(pmf, got) == pytest.approx(best, rel=1e-12, abs=1e-12)
    dropped = [c for c in planner.prompt_plan(_plain(n), n, 16)[0] if ok(c)]
    assert len(dropped) < len(got)
    assert expected_recompute(pmf, dropped) > expected_recompute(pmf, got)
