"""Priced placement (a price per checkpoint position) against exhaustive search and the frontier."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import frontier, place_priced


def direct_cost(p, positions):
    """E[r] by the definition, one depth at a time."""
    p = np.asarray(p, dtype=float) / np.sum(p)
    return sum(pt * (t - max([0] + [c for c in positions if c <= t])) for t, pt in enumerate(p))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), seed=st.integers(0, 2**32 - 1), chunked=st.booleans())
def test_priced_equals_exhaustive(n, seed, chunked):
    rng = np.random.default_rng(seed)
    p = rng.random(n + 1) * (rng.random(n + 1) < 0.6)
    p[rng.integers(0, n + 1)] += 0.5
    price = rng.random(n + 1) * rng.choice([0.0, 0.3, 2.0])
    allowed = list(range(2, n + 1, 2)) if chunked else list(range(1, n + 1))
    res = place_priced(p, price, candidates=allowed if chunked else None)
    best = min(direct_cost(p, c) + sum(price[i] for i in c)
               for m in range(len(allowed) + 1) for c in itertools.combinations(allowed, m))
    assert set(res.positions.tolist()) <= set(allowed)
    assert abs(res.total - best) <= 1e-9 * max(best, 1.0)
    assert abs(res.cost - direct_cost(p, res.positions.tolist())) <= 1e-12


def test_flat_price_matches_frontier(fresh_rng):
    rng = fresh_rng
    p = rng.gamma(0.4, size=801)
    fr = frontier(p, 800)
    for lam in [0.0, 0.05, 1.0, 20.0]:
        res = place_priced(p, lam)
        want = np.min(fr.costs + lam * np.arange(fr.costs.size))
        assert abs(res.total - want) <= 1e-9 * max(want, 1.0)


def test_price_errors():
    with pytest.raises(ValueError, match="array of 5 entries"):
        place_priced(np.ones(5), np.ones(4))
    with pytest.raises(ValueError, match=r"price\[2\] = -1.0"):
        place_priced(np.ones(5), [0, 0, -1, 0, 0])
    with pytest.raises(ValueError, match="negative value"):
        place_priced([1, -1], 0.5)
