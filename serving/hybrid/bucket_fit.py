"""Where a prefill chunk stops so that its step fits a smaller token bucket (host, plain Python).

A step is compiled per token bucket (Config.token_buckets) and pays for its bucket, not for its
real tokens: a prompt tail that overflows a bucket by a little (1,150 tokens) runs as the next one
(2,048). With hybrid prefix caching that is the common case (a request computes the new tokens
behind its checkpoint), and it hides the tokens a better checkpoint saves: they go to padding.

`fit_stop` cuts such a chunk at the smaller bucket when the overflow is small enough to ride on
the next step (at most `spill` tokens: the next step holds the running sequences' decodes and
the overflow, and stays in the smallest bucket). The cut turns that next step from a decode step
into a prefill step and delays the chunk's own first token by a step. On the H200 (Qwen3.5-0.8B
shape) that costs more than it saves: a prefill step costs several decode steps of the same
bucket, while two prefill buckets differ by much less (benchmarks/RESULTS.md, Hybrid prefix
caching: the step costs and the `checkpoint_bucket_fit` A/B). So Config.hybrid_cache.bucket_fit
is off by default; it pays where a prefill step costs little more than its tokens.
"""

from __future__ import annotations


def fit_stop(start: int, total: int, used: int, budget: int, buckets, spill: int):
    """Token index where a chunk from `start` should stop, or None (no cut).

    Args:
      start: the sequence's first token index to compute.
      total: where the chunk would stop at most (prompt end or an earlier stop).
      used: tokens already in this step (decodes and earlier chunks).
      budget: tokens the step can still take.
      buckets: the compiled token buckets, ascending.
      spill: the overflow past the smaller bucket allowed onto the next step.
    """
    n = min(total - start, budget)
    if n <= 0 or spill <= 0:
        return None
    t = used + n
    below = [b for b in buckets if b < t]
    if not below or len(below) == len(buckets):  # the smallest bucket, or past the largest
        return None
    lower = below[-1]
    if used >= lower or t - lower > spill:
        return None
    return start + (lower - used)


class BucketFit:
    """`fit_stop` for one engine: its token buckets, step size and allowed spill."""

    def __init__(self, buckets, step_tokens: int, spill: int):
        self.buckets, self.step_tokens, self.spill = tuple(buckets), step_tokens, spill

    @classmethod
    def from_config(cls, config):
        """The spill that keeps the next step in the smallest bucket with every seat's decode;
        None when Config.hybrid_cache.bucket_fit is off."""
        spill = config.token_buckets[0] - config.num_seats
        if not config.hybrid_cache.bucket_fit or spill <= 0:
            return None
        return cls(config.token_buckets, config.max_num_batched_tokens, spill)

    def stop(self, start: int, total: int, budget: int):
        """fit_stop for a chunk from `start` (at most to `total`) with `budget` tokens left."""
        return fit_stop(start, total, self.step_tokens - budget, budget, self.buckets, self.spill)
