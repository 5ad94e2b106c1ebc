"""Where a hybrid model's prefill takes recurrent checkpoints (host, plain Python + numpy).

A checkpoint can sit only where a resume is exact and addressable: at a block boundary c (the key
is the prefix-chain hash of block c/B - 1) whose logical position (valid tokens before c) is a
positive multiple of the GDN kernel's chunk (the ragged kernel aligns chunks on positions, so the
state there is what a prefill that stopped at c computes). For plain prompts with B | 64 those are
the multiples of 64.
A span prompt's first span start (`first_span_start`) is one more, wherever it falls: a chunk
stops there (serving/hybrid/hybrid_prefix.py `chunk_stop`), and the kernel's checkpoint at a
sequence's last row is its final state, what a prefill that stopped there computes.

A prompt of n tokens is planned on the pmf of how deep later requests will share *its* prefix
(serving/hybrid/overlap_estimate.py: recurrences along its own matched blocks, extensions read from its
end), with at most M checkpoints per prompt:

  none      nothing.
  last      the deepest candidate <= n (the end of the prompt's last full chunk; vLLM's align mode
            caches at its last block boundary).
  block     every `block_tokens` tokens (snapped down to candidates), the shallowest M.
  balanced  M evenly spaced positions over [0, n] (snapped).
  dp        the exact optimum of sum_t p_t (t - l(t; C)) over candidates (planner.place), with
            each checkpoint past CHECKPOINTS_PER_STEP per prefill chunk priced at what splitting
            a chunk costs a later request (Config.hybrid_cache.step_tokens over the admissions
            an entry lives).

Each planned checkpoint carries its value under that pmf, the expected tokens it saves a later
request next to the prompt's other checkpoints; the store's eviction ranks entries by it.

The global overlap-depth histogram (exponentially weighted, replanned by the planner's Replanner
rule) is kept for observability: `plan` is where checkpoints would go for one prefix that all
traffic shared. Per-prompt plans are made fresh at admission from the current estimates.
"""

from __future__ import annotations

import numpy as np

from planner import DecayingHistogram, Replanner, expected_recompute, place
from serving.hybrid.overlap_estimate import OverlapEstimate

CHECKPOINT_STRATEGIES = ("none", "last", "block", "balanced", "dp")
# Fixed here, not engine options (no caller or benchmark ever set them; they were Config fields):
# the `block` strategy's spacing: a checkpoint every 512 prompt tokens (8 GDN chunks of 64).
# `block` is a comparison baseline to dp (the default), so its spacing was never tuned.
BLOCK_TOKENS = 512
# The global plan (`plan`, get_stats()["checkpoint_plan"]) is replanned every 64 requests or
# when the depth histogram drifted 0.1 in total variation. It is for observability only (each
# prompt is planned fresh at admission), so these values change no placement.
REPLAN_EVERY = 64
REPLAN_TV = 0.1
# Checkpoints one step takes per sequence at most: a chunk holds its planned checkpoints and the
# free-room halving cover (64, 128, ... 4096 from a cold start) without being cut, up to this
# many; a chunk holding more stops before the next.
CHECKPOINTS_PER_STEP = 8
# ... and in all, over its sequences: the step's checkpoint fields are K = `step_rows(S)` flat
# rows (one static K per token bucket, so the count adds no step variant). Each row is a state
# per GDN layer the step moves (1 MiB each at Qwen3.5-0.8B: 18 MiB a row); [S, M] rows were
# 576 states a layer at 64 seats, ~18 ms of a prefill step on an H100 (issue 29). A sequence
# scheduled when fewer rows are left stops its chunk before the first checkpoint that does not fit.
CHECKPOINT_ROWS = 2 * CHECKPOINTS_PER_STEP


# A step's restores (a sequence resuming from a checkpoint: its state written from the pool before
# the model runs) are flat rows too, R = `restore_rows(S)`, not one per sequence: [S] restores
# gathered and scattered all S states per GDN layer whatever the step restored (~0.95 GB per
# layer at 64 seats, CPU count; issue 29). An admission that would restore when none is left
# waits a step (its place kept, hybrid_prefix.py).
RESTORE_ROWS = CHECKPOINTS_PER_STEP


def step_rows(seqs: int) -> int:
    """K, the checkpoint rows of a step of `seqs` sequences (its static bound)."""
    return min(seqs * CHECKPOINTS_PER_STEP, CHECKPOINT_ROWS)


def restore_rows(seqs: int) -> int:
    """R, the restore rows of a step of `seqs` sequences (its static bound; one a sequence)."""
    return min(seqs, RESTORE_ROWS)


def candidates(layout, num_tokens: int, block_size: int, chunk: int) -> np.ndarray:
    """Token indices c in (0, num_tokens] at block boundaries whose logical position is a positive
    multiple of `chunk`."""
    c = np.arange(block_size, num_tokens + 1, block_size)
    pos = positions_of(layout, c)
    return c[(pos > 0) & (pos % chunk == 0)]


def positions_of(layout, token_idx) -> np.ndarray:
    """Logical position of token index c: the valid (non-pad) tokens before it."""
    idx = np.asarray(token_idx, np.int64)
    n = layout.num_tokens
    inside = np.minimum(idx, n - 1)
    pos = np.where(idx < n, layout.pos_at(inside), layout.num_valid)
    return pos.astype(np.int64)


def first_span_start(layout, num_tokens: int, block_size: int) -> int | None:
    """Token index of the prompt's first SSEP span start when a checkpoint there is addressable
    and serves span reuse, else None: after a PDEP block (its prefix-chain key covers every token
    before it), at a positive logical position, inside the prompt, and a segment follows the span
    (only a non-final span is ever skipped). The state there is what a request that reuses the
    prompt's spans in any order (a new question after them) resumes from: every span after it is
    skipped through its map, so that request computes its question in one step."""
    starts = np.flatnonzero(layout.span_start)
    if not starts.size or starts[0] == 0 or layout.span_block[starts[0] - 1] or \
            not layout.seg_start[starts[0] + 1:].any():
        return None
    p = int(starts[0]) * block_size
    if p >= num_tokens or int(positions_of(layout, [p])[0]) <= 0:
        return None
    return p


def on_grid(layout, ps, chunk: int) -> np.ndarray:
    """Per token index in `ps`: whether its logical position is a multiple of the GDN chunk (a
    checkpoint there can sit anywhere in a chunk; one off the grid only where a chunk ends)."""
    return positions_of(layout, ps) % chunk == 0


def halving_cover(cand, start: int, planned, num_tokens: int) -> list[int]:
    """Candidates a prefill resumed at token `start` takes besides `planned` so that every depth
    d in [first candidate, num_tokens] has a checkpoint (planned, added, or `start`'s) in
    [d/2, d]: from c = start, the deepest candidate <= 2c (the first above c where there is none,
    as at c = 0) unless a planned position in (c, it] serves; then on from there while
    2c < num_tokens. About log2(num_tokens / 64) positions for a cold prompt (64, 128, 256...)."""
    cand, marks = [int(x) for x in cand], sorted(int(p) for p in planned)
    out, c = [], int(start)
    while 2 * c < num_tokens:
        later = [x for x in cand if x > c]
        if not later:
            break
        reach = [x for x in later if x <= 2 * c] or later[:1]
        served = [q for q in marks if c < q <= reach[-1]]
        c = served[-1] if served else reach[-1]
        if not served:
            out.append(c)
    return out


class CheckpointPlanner:
    def __init__(self, strategy: str, per_prompt: int, block_tokens: int, max_len: int,
                 chunk: int, *, block_size: int = 16, half_life: float = 256.0,
                 every: int = REPLAN_EVERY, tv: float = REPLAN_TV, extra_price: float = 0.0,
                 step_tokens: int | None = None, per_step: int = 1):
        if strategy not in CHECKPOINT_STRATEGIES:
            raise ValueError(f"checkpoint strategy must be one of {CHECKPOINT_STRATEGIES}, "
                             f"got {strategy!r}")
        self.strategy, self.per_prompt, self.block_tokens = strategy, per_prompt, block_tokens
        self.max_len, self.chunk, self.extra_price = max_len, chunk, extra_price
        self.step_tokens = step_tokens or max_len  # a prefill chunk's tokens at most
        self.per_step = per_step  # checkpoints a chunk takes without a split (the step's M)
        self.overlap = OverlapEstimate(max_len, block_size, chunk, half_life)
        # prior: one observation's worth of mass spread uniformly (the plan before any traffic)
        self.hist = DecayingHistogram(max_len, half_life=half_life, smoothing=1.0 / (max_len + 1))
        grid = np.arange(chunk, max_len + 1, chunk)
        self.replanner = Replanner(self.hist, per_prompt, strategy="dp",
                                   candidates=grid if grid.size else None, every=every,
                                   tv_threshold=tv)

    def observe(self, blocks, shared: int, origin_len: int | None = None) -> None:
        """One admitted request (after its plan): the hashes of its prompt's full blocks, how
        many of them earlier prompts hold, and the length of the prompt holding the last of
        those (None: unknown)."""
        self.replanner.observe([min(max(shared * self.overlap.block_size, 0), self.max_len)])
        self.overlap.observe(blocks, shared, origin_len)

    @property
    def plan(self) -> list[int]:
        """The global plan: the all-traffic depth pmf's optimal positions over 0..max_model_len."""
        return [int(x) for x in self.replanner.positions]

    def prompt_pmf(self, n: int, blocks, shared: int = 0) -> np.ndarray:
        return self.overlap.prompt_pmf(n, blocks, shared)

    @staticmethod
    def values(pmf: np.ndarray, planned) -> list[float]:
        """Per planned position c_i: (mass of depths in [c_i, c_i+1)) x (c_i - c_i-1), the tokens
        it saves a later request on average that the prompt's shallower checkpoint would not."""
        cdf = np.concatenate([[0.0], np.cumsum(pmf)])
        edges = [0] + list(planned) + [pmf.size]
        return [float((cdf[edges[i + 1]] - cdf[edges[i]]) * (edges[i] - edges[i - 1]))
                for i in range(1, len(edges) - 1)]

    def prompt_plan(self, layout, num_tokens: int, block_size: int, blocks=(), shared: int = 0,
                    free: dict | None = None, allowed=None):
        """(token indices where this prompt's prefill takes checkpoints, sorted; their values).
        `blocks`: hashes of the prompt's full blocks, the first `shared` held by earlier prompts
        (the prompt not yet observed). With `free` (a dict), every other candidate's value next
        to the plan goes into it (position -> value): where a chunk may take a checkpoint while
        the store has free slots (serving/hybrid/hybrid_prefix.py, `free_room`). `allowed`:
        None, or a function of the candidate token indices [N] -> [N] bool, those the prompt
        can address (span prompts: span_cache._checkpoints); the plan is optimal among them."""
        if self.strategy == "none" or self.per_prompt == 0:
            return [], []
        cand = candidates(layout, num_tokens, block_size, self.chunk)
        if allowed is not None and cand.size:
            cand = cand[allowed(cand)]
        if cand.size == 0:
            return [], []
        pmf = self.prompt_pmf(int(num_tokens), blocks, shared)
        got, values = self._place(pmf, cand, num_tokens, block_size)
        if free is not None:
            free.update(self.free_values(pmf, got, cand))
        return got, values

    @staticmethod
    def free_values(pmf: np.ndarray, planned, cand) -> dict:
        """Per candidate c off the plan: what adding it alone to the plan saves a later request
        on average, (mass of depths in [c, r)) x (c - l) between its planned neighbours l < c < r
        (the same measure as `values`, so the store's eviction ranks both kinds alike)."""
        cdf = np.concatenate([[0.0], np.cumsum(pmf)])
        edges = np.asarray([0] + list(planned) + [pmf.size], np.int64)
        out = {}
        for c in (int(x) for x in cand):
            i = int(np.searchsorted(edges, c, side="right"))
            if edges[i - 1] == c:
                continue  # planned
            out[c] = float((cdf[edges[i]] - cdf[c]) * (c - edges[i - 1]))
        return out

    def _place(self, pmf, cand, num_tokens: int, block_size: int):
        """(positions, values) of the strategy's plan over `cand` under `pmf`."""
        if self.strategy == "last":
            got = [int(cand[-1])]
        elif self.strategy == "block":
            got = place(pmf, self.per_prompt, "block", cand, block_size=max(1, self.block_tokens))
        elif self.strategy == "dp":
            got = self._priced(pmf, cand,
                               -(-int(num_tokens) // self.step_tokens) * self.per_step)
        else:
            got = place(pmf, self.per_prompt, self.strategy, cand)
        got = [int(x) for x in got]
        return got, self.values(pmf, got)

    def _priced(self, pmf, cand, free: int):
        """The m <= per_prompt minimising OPT(m) + extra_price max(m - free, 0): a prompt
        prefilled in c chunks takes `free` = c per_step checkpoints without a split (a step
        stores up to per_step per sequence), each further one may split a chunk (exact: OPT(m)
        and the price are convex in m)."""
        best, got = None, []
        for m in range(1, self.per_prompt + 1):
            pos = place(pmf, m, "dp", cand)
            total = expected_recompute(pmf, pos) + self.extra_price * max(len(pos) - free, 0)
            if best is not None and total >= best - 1e-12:
                break
            best, got = total, pos
        return got

    def prompt_positions(self, layout, num_tokens: int, block_size: int, blocks=(),
                         shared: int = 0) -> list[int]:
        return self.prompt_plan(layout, num_tokens, block_size, blocks, shared)[0]
