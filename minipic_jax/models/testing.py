"""A minimal paged runner for tests and demos: host-side page allocation + metadata + greedy loop.

Not the engine (that is `serving/`): no prefix caching, no scheduling, every sequence of a batch
steps together. Pages are handed out in a shuffled order so block tables are not trivially
contiguous. Token counts are padded to powers of two so compiles stay few.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention.metadata import AttentionMetadata


def _bucket(n: int, minimum: int = 8) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


class SimplePager:
    """Owns page allocation for a fixed set of sequences and builds AttentionMetadata per step."""

    def __init__(self, num_seqs: int, max_len: int, page_size: int, seed: int = 0):
        self.page_size = page_size
        self.max_blocks = -(-max_len // page_size)
        self.num_pages = num_seqs * self.max_blocks + 1
        self.free = list(np.random.default_rng(seed).permutation(self.num_pages))
        self.pages: list[list[int]] = [[] for _ in range(num_seqs)]
        self.lengths = [0] * num_seqs

    def step(self, new_counts: list[int], min_tokens: int = 0):
        """Metadata for appending new_counts[s] tokens to each sequence s (0 = idle this step),
        padded to the token bucket of max(total, min_tokens).

        Returns (metadata, logits_indices [T_pad] int32 (row of each sequence's last new token,
        then padding), num_real_rows).
        """
        seqs = len(self.pages)
        total = sum(new_counts)
        t_pad = _bucket(max(total, min_tokens))
        q_pos = np.zeros(t_pad, np.int32)
        q_seq = np.zeros(t_pad, np.int32)
        slots = np.full(t_pad, -1, np.int32)
        cu = np.zeros(seqs + 1, np.int32)
        tables = np.zeros((seqs, self.max_blocks), np.int32)
        pos_start = np.zeros((seqs, self.max_blocks), np.int32)
        num_valid = np.zeros((seqs, self.max_blocks), np.int32)
        num_blocks = np.zeros(seqs, np.int32)
        last_rows = []
        row = 0
        for s, n in enumerate(new_counts):
            start, end = self.lengths[s], self.lengths[s] + n
            if end > self.max_blocks * self.page_size:
                raise ValueError(f"SimplePager: sequence {s} grows to {end} tokens, more than "
                                 f"max_len {self.max_blocks * self.page_size}")
            while len(self.pages[s]) * self.page_size < end:
                self.pages[s].append(int(self.free.pop()))
            for p in range(start, end):
                q_pos[row] = p
                q_seq[row] = s
                slots[row] = self.pages[s][p // self.page_size] * self.page_size + p % self.page_size
                row += 1
            if n:
                last_rows.append(row - 1)
            cu[s + 1] = row
            nb = len(self.pages[s])
            num_blocks[s] = nb
            tables[s, :nb] = self.pages[s]
            pos_start[s, :nb] = np.arange(nb) * self.page_size
            num_valid[s, :nb] = np.clip(end - np.arange(nb) * self.page_size, 0, self.page_size)
            self.lengths[s] = end
        md = AttentionMetadata(
            q_positions=jnp.asarray(q_pos), q_window_start=jnp.zeros(t_pad, jnp.int32),
            q_seq=jnp.asarray(q_seq), cu_q_lens=jnp.asarray(cu), num_blocks=jnp.asarray(num_blocks),
            block_tables=jnp.asarray(tables), block_pos_start=jnp.asarray(pos_start),
            block_num_valid=jnp.asarray(num_valid), slot_mapping=jnp.asarray(slots))
        idx = np.zeros(t_pad, np.int32)
        idx[:len(last_rows)] = last_rows
        return md, jnp.asarray(idx), total


@functools.lru_cache(maxsize=None)
def jitted_forward(family):
    """family.forward jitted with cfg/kv_mode/attn_impl static and the cache donated."""
    return jax.jit(family.forward, static_argnames=("cfg", "kv_mode", "attn_impl"),
                   donate_argnames=("cache",))


def prefill_logits(family, params, cfg, prompts, *, page_size: int = 4, kv_mode="position_free",
                   dtype=jnp.float32, seed: int = 0, max_len: int | None = None):
    """All prompts in ONE ragged call; returns per-prompt logits [Lp, V] (numpy float32).

    max_len (default: the longest prompt) sizes the block tables; fix it to share compiles."""
    pager = SimplePager(len(prompts), max_len or max(len(p) for p in prompts), page_size, seed)
    cache = family.init_cache(cfg, pager.num_pages, page_size, len(prompts), dtype)
    md, _, total = pager.step([len(p) for p in prompts])
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[:total] = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    logits, _ = jitted_forward(family)(params, jnp.asarray(tokens), md, cache, cfg=cfg,
                                       kv_mode=kv_mode)
    logits = np.asarray(logits)
    bounds = np.cumsum([0] + [len(p) for p in prompts])
    return [logits[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def greedy_generate(family, params, cfg, prompts, max_new_tokens: int, *, page_size: int = 4,
                    kv_mode="position_free", dtype=jnp.float32, stop_on_eos: bool = True,
                    seed: int = 0, max_len: int | None = None):
    """Greedy decoding through the paged cache: one ragged prefill, then batched decode steps.

    Returns (tokens, step_logits): per prompt the generated ids, and per prompt a list of the
    [V] float32 logits that chose each generated token. A sequence that emits one of
    cfg.eos_token_ids stops (when stop_on_eos) and sits idle in later steps.
    """
    n = len(prompts)
    pager = SimplePager(n, max_len or max(len(p) for p in prompts) + max_new_tokens, page_size,
                        seed)
    cache = family.init_cache(cfg, pager.num_pages, page_size, n, dtype)
    fwd = jitted_forward(family)
    out = [[] for _ in range(n)]
    step_logits = [[] for _ in range(n)]
    done = [False] * n
    counts = [len(p) for p in prompts]
    feed = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        md, idx, total = pager.step(counts)
        tokens = np.zeros(md.num_tokens, np.int32)
        tokens[:total] = [t for f, c in zip(feed, counts) for t in f[:c]]
        logits, cache = fwd(params, jnp.asarray(tokens), md, cache, cfg=cfg,
                            logits_indices=idx, kv_mode=kv_mode)
        logits = np.asarray(logits)
        active = [s for s in range(n) if counts[s]]
        for row, s in enumerate(active):
            tok = int(np.argmax(logits[row]))
            out[s].append(tok)
            step_logits[s].append(logits[row])
            if stop_on_eos and tok in cfg.eos_token_ids:
                done[s] = True
        counts = [0 if done[s] else 1 for s in range(n)]
        feed = [[out[s][-1]] if out[s] else [] for s in range(n)]
        if all(done):
            break
    return out, step_logits
