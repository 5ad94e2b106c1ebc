"""The blocks a cached span was found in last time, so that admission finds it again as a whole.

A cached span request (issue 28: 8 spans of 4,096 ids, ~2,000 blocks, all cached) looked every
block's key up in the pool's table, gathered each block's kept tokens to confirm the hits, and
converted the blocks found to an array: per block work, inside its time to first token. A span
run (one SSEP span's blocks) that was a whole hit is remembered here with its keys, its blocks,
their stamps (BlockManager.stamp: new at every change of a block's key or kept tokens) and its
tokens' bytes. The next request holding the same run finds the same blocks when

  * its keys are the remembered ones (the same list object: the span-chain memo hands out
    one list per span; else a list compare, fast too: the memo's lists hold the same ints),
  * every block's stamp is as remembered: each still holds the key and the kept tokens it held
    when the run was confirmed (a block evicted, reused or re-registered since has a new stamp),
  * its token bytes equal the remembered ones, which equal those blocks' kept tokens:
    the hit confirmation of DESIGN §3, one compare per run instead of one join per block.

Those are exactly the blocks the per-block lookup and confirmation would give (the table maps a
key to the one block whose stamp says it holds it), so nothing else changes. Runs shorter than
MIN_RUN_BLOCKS are looked up block by block as before (remembering them would not pay).
"""

from __future__ import annotations

import collections

import numpy as np

MIN_RUN_BLOCKS = 8


class RunMemo:
    """Runs remembered, least recently found first out: at most as many blocks in all as the
    pool has (their token bytes kept here are then at most the pool's kept tokens again)."""

    def __init__(self):
        # (last key, length) -> (pool, keys, blocks, array, stamps, bytes)
        self._runs: collections.OrderedDict = collections.OrderedDict()
        self._num_blocks = 0
        self.hits = 0

    def known(self, bm, runs, hashes: list, raw: bytes, step: int) -> list[tuple]:
        """(first, end, blocks, blocks as int64) of each of `runs` ((first, end) block ranges,
        ascending, each optionally with its keys' list: hashing.block_keys_and_tail's runs)
        whose blocks in pool `bm` are the ones remembered and still hold its keys and tokens
        (`raw`: the sequence's int64 token bytes, `step` bytes a block)."""
        found, arrays, stamps = [], [], []
        for first, end, *chain in runs:
            if end - first < MIN_RUN_BLOCKS:
                continue
            key = (hashes[end - 1], end - first)
            got = self._runs.get(key)
            # the keys' list remembered is this run's own (no slice, no compare), or equal
            if (got is not None and got[0] is bm
                    and ((chain and got[1] is chain[0]) or got[1] == hashes[first:end])
                    and raw.startswith(got[5], first * step)):
                self._runs.move_to_end(key)
                found.append((first, end, got[2], got[3]))
                arrays.append(got[3])
                stamps.append(got[4])
        if len(found) > 1:  # the stamps of all in one gather (one run's mismatch: look closer)
            if not np.array_equal(bm.stamp[np.concatenate(arrays)], np.concatenate(stamps)):
                found = [f for f, s in zip(found, stamps) if np.array_equal(bm.stamp[f[3]], s)]
        elif found and not np.array_equal(bm.stamp[arrays[0]], stamps[0]):
            found = []
        self.hits += len(found)
        return found

    def remember(self, bm, runs, hashes: list, raw: bytes, step: int, got: list,
                 known: list) -> None:
        """Remember each of `runs` not `known` whose blocks `got` (per block: the confirmed
        hit, or None) are all hits."""
        skip = {k[0] for k in known}
        for first, end, *chain in runs:
            if end - first < MIN_RUN_BLOCKS or first in skip:
                continue
            blocks = got[first:end]
            if None in blocks:
                continue
            key = (hashes[end - 1], end - first)
            self._forget(self._runs.pop(key, None))
            while self._runs and self._num_blocks + len(blocks) > bm.num_blocks:
                self._forget(self._runs.popitem(last=False)[1])
            arr = np.array(blocks, np.int64)
            arr.flags.writeable = False
            keys = chain[0] if chain else hashes[first:end]  # never changed: kept as it is
            self._runs[key] = (bm, keys, blocks, arr, bm.stamp[arr],
                               raw[first * step:end * step])
            self._num_blocks += len(blocks)

    def _forget(self, run) -> None:
        if run is not None:
            self._num_blocks -= len(run[2])
