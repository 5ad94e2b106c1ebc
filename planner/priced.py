"""Exact placement with a price on each checkpoint position: min_C E[r](C) + sum_{c in C} price(c).

`place` limits how many positions are used. Memory is different: a cached entry of length L holds
the states at C n [1, L], so a shallow position costs more bytes than a deep one. With
price(c) = lam * state_bytes * P(cached entry is at least c long), sweeping lam traces the
supported points of the recompute-vs-bytes-held frontier. One O(K) pass of the convex hull trick
used by the Lagrangian solver; zero-mass bins are kept, since a dearer bin to their right need not
dominate them once prices differ.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from planner.dp import _prepare
from planner.lagrangian import _penalised
from planner.placement import expected_recompute


@dataclasses.dataclass(frozen=True)
class PricedResult:
    positions: np.ndarray  # sorted int64
    cost: float  # E[r] of `positions` (expected tokens recomputed)
    total: float  # cost + the prices of `positions`: the minimised objective


def place_priced(pmf, price, candidates=None) -> PricedResult:
    """Checkpoints minimising expected recompute plus the sum of their prices.

    Args:
      pmf: [N+1] nonnegative weights over overlap depths 0..N (normalised here).
      price: a number >= 0 (the same for every position) or an [N+1] array, price[c] for a
        checkpoint at c (price[0] is ignored); in expected tokens of recompute per request.
      candidates: optional positions in 1..N that checkpoints may use.
    Returns:
      PricedResult.
    """
    x, q, const, pos = _prepare(pmf, candidates, drop_empty=False)
    n = int(np.asarray(pmf).size - 1)
    pr = np.asarray(price, dtype=np.float64)
    if pr.ndim == 0:
        pr = np.full(n + 1, float(pr))
    if pr.shape != (n + 1,):
        raise ValueError(f"price must be a number or an array of {n + 1} entries, got {pr.shape}")
    bad = np.flatnonzero(~np.isfinite(pr) | (pr < 0))
    if bad.size:
        raise ValueError(f"price[{bad[0]}] = {pr[bad[0]]} must be finite and >= 0")
    _, _, chosen = _penalised(x, q, pr[pos].tolist())
    positions = np.sort(pos[np.asarray(chosen, dtype=np.int64)])
    cost = expected_recompute(pmf, positions)
    return PricedResult(positions=positions, cost=cost, total=cost + float(pr[positions].sum()))
