"""Aliens / WQS binary search: the optimum for a budget M without running M layers.

OPT(m) is convex in m, so for a price lambda >= 0 per checkpoint the penalised problem
    F(lambda) = min_C E[r](C) + lambda * |C|
is solved by some |C| = m(lambda), nonincreasing in lambda, and that C is optimal for budget
m(lambda). Binary search on lambda finds m(lambda) = M; each step is one O(K) pass of a monotone
convex hull trick (lines slope -x_s, queries Q[j+1] increasing), so the time depends on K and the
number of steps, never on M. Weak duality gives a certificate either way:
F(lambda) - lambda * M <= OPT(M) for every lambda, with equality at the right lambda.
When several budgets tie for one lambda (collinear points of the frontier), M itself may not be
attained; the result then holds the deepest attained budget below M and says so.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from planner.dp import _prepare
from planner.placement import check_budget


@dataclasses.dataclass(frozen=True)
class LagrangianResult:
    positions: np.ndarray  # sorted int64, at most `budget` of them
    cost: float  # E[r] of `positions`
    lower_bound: float  # max over tried lambda of F(lambda) - lambda * budget (<= OPT(budget))
    attained: bool  # len(positions) == budget (then cost == OPT(budget))
    optimal: bool  # cost == lower_bound up to rounding: certified OPT(budget), attained or not
    iterations: int


def _penalised(x, q, lam):
    """One pass of the online DP f[j] = min_s g(s) + w(s, j), g(s) = f[s-1] + lam, g(0) = 0.

    `lam` is one price for every bin, or a list with the price of each bin (entry 0 unused).
    Returns (F without the constant, number of checkpoints, chosen bin indices).
    """
    price = lam if isinstance(lam, list) else [lam] * len(x)
    k1 = len(x)
    qp = np.concatenate([[0.0], np.cumsum(q)]).tolist()  # Q
    xp = np.concatenate([[0.0], np.cumsum(q * x)]).tolist()  # X
    xs = x.tolist()
    f = [0.0] * k1
    parent = [0] * k1  # argmin s of row j
    cnt = [0] * k1
    hs, hb = [], []  # hull lines: slope -xs[s] (decreasing), intercept b_s
    head = 0
    for j in range(k1):
        # add the line of s = j (it needs f[j-1], known now)
        g = 0.0 if j == 0 else f[j - 1] + price[j]
        m_new, b_new = -xs[j], g - xp[j] + xs[j] * qp[j]
        while len(hs) - head >= 2:
            m1, b1, m2, b2 = -xs[hs[-2]], hb[-2], -xs[hs[-1]], hb[-1]
            # drop the last line if the new one overtakes the one before it no later than it does
            if (b_new - b1) * (m1 - m2) <= (b2 - b1) * (m1 - m_new):
                hs.pop()
                hb.pop()
            else:
                break
        hs.append(j)
        hb.append(b_new)
        y = qp[j + 1]
        while (len(hs) - head >= 2
               and hb[head + 1] - xs[hs[head + 1]] * y <= hb[head] - xs[hs[head]] * y):
            head += 1
        s = hs[head]
        f[j] = hb[head] - xs[s] * y + xp[j + 1]
        parent[j] = s
        cnt[j] = 0 if s == 0 else cnt[s - 1] + 1
    chosen = []
    j = k1 - 1
    while j >= 0 and parent[j] != 0:
        chosen.append(parent[j])
        j = parent[j] - 1
    return f[-1], cnt[-1], chosen[::-1]


def place_lagrangian(pmf, budget: int, candidates=None, max_iter: int = 100) -> LagrangianResult:
    """Optimal placement of at most `budget` checkpoints by binary search on the price lambda.

    Args:
      pmf: [N+1] nonnegative weights over overlap depths 0..N.
      budget: most checkpoints M.
      candidates: optional allowed positions in 1..N.
      max_iter: most binary-search steps.
    Returns:
      LagrangianResult (see its fields).
    """
    budget = check_budget(budget)
    x, q, const, pos = _prepare(pmf, candidates)
    # adding one checkpoint saves at most OPT(0) <= x_K, so above that price none is worth it
    lo, hi = 0.0, float(x[-1]) + 1.0
    # continuum guess: spacing L(t) = sqrt(2 lam / p(t)) gives M = integral sqrt(p / (2 lam)) dt
    mass = float(np.sum(np.sqrt(q[1:] * np.diff(x))))
    guess = mass**2 / (2.0 * budget**2) if budget else hi
    best = (np.asarray([], dtype=np.int64), 0.0)
    best_cnt, bound, it = -1, -np.inf, 0
    for it in range(1, max_iter + 1):
        if it == 1:
            lam = 0.0
        elif it == 2 and lo < guess < hi:
            lam = guess
        elif lo == 0.0:
            lam = hi / 4.0
        else:  # bisect in log space while the bracket is wide, then plainly
            lam = float(np.sqrt(lo * hi)) if hi > 2.0 * lo else 0.5 * (lo + hi)
        val, cnt, chosen = _penalised(x, q, lam)
        bound = max(bound, val - lam * budget + const)
        if cnt <= budget and cnt > best_cnt:
            best_cnt = cnt
            best = (pos[np.asarray(chosen, dtype=np.int64)], val - lam * cnt + const)
        if cnt == budget or (it == 1 and cnt < budget) or (it > 1 and hi - lo <= 1e-15 * hi):
            break
        if cnt > budget:
            lo = lam
        else:
            hi = lam
    positions, cost = best
    optimal = cost <= bound + 1e-12 * max(abs(bound), 1.0)
    return LagrangianResult(positions=np.sort(positions), cost=float(cost),
                            lower_bound=float(bound), attained=best_cnt == budget,
                            optimal=bool(optimal), iterations=it)
