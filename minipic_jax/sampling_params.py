"""SamplingParams, vLLM-shaped (the subset this engine implements)."""

from __future__ import annotations

import dataclasses
import math
import numbers


# The device arrays a request's sampling fields land in (serving/step/step_inputs.fill_sampling):
# top_k is int32, temperature and top_p float32. A value they cannot hold is refused here, not
# found mid-step (where it would fail every request of that step).
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: a smaller temperature divides
# the logits to inf


def _is_int(x) -> bool:
    # a plain int first: the ABC check costs ~1 us, and generate checks every request's fields
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _is_real(x) -> bool:
    if type(x) is float or type(x) is int:
        return math.isfinite(x)
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request.

    temperature 0 is greedy; top_k 0 or -1 and top_p 1 are off; `seed` makes a sampled request
    reproducible regardless of batch composition; `logprobs` = number of top logprobs returned
    per generated token (the sampled token is always included), None = none. `stop`: strings
    that end the request once its output text contains one (the text stops before it, or after
    it with `include_stop_str_in_output`; the token ids keep the token that completed it).
    `n`: independent samples of the prompt (sample k is seeded `seed + k` when `seed` is set);
    they share the prompt's cached blocks.

    Checked at construction and again by `LLM.generate` (`validate`), so a field changed after
    construction gets the same errors.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError/TypeError naming the bad field; normalizes `stop` and
        `stop_token_ids` to lists."""
        def bad(field, want, exc=ValueError):
            raise exc(f"SamplingParams.{field} must be {want}, got {getattr(self, field)!r}")

        if not _is_real(self.temperature) or self.temperature < 0 or \
                self.temperature > FLOAT32_MAX or 0 < self.temperature < FLOAT32_TINY:
            bad("temperature", f"0 (greedy) or a number in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] "
                               f"(float32)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            bad("top_k", f"-1, 0 (off) or a positive int <= {INT32_MAX} (int32)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "None or an int >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        for field in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "a bool", TypeError)
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "None or an int", TypeError)
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "None or an int >= 0")
        if not _is_int(self.n) or self.n < 1:
            bad("n", "an int >= 1")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for k, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop[{k}] must be a non-empty str, got {s!r}")
        self.stop = stop
        ids = self.stop_token_ids
        if ids is not None and (isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__")):
            bad("stop_token_ids", "None or a list of ints", TypeError)
        ids = list(ids or [])
        for k, t in enumerate(ids):
            if not _is_int(t):
                raise TypeError(f"SamplingParams.stop_token_ids[{k}] must be an int, got {t!r}")
        self.stop_token_ids = [int(t) for t in ids]
