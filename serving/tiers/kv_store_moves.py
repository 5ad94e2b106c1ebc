"""Page moves of the span store's tier: chunked gathers of blocks to write, and copy-ins of
staged runs (one device scatter per run, from the transfer a reader thread started)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.tiers.offload import PageMover
from serving.tiers.run_file import MAX_RUN, Run, run_rows

CHUNK_BLOCKS = MAX_RUN  # page moves per jitted call: bounded compiles (4..256), warmed up front


class _Staged:
    """A staged block: row `row` of a verified run (`run.kv` [L, rows, B, ...])."""

    __slots__ = ("run", "row")

    def __init__(self, run: Run, row: int):
        self.run, self.row = run, row


class ChunkedPageMover(PageMover):
    """PageMover in chunks of at most CHUNK_BLOCKS pages (a warm store copies in thousands of
    blocks per step; power-of-two buckets up to that would each compile mid-run). Staged store
    blocks go to the device a run at a time: the run's array as read ([L, rows, B, ...], rows
    `run_rows(n)`) is the transfer, with no host copy, and a scatter puts the wanted rows in
    place."""

    def __init__(self, num_pages: int, block_size: int, counters: dict | None = None):
        super().__init__(num_pages, block_size)
        self.counters = counters if counters is not None else {}  # copy_in_s, copy_in_runs

    def gather(self, cache, blocks):
        if len(blocks) <= CHUNK_BLOCKS:
            return super().gather(cache, blocks)
        return _Chunks([super(ChunkedPageMover, self).gather(cache, blocks[i:i + CHUNK_BLOCKS])
                        for i in range(0, len(blocks), CHUNK_BLOCKS)])

    def scatter(self, cache, blocks, sources):
        runs, others = {}, []
        for b, (src, row) in zip(blocks, sources):
            if isinstance(src, _Staged):
                runs.setdefault(id(src.run), (src.run, []))[1].append((b, src.row))
            else:
                others.append((b, (src, row)))
        t0 = time.perf_counter()
        for run, rows in runs.values():
            cache = self._scatter_run(cache, run, rows)
        if runs:
            self.counters["copy_in_s"] = self.counters.get("copy_in_s", 0.0) + \
                time.perf_counter() - t0
            self.counters["copy_in_runs"] = self.counters.get("copy_in_runs", 0) + len(runs)
        for i in range(0, len(others), CHUNK_BLOCKS):
            part = others[i:i + CHUNK_BLOCKS]
            cache = super().scatter(cache, [b for b, _ in part], [s for _, s in part])
        return cache

    def _scatter_run(self, cache, run, rows):
        """Copy rows of one run (kv [L, R, B, ...]) into device blocks: one call, with the
        transfer a reader thread started (or one now)."""
        data = run.dev
        r = (data if data is not None else run.kv).shape[1]
        if data is None and r != run_rows(r):  # not read by the tier (rare): pad on the host
            data = np.zeros((run.kv.shape[0], run_rows(r)) + run.kv.shape[2:], run.kv.dtype)
            data[:, :r] = run.kv
            r = data.shape[1]
        ids = np.full(r, self.num_pages, np.int32)  # rows nobody wants are dropped
        for b, row in rows:
            ids[row] = b
        if data is None:
            data = jax.device_put(run.kv)
        return self._scatter_packed(cache, jnp.asarray(ids), data)

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
    def _scatter_packed(self, cache, ids, packed):
        leaves, treedef = jax.tree.flatten(cache)
        out, k = [], 0
        for x, m in zip(leaves, self._mask(cache)):
            if m:
                x = x.at[ids].set(packed[k].astype(x.dtype), mode="drop")
                k += 1
            out.append(x)
        return jax.tree.unflatten(treedef, out)

    def warmup(self, cache):
        """Compile every chunk bucket of gather and every run shape of scatter (rows all
        dropped)."""
        host = super().gather(cache, [0]).materialize()
        n = 4
        while n <= CHUNK_BLOCKS:
            super().gather(cache, [0] * n).materialize()
            n *= 2
        for r in sorted({run_rows(n) for n in range(1, MAX_RUN + 1)}):
            kv = np.zeros((len(host), r) + host[0].shape[1:], host[0].dtype)
            cache = self._scatter_run(cache, Run(np.zeros(0, np.uint64), None, kv), [])
        return cache


class _Chunks:
    """Several gathered batches read as one (`materialize()` -> leaves over all rows)."""

    def __init__(self, parts):
        self.parts = parts
        self.host = None

    def materialize(self):
        if self.host is None:
            host = [p.materialize() for p in self.parts]
            self.host = [np.concatenate(xs) for xs in zip(*host)]
            self.parts = None
        return self.host
