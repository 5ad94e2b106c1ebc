"""Estimating the overlap pmf from traffic, replanning under drift, and the robustness bound.

Robustness. For a placement C let G(C) = max_t (t - l(t; C)) be its longest gap (the most tokens
any hit can recompute). Every per-depth cost r_t(C) = t - l(t; C) lies in [0, G(C)], and
sum_t (p_t - q_t) = 0, so for any two pmfs on 0..N

    |E_p[C] - E_q[C]| = |sum_t (p_t - q_t) (r_t(C) - G(C)/2)| <= TV(p, q) * G(C),

with TV(p, q) = 1/2 sum_t |p_t - q_t|. Let C_q be optimal for the estimate q and C_p for the
truth p (same budget and candidates). Then

    E_p[C_q] - E_p[C_p] = (E_p - E_q)[C_q] + (E_q[C_q] - E_q[C_p]) + (E_q - E_p)[C_p]
                        <= TV(p, q) * (G(C_q) + G(C_p))      (the middle term is <= 0)
                        <= TV(p, q) * (G(C_q) + N) <= 2 N TV(p, q).

`regret_bound` returns the middle, computable form (C_p is unknown, G(C_p) <= N).

With candidates, E_p[C] = const(p) + sum_k P_k (x_k - l(x_k; C)) where P_k is the mass of bin k
(depths from candidate x_k up to the next candidate). The constant cancels in the regret and the
per-bin costs lie in [0, G(C)], so the same steps hold with TV taken over bin masses, which is
never larger (and far less noisy for a sampled histogram): pass `candidates` to `tv_distance`.
"""

from __future__ import annotations

import numpy as np

from planner.placement import check_pmf, check_positions, max_gap
from planner.strategies import place


def tv_distance(p, q, candidates=None) -> float:
    """Total-variation distance 1/2 sum |p - q| between two pmfs (each normalised first).

    With `candidates`, between the masses of the candidate bins [0, c_1), [c_1, c_2), ..., the
    only part of a pmf that a placement restricted to those candidates depends on.
    """
    a, b = check_pmf(p, "p"), check_pmf(q, "q")
    if a.size != b.size:
        raise ValueError(f"p and q cover different depth ranges: {a.size} vs {b.size} entries")
    if candidates is not None:
        cand = check_positions(candidates, a.size - 1, name="candidates")
        bins = np.searchsorted(cand, np.arange(a.size), side="right")
        a, b = (np.bincount(bins, weights=v, minlength=cand.size + 1) for v in (a, b))
    return 0.5 * float(np.abs(a - b).sum())


def regret_bound(tv: float, plan_positions, n: int) -> float:
    """Upper bound on E_p[plan] - OPT_p when `plan` is optimal for an estimate q with TV(p,q) = tv.

    Equals tv * (G(plan) + n); see the module docstring for the derivation.
    """
    if not 0.0 <= tv <= 1.0:
        raise ValueError(f"tv must be in [0, 1], got {tv}")
    return tv * (max_gap(plan_positions, n) + n)


def _check_depths(depths, n: int) -> np.ndarray:
    d = np.asarray(depths).reshape(-1)
    if d.size and not np.issubdtype(d.dtype, np.integer):
        if not np.all(np.isfinite(d)) or np.any(d != np.round(d)):
            raise ValueError("observed depths must be integers")
        d = d.astype(np.int64)
    bad = np.flatnonzero((d < 0) | (d > n))
    if bad.size:
        raise ValueError(f"observed depth [{bad[0]}] = {d[bad[0]]} is outside 0..N = 0..{n}")
    return d.astype(np.int64)


class EmpiricalHistogram:
    """Counts of observed depths, additively (Laplace) smoothed: (count + a) / (total + a (N+1)).

    An observation costs O(its depths), not O(N) (an engine observes one depth per admitted
    request, N = max_model_len). `track_bins` keeps per-bin sums beside the counts, so the pmf's
    bin masses (`bin_pmf`, what a Replanner with candidates compares) cost O(bins)."""

    def __init__(self, n: int, smoothing: float = 0.5):
        if n < 0 or smoothing < 0:
            raise ValueError(f"need n >= 0 and smoothing >= 0, got n={n}, smoothing={smoothing}")
        self.n, self.smoothing = n, float(smoothing)
        self.counts = np.zeros(n + 1)
        self._scale = 1.0  # stored counts are weights x _scale (DecayingHistogram grows it)
        self._bins = self.bin_counts = self._bin_width = None

    @property
    def total(self) -> float:
        return float(self.counts.sum() / self._scale)

    def _add(self, d: np.ndarray, w) -> None:
        np.add.at(self.counts, d, w)
        if self._bins is not None:
            np.add.at(self.bin_counts, self._bins[d], w)

    def observe(self, depths) -> None:
        self._add(_check_depths(depths, self.n), 1.0)

    def pmf(self) -> np.ndarray:
        w = self.counts / self._scale + self.smoothing
        if not w.sum() > 0:
            raise ValueError("no observations yet and smoothing = 0: the pmf is undefined")
        return w / w.sum()

    def track_bins(self, bins) -> None:
        """Keep the counts summed per bin (bins: [N + 1] the bin of each depth, 0-based). One
        binning per estimator: a second, different one raises (its owner's drift would read
        the wrong sums)."""
        bins = np.asarray(bins, np.int64)
        if self._bins is not None and not np.array_equal(bins, self._bins):
            raise ValueError("this histogram already keeps sums for another binning (one "
                             "Replanner with candidates per estimator)")
        self._bins = bins
        n_bins = int(self._bins.max()) + 1
        self.bin_counts = np.bincount(self._bins, weights=self.counts, minlength=n_bins)
        self._bin_width = np.bincount(self._bins, minlength=n_bins).astype(np.float64)

    def bin_pmf(self) -> np.ndarray:
        """The pmf's mass per tracked bin (`track_bins` first): the pmf binned, in O(bins)."""
        w = self.bin_counts / self._scale + self.smoothing * self._bin_width
        if not w.sum() > 0:
            raise ValueError("no observations yet and smoothing = 0: the pmf is undefined")
        return w / w.sum()


class DecayingHistogram(EmpiricalHistogram):
    """Exponentially weighted counts: each observation's weight halves every `half_life` later ones.

    Tracks a drifting pmf; the effective sample size is about half_life / ln 2. Stored as counts
    scaled by a growing factor, so one observation costs O(1), not O(N).
    """

    def __init__(self, n: int, half_life: float = 1000.0, smoothing: float = 0.5):
        super().__init__(n, smoothing)
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.decay = 0.5 ** (1.0 / half_life)
        # _scale: the weight of the next observation in stored units

    def observe(self, depths) -> None:
        d = _check_depths(depths, self.n)
        piece = max(1, int(50 * np.log(10) / -np.log(self.decay)))  # scale grows <= 1e50 per piece
        for start in range(0, d.size, piece):
            part = d[start:start + piece]
            # observation i of a piece has weight decay^(len - 1 - i) right after it
            w = self._scale * self.decay ** -np.arange(1, part.size + 1)
            self._scale = self._scale * self.decay ** -part.size
            self._add(part, w)
            if self._scale > 1e100:  # keep stored numbers finite
                self.counts /= self._scale
                if self._bins is not None:
                    self.bin_counts /= self._scale
                self._scale = 1.0


class Replanner:
    """Keeps a placement current: re-solves every `every` observations, or sooner when the
    estimate has moved more than `tv_threshold` (total variation; over candidate bins when
    `candidates` is given) from the pmf of the last plan.
    """

    def __init__(self, estimator: EmpiricalHistogram, budget: int, *, strategy: str = "dp",
                 candidates=None, every: int = 1000, tv_threshold: float = 0.1):
        if every < 1 or not 0.0 < tv_threshold <= 1.0:
            raise ValueError(
                f"need every >= 1 and 0 < tv_threshold <= 1, got {every}, {tv_threshold}")
        self.estimator, self.budget, self.strategy = estimator, budget, strategy
        self.candidates, self.every, self.tv_threshold = candidates, every, tv_threshold
        if candidates is not None:  # drift compares bin masses: kept per bin by the estimator
            cand = check_positions(candidates, estimator.n, name="candidates")
            estimator.track_bins(np.searchsorted(cand, np.arange(estimator.n + 1), side="right"))
        self.replans = 0
        self._since = 0
        self._replan()

    def _replan(self) -> None:
        self.plan_pmf = self.estimator.pmf()
        if self.candidates is not None:
            self._plan_bins = self.estimator.bin_pmf()
        self.positions = place(self.plan_pmf, self.budget, self.strategy, self.candidates)
        self._since = 0
        self.replans += 1

    def drift(self) -> float:
        """TV distance between the current estimate and the pmf the plan was made for (over
        candidate bins with candidates: `tv_distance`'s, from the estimator's bin sums)."""
        if self.candidates is not None:
            return 0.5 * float(np.abs(self.estimator.bin_pmf() - self._plan_bins).sum())
        return tv_distance(self.estimator.pmf(), self.plan_pmf)

    def observe(self, depths) -> bool:
        """Records observed depths; returns True if this call triggered a new plan."""
        d = _check_depths(depths, self.estimator.n)
        self.estimator.observe(d)
        self._since += d.size
        if self._since >= self.every or self.drift() > self.tv_threshold:
            self._replan()
            return True
        return False
