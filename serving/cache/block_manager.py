"""Host-side paged KV block pool: ref counts, chained-hash prefix cache, LRU free list.

Per-block state in numpy arrays (ref counts, readiness, owners) and a numpy LRU free list
(serving/cache/free_list.py): one block is plain indexing, a cached request's ~2,000 blocks are
shared and released by whole-array operations; keys and kept tokens are Python lists (keys are
128-bit ints). A block registered under a hash is *pending* until the
sequence that owns it has computed all its tokens, then *ready*. Other sequences may share a
pending block and wait for it instead of computing it twice; if its owner goes away (preempted)
the first waiter to reach it claims it. Freed blocks join the tail of an LRU free list (a
sequence's blocks in reverse order, so its last blocks are evicted first) and keep their hash
until the block is reused; a ready block evicted that way can be handed to the host tier.
Every block handed out is recorded as fresh until the runner takes the record: its pages are
zeroed on the device before the step that first uses them (serving/cache/page_zeroing.py), unless a
copy-in fills them whole (`filled`).
"""

from __future__ import annotations

import numpy as np

from serving.cache.free_list import FreeList

BULK = 64  # blocks from which share_many / release work on whole arrays


def block_array(blocks, arr=None) -> np.ndarray:
    """`blocks` as int64 (`arr`: the caller's array of them already, e.g. Sequence.table_array)."""
    return np.fromiter(blocks, np.int64, len(blocks)) if arr is None else arr


def _distinct(arr: np.ndarray, scratch: np.ndarray) -> bool:
    """Whether the block ids `arr` are distinct: each writes its index into `scratch` (one entry
    per pool block, any contents); a block given twice holds one of its indices, so the other
    place reads back another (whichever write lands last). Costs O(len(arr)) whatever the pool's size (a bincount over a 30K-block pool cost
    more than the check of a cached request's 2,000 blocks)."""
    idx = np.arange(arr.size, dtype=np.int64)
    scratch[arr] = idx
    return bool((scratch[arr] == idx).all())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 on_evict=None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.on_evict = on_evict  # callable(block, hash, confirm) for ready blocks being reused
        self.ref = np.zeros(num_blocks, np.int64)
        self.hash = [-1] * num_blocks
        self.confirm: list[tuple | None] = [None] * num_blocks  # tokens kept to confirm hits
        # per block, a number new at each change of its kept tokens (so of its key too: both
        # change together), 0 while it keeps none: a run of blocks whose stamps are as they
        # were still holds the keys and tokens it held then (serving/cache/run_memo.py)
        self.stamp = np.zeros(num_blocks, np.int64)
        self._scratch = np.zeros(num_blocks, np.int64)  # _distinct's, contents meaningless
        self._last_stamp = 0
        self.ready = np.zeros(num_blocks, bool)
        self.owner = np.full(num_blocks, -1, np.int64)
        self.free = FreeList(num_blocks, range(num_blocks))
        self.table: dict[int, int] = {}  # hash -> block
        self.num_odd_confirms = 0  # kept tokens that are not int64 bytes of a full block
        self.num_evicted = 0
        self.fresh: dict[int, None] = {}  # allocated since the last take_fresh, oldest first

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def lookup(self, h: int, confirm: tuple) -> int | None:
        """Block holding hash `h` whose kept tokens equal `confirm` (collisions are misses)."""
        if not self.enable_caching:
            return None
        b = self.table.get(h)
        if b is None or self.confirm[b] != confirm:
            return None
        return b

    def _bulk(self, blocks) -> bool:
        """Whole-array operations for these blocks: many of them, and the state is arrays (a
        test may swap in lists, which the per-block loops take too)."""
        return len(blocks) >= BULK and all(isinstance(x, np.ndarray)
                                           for x in (self.ref, self.owner, self.ready))

    def num_idle(self, blocks, arr=None) -> int:
        """How many entries of `blocks` no sequence holds (a repeated block counts each time);
        `arr`: `blocks` as an int64 array, when the caller has one."""
        if self._bulk(blocks):
            return int(np.count_nonzero(self.ref[block_array(blocks, arr)] == 0))
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 0)

    def share(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def share_many(self, blocks: list[int], arr=None) -> bool:
        """`share` of each block in order (a block may repeat). If it raises part way, the
        blocks shared so far are released again (last first), so the caller holds none of
        them: what undoing the per-block calls did. Many distinct blocks: whole-array
        operations (the free list's order is the same: a share only takes blocks out); `arr`:
        `blocks` as an int64 array, when the caller has one. True: the blocks were checked
        distinct (else not known either way)."""
        if self._bulk(blocks):
            arr = block_array(blocks, arr)
            if _distinct(arr, self._scratch):
                refs = self.ref[arr]  # gathered once (distinct: one increment each)
                idle = arr[refs == 0]
                if not self.free.missing(idle):
                    self.free.take_many(idle)
                    refs += 1
                    self.ref[arr] = refs
                    return True
        ref, free, i = self.ref, self.free, 0
        try:
            for i, b in enumerate(blocks):
                if not ref[b]:
                    del free[b]
                ref[b] += 1
        except BaseException:
            self.release(blocks[:i], -1)
            raise
        return False

    def allocate(self) -> int:
        """Take the least recently freed block (evicting its cached content)."""
        if not self.free:
            raise RuntimeError("BlockManager.allocate: no free block (caller must check)")
        b, _ = self.free.popitem(last=False)
        if self.hash[b] != -1:
            if self.ready[b] and self.on_evict is not None:
                self.on_evict(b, self.hash[b], self.confirm[b])
            self.num_evicted += 1
            self.unregister(b)
        self.ref[b] = 1
        self.ready[b] = False
        self.owner[b] = -1
        self.fresh[b] = None
        return b

    def take_fresh(self) -> list[int]:
        """The blocks allocated since the last call (oldest first), to be zeroed on the device;
        the record starts again empty. A block freed and allocated again since is listed once."""
        fresh, self.fresh = list(self.fresh), {}
        return fresh

    def filled(self, blocks) -> None:
        """Blocks whose whole pages a copy-in writes (dispatched now): not to be zeroed after it."""
        for b in blocks:
            self.fresh.pop(b, None)

    def register(self, b: int, h: int, confirm: tuple, owner: int, ready: bool = False) -> None:
        """Publish block b under hash h (first publisher wins; later duplicates stay private)."""
        if not self.enable_caching or h in self.table:
            return
        self.table[h] = b
        self.hash[b] = h
        self._keep(b, confirm)
        self.ready[b] = ready
        self.owner[b] = -1 if ready else owner

    def mark_ready(self, b: int) -> None:
        self.ready[b] = True
        self.owner[b] = -1

    def is_pending(self, b: int) -> bool:
        return self.hash[b] != -1 and not self.ready[b]

    def release(self, blocks, seq_id: int, arr=None, distinct: bool = False) -> None:
        """Drop one reference to each block, last block first. Many distinct blocks: whole-array
        operations (freed blocks join the free list in the same order); `arr`: `blocks` as an
        int64 array, when the caller has one; `distinct`: the caller knows no block repeats
        (Memos.distinct_table), so the check is skipped (~7 us over a cached request's 2,000)."""
        if self._bulk(blocks):
            # last first, copied contiguous: a scatter through the reversed view cost twice
            # as much as the copy and a contiguous scatter
            arr = np.ascontiguousarray(block_array(blocks, arr)[::-1])
            left = self.ref[arr] - 1
            if (distinct or _distinct(arr, self._scratch)) and left.min() >= 0:
                self.owner[arr[self.owner[arr] == seq_id]] = -1
                self.ref[arr] = left
                freed = arr[left == 0]
                for b in freed[~self.ready[freed]].tolist():
                    if self.hash[b] != -1:
                        self.unregister(b)  # half-computed content is worthless
                self.free.put_many(freed)
                return
        ref, owner, free = self.ref, self.owner, self.free  # locals: this loop is hot
        hashes, ready = self.hash, self.ready
        for b in reversed(blocks):
            if owner[b] == seq_id:
                owner[b] = -1
            r = ref[b] - 1
            ref[b] = r
            if r <= 0:
                if r < 0:
                    raise RuntimeError(f"BlockManager.release: block {b} freed twice")
                if hashes[b] != -1 and not ready[b]:
                    self.unregister(b)  # half-computed content is worthless
                free[b] = None

    def unregister(self, b: int) -> None:
        """Unpublish block b (its key, kept tokens and readiness go; references stay)."""
        if self.table.get(self.hash[b]) == b:
            del self.table[self.hash[b]]
        self.hash[b] = -1
        self._keep(b, None)
        self.ready[b] = False
        self.owner[b] = -1

    def _keep(self, b: int, confirm) -> None:
        self.num_odd_confirms += self._odd(confirm) - self._odd(self.confirm[b])
        self.confirm[b] = confirm
        if confirm is None:
            self.stamp[b] = 0
        else:
            self._last_stamp += 1
            self.stamp[b] = self._last_stamp

    def _odd(self, confirm) -> bool:
        return confirm is not None and (type(confirm) is not bytes
                                        or len(confirm) != 8 * self.block_size)

    @property
    def confirms_are_blocks(self) -> bool:
        """Whether every kept confirm is a full block's int64 bytes (what the engine registers;
        the pool does not require it), so that many can be compared joined at once."""
        return self.num_odd_confirms == 0

    def forget_cached(self) -> None:
        """Unregister every cached block (blocks stay allocated where they are in use)."""
        for b in range(self.num_blocks):
            if self.hash[b] != -1:
                self.unregister(b)
