"""Random ragged batches over a paged cache, for tests and benchmarks (host numpy).

Each sequence is (cached, new, window): `cached` keys already in the cache, `new` query tokens whose
K/V are also in the cache (written before attention), window = logical window start of its queries
(0 = whole prefix). Blocks get random physical pages; with `pad_prob` a block holds fewer valid
slots than the page size (pads inside blocks take no position); with `share` the second block of
every later sequence maps to sequence 0's first physical page, at a different logical offset;
with `shuffle_entries` each table's in-use entries are permuted (positions travel with them).
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from kernels_pallas.paged_attention.metadata import AttentionMetadata


def random_batch(rng, specs, *, page_size, extra_pages=3, pad_prob=0.0, share=False,
                 pad_tokens=0, extra_table_cols=1, shuffle_entries=False):
    """specs: list of (cached, new, window) -> (AttentionMetadata, num_pages, q_tokens)."""
    seq_blocks = []  # per sequence: list of (num_valid, pos_start)
    for cached, new, _ in specs:
        total, pos, blocks = cached + new, 0, []
        while pos < total:
            valid = page_size
            if pad_prob and rng.random() < pad_prob:
                valid = int(rng.integers(1, page_size + 1))
            valid = min(valid, total - pos)
            blocks.append((valid, pos))
            pos += valid
        seq_blocks.append(blocks)
    n_used = sum(len(b) for b in seq_blocks)
    num_pages = n_used + extra_pages
    pages = rng.permutation(num_pages)
    seqs = len(specs)
    max_blocks = max(len(b) for b in seq_blocks) + extra_table_cols
    tables = np.zeros((seqs, max_blocks), np.int32)
    starts = np.zeros((seqs, max_blocks), np.int32)
    n_valid = np.zeros((seqs, max_blocks), np.int32)
    num_blocks = np.zeros((seqs,), np.int32)
    q_pos, q_win, q_seq, cu = [], [], [], [0]
    nxt = 0
    for s, ((cached, new, window), blocks) in enumerate(zip(specs, seq_blocks)):
        num_blocks[s] = len(blocks)
        for b, (valid, pos) in enumerate(blocks):
            tables[s, b] = pages[nxt]
            nxt += 1
            starts[s, b] = pos
            n_valid[s, b] = valid
        if share and s > 0 and len(blocks) > 1:
            tables[s, 1] = tables[0, 0]  # same page, logical start blocks[1] != 0
        if shuffle_entries:  # table order need not follow logical order
            perm = rng.permutation(len(blocks))
            for arr in (tables, starts, n_valid):
                arr[s, : len(blocks)] = arr[s, perm]
        tables[s, len(blocks):] = rng.integers(0, num_pages, max_blocks - len(blocks))
        total = cached + new
        q_pos += list(range(cached, total))
        q_win += [min(window, cached)] * new
        q_seq += [s] * new
        cu.append(cu[-1] + new)
    tokens = cu[-1] + pad_tokens
    pad = [0] * pad_tokens
    md = AttentionMetadata(
        q_positions=jnp.asarray(np.asarray(q_pos + pad, np.int32)),
        q_window_start=jnp.asarray(np.asarray(q_win + pad, np.int32)),
        q_seq=jnp.asarray(np.asarray(q_seq + pad, np.int32)),
        cu_q_lens=jnp.asarray(np.asarray(cu, np.int32)),
        num_blocks=jnp.asarray(num_blocks),
        block_tables=jnp.asarray(tables),
        block_pos_start=jnp.asarray(starts),
        block_num_valid=jnp.asarray(n_valid),
        slot_mapping=jnp.full((tokens,), -1, jnp.int32),
    )
    return md, num_pages, tokens


def inv_freq_for(head_dim, rotary_dim=None, theta=10000.0):
    """Default RoPE inverse frequencies over rotary_dim (partial rotary when < head_dim)."""
    rot = head_dim if rotary_dim is None else rotary_dim
    return 1.0 / theta ** (np.arange(0, rot, 2, dtype=np.float32) / rot)
