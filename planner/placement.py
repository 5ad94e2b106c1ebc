"""The placement cost model: input checks, expected recompute, exact compression onto candidates.

A cached prefix has positions 0..N. A future request overlaps it to depth t with probability
`pmf[t]`. Checkpoints C (positions in 1..N; position 0, the empty state, is always available) let a
hit at depth t resume from l(t; C) = max({0} u {c in C: c <= t}) and recompute t - l(t; C) tokens:

    E[r](C) = sum_t pmf[t] * (t - l(t; C)).

`pmf` may be unnormalised counts; it is divided by its sum, so costs are expected tokens per
request.
"""

from __future__ import annotations

import numpy as np


def check_pmf(pmf, name: str = "pmf") -> np.ndarray:
    """Returns `pmf` as float64 [N+1], normalised to sum 1; raises ValueError on bad input."""
    p = np.asarray(pmf, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(
            f"{name} must be a non-empty 1-D array over depths 0..N, got shape {p.shape}")
    bad = np.flatnonzero(~np.isfinite(p))
    if bad.size:
        raise ValueError(f"{name} has a non-finite value {p[bad[0]]} at depth {bad[0]}")
    neg = np.flatnonzero(p < 0)
    if neg.size:
        raise ValueError(f"{name} has a negative value {p[neg[0]]} at depth {neg[0]}")
    total = p.sum()
    if not total > 0:
        raise ValueError(f"{name} has no mass (all {p.size} entries are zero)")
    return p / total


def check_budget(budget) -> int:
    """Returns `budget` as an int >= 0; raises ValueError otherwise."""
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, np.integer)):
        raise ValueError(f"budget must be an integer number of checkpoints, got {budget!r}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    return int(budget)


def check_positions(positions, n: int, name: str = "positions") -> np.ndarray:
    """Returns sorted unique int64 positions, each in 1..n; raises ValueError otherwise."""
    if isinstance(positions, np.ndarray) and positions.dtype.kind in "iu":
        c = positions.astype(np.int64).reshape(-1)  # integers already (the planner's own)
    else:
        c = np.asarray(positions if positions is not None else [], dtype=np.float64).reshape(-1)
        if c.size and not np.all(np.isfinite(c)):
            raise ValueError(f"{name} must be finite, got {c[~np.isfinite(c)][0]}")
        if c.size and np.any(c != np.round(c)):
            raise ValueError(f"{name} must be integers, got {c[c != np.round(c)][0]}")
        c = c.astype(np.int64)
    out = np.flatnonzero((c < 1) | (c > n))
    if out.size:
        raise ValueError(
            f"{name}[{out[0]}] = {c[out[0]]} is outside 1..N = 1..{n} "
            f"(position 0 is implicit, N = len(pmf) - 1)")
    return np.unique(c)


def expected_recompute(pmf, positions) -> float:
    """Expected tokens recomputed per request, E[r] = sum_t pmf[t] * (t - l(t; C)).

    Args:
      pmf: [N+1] nonnegative weights over overlap depths 0..N (normalised here).
      positions: checkpoint positions, each in 1..N (any order, duplicates ignored).
    Returns:
      E[r] in tokens.
    """
    p = check_pmf(pmf)
    n = p.size - 1
    c = check_positions(positions, n)
    starts = np.concatenate([[0], c])  # [|C|+1]
    last = np.repeat(starts, _bin_sizes(c, n))  # [N+1] l(t; C)
    return weighted_sum(p, np.arange(n + 1) - last)


def _bin_sizes(cand: np.ndarray, n: int) -> np.ndarray:
    """[K+1] depths in each bin [c_k, c_{k+1}) of sorted positions c_1 < ... < c_K in 1..n
    (bin 0 = [0, c_1)): np.repeat of a value per bin by these is the bins' step function over
    depths 0..n, what a searchsorted of every depth gives, in O(N) without the search."""
    return np.diff(np.concatenate([[0], cand, [n + 1]]))


def weighted_sum(p: np.ndarray, v: np.ndarray) -> float:
    """sum_t p[t] * v[t] by numpy's pairwise sum, not `np.dot`: np.dot hands vectors of over
    10,000 entries to OpenBLAS's worker threads, and waking them on a busy host (an engine's XLA
    threads, the device wait) cost the admission of a 25,601-depth pmf 1-1.4 ms a call on an
    H100 host (benchmarks/RESULTS.md, Position-independent spans on hybrid models)."""
    return float(np.add.reduce(p * v))


def max_gap(positions, n: int) -> int:
    """Largest recompute any depth can need: max_t (t - l(t; C)) over t in 0..n."""
    c = check_positions(positions, n)
    bounds = np.concatenate([[0], c, [n + 1]])
    return int(np.max(np.diff(bounds)) - 1)


def compress(p: np.ndarray, candidates) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """Folds a normalised pmf onto candidate bins, exactly.

    With candidates c_1 < ... < c_K, every depth t in bin k = [c_k, c_{k+1}) resumes from the same
    checkpoint as depth c_k would, so E[r] = const + sum_k q_k (x_k - x_{l(k)}) with x_0 = 0,
    x_k = c_k, q_k the bin mass, and const = sum_k sum_{t in bin k} p_t (t - x_k).

    Returns:
      x: [K+1] float64 positions (x_0 = 0), q: [K+1] bin masses, const, cand: [K] int64 candidates.
    """
    n = p.size - 1
    cand = check_positions(candidates, n, name="candidates")
    x = np.concatenate([[0], cand]).astype(np.float64)  # [K+1]
    t = np.arange(n + 1)
    bins = np.repeat(np.arange(x.size), _bin_sizes(cand, n))  # [N+1] bin index of each depth
    q = np.bincount(bins, weights=p, minlength=x.size)
    const = weighted_sum(p, t - x[bins])
    return x, q, const, cand
