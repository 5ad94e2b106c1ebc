"""The exact DP, its frontier and the Lagrangian solver against independent brute-force oracles."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import expected_recompute, frontier, place, place_lagrangian


def direct_cost(p, positions):
    """E[r] by the definition, one depth at a time (independent of planner.placement)."""
    p = np.asarray(p, dtype=float) / np.sum(p)
    total = 0.0
    for t, pt in enumerate(p):
        last = max([0] + [c for c in positions if c <= t])
        total += pt * (t - last)
    return total


def exhaustive(p, budget, allowed):
    """min over every subset of `allowed` with at most `budget` elements."""
    best = direct_cost(p, [])
    for m in range(1, min(budget, len(allowed)) + 1):
        for subset in itertools.combinations(allowed, m):
            best = min(best, direct_cost(p, subset))
    return best


def recurrence(p, budget, allowed):
    """The O(N^2 M) DP of DESIGN.md on raw depths: dp[m][j] = min_s dp[m-1][s-1] + w(s, j)."""
    p = np.asarray(p, dtype=float) / np.sum(p)
    n = len(p) - 1

    def w(s, j):
        return sum(p[t] * (t - s) for t in range(s, j + 1))

    # prev[j + 1] = best cost of depths 0..j; index 0 stands for j = -1 (nothing to cover)
    prev = [0.0] + [w(0, j) for j in range(n + 1)]
    out = [prev[-1]]
    for _ in range(budget):
        cur = [0.0]
        for j in range(n + 1):
            opts = [w(0, j)] + [prev[s] + w(s, j) for s in allowed if 1 <= s <= j]
            cur.append(min(opts))
        prev = cur
        out.append(prev[-1])
    return np.asarray(out)


def close(a, b):
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b)) + 1e-12


@st.composite
def pmfs(draw, max_n):
    n = draw(st.integers(1, max_n))
    value = st.one_of(st.just(0.0), st.floats(1e-3, 1.0))
    vals = draw(st.lists(value, min_size=n + 1, max_size=n + 1))
    if sum(vals) == 0:
        vals[draw(st.integers(0, n))] = 1.0
    return np.asarray(vals)


@st.composite
def candidate_sets(draw, n):
    if draw(st.booleans()):
        return None
    return sorted(draw(st.sets(st.integers(1, n), max_size=n)))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_dp_equals_exhaustive_search(data):
    p = data.draw(pmfs(max_n=9))
    n = len(p) - 1
    cand = data.draw(candidate_sets(n))
    budget = data.draw(st.integers(0, 4))
    got = place(p, budget, "dp", candidates=cand)
    allowed = list(range(1, n + 1)) if cand is None else cand
    assert len(got) <= budget and set(got.tolist()) <= set(allowed)
    assert list(got) == sorted(got)
    assert close(direct_cost(p, got.tolist()), exhaustive(p, budget, allowed))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_frontier_equals_quadratic_recurrence(data):
    p = data.draw(pmfs(max_n=30))
    n = len(p) - 1
    cand = data.draw(candidate_sets(n))
    budget = data.draw(st.integers(0, 8))
    allowed = list(range(1, n + 1)) if cand is None else cand
    want = recurrence(p, budget, allowed)
    fr = frontier(p, budget, candidates=cand)
    for m in range(budget + 1):
        assert close(fr.costs[m], want[m]), (m, fr.costs, want)
        assert len(fr.placements[m]) <= m
        assert close(direct_cost(p, fr.placements[m].tolist()), want[m])


def test_frontier_convex_and_matches_per_budget_solves(fresh_rng):
    rng = fresh_rng
    n, max_m = 400, 40
    p = rng.gamma(0.3, size=n + 1) * (rng.random(n + 1) < 0.5)
    p[n] += 1.0
    fr = frontier(p, max_m)
    assert np.all(np.diff(fr.costs) <= 1e-12)  # nonincreasing
    assert np.all(np.diff(fr.costs, 2) >= -1e-9 * fr.costs[0])  # convex
    for m in range(max_m + 1):
        single = place(p, m)
        assert close(expected_recompute(p, single), fr.costs[m])
        assert close(expected_recompute(p, fr.placements[m]), fr.costs[m])
    # choosing M by price: the chosen m minimises cost + price * m over the frontier
    for price in [0.0, 0.01, 0.5, 3.0, 1e9]:
        m = fr.choose_budget(price)
        totals = fr.costs + price * np.arange(max_m + 1)
        assert totals[m] <= totals.min() + 1e-12
    with pytest.raises(ValueError, match="price"):
        fr.choose_budget(-1.0)


def test_dp_on_long_pmf_matches_recurrence_on_chunk_candidates(fresh_rng):
    """A long pmf with 64-token candidates: the compressed DP equals the raw recurrence."""
    rng = fresh_rng
    n = 700
    p = rng.random(n + 1) ** 4
    cand = list(range(64, n + 1, 64))
    want = recurrence(p, 4, cand)
    fr = frontier(p, 4, candidates=cand)
    assert np.allclose(fr.costs, want, rtol=1e-9, atol=1e-12)


def test_budget_at_least_support_gives_zero_recompute(fresh_rng):
    rng = fresh_rng
    n = 5000
    spikes = rng.choice(np.arange(1, n + 1), size=7, replace=False)
    p = np.zeros(n + 1)
    p[spikes] = rng.random(7) + 0.1
    p[0] = 0.3  # depth 0 never costs anything
    got = place(p, 7)
    assert sorted(got.tolist()) == sorted(spikes.tolist())
    assert expected_recompute(p, got) == 0.0
    assert len(place(p, 100)) <= 7


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_lagrangian_matches_dp_where_attained(data):
    p = data.draw(pmfs(max_n=40))
    n = len(p) - 1
    cand = data.draw(candidate_sets(n))
    budget = data.draw(st.integers(0, 12))
    opt = frontier(p, budget, candidates=cand).costs[budget]
    res = place_lagrangian(p, budget, candidates=cand)
    assert len(res.positions) <= budget
    assert close(res.cost, direct_cost(p, res.positions.tolist()))
    assert res.lower_bound <= opt + 1e-9 * max(opt, 1.0)  # weak duality
    assert res.cost >= opt - 1e-9 * max(opt, 1.0)
    if res.attained or res.optimal:
        assert close(res.cost, opt)


def test_lagrangian_attains_on_generic_random_pmf(fresh_rng):
    rng = fresh_rng
    p = rng.random(3001)
    opts = frontier(p, 64).costs
    for budget in [1, 5, 17, 64]:
        res = place_lagrangian(p, budget)
        assert res.attained and len(res.positions) == budget
        assert close(res.cost, opts[budget])


def test_dp_and_lagrangian_agree_on_irregular_candidates(fresh_rng):
    """Two independent exact algorithms (PAVA-hull layers vs a convex-hull-trick price search)
    on uneven candidate spacing, where the hull needs its weights."""
    rng = fresh_rng
    n = 6000
    p = rng.gamma(0.5, size=n + 1)
    cand = np.sort(rng.choice(np.arange(1, n + 1), size=700, replace=False))
    opts = frontier(p, 40, candidates=cand).costs
    for budget in [3, 40]:
        res = place_lagrangian(p, budget, candidates=cand)
        assert set(res.positions.tolist()) <= set(cand.tolist())
        assert res.attained and len(res.positions) == budget  # generic data: no ties
        assert close(res.cost, opts[budget])
        assert close(direct_cost(p, res.positions.tolist()), opts[budget])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(1, 400), seed=st.integers(0, 2**31 - 1), k=st.integers(0, 40),
       as_list=st.booleans())
def test_compression_and_cost_are_the_depth_search_bit_for_bit(n, seed, k, as_list):
    """placement.compress / expected_recompute bin the depths by a step function
    (`_bin_sizes`, np.repeat) where they searched every depth (np.searchsorted): the same bins,
    masses, constant and cost, bit for bit, for integer arrays and for float lists (the checked
    path)."""
    from planner import placement
    rng = np.random.default_rng(seed)
    p = placement.check_pmf(rng.random(n + 1) * (rng.random(n + 1) < 0.7) + 1e-3)
    cand = np.unique(rng.integers(1, n + 1, k)).astype(np.int64)
    given_cand = [float(c) for c in cand] if as_list else cand
    t = np.arange(n + 1)
    bins = np.searchsorted(cand, t, side="right")  # the search the step function replaces
    x = np.concatenate([[0], cand]).astype(np.float64)
    q = np.bincount(bins, weights=p, minlength=x.size)
    got = placement.compress(p, given_cand)
    np.testing.assert_array_equal(got[0], x)
    np.testing.assert_array_equal(got[1], q)
    assert got[2] == float(np.add.reduce(p * (t - x[bins])))
    starts = np.concatenate([[0], cand])
    last = starts[np.searchsorted(starts, t, side="right") - 1]
    p2 = placement.check_pmf(p)  # (expected_recompute normalises its pmf again)
    assert placement.expected_recompute(p, given_cand) == float(np.add.reduce(p2 * (t - last)))
    assert placement.expected_recompute(p, given_cand) == pytest.approx(direct_cost(p, cand))


def test_placement_of_a_long_pmf_calls_no_blas(monkeypatch):
    """The planner runs inside every hybrid admission: its sums over the depths go by numpy's
    own reductions, never BLAS (np.dot wakes OpenBLAS's threads for vectors over 10,000 entries:
    1-1.4 ms a call in the engine on the H100 host)."""
    from planner import placement

    def no_blas(*args, **kwargs):
        raise AssertionError("a BLAS call in the planner's path")

    rng = np.random.default_rng(7)
    p = rng.random(25_601) * (rng.random(25_601) < 0.01)
    p[0] = 1.0
    cand = np.arange(16, 25_601, 16)
    want = (place(p, 3, candidates=cand), expected_recompute(p, cand[::7]),
            placement.compress(placement.check_pmf(p), cand)[2])
    for name in ("dot", "vdot", "inner", "matmul", "tensordot", "einsum"):
        monkeypatch.setattr(np, name, no_blas)
    got = (place(p, 3, candidates=cand), expected_recompute(p, cand[::7]),
           placement.compress(placement.check_pmf(p), cand)[2])
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1:] == want[1:]
