"""A prefill chunk's token indices over a sequence's blocks (host, plain Python).

A chunk walks a sequence's blocks in order: a ready cached block is skipped, a block another
live sequence is still computing stalls the chunk (computed once; if its owner went away the
chunk claims it), pads are skipped for free.
"""

from __future__ import annotations

import numpy as np


def plan_chunk(bm, seq, budget: int, total: int, block_size: int):
    """(token indices to compute next, at most `budget` valid ones below `total`; the new
    frontier)."""
    bs = block_size
    i, parts, n = seq.num_computed, [], 0
    while i < total and n < budget:
        j = i // bs
        if j not in seq.owned:  # a shared (hit or waited-for) block, entered at its start
            b = seq.block_table[j]
            if bm.ready[b] or bm.hash[b] == -1:
                i = skip_shared(bm, seq, j + 1, total, bs) * bs
                continue
            if bm.owner[b] != -1:
                break  # another sequence is computing it: wait
            bm.owner[b] = seq.seq_id  # its owner went away: claim it
            seq.owned.add(j)
        end = min((j + 1) * bs, total)
        idx = np.arange(i, end)
        if i < seq.num_prompt_tokens:
            idx = idx[~seq.layout.is_pad[np.minimum(idx, seq.num_prompt_tokens - 1)]
                      | (idx >= seq.num_prompt_tokens)]
        if idx.size > budget - n:
            idx = idx[:budget - n]
            end = int(idx[-1]) + 1
            if end < seq.num_prompt_tokens:  # trailing pads of the block come for free
                rest = seq.layout.is_pad[end:min((j + 1) * bs, seq.num_prompt_tokens)]
                if rest.size and rest.all():
                    end += rest.size
        parts.append(idx)
        n += idx.size
        i = end
    idx = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return idx, i


def skip_shared(bm, seq, j: int, total: int, block_size: int) -> int:
    """First block >= j a chunk cannot skip (owned, shared and pending, or past `total`).
    A cached request's 2,000 ready blocks are passed by one gather of their readiness (the
    pool's numpy array); Python looks only at the not-ready blocks and at the owned ones."""
    owned, table, hashes = seq.owned, seq.block_table, bm.hash
    end = min(-(-total // block_size), len(table))
    if j >= end:
        return j
    if len(owned) <= end - j:  # the first owned block at or after j bounds the run
        end = min((k for k in owned if j <= k < end), default=end)
    else:
        end = next((k for k in range(j, end) if k in owned), end)
    run = seq.table_array()[j:end]  # converted once per entry (Sequence.table_array)
    for k in np.flatnonzero(~np.asarray(bm.ready)[run]).tolist():
        if hashes[table[j + k]] != -1:  # not ready, computed by someone: wait or claim it
            return j + k
    return end


def publish_computed(bm, keys, seq, caching: bool) -> None:
    """After `seq`'s frontier moved: its owned blocks completed since `seq.ready_ptr` become
    ready (others may share them); a block completed during generation is keyed and published
    (PrefixKeys.publish_generated)."""
    bs = bm.block_size
    j0, owned = seq.ready_ptr, seq.owned
    end = min(seq.num_computed // bs, len(seq.block_table))
    if end <= j0:  # no block completed (most decode steps)
        return
    # completed blocks [j0, end): only owned ones change (few, after a cached prefix)
    todo = range(j0, end) if len(owned) >= end - j0 else sorted(
        j for j in owned if j0 <= j < end)
    for j in todo:
        if j not in owned:
            continue
        b = seq.block_table[j]
        if bm.is_pending(b) and bm.owner[b] == seq.seq_id:
            bm.mark_ready(b)
        elif (caching and j == len(seq.block_hashes) and bm.hash[b] == -1
              and seq.chain_tail is not None and not seq.is_span_job):
            keys.publish_generated(seq, j, b, bm)
    seq.ready_ptr = max(j0, end)
