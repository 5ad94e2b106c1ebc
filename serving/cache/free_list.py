"""The block pool's LRU free list, with whole-array takes and puts.

What the pool used as an OrderedDict of block ids (oldest freed first; `in`, `len`, iteration in
that order, `del`, `[b] = None` appending a block not yet in it, `popitem(last=False)`, `copy`),
held as numpy arrays so that a cached request's ~2,000 blocks leave the list (shared) and come
back (released) by one vectorized operation each instead of one dict operation per block.

A queue of block ids in the order they were freed, and each free block's position in it
(`pos`, -1 when not free). Taking a block out only clears its `pos` (its queue entry goes stale);
stale entries are passed over by `popitem` and dropped when the queue is compacted.
"""

from __future__ import annotations

import numpy as np

_SCAN = 64  # queue entries looked at in one go when passing stale ones


class FreeList:
    def __init__(self, num_blocks: int, blocks=()):
        self.pos = np.full(num_blocks, -1, np.int64)
        self.queue = np.zeros(4 * num_blocks + 16, np.int64)
        self.head = self.tail = self.count = 0
        self.put_many(np.asarray(list(blocks), np.int64))

    def __len__(self) -> int:
        return self.count

    def __contains__(self, b) -> bool:
        return bool(self.pos[b] >= 0)

    def __iter__(self):
        return iter(self._live().tolist())

    def _live(self) -> np.ndarray:
        """The free blocks in queue order (oldest first)."""
        seg = self.queue[self.head:self.tail]
        return seg[self.pos[seg] == np.arange(self.head, self.tail)]

    def __delitem__(self, b) -> None:
        if self.pos[b] < 0:
            raise KeyError(b)
        self.pos[b] = -1
        self.count -= 1

    def __setitem__(self, b, _value) -> None:
        """Append `b` (oldest last); a block already free keeps its place (as a dict key)."""
        if self.pos[b] >= 0:
            return
        if self.tail == self.queue.size:
            self._compact(1)
        self.queue[self.tail] = b
        self.pos[b] = self.tail
        self.tail += 1
        self.count += 1

    def popitem(self, last: bool = False) -> tuple[int, None]:
        """(the least recently freed block, None), taken out; KeyError when empty."""
        if last:
            raise NotImplementedError("FreeList.popitem takes the oldest block only")
        if not self.count:
            raise KeyError("popitem(): free list is empty")
        h, pos, queue = self.head, self.pos, self.queue
        b = int(queue[h])
        while pos[b] != h:  # stale: pass a run of them at once
            seg = queue[h:min(h + _SCAN, self.tail)]
            live = np.flatnonzero(pos[seg] == np.arange(h, h + seg.size))
            h = h + int(live[0]) if live.size else h + seg.size
            b = int(queue[h])
        pos[b] = -1
        self.head = h + 1
        self.count -= 1
        return b, None

    def take_many(self, blocks: np.ndarray) -> None:
        """Take distinct free `blocks` out (the caller checked that each is free)."""
        self.pos[blocks] = -1
        self.count -= blocks.size

    def missing(self, blocks: np.ndarray) -> bool:
        """Whether any of `blocks` is not free."""
        return bool((self.pos[blocks] < 0).any())

    def put_many(self, blocks: np.ndarray) -> None:
        """Append distinct `blocks`, none of them free now, in order (the last is freed last)."""
        k = blocks.size
        if self.tail + k > self.queue.size:
            self._compact(k)
        self.queue[self.tail:self.tail + k] = blocks
        self.pos[blocks] = np.arange(self.tail, self.tail + k)
        self.tail += k
        self.count += k

    def _compact(self, room: int) -> None:
        """Drop the stale entries (the live ones keep their order); grow to hold `room` more."""
        live = self._live()
        if 2 * (live.size + room) > self.queue.size:  # at least as much room again after
            self.queue = np.zeros(4 * (live.size + room) + 16, np.int64)
        self.queue[:live.size] = live
        self.pos[live] = np.arange(live.size)
        self.head, self.tail = 0, live.size

    def copy(self) -> "FreeList":
        twin = FreeList.__new__(FreeList)
        twin.pos, twin.queue = self.pos.copy(), self.queue.copy()
        twin.head, twin.tail, twin.count = self.head, self.tail, self.count
        return twin
