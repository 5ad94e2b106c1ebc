"""SamplingParams, vLLM-shaped (the subset this engine implements)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request.

    temperature 0 is greedy; top_k 0 or -1 and top_p 1 are off; `seed` makes a sampled request
    reproducible regardless of batch composition; `logprobs` = number of top logprobs returned
    per generated token (the sampled token is always included), None = none.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"SamplingParams.logprobs must be >= 0, got {self.logprobs}")
        if self.n != 1:
            raise ValueError(f"SamplingParams.n must be 1 (parallel sampling is not supported)")
        self.stop_token_ids = list(self.stop_token_ids or [])
