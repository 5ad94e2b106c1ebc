"""Where a hybrid model's prefill takes recurrent checkpoints (host, plain Python + numpy).

A checkpoint can sit only where a resume is exact and addressable: at a block boundary c (the key
is the prefix-chain hash of block c/B - 1) whose logical position (valid tokens before c) is a
positive multiple of the GDN kernel's chunk (the ragged kernel aligns chunks on positions, so the
state there is what a prefill that stopped at c computes). For plain prompts with B | 64 those are
the multiples of 64.

Overlap depths d (tokens of a new request that match ready cached blocks) feed an exponentially
weighted histogram over 0..max_model_len (planner.DecayingHistogram); the planner's Replanner keeps
the pmf a plan is made for and says when to replan (every `every` requests, or sooner when the
estimate moved more than `tv` in total variation). A prompt of L tokens is planned on that pmf
truncated at L (a future request overlapping it deeper than L overlaps it to L), with at most M
checkpoints per prompt:

  none      nothing.
  last      the deepest candidate <= L (the end of the prompt's last full chunk; vLLM's align mode
            caches at its last block boundary).
  block     every `block_tokens` tokens (snapped down to candidates), the shallowest M.
  balanced  M evenly spaced positions over [0, L] (snapped).
  dp        the exact optimum of sum_t p_t (t - l(t; C)) over candidates (planner.place).
"""

from __future__ import annotations

import numpy as np

from planner import DecayingHistogram, Replanner, place

CHECKPOINT_STRATEGIES = ("none", "last", "block", "balanced", "dp")
TAIL_WEIGHT = 0.5  # share of the unshared-tail pmf in a prompt's plan (0.8 measured no better)


def candidates(layout, num_tokens: int, block_size: int, chunk: int) -> np.ndarray:
    """Token indices c in (0, num_tokens] at block boundaries whose logical position is a positive
    multiple of `chunk`."""
    c = np.arange(block_size, num_tokens + 1, block_size)
    pos = positions_of(layout, c)
    return c[(pos > 0) & (pos % chunk == 0)]


def positions_of(layout, token_idx) -> np.ndarray:
    """Logical position of token index c: the valid (non-pad) tokens before it."""
    idx = np.asarray(token_idx, np.int64)
    n = layout.pos.shape[0]
    inside = np.minimum(idx, n - 1)
    pos = np.where(idx < n, layout.pos[inside], layout.num_valid)
    return pos.astype(np.int64)


class CheckpointPlanner:
    def __init__(self, strategy: str, per_prompt: int, block_tokens: int, max_len: int,
                 chunk: int, *, half_life: float = 256.0, every: int = 64, tv: float = 0.1):
        if strategy not in CHECKPOINT_STRATEGIES:
            raise ValueError(f"checkpoint strategy must be one of {CHECKPOINT_STRATEGIES}, "
                             f"got {strategy!r}")
        self.strategy, self.per_prompt, self.block_tokens = strategy, per_prompt, block_tokens
        self.max_len, self.chunk = max_len, chunk
        # prior: one observation's worth of mass spread uniformly (the plan before any traffic)
        self.hist = DecayingHistogram(max_len, half_life=half_life, smoothing=1.0 / (max_len + 1))
        grid = np.arange(chunk, max_len + 1, chunk)
        self._cdf, self._cdf_version = None, -1
        # unshared tails (prompt length - overlap) of the cached prompts that requests overlap
        self.tails = DecayingHistogram(max_len, half_life=half_life,
                                       smoothing=1.0 / (max_len + 1))
        # prior: one observation of a tail shorter than a chunk (same prompt, another question)
        self.tails.observe([min(chunk // 2, max_len)])
        self.replanner = Replanner(self.hist, per_prompt, strategy="dp",
                                   candidates=grid if grid.size else None, every=every,
                                   tv_threshold=tv)

    def observe(self, depth: int, tail: int | None = None) -> None:
        """One admitted request's overlap depth (tokens) and, when it overlaps a cached prompt of
        known length, that prompt's tokens beyond the overlap (its unshared tail)."""
        self.replanner.observe([min(max(int(depth), 0), self.max_len)])
        if tail is not None:
            self.tails.observe([min(max(int(tail), 0), self.max_len)])

    @property
    def plan(self) -> list[int]:
        """The current global plan: the pmf's optimal positions over 0..max_model_len."""
        return [int(x) for x in self.replanner.positions]

    def prompt_pmf(self, n: int) -> np.ndarray:
        """[n+1] overlap depths a future request may have with a prompt of n tokens: half the
        planned depth pmf truncated at n (deeper overlaps stop at its end), half the observed
        unshared tails read from its end (depth n - tail; tails longer than n give depth 0)."""
        pmf = np.asarray(self.replanner.plan_pmf)
        trunc = np.zeros(n + 1)
        m = min(n, pmf.size - 1)
        trunc[:m] = pmf[:m]
        trunc[m] = pmf[m:].sum()
        tails = self.tails.pmf()
        rel = np.zeros(n + 1)
        k = min(n, tails.size - 1)
        rel[n - k:] = tails[:k + 1][::-1]
        rel[0] += tails[k + 1:].sum()
        return (1 - TAIL_WEIGHT) * trunc / trunc.sum() + TAIL_WEIGHT * rel / rel.sum()

    def value(self, position: int, planned) -> float:
        """Expected tokens a checkpoint at `position` saves a request, under the planned pmf, next
        to the prompt's other planned positions: (mass of depths in [position, next planned)) x
        (position - previous planned). The store's eviction ranks entries by it."""
        if self.replanner.replans != self._cdf_version:
            self._cdf = np.concatenate([[0.0], np.cumsum(self.replanner.plan_pmf)])
            self._cdf_version = self.replanner.replans
        prev = max((q for q in planned if q < position), default=0)
        nxt = min((q for q in planned if q > position), default=self.max_len + 1)
        cdf = self._cdf
        mass = cdf[min(nxt, cdf.size - 1)] - cdf[min(position, cdf.size - 1)]
        return float(mass * (position - prev))

    def prompt_positions(self, layout, num_tokens: int, block_size: int) -> list[int]:
        """Token indices where this prompt's prefill takes checkpoints (sorted)."""
        if self.strategy == "none" or self.per_prompt == 0:
            return []
        cand = candidates(layout, num_tokens, block_size, self.chunk)
        if cand.size == 0:
            return []
        if self.strategy == "last":
            return [int(cand[-1])]
        trunc = self.prompt_pmf(int(num_tokens))
        if self.strategy == "block":
            got = place(trunc, self.per_prompt, "block", cand,
                        block_size=max(1, self.block_tokens))
        else:
            got = place(trunc, self.per_prompt, self.strategy, cand)
        return [int(x) for x in got]
