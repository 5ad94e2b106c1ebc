"""Baseline strategies, DP dominance, balanced optimality, and input errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import STRATEGIES, expected_recompute, frontier, max_gap, place


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), budget=st.integers(0, 40), seed=st.integers(0, 2**32 - 1),
       chunk=st.sampled_from([None, 1, 8, 64]), block=st.sampled_from([None, 16, 100]))
def test_dp_never_worse_than_any_strategy(n, budget, seed, chunk, block):
    rng = np.random.default_rng(seed)
    p = rng.gamma(0.2, size=n + 1) * (rng.random(n + 1) < 0.6)
    p[rng.integers(0, n + 1)] += 1.0
    cand = None if chunk is None else list(range(chunk, n + 1, chunk))
    best = expected_recompute(p, place(p, budget, "dp", candidates=cand))
    for strategy in STRATEGIES:
        got = place(p, budget, strategy, candidates=cand, block_size=block)
        assert len(got) <= budget
        assert np.all(np.diff(got) > 0) and (got.size == 0 or (got[0] >= 1 and got[-1] <= n))
        if cand is not None:
            assert set(got.tolist()) <= set(cand)
        assert best <= expected_recompute(p, got) + 1e-12


@pytest.mark.parametrize("n", [1, 2, 7, 64, 100, 257])
def test_balanced_is_optimal_for_uniform_pmf(n):
    p = np.ones(n + 1)
    opt = frontier(p, min(n, 40)).costs
    for budget in range(min(n, 40) + 1):
        bal = place(p, budget, "balanced")
        assert len(bal) == budget
        assert abs(expected_recompute(p, bal) - opt[budget]) <= 1e-12 * max(opt[budget], 1)
        # and it minimises the longest gap: ceil((N+1)/(M+1)) - 1
        assert max_gap(bal, n) == -(-(n + 1) // (budget + 1)) - 1


def test_rule_positions():
    p = np.ones(1001)
    assert place(p, 5, "none").size == 0
    assert place(p, 100, "block", block_size=64).tolist() == list(range(64, 1001, 64))
    assert place(p, 3, "block", block_size=64).tolist() == [64, 128, 192]
    assert place(p, 4, "block").tolist() == [201, 402, 603, 804]  # B = 1000 // 5 + 1
    assert place(p, 100, "log").tolist() == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert place(p, 100, "sqrt").tolist() == list(range(32, 1001, 32))
    assert place(p, 3, "balanced").tolist() == [250, 500, 750]
    # candidates: rule positions move down to the deepest chunk boundary at or before them
    assert place(p, 3, "balanced", candidates=range(100, 1001, 100)).tolist() == [200, 500, 700]
    assert place(p, 10, "log", candidates=[100, 300]).tolist() == [100, 300]  # 128->100, 512->300


@pytest.mark.parametrize("bad, match", [
    ([0.5, -0.1, 0.6], r"negative value -0\.1 at depth 1"),
    ([0.5, np.nan], r"non-finite value nan at depth 1"),
    ([np.inf, 1.0], r"non-finite value inf at depth 0"),
    ([], r"non-empty"),
    ([[0.5, 0.5]], r"1-D"),
    ([0.0, 0.0], r"no mass"),
])
def test_bad_pmf(bad, match):
    with pytest.raises(ValueError, match=match):
        place(bad, 1)
    with pytest.raises(ValueError, match=match):
        expected_recompute(bad, [])
    with pytest.raises(ValueError, match=match):
        frontier(bad, 1)


@pytest.mark.parametrize("budget", [-1, 1.5, True, "3", None])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="budget"):
        place([1.0, 1.0, 1.0], budget)


@pytest.mark.parametrize("cand, match", [
    ([0, 2], r"candidates\[0\] = 0 is outside 1\.\.N = 1\.\.4"),
    ([1, 5], r"candidates\[1\] = 5 is outside 1\.\.N = 1\.\.4"),
    ([1.5], r"integers"),
    ([np.nan], r"finite"),
])
def test_bad_candidates(cand, match):
    for strategy in ("dp", "balanced"):
        with pytest.raises(ValueError, match=match):
            place(np.ones(5), 2, strategy, candidates=cand)


def test_other_errors():
    with pytest.raises(ValueError, match="unknown strategy 'greedy'"):
        place(np.ones(5), 2, "greedy")
    with pytest.raises(ValueError, match="block_size"):
        place(np.ones(5), 2, "block", block_size=0)
    with pytest.raises(ValueError, match=r"positions\[0\] = 9 is outside"):
        expected_recompute(np.ones(5), [9])


def test_expected_recompute_definition():
    p = np.array([1.0, 0.0, 2.0, 0.0, 3.0, 4.0])  # N = 5, normalised by 10
    # C = {2, 4}: l = 0,0,2,2,4,4 -> r = 0,1,0,1,0,1 -> (0 + 0 + 0 + 0 + 0 + 4) / 10
    assert expected_recompute(p, [4, 2, 2]) == pytest.approx(0.4)
    assert expected_recompute(p, []) == pytest.approx((2 * 2 + 3 * 4 + 4 * 5) / 10)
