"""Where a prefill chunk stops so that its step fits a smaller token bucket (host, plain Python).

A step is compiled per token bucket (Config.token_buckets) and costs about what its bucket costs,
not what its real tokens would: on the H200 at the Qwen3.5-0.8B shape a 2,048-token step takes
~24 ms, a 1,024-token one ~13 ms and a decode step ~7 ms (benchmarks/RESULTS.md, hybrid prefix
caching). A prompt tail that overflows a bucket by a little pays the next bucket for it: 1,150
tokens run as 2,048. With hybrid prefix caching that is the common case (a request computes the
new tokens behind its checkpoint), and it hides the tokens a better checkpoint saves: they go to
padding.

`fit_stop` cuts such a chunk at the smaller bucket when the overflow is small enough to ride on
the next step for little (at most `spill` tokens: the next step holds the running sequences'
decodes and the overflow, and stays in the smallest bucket). Cutting delays the chunk's own first
token by one step; it saves the difference between the two buckets, less the decode step's
share that turns into a prefill step.
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
        None when Config.checkpoint_bucket_fit is off."""
        spill = config.token_buckets[0] - config.num_seats
        if not config.checkpoint_bucket_fit or spill <= 0:
            return None
        return cls(config.token_buckets, config.max_num_batched_tokens, spill)

    def stop(self, start: int, total: int, budget: int):
        """fit_stop for a chunk from `start` (at most to `total`) with `budget` tokens left."""
        return fit_stop(start, total, self.step_tokens - budget, budget, self.buckets, self.spill)
