"""The hybrid checkpoint store (tiers, pins, LRU, dependency eviction), the device pool's moves,
and per-prompt placement (candidates with pads, strategies, dp against brute force)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from planner import expected_recompute
from serving import checkpoint_pool
from serving.checkpoint_plan import CheckpointPlanner, candidates, positions_of
from serving.checkpoint_store import CheckpointStore
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


def test_dp_is_the_brute_force_optimum_on_the_truncated_observed_pmf():
    rng = np.random.default_rng(3)
    planner = CheckpointPlanner("dp", 2, 512, 1024, 64, every=1000, tv=1.0)
    depths = rng.choice([100, 300, 300, 650, 900], 200)
    for d in depths:
        planner.observe(int(d))
    planner.replanner._replan()
    n = 700
    got = planner.prompt_positions(_plain(n), n, 16)
    trunc = planner.prompt_pmf(n)
    pmf = np.asarray(planner.replanner.plan_pmf)
    tails = planner.tails.pmf()  # no tail observed: the prior (one tail of 32 tokens)
    want = 0.5 * np.concatenate([pmf[:n], [pmf[n:].sum()]]) + 0.5 * np.concatenate(
        [[tails[n:].sum()], tails[:n][::-1]])
    np.testing.assert_allclose(trunc, want, rtol=1e-12, atol=1e-15)
    cand = range(64, n + 1, 64)
    best = min(expected_recompute(trunc, c) for c in itertools.combinations(cand, 2))
    assert expected_recompute(trunc, got) == pytest.approx(best, rel=1e-12)
    assert 640 in got  # the mass at 650 and beyond (truncated at 700) is served at 640


def test_replan_follows_drift():
    planner = CheckpointPlanner("dp", 1, 512, 1024, 64, half_life=16, every=10**6, tv=0.2)
    for _ in range(64):
        planner.observe(300)
    assert planner.plan == [256]
    for _ in range(64):
        planner.observe(800)
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
    planner = CheckpointPlanner("dp", 2, 512, 1000, 64, every=10**6, tv=1.0)
    for d in [300] * 50 + [700] * 50:
        planner.observe(d)
    planner.replanner._replan()
    pmf = np.asarray(planner.replanner.plan_pmf)
    assert planner.value(640, [256, 640]) == pytest.approx(pmf[640:].sum() * (640 - 256))
    assert planner.value(256, [256, 640]) == pytest.approx(pmf[256:640].sum() * 256)


def test_unshared_tails_put_a_checkpoint_just_before_each_prompts_own_suffix():
    """Requests that share all of a cached prompt but its last ~40 tokens (another question):
    a prompt of any length gets its single checkpoint at the last chunk boundary before that."""
    planner = CheckpointPlanner("dp", 1, 512, 4096, 64, every=10**6, tv=1.0)
    for _ in range(50):
        planner.observe(0, None)
        planner.observe(1000, 40)
    planner.replanner._replan()
    assert planner.prompt_positions(_plain(1040), 1040, 16) == [960]
    assert planner.prompt_positions(_plain(3000), 3000, 16) == [2944]
