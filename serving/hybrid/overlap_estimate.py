"""How deep later requests will share one prompt's prefix (host, plain Python + numpy).

A checkpoint at c in prompt P pays off only for a later request R whose first c tokens are P's,
so P is planned on the pmf of lcp(R, P), not on the histogram of all overlap depths: a request
that overlaps *another* prompt to depth t gets nothing from P's checkpoint at t. (With several
system prompts of different lengths the global histogram put each prompt's single checkpoint
where the other prompts' depths pulled it, a chunk or more short of its own.)

Two kinds of later sharing, both estimated from the requests admitted before P (leave-one-out:
P's own prompt says nothing about who comes after it), with exponential weights (a request's weight
halves every `half_life` later requests):

  recurrence  R shares P as deep as earlier requests shared it. Every block hash counts the
              requests whose match went through it (the prefix-chain hash names the whole prefix;
              the prompt that wrote a block does not count: writing is not sharing); along P's
              blocks h_1..h_k, P(lcp >= jB) = through(h_j) / requests.
  extension   R shares P deeper than any request before it (the next round of a conversation or
              of a RAG prompt, a document with a new question). Its rate is the share of requests
              whose match went past every earlier match on their path (and reached a chunk: a
              shallower match reaches no checkpoint position); where it stops is read from
              P's end: the histogram of those requests' unshared tails (length of the cached
              prompt they matched - match), conditioned on stopping past P's own match d, puts
              mass at n - tail.

The resulting pmf is a probability per later request (mass at depth 0 = shares nothing), so a
checkpoint's value under it (serving/hybrid/checkpoint_plan.py) is in expected tokens saved per request
and comparable across prompts.
"""

from __future__ import annotations

import itertools

import numpy as np

from planner import DecayingHistogram

_RESCALE = 1e100  # stored weights are divided down past this (they grow with each observation)
MAX_PATHS = 1 << 20  # block hashes tracked at most; the lightest are dropped past it


class OverlapEstimate:
    def __init__(self, max_len: int, block_size: int, chunk: int, half_life: float = 256.0):
        if not half_life > 0:
            raise ValueError(f"checkpoint_half_life must be > 0, got {half_life}")
        self.max_len, self.block_size, self.chunk = max_len, block_size, chunk
        self.decay = 0.5 ** (1.0 / half_life)
        self._scale = 1.0  # stored units of the latest observation (weights are stored / scale)
        self.through: dict[int, float] = {}  # block hash -> stored weight of matches through it
        self.tails = DecayingHistogram(max_len, half_life=half_life,
                                       smoothing=1.0 / (max_len + 1))
        # prior: one request, an extension stopping a tail of half a chunk before the end (the
        # same prompt with another question), so the first prompts checkpoint near their end
        self.tails.observe([min(chunk // 2, max_len)])
        self.requests = self.extensions = 1.0

    def _advance(self) -> float:
        self._scale /= self.decay
        if self._scale > _RESCALE:
            self.requests, self.extensions = self.weight(self.requests), self.weight(self.extensions)
            self.through = {h: w / self._scale for h, w in self.through.items()}
            self._scale = 1.0
        return self._scale

    def weight(self, stored: float) -> float:
        return stored / self._scale

    def observe(self, blocks, shared: int, origin_len: int | None) -> None:
        """One admitted request: `blocks` = hashes of its prompt's full blocks, the first `shared`
        of them held by earlier prompts; `origin_len` = length of the prompt whose block
        `shared` - 1 is (None: unknown)."""
        blocks = list(blocks)
        # a match shorter than a chunk reaches no checkpoint position: no sharing to plan for
        extension = (shared * self.block_size >= self.chunk
                     and blocks[shared - 1] not in self.through)
        w = self._advance()
        self.requests += w
        through = self.through
        get = through.get
        for h in blocks[:shared]:
            through[h] = get(h, 0.0) + w
        if extension:
            self.extensions += w
            if origin_len is not None:
                tail = origin_len - shared * self.block_size
                self.tails.observe([min(max(int(tail), 0), self.max_len)])
        if len(self.through) > MAX_PATHS:
            floor = 1e-3 * self._scale  # matches weighing under a thousandth of a new one
            self.through = {h: v for h, v in self.through.items() if v >= floor}

    def share(self, block_hash: int) -> float:
        """Share of requests whose match went through this block (the recurrence rate of the
        prefix it ends)."""
        return self.weight(self.through.get(block_hash, 0.0)) / self.weight(self.requests)

    def prompt_pmf(self, n: int, blocks, shared: int) -> np.ndarray:
        """[n+1] probability that a later request shares exactly the first t tokens of a prompt
        of n tokens whose full blocks are `blocks`, the first `shared` held by earlier prompts
        (before that prompt is observed)."""
        bs, total = self.block_size, self.weight(self.requests)
        pmf = np.zeros(n + 1)
        get = self.through.get  # stored weights, divided by the scale as one array (weight())
        ge = np.fromiter(itertools.chain(map(get, blocks, itertools.repeat(0.0)), (0.0,)),
                         np.float64) / self._scale
        ge = np.minimum.accumulate(ge)  # a match through block j + 1 went through block j
        k = int(np.count_nonzero(ge))
        pmf[bs * np.arange(1, k + 1)] = (ge[:k] - ge[1:k + 1]) / total
        d = max(shared, k) * bs
        tails = self.tails.pmf()[:n - d]  # tail < n - d: the extension stops past d
        if tails.sum() > 0:
            pmf[d + 1:] += self.weight(self.extensions) / total * tails[::-1] / tails.sum()
        pmf[0] = max(0.0, 1.0 - pmf.sum()) + 1e-12
        return pmf
