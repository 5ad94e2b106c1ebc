"""Host tier for cached KV blocks (`cpu_offload_gb`).

A ready cached block that the device pool evicts is copied to host memory under its hash; a later
hit copies it back into a fresh device block. Keys are position-free, so a block comes back
byte-identical with no position bookkeeping. Copies are batched per step: one jitted gather of
the evicted pages (dispatched before the step overwrites them, host copy started asynchronously)
and one jitted scatter of the pages coming back.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np

from serving.cache.kv_pool import page_mask


class HostBatch:
    """Pages (or checkpoint slots) gathered in one step: device arrays, their host copy started,
    until first read, then numpy."""

    def __init__(self, arrays):
        self.arrays = arrays
        for a in arrays:
            a.copy_to_host_async()
        self.host = None

    def materialize(self):
        if self.host is None:
            self.host = [np.asarray(a) for a in self.arrays]
            self.arrays = None
        return self.host


class HostKVTier:
    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self.entries: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.pending: list[HostBatch] = []
        self.num_offloaded = 0
        self.num_restored = 0

    def contains(self, h: int | None) -> bool:
        return h is not None and h in self.entries

    def put(self, h: int, confirm, batch: HostBatch, row: int) -> None:
        self.entries[h] = (confirm, batch, row)
        self.entries.move_to_end(h)
        self.num_offloaded += 1
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, h: int):
        confirm, batch, row = self.entries[h]
        self.entries.move_to_end(h)
        self.num_restored += 1
        return batch, row

    def materialize(self) -> None:
        for b in self.pending:
            b.materialize()
        self.pending = []


def _bucket(n: int) -> int:
    return max(4, 1 << (n - 1).bit_length())


class PageMover:
    """Jitted gather (device -> host tier) and scatter (host tier -> device) of whole pages."""

    def __init__(self, num_pages: int, block_size: int):
        self.num_pages = num_pages
        self.block_size = block_size

    def _mask(self, cache):
        return page_mask(cache, self.num_pages, self.block_size)

    @functools.partial(jax.jit, static_argnums=(0,))
    def _gather(self, cache, ids):
        leaves = [x[ids] for x, m in zip(jax.tree.leaves(cache), self._mask(cache)) if m]
        return leaves  # list of [n, B, ...]

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
    def _scatter(self, cache, ids, data):
        leaves, treedef = jax.tree.flatten(cache)
        it = iter(data)
        out = [x.at[ids].set(next(it).astype(x.dtype), mode="drop") if m else x
               for x, m in zip(leaves, self._mask(cache))]
        return jax.tree.unflatten(treedef, out)

    def gather(self, cache, blocks: list[int]) -> HostBatch:
        n = len(blocks)
        ids = np.zeros(_bucket(n), np.int32)
        ids[:n] = blocks
        return HostBatch(self._gather(cache, jnp.asarray(ids)))

    def scatter(self, cache, blocks: list[int], sources: list[tuple[HostBatch, int]]):
        n = len(blocks)
        nb = _bucket(n)
        ids = np.full(nb, self.num_pages, np.int32)  # out of range rows are dropped
        ids[:n] = blocks
        data = None
        for k, (batch, row) in enumerate(sources):
            host = batch.materialize()
            if data is None:
                data = [np.zeros((nb,) + a.shape[1:], a.dtype) for a in host]
            for d, a in zip(data, host):
                d[k] = a[row]
        return self._scatter(cache, jnp.asarray(ids), [jnp.asarray(d) for d in data])
