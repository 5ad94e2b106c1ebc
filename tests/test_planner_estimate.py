"""Histogram estimators, the replan rule, and the robustness bound on random instances."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import (DecayingHistogram, EmpiricalHistogram, Replanner, expected_recompute,
                     max_gap, place, regret_bound, tv_distance)


def test_empirical_histogram_matches_counts(fresh_rng):
    rng = fresh_rng
    n = 50
    depths = rng.integers(0, n + 1, size=333)
    h = EmpiricalHistogram(n, smoothing=0.25)
    h.observe(depths[:100])
    h.observe(depths[100:].tolist())
    counts = np.array([(depths == t).sum() for t in range(n + 1)], dtype=float)
    assert np.allclose(h.pmf(), (counts + 0.25) / (333 + 0.25 * (n + 1)))
    assert h.total == 333


def test_decaying_histogram_matches_direct_weights(fresh_rng):
    rng = fresh_rng
    n, half_life = 20, 7.0
    depths = rng.integers(0, n + 1, size=3000)  # long enough to cross the internal rescale
    h = DecayingHistogram(n, half_life=half_life, smoothing=0.1)
    for part in np.array_split(depths, [1, 2, 50, 1700]):
        h.observe(part)
    age = np.arange(depths.size)[::-1]  # last observation has age 0
    w = 0.5 ** (age / half_life)
    want = np.bincount(depths, weights=w, minlength=n + 1) + 0.1
    assert np.allclose(h.pmf(), want / want.sum(), rtol=1e-9)
    assert h.total == pytest.approx(w.sum(), rel=1e-9)


def test_estimator_errors():
    with pytest.raises(ValueError, match=r"depth \[1\] = 11 is outside 0\.\.N = 0\.\.10"):
        EmpiricalHistogram(10).observe([3, 11])
    with pytest.raises(ValueError, match="integers"):
        EmpiricalHistogram(10).observe([1.5])
    with pytest.raises(ValueError, match="undefined"):
        EmpiricalHistogram(10, smoothing=0).pmf()
    with pytest.raises(ValueError, match="half_life"):
        DecayingHistogram(10, half_life=0)
    with pytest.raises(ValueError, match="different depth ranges"):
        tv_distance([1, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="tv must be"):
        regret_bound(1.5, [], 10)


def test_tv_distance(fresh_rng):
    rng = fresh_rng
    p, q = rng.random(30), rng.random(30)
    want = 0.5 * sum(abs(a / p.sum() - b / q.sum()) for a, b in zip(p, q))
    assert tv_distance(p, q) == pytest.approx(want)
    assert tv_distance(p, 3 * p) == pytest.approx(0.0)
    cand = [5, 17, 29]  # bins [0,5) [5,17) [17,29) [29,29]
    edges = [0, 5, 17, 29, 30]
    pb = [p[a:b].sum() / p.sum() for a, b in zip(edges, edges[1:])]
    qb = [q[a:b].sum() / q.sum() for a, b in zip(edges, edges[1:])]
    assert tv_distance(p, q, cand) == pytest.approx(0.5 * sum(abs(a - b) for a, b in zip(pb, qb)))
    assert tv_distance(p, q, cand) <= tv_distance(p, q) + 1e-12


def test_replanner_every_k_and_on_drift(fresh_rng):
    rng = fresh_rng
    n = 200
    cand = list(range(8, n + 1, 8))
    shallow = lambda k: rng.integers(0, 40, size=k)  # noqa: E731
    deep = lambda k: rng.integers(160, n + 1, size=k)  # noqa: E731
    est = DecayingHistogram(n, half_life=200, smoothing=1e-5)  # ~290 effective observations
    est.observe(shallow(2000))
    rp = Replanner(est, budget=4, candidates=cand, every=10**6, tv_threshold=0.3)
    assert rp.replans == 1 and np.all(rp.positions < 40) and set(rp.positions) <= set(cand)
    for _ in range(5):  # same distribution: binned TV stays far below the threshold
        assert not rp.observe(shallow(20))
    fired = [rp.observe(deep(50)) for _ in range(40)]  # old traffic decays to 2^-10
    assert any(fired) and rp.replans >= 2
    assert np.sum(rp.positions >= 160) >= 3  # the new plan follows the new traffic
    tv = rp.drift()
    assert tv <= 0.3  # after any observe: just replanned, or still within the threshold
    # a plan within TV of the current estimate is within the robustness bound of its optimum
    now = est.pmf()
    best = expected_recompute(now, place(now, 4, candidates=cand))
    assert expected_recompute(now, rp.positions) <= best + regret_bound(tv, rp.positions, n) + 1e-12
    rp2 = Replanner(EmpiricalHistogram(n), budget=2, every=25, tv_threshold=1.0)
    fired = [rp2.observe(shallow(5)) for _ in range(10)]
    assert fired == [False, False, False, False, True] * 2


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 120), budget=st.integers(0, 10), seed=st.integers(0, 2**32 - 1),
       mix=st.floats(0.0, 1.0), chunk=st.sampled_from([None, 4, 16]))
def test_robustness_bound_holds(n, budget, seed, mix, chunk):
    rng = np.random.default_rng(seed)
    p = rng.gamma(0.3, size=n + 1) + 1e-12
    p /= p.sum()
    other = rng.gamma(0.3, size=n + 1) + 1e-12
    q = (1 - mix) * p + mix * other / other.sum()  # an estimate at a controlled distance
    cand = None if chunk is None else list(range(chunk, n + 1, chunk))
    tv = tv_distance(p, q, cand)  # over candidate bins when placements are restricted to them
    assert tv <= tv_distance(p, q) + 1e-12
    c_p, c_q = place(p, budget, candidates=cand), place(q, budget, candidates=cand)
    regret = expected_recompute(p, c_q) - expected_recompute(p, c_p)
    assert regret >= -1e-12
    assert regret <= tv * (max_gap(c_q, n) + max_gap(c_p, n)) + 1e-12
    assert regret <= regret_bound(tv, c_q, n) + 1e-12 <= 2 * n * tv + 2e-12
    if cand is None:  # the per-placement step of the proof: |E_p[C] - E_q[C]| <= TV * G(C)
        gap = abs(expected_recompute(p, c_q) - expected_recompute(q, c_q))
        assert gap <= tv * max_gap(c_q, n) + 1e-12


@pytest.mark.parametrize("make", [lambda n: EmpiricalHistogram(n, smoothing=0.3),
                                  lambda n: DecayingHistogram(n, half_life=3, smoothing=1e-4)])
def test_drift_from_bin_sums_equals_the_binned_tv_distance(fresh_rng, make):
    """The Replanner's drift reads the estimator's per-bin sums (kept as it observes, O(depths)
    an observation, not O(N)); it equals tv_distance over the candidate bins of the whole pmf,
    also across the decaying histogram's rescales (half-life 3: 1e100 within ~1,000 depths)."""
    n = 97
    cand = [5, 17, 40, 41, 90]
    est = make(n)
    est.observe(fresh_rng.integers(0, n + 1, size=30))  # before the Replanner starts tracking
    rp = Replanner(est, budget=2, candidates=cand, every=10**9, tv_threshold=1.0)
    for k in (1, 1, 7, 400, 1500, 1):
        rp.observe(fresh_rng.integers(0, 30, size=k))
        want = tv_distance(est.pmf(), rp.plan_pmf, cand)
        assert rp.drift() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert rp.drift() > 0.05  # the traffic moved: the check compares something
    with pytest.raises(ValueError, match="another binning"):
        Replanner(est, budget=2, candidates=[3, 50], tv_threshold=1.0)
