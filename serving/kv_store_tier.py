"""The disk tier under the host tier, as the engine and scheduler see it (`kv_store_dir`).

Reads: before a request is admitted, the blocks it could hit that are neither on the device nor
in the host tier are read from the store by a thread pool (`prefetch`, called for the next
waiting requests while the device computes a step). A read is verified (checksum, and the file's
tokens against the request's) before the block is *staged*; the scheduler sees only staged
blocks as hits (`contains`), so a bad file is a plain miss, never a planned hit that fails. A read
still in flight when its request is admitted is waited for; a block that was not read ahead (the
staging memory was full) is read then. Staged blocks are copied into device blocks with the host
tier's copy-ins (`get`).

Writes: every block a step completes under its hash (`note_ready`) is gathered from the device at
the start of the next step (before anything can overwrite it) and written by a writer thread;
`flush` waits for all of them.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.disk_store import DiskStore, namespace
from serving.offload import PageMover, _bucket

CHUNK_BLOCKS = 256  # page moves per jitted call: bounded compiles (4..256), warmed up front


class _Staged:
    """A staged block: its pages [L, B, ...] as read; `materialize()[leaf][row]` is the host
    tier's batch shape (for copy-ins mixed with host-tier blocks)."""

    def __init__(self, kv):
        self.kv = kv

    def materialize(self):
        return [self.kv[i][None] for i in range(self.kv.shape[0])]


class KVStoreTier:
    def __init__(self, store: DiskStore, keys, *, bytes_per_block: int, staging_bytes: int,
                 lookahead: int, read_workers: int = 8, write_workers: int = 2):
        self.store = store
        self.keys = keys  # serving.prefix_keys.PrefixKeys: block keys and tokens of a sequence
        self.bytes_per_block = max(bytes_per_block, 1)
        self.staging_blocks = max(staging_bytes // self.bytes_per_block, 1)
        self.lookahead = lookahead
        self.staged: collections.OrderedDict[int, list] = collections.OrderedDict()
        self.reads: dict[int, cf.Future] = {}
        self.wanted: dict[int, tuple[str, bytes]] = {}  # hash -> (ns, tokens) of stored blocks
        # that waiting requests could hit (read ahead, or at admission if not staged by then)
        self.unread: collections.deque[int] = collections.deque()  # wanted, no read started
        self.readers = cf.ThreadPoolExecutor(read_workers, thread_name_prefix="kv-store-read")
        self.writers = cf.ThreadPoolExecutor(write_workers, thread_name_prefix="kv-store-write")
        self.writes: list[cf.Future] = []
        self.queued: set[int] = set()  # hashes written or being written by this process
        self.to_write: list[tuple] = []  # (block, hash, tokens, ns) gathered next step
        self.counters = dict(prefetched=0, staged_hits=0, read_wait_s=0.0, sync_reads=0,
                             writes_queued=0)

    # -- the scheduler's lower tier ------------------------------------------------------------
    def contains(self, h) -> bool:
        if h is None:
            return False
        if h in self.staged:
            return True
        fut = self.reads.get(h)
        if fut is None and h not in self.wanted:
            return False
        t0 = time.perf_counter()
        if fut is not None:
            self._harvest(h, fut.result())
        else:  # not read ahead: read it now
            self.counters["sync_reads"] += 1
            ns, tokens = self.wanted[h]
            self._harvest(h, self.store.read(h, ns, tokens))
        self.counters["read_wait_s"] += time.perf_counter() - t0
        if h not in self.staged:
            self.wanted.pop(h, None)  # corrupt or gone: a miss from now on
            return False
        return True

    def get(self, h):
        self.counters["staged_hits"] += 1
        self.wanted.pop(h, None)
        return _Staged(self.staged.pop(h)), 0

    def _harvest(self, h, leaves) -> None:
        self.reads.pop(h, None)
        if leaves is not None:
            self.staged[h] = leaves

    # -- prefetch ------------------------------------------------------------------------------
    def begin_step(self, waiting, bm, host) -> None:
        """Collect finished reads, drop the oldest staged blocks past the staging size, and
        prefetch for the next waiting requests (the first step has had no earlier chance)."""
        for h, fut in list(self.reads.items()):
            if fut.done():
                self._harvest(h, fut.result())
        while len(self.staged) > self.staging_blocks:
            self.staged.popitem(last=False)
        self.prefetch(waiting, bm, host)

    def prefetch(self, waiting, bm, host) -> None:
        """Note the blocks the next `lookahead` waiting requests could hit that are on no faster
        tier and in the store, and start reading them while the staging memory has room."""
        if len(self.wanted) > 64 * self.staging_blocks:  # entries nobody came back for
            self.wanted = {h: v for h, v in self.wanted.items() if h in self.reads}
        for k, seq in enumerate(waiting):
            if k >= self.lookahead:
                break
            if getattr(seq, "kv_store_scanned", False) or seq.is_span_job:
                continue
            seq.kv_store_scanned = True
            hashes, ns = self.keys.hashes(seq), namespace(seq.cache_salt)
            for j in range(self.keys.hit_limit(seq)):
                h = hashes[j]
                if (h in bm.table or (host is not None and host.contains(h)) or h in self.staged
                        or h in self.reads or not self.store.has(h, ns)):
                    continue
                self.wanted[h] = (ns, self.keys.confirm(seq, j))
                self.unread.append(h)
        self._start_reads()

    def _start_reads(self) -> None:
        """Read wanted blocks, oldest request first, while the staging memory has room."""
        room = self.staging_blocks - len(self.staged) - len(self.reads)
        while room > 0 and self.unread:
            h = self.unread.popleft()
            if h not in self.wanted or h in self.staged or h in self.reads:
                continue
            self.reads[h] = self.readers.submit(self.store.read, h, *self.wanted[h])
            self.counters["prefetched"] += 1
            room -= 1

    # -- writes --------------------------------------------------------------------------------
    def note_ready(self, batch, ready_before, bm) -> None:
        """After scheduler.advance: queue the blocks each sequence completed under its key."""
        for e, j0 in zip(batch, ready_before):
            seq = e.seq
            hashes = seq.block_hashes or ()
            for j in range(j0, min(seq.ready_ptr, len(hashes))):
                if j not in seq.owned:
                    continue
                b, h = seq.block_table[j], hashes[j]
                if bm.hash[b] != h or not bm.ready[b] or h in self.queued:
                    continue
                self.queued.add(h)
                self.to_write.append((b, h, bm.confirm[b], namespace(seq.cache_salt)))

    def dispatch_writes(self, mover, cache) -> None:
        """Gather the queued blocks (a device call ordered before the step that follows) and
        hand them to a writer thread."""
        if not self.to_write:
            return
        rows, self.to_write = self.to_write, []
        batch = mover.gather(cache, [b for b, *_ in rows])
        self.writes = [f for f in self.writes if not f.done()]
        self.writes.append(self.writers.submit(self._write, batch, rows))
        self.counters["writes_queued"] += len(rows)

    def _write(self, batch, rows) -> None:
        host = batch.materialize()
        for row, (_, h, tokens, ns) in enumerate(rows):
            self.store.write(h, ns, [a[row] for a in host], tokens)

    def flush(self, mover, cache) -> None:
        """Write everything queued so far and wait for the files (errors surface here)."""
        self.dispatch_writes(mover, cache)
        for f in self.writes:
            f.result()
        self.writes = []

    def stats(self) -> dict:
        out = self.store.stats()
        out.update(self.counters, staged_blocks=len(self.staged), reads_in_flight=len(self.reads),
                   wanted_blocks=len(self.wanted))
        return out


class ChunkedPageMover(PageMover):
    """PageMover in chunks of at most CHUNK_BLOCKS pages (a warm store copies in thousands of
    blocks per step; power-of-two buckets up to that would each compile mid-run), with a
    vectorized host side for staged store blocks (one concatenate per leaf, not a copy per
    block and leaf)."""

    def gather(self, cache, blocks):
        if len(blocks) <= CHUNK_BLOCKS:
            return super().gather(cache, blocks)
        return _Chunks([super(ChunkedPageMover, self).gather(cache, blocks[i:i + CHUNK_BLOCKS])
                        for i in range(0, len(blocks), CHUNK_BLOCKS)])

    def scatter(self, cache, blocks, sources):
        for i in range(0, len(blocks), CHUNK_BLOCKS):
            part, src = blocks[i:i + CHUNK_BLOCKS], sources[i:i + CHUNK_BLOCKS]
            if all(isinstance(b, _Staged) for b, _ in src):
                cache = self._scatter_staged(cache, part, [b.kv for b, _ in src])
            else:
                cache = super().scatter(cache, part, src)
        return cache

    def _scatter_staged(self, cache, blocks, kvs):
        """One host stack and one transfer per chunk; the leaves are split on device."""
        n, nb = len(blocks), _bucket(len(blocks))
        ids = np.full(nb, self.num_pages, np.int32)  # out of range rows are dropped
        ids[:n] = blocks
        packed = np.empty((nb,) + kvs[0].shape, kvs[0].dtype)  # [n, L, B, ...]
        for k, kv in enumerate(kvs):
            packed[k] = kv
        packed[n:] = 0
        return self._scatter_packed(cache, jnp.asarray(ids), jnp.asarray(packed))

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
    def _scatter_packed(self, cache, ids, packed):
        leaves, treedef = jax.tree.flatten(cache)
        out, k = [], 0
        for x in leaves:
            if self._is_page(x):
                x = x.at[ids].set(packed[:, k].astype(x.dtype), mode="drop")
                k += 1
            out.append(x)
        return jax.tree.unflatten(treedef, out)

    def warmup(self, cache):
        """Compile every chunk bucket of gather and scatter (scatter rows all dropped)."""
        host = super().gather(cache, [0]).materialize()
        kv = np.stack([a[0] for a in host])  # [L, B, ...]
        n = 4
        while n <= CHUNK_BLOCKS:
            super().gather(cache, [0] * n).materialize()
            cache = self._scatter_staged(cache, [self.num_pages] * n, [kv] * n)
            n *= 2
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


class LowerTiers:
    """Host tier, then the disk tier, behind the host tier's `contains` / `get`."""

    def __init__(self, host, disk: KVStoreTier):
        self.host = host
        self.disk = disk

    def contains(self, h) -> bool:
        return (self.host is not None and self.host.contains(h)) or self.disk.contains(h)

    def get(self, h):
        if self.host is not None and self.host.contains(h):
            return self.host.get(h)
        return self.disk.get(h)


STAGING_BYTES = 16 << 30  # verified blocks held in host memory ahead of their copy-in (at
# most the blocks of the next max_num_seqs waiting requests)


def open_kv_store(config, cache, num_blocks: int, keys, *, fingerprint: str, model_name: str,
                  markers: dict, bytes_per_block: int) -> KVStoreTier:
    """The disk tier over `config.kv_store_dir` (raises StoreMismatch, a ValueError, when the
    folder was made by another model or settings)."""
    from serving.disk_store import StoreIdentity
    from serving.offload import page_leaf
    import jax
    leaves = tuple((tuple(x.shape[1:]), x.dtype.name) for x in jax.tree.leaves(cache)
                   if page_leaf(x, num_blocks, config.block_size))
    identity = StoreIdentity(
        model=fingerprint, model_name=model_name, block_size=config.block_size,
        kv_mode=config.kv_mode, hash_algo=config.hash_algo,
        markers=(markers["pad_token_id"], markers["ssep_token_id"], markers["pdep_token_id"]),
        leaves=leaves)
    store = DiskStore(config.kv_store_dir, identity, int(config.kv_store_gb * (1 << 30)))
    return KVStoreTier(store, keys, bytes_per_block=bytes_per_block, staging_bytes=STAGING_BYTES,
                       lookahead=config.max_num_seqs)
