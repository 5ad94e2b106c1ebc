"""Exact optimal placement in O(N M) (plus an O(N log N) search per layer), and the whole frontier.

On compressed bins (positions x_0 = 0 < x_1 < ... < x_K, masses q_k; see placement.compress):

    D_m[j] = min cost of depths in bins 0..j with at most m checkpoints among x_1..x_j
    D_0[j] = w(0, j),   D_m[j] = min_{s=0..j} g_m(s) + w(s, j),   g_m(0) = 0, g_m(s) = D_{m-1}[s-1]
    w(s, j) = sum_{k=s..j} q_k (x_k - x_s) = (X[j+1] - X[s]) - x_s (Q[j+1] - Q[s])

with Q, X the prefix sums of q and q*x. So D_m[j] = X[j+1] + min_s (b_s - x_s * Q[j+1]) with
b_s = g_m(s) - X[s] + x_s Q[s]: a lower envelope of lines (slope -x_s) queried at Q[j+1].

Two facts make each layer one vectorised pass:
1. The constraint s <= j can be dropped. For s > j the same formula gives
   g_m(s) + sum_{k=j+1..s-1} q_k (x_s - x_k) >= D_{m-1}[s-1] >= D_{m-1}[j-1] = g_m(j) + w(j, j),
   because D_{m-1} is nondecreasing in j (masses are >= 0, and "at most" lets a restriction drop a
   checkpoint). So an invalid s never beats the valid s = j; we clamp s* to j against rounding.
2. The envelope of lines {(-x_s, b_s)} is the lower convex hull of points (x_s, b_s), and the
   slopes of that hull are the isotonic (pool-adjacent-violators) regression of the secant slopes
   diff(b)/diff(x) with weights diff(x) (Barlow et al.: the greatest convex minorant of a cumulative
   sum diagram). scipy's PAVA is O(K) compiled code; the hull vertices are its block starts. The
   minimiser for a query y is the first hull vertex whose outgoing slope is >= y: one searchsorted.
"""

from __future__ import annotations

import dataclasses

import numpy as np

try:  # scipy's compiled PAVA, without the public wrapper's input copies and result object
    from scipy.optimize._pava_pybind import pava as _pava
except ImportError:  # pragma: no cover - other scipy layouts
    from scipy.optimize import isotonic_regression

    def _pava(z, w, _scratch):
        res = isotonic_regression(z, weights=w)
        return res.x, res.weights, res.blocks, res.blocks.size - 1

from planner.placement import check_budget, check_pmf, compress


@dataclasses.dataclass(frozen=True)
class Frontier:
    """OPT(m) for m = 0..M and an optimal placement for each (costs are convex in m)."""

    costs: np.ndarray  # [M+1] float64 expected recompute with at most m checkpoints
    args: np.ndarray = dataclasses.field(repr=False)  # [layers, K+1] int32 argmins of the DP
    bins: np.ndarray = dataclasses.field(repr=False)  # [K+1] position of each bin (bins[0] = 0)

    def placement(self, m: int) -> np.ndarray:
        """An optimal placement of at most m checkpoints (sorted int64 positions)."""
        if not 0 <= m < self.costs.size:
            raise ValueError(f"m must be in 0..{self.costs.size - 1}, got {m}")
        return _backtrack(self.args, min(m, self.args.shape[0]), self.bins)

    @property
    def placements(self) -> tuple:
        """Optimal placements for every m = 0..M."""
        return tuple(self.placement(m) for m in range(self.costs.size))

    def marginal_savings(self) -> np.ndarray:
        """[M] expected tokens saved by the m-th checkpoint (nonincreasing, by convexity)."""
        return -np.diff(self.costs)

    def choose_budget(self, price: float) -> int:
        """Smallest m minimising costs[m] + price * m.

        `price` is what one checkpoint costs in the units of the objective (expected tokens of
        recompute per request), e.g. its bytes times the tokens a byte of cache is worth. By
        convexity this is the first m whose next checkpoint saves less than `price`.
        """
        if not np.isfinite(price) or price < 0:
            raise ValueError(f"price must be a finite number >= 0, got {price}")
        total = self.costs + price * np.arange(self.costs.size)
        return int(np.argmin(total))


MAX_TABLE = 2**28  # argmin entries kept for backtracking (int32: 1 GiB); past it use the Lagrangian


def _prepare(pmf, candidates, drop_empty: bool = True):
    p = check_pmf(pmf)
    n = p.size - 1
    cand = np.arange(1, n + 1) if candidates is None else candidates
    x, q, const, cand = compress(p, cand)
    if not drop_empty:
        return x, q, const, np.concatenate([[0], cand])
    # A checkpoint on a bin with no mass can move right to the next bin with mass (or be dropped)
    # at no loss, so zero-mass bins are never needed: dropping them is exact and shrinks K.
    keep = np.concatenate([[True], q[1:] > 0])
    return x[keep], q[keep], const, np.concatenate([[0], cand])[keep]


class _Hull:
    """Lower-hull argmin queries over a fixed x grid and fixed sorted queries y, one per layer."""

    def __init__(self, x, y):
        self.dx = np.diff(x)  # [K]
        self.uniform = bool(np.all(self.dx == 1.0))
        self.y = y  # [K+1] nondecreasing
        self.scratch = np.empty(x.size, dtype=np.intp)  # [K+1] PAVA block starts, then K

    def argmin(self, b):
        """For each query y_j, the smallest s minimising b_s - x_s * y_j."""
        z = np.diff(b)  # [K] secant slopes of the points (x_s, b_s)
        if not self.uniform:
            z /= self.dx
        z, _, r, nb = _pava(z, self.dx.copy(), self.scratch)
        verts = r[: nb + 1]  # [H+1] hull vertices: where each hull segment starts, then K
        slopes = z[verts[:-1]]  # [H] nondecreasing
        # count[j] = number of segments with slope < y_j; the minimiser is the vertex after them.
        if 8 * nb < self.y.size:  # few segments: search them in y, then spread by a cumsum
            first = np.searchsorted(self.y, slopes, side="right")  # [H] first j with y_j > slope
            count = np.cumsum(np.bincount(first, minlength=self.y.size + 1)[: self.y.size])
        else:
            count = np.searchsorted(slopes, self.y, side="left")  # [K+1]
        return verts[count]


def _layers(x, q, max_m):
    """Runs layers 1..max_m. Returns D_m[K] for m = 0..max_m and argmins [max_m, K+1] int32."""
    k1 = x.size
    qp = np.concatenate([[0.0], np.cumsum(q)])  # [K+2] Q
    xp = np.concatenate([[0.0], np.cumsum(q * x)])  # [K+2] X
    y = qp[1:]  # [K+1] query of row j: Q[j+1]
    rows = np.arange(k1)
    base = xp[:-1] - x * qp[:-1]  # [K+1] X[s] - x_s Q[s]
    d = xp[1:].copy()  # [K+1] D_0[j] = w(0, j) (x_0 = 0)
    ends = [d[-1]]
    args = np.empty((max_m, k1), dtype=np.int32)
    hull = _Hull(x, y) if max_m else None
    b = np.empty(k1)  # [K+1]
    srow = np.empty(k1, dtype=np.intp)  # [K+1]
    xp1 = xp[1:]
    for m in range(max_m):
        b[0] = 0.0  # s = 0: no checkpoint at all before row j
        np.subtract(d[:-1], base[1:], out=b[1:])  # b_s = D_{m-1}[s-1] - X[s] + x_s Q[s]
        s = np.minimum(hull.argmin(b), rows, out=srow)
        d = b[s]  # D_m[j] = g(s) + w(s, j) = b_s + X[j+1] - x_s Q[j+1]
        d += xp1
        d -= (s if hull.uniform else x[s]) * y
        args[m] = s
        ends.append(d[-1])
    return np.asarray(ends), args


def _backtrack(args, m, pos):
    out = []
    j = args.shape[1] - 1
    for layer in range(m - 1, -1, -1):
        s = int(args[layer, j])
        if s == 0:
            break
        out.append(pos[s])
        j = s - 1
    return np.asarray(sorted(out), dtype=np.int64)


def _run(pmf, max_budget, candidates):
    max_budget = check_budget(max_budget)
    x, q, const, pos = _prepare(pmf, candidates)
    layers = min(max_budget, x.size - 1)  # more layers than bins cannot help
    if layers * x.size > MAX_TABLE:
        raise ValueError(
            f"budget {max_budget} over {x.size - 1} candidate positions needs a "
            f"{layers} x {x.size} argmin table (> {MAX_TABLE} entries); use "
            f"planner.place_lagrangian for budgets this large, or fewer candidates")
    ends, args = _layers(x, q, layers)
    costs = np.concatenate([ends, np.full(max_budget - layers, ends[-1])]) + const
    return Frontier(costs=costs, args=args, bins=pos)


def frontier(pmf, max_budget: int, candidates=None) -> Frontier:
    """OPT(m) and an optimal placement for every m = 0..max_budget, in one pass of the DP.

    Args:
      pmf: [N+1] nonnegative weights over overlap depths 0..N.
      max_budget: largest number of checkpoints M.
      candidates: optional positions in 1..N that checkpoints may use (default: all of 1..N).
    Returns:
      Frontier: costs [M+1] (E[r] in tokens) and `placement(m)`. Time O(M K) plus a search per
      layer, memory 4 M K bytes (K = candidates that carry mass).
    """
    return _run(pmf, max_budget, candidates)


def solve(pmf, budget: int, candidates=None) -> np.ndarray:
    """An optimal placement of at most `budget` checkpoints (sorted int64 positions in 1..N)."""
    fr = _run(pmf, budget, candidates)
    return fr.placement(budget)
