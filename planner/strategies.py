"""Placement strategies: the fixed-rule baselines and the exact DP, behind one `place` call.

Rule-based strategies ignore the pmf except for its length N (= len(pmf) - 1):
  none      no checkpoints.
  balanced  `budget` evenly spaced positions: floor(i (N+1) / (budget+1)), i = 1..budget. The
            segments differ in length by at most one, which is optimal for a uniform pmf and
            minimises the worst-case recompute (the longest gap).
  block     every `block_size` tokens (B, 2B, ...). Without `block_size`, the finest block that
            fits the budget: B = N // (budget + 1) + 1, the smallest B with N // B <= budget.
  log       powers of two 1, 2, 4, ... <= N.
  sqrt      every ceil(sqrt(N)) tokens.
  dp        the exact optimum (planner.dp).
When a rule yields more positions than the budget, the shallowest `budget` are kept (a cache that
checkpoints as the prefill advances and stops when the budget is spent). With `candidates`, each
rule position moves down to the deepest candidate at or before it (a state can only be taken at a
chunk boundary); positions with no candidate at or before them are dropped.
"""

from __future__ import annotations

import math

import numpy as np

from planner import dp
from planner.placement import check_budget, check_pmf, check_positions

STRATEGIES = ("none", "balanced", "block", "log", "sqrt", "dp")


def _rule_positions(strategy: str, n: int, budget: int, block_size) -> np.ndarray:
    if strategy == "none" or budget == 0 or n == 0:
        return np.zeros(0, dtype=np.int64)
    if strategy == "balanced":
        m = min(budget, n)
        return (np.arange(1, m + 1) * (n + 1)) // (m + 1)
    if strategy == "block":
        step = n // (budget + 1) + 1 if block_size is None else block_size
        return np.arange(step, n + 1, step)[:budget]
    if strategy == "log":
        return (1 << np.arange(n.bit_length()))[:budget]
    if strategy == "sqrt":
        step = math.isqrt(n - 1) + 1 if n > 1 else 1  # ceil(sqrt(n))
        return np.arange(step, n + 1, step)[:budget]
    raise AssertionError(strategy)


def _snap(positions: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    idx = np.searchsorted(candidates, positions, side="right") - 1
    return np.unique(candidates[idx[idx >= 0]])


def place(pmf, budget: int, strategy: str = "dp", candidates=None, *,
          block_size=None) -> np.ndarray:
    """Checkpoint positions for a cached prefix of length N = len(pmf) - 1.

    Args:
      pmf: [N+1] nonnegative weights; pmf[t] ~ probability that a request overlaps to depth t.
      budget: most checkpoints M (>= 0).
      strategy: one of STRATEGIES.
      candidates: optional positions in 1..N where a checkpoint may go (e.g. chunk boundaries).
      block_size: tokens between checkpoints for strategy "block" (default: fit the budget).
    Returns:
      Sorted int64 array of at most `budget` positions in 1..N.
    """
    p = check_pmf(pmf)
    budget = check_budget(budget)
    n = p.size - 1
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    if block_size is not None and (not isinstance(block_size, (int, np.integer)) or block_size < 1):
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    cand = None if candidates is None else check_positions(candidates, n, name="candidates")
    if strategy == "dp":
        return dp.solve(p, budget, cand)
    out = _rule_positions(strategy, n, budget, block_size).astype(np.int64)
    return out if cand is None else _snap(out, cand)[:budget]
