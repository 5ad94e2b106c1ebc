"""The disk tier under the host tier, as the engine and scheduler see it (`kv_store_dir`).

Reads: before a request is admitted, the runs (files) it could hit at blocks that are neither
on the device nor in the host tier are read from the store by a thread pool (`prefetch`, called
for the next waiting requests while the device computes a step). A read is verified (checksum,
and the file's keys and tokens against the request's) before its blocks are *staged*; the
scheduler sees only staged blocks as hits (`contains`), so a bad file is a plain miss, never a
planned hit that fails. A read still in flight when its request is admitted is waited for; one
that was not started (the staging memory was full) is done then. Staged blocks are copied into
device blocks with the host tier's copy-ins (`get`), one transfer per run.

Staging memory: a reader thread sends its run to the device, so staged runs and reads in flight
hold device memory next to the KV pool. Both count in bytes of the runs' arrays (padded rows and
unwanted blocks included, `serving/tiers/kv_store_staging.py`) against `staging_bytes`
(`Config.kv_store.staging_gb`, which a default-sized KV pool leaves free), and so do the runs
copied in by the last step, until the next one begins. A prefetch starts no read past it (except
one when nothing is staged or in flight, for a run larger than the limit).
The one request a step admits without waiting for its reads (the scheduler does so when the step
has nothing else to run) reads what it lacks at admission: staging may exceed the limit by that
request's runs, freed when the next step begins. The oldest staged runs are dropped while
the limit is exceeded at the start of a step (a file longer than its estimate).

Writes: every block a step completes under its hash (`note_ready`; with `spans_only`, SSEP span
blocks only, so one-off questions do not fill the store) is gathered from the device at the
start of the next step (before anything can overwrite it), brought to the host by one thread as
soon as it is copied (so a slow disk keeps its backlog in host memory, not on the device) and
written by a writer thread, one file per run of consecutive blocks of one segment; `flush` waits
for all of them. A write that fails is a miss (serving/tiers/kv_store_failures.py): one warning per
flush, never an exception that costs the call its results.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import threading
import time
import warnings

import jax
import numpy as np

from serving.tiers.disk_store import DiskStore, namespace
from serving.tiers.kv_store_failures import WriteFailures
from serving.cache.kv_pool import staging_bytes
from serving.tiers.kv_store_buffers import RunBuffers
from serving.tiers.kv_store_staging import StagedBlocks
from serving.tiers.run_file import MAX_RUN, Run, run_rows


class _Want:
    """A run read for one sequence: the blocks it expects from `start` on (to its segment's end
    or its hit limit), their namespace and tokens."""

    __slots__ = ("start", "ns", "hashes", "confirm")

    def __init__(self, ns: str, hashes: list[int], confirm: bytes):
        self.start, self.ns, self.hashes, self.confirm = hashes[0], ns, hashes, confirm


def _matched(run: Run, want: _Want, block_bytes: int) -> int:
    """How many leading blocks of the run are the wanted ones (same keys, same tokens)."""
    k = min(run.n, len(want.hashes))
    same = run.hashes[:k] == np.asarray(want.hashes[:k], np.uint64)
    m = k if same.all() else int(np.argmin(same))
    if run.tokens[:m].tobytes() != want.confirm[:m * block_bytes]:  # a 64-bit hash collision
        mine = np.frombuffer(want.confirm[:m * block_bytes], np.int64).reshape(m, -1)
        m = int(np.argmin((run.tokens[:m] == mine).all(axis=1)))
    return m


class KVStoreTier:
    def __init__(self, store: DiskStore, keys, *, bytes_per_block: int, staging_bytes: int,
                 lookahead: int, spans_only: bool = False, read_workers: int | None = None,
                 write_workers: int = 4, send: bool = True, pinned: bool = False):
        read_workers = read_workers or min(16, max(4, os.cpu_count() or 4))  # page-cache copies
        # and checksums release the GIL: they scale with cores
        self.store = store
        self.keys = keys  # serving.cache.prefix_keys.PrefixKeys: block keys and tokens of a sequence
        self.spans_only = spans_only  # store (and look up) SSEP span blocks only
        self.block_bytes = 8 * keys.block_size  # a block's tokens as int64 bytes
        self.bytes_per_block = bytes_per_block  # of every paged layer (K and V)
        self.staging_bytes = staging_bytes  # device bytes of staged runs and reads in flight
        self.lookahead = lookahead
        self.send = send  # reader threads send each run to the device
        self.lock = threading.Lock()  # counters the reader threads add to
        # pinned (Config.kv_store.pinned) where the backend has it, else plain
        self.buffers = RunBuffers(2 * read_workers, pinned=pinned, required=False)
        self.staged = StagedBlocks()
        self.reads: dict[int, tuple[cf.Future, _Want]] = {}  # start hash -> read in flight
        self.queue: collections.deque[_Want] = collections.deque()  # no room to read yet
        self.queued: dict[int, _Want] = {}  # start hash -> want in `queue`
        self.pending: dict[int, int] = {}  # block hash -> start of the read expected to hold it
        self.inflight_bytes = 0  # estimated: run_rows of the wanted blocks (`_estimate`)
        self.peak_staging = 0  # the most staged + in-flight bytes seen
        self.readers = cf.ThreadPoolExecutor(read_workers, thread_name_prefix="kv-store-read")
        self.writers = cf.ThreadPoolExecutor(write_workers, thread_name_prefix="kv-store-write")
        # one thread brings gathered blocks to the host as soon as they are copied (the device
        # arrays are then freed; a backlog of disk writes waits in host memory)
        self.to_host = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-store-d2h")
        self.writes: list[cf.Future] = []  # to_host futures, each giving its write's future
        self.written: set[int] = set()  # hashes written or being written by this process
        self.to_write: list[tuple] = []  # (block, hash, tokens, ns, new run) gathered next step
        self.counters = dict(prefetched_runs=0, staged_hits=0, read_wait_s=0.0, sync_reads=0,
                             writes_queued=0, follow_up_reads=0, copy_in_s=0.0, copy_in_runs=0,
                             send_s=0.0, read_errors=0, pinned=self.buffers.pinned)
        self.failures = WriteFailures(self.counters)

    # -- the scheduler's lower tier ------------------------------------------------------------
    def contains(self, h) -> bool:
        if h is None:
            return False
        if h in self.staged:
            return True
        start = self.pending.get(h)
        while start is not None:  # wait for the read that should hold it (or read it now)
            t0 = time.perf_counter()
            if start in self.reads:
                fut, want = self.reads[start]
                run = fut.result()
            else:
                want = self.queued.pop(start)
                self.counters["sync_reads"] += 1
                run = self._read(want)
            self._harvest(want, run)
            self.counters["read_wait_s"] += time.perf_counter() - t0
            if h in self.staged:
                return True
            start = self.pending.get(h)  # a follow-up read may hold it
        return False

    def ready(self, seq) -> bool:
        """No read that the request waits for is still in flight or queued (the scheduler then
        admits it without blocking; a step with other work runs first otherwise)."""
        return not any(h in self.pending for hashes in seq.store.wants
                       for h in hashes)

    def get(self, h):
        self.counters["staged_hits"] += 1
        return self.staged.pop(h, copy_in=True), 0

    def _harvest(self, want: _Want, run: Run | None) -> None:
        """Stage the blocks of a finished read that the request wanted; read on where the run
        ended early (a span written in two steps is two files)."""
        if self.reads.pop(want.start, None) is not None:
            self.inflight_bytes -= self._estimate(want)
        for x in want.hashes:
            if self.pending.get(x) == want.start:
                del self.pending[x]
        m = 0 if run is None else _matched(run, want, self.block_bytes)
        for i in range(m):
            self.staged.put(want.hashes[i], run, i)
        self._note_peak()
        # read on from the next block that starts a file (the run ended early, or was bad)
        nxt = next((i for i in range(max(m, 1), len(want.hashes))
                    if self.store.has(want.hashes[i], want.ns)), None)
        if nxt is not None:
            self.counters["follow_up_reads"] += 1
            self._enqueue(_Want(want.ns, want.hashes[nxt:],
                                want.confirm[nxt * self.block_bytes:]))
            self._start_reads()

    # -- prefetch ------------------------------------------------------------------------------
    def begin_step(self, waiting, bm, host) -> None:
        """Release the last step's copied-in runs, collect finished reads, drop the oldest
        staged runs past the staging limit, and prefetch for the next waiting requests (the
        first step has had no earlier chance)."""
        self.staged.end_copies()
        for fut, want in list(self.reads.values()):
            if fut.done():
                self._harvest(want, fut.result())
        while self.staged.nbytes > self.staging_bytes:
            self.staged.drop_oldest_run()
        self.prefetch(waiting, bm, host)

    def prefetch(self, waiting, bm, host) -> None:
        """Find the runs in the store that the next `lookahead` waiting requests could hit (at
        blocks on no faster tier) and start reading them while the staging memory has room."""
        for k, seq in enumerate(waiting):
            if k >= self.lookahead:
                break
            if seq.store.scanned or seq.is_span_job:
                continue
            seq.store.scanned = True
            self._scan(seq, bm, host)
        self._start_reads()

    def _scan(self, seq, bm, host) -> None:
        hashes, ns, limit = self.keys.hashes(seq), namespace(seq.cache_salt), \
            self.keys.hit_limit(seq)
        lay, raw = seq.layout, self.keys.token_bytes(seq)
        starts = np.flatnonzero(lay.seg_start)
        seq.store.wants, j = [], 0
        while j < limit:
            h = hashes[j]
            if (self.spans_only and not _in_span(lay, j)) or h in bm.table or h in self.staged \
                    or h in self.pending or (host is not None and host.contains(h)) \
                    or not self.store.has(h, ns):
                j += 1
                continue
            nxt = starts[np.searchsorted(starts, j, side="right"):]
            end = min(limit, int(nxt[0]) if len(nxt) else limit)
            self._enqueue(_Want(ns, hashes[j:end], raw[j * self.block_bytes:
                                                        end * self.block_bytes]))
            seq.store.wants.append(hashes[j:end])
            j = end

    def _enqueue(self, want: _Want) -> None:
        for x in want.hashes:
            self.pending.setdefault(x, want.start)
        self.queue.append(want)
        self.queued[want.start] = want

    def _start_reads(self) -> None:
        """Start queued reads, oldest request first, while the staging memory has room (the
        rest are started as copy-ins free it, or read at admission)."""
        while self.queue:
            want = self.queue[0]
            if self.queued.get(want.start) is not want:
                self.queue.popleft()  # read at admission already
                continue
            size = self._estimate(want)
            if (self.reads or len(self.staged)) and \
                    self.inflight_bytes + self.staged.nbytes + size > self.staging_bytes:
                break
            self.queue.popleft()
            del self.queued[want.start]
            fut = self.readers.submit(self._read, want)
            self.reads[want.start] = (fut, want)
            self.inflight_bytes += size
            self.counters["prefetched_runs"] += 1
            self._note_peak()

    def _estimate(self, want: _Want) -> int:
        """Bytes a read will hold: the wanted blocks' rows, padded as read (one file holds at
        most MAX_RUN blocks; a longer file than wanted is counted once staged)."""
        return run_rows(min(len(want.hashes), MAX_RUN)) * self.bytes_per_block

    def _note_peak(self) -> None:
        self.peak_staging = max(self.peak_staging, self.staged.nbytes + self.inflight_bytes)

    def _read(self, want: _Want) -> Run | None:
        """A reader thread: read and verify the run, and send it to the device (the copy-in is
        then one scatter on device: the host side of the transfer runs here, in parallel, not
        on the engine's thread)."""
        taken = []

        def alloc(shape, dtype):
            taken.append(self.buffers.take(shape, dtype))
            return taken[-1]
        try:
            run = self.store.read(want.start, want.ns, pad=run_rows, alloc=alloc)
            if run is not None and self.send:
                t0 = time.perf_counter()
                run.dev, keep = self.buffers.send(run.kv)
                if not keep:
                    run.kv = None
                with self.lock:
                    self.counters["send_s"] += time.perf_counter() - t0
        except Exception as err:  # e.g. the device refused the transfer: a miss, not a stall
            with self.lock:
                self.counters["read_errors"] += 1
            warnings.warn(f"kv store: reading the run at {want.start:#x} failed ({err!r:.200}); "
                          "its blocks are recomputed", RuntimeWarning, stacklevel=2)
            run = None
        if run is None:  # absent, corrupt or failed: its buffers go back
            for a in taken:
                self.buffers.give(a)
        return run

    # -- writes --------------------------------------------------------------------------------
    def note_ready(self, batch, ready_before, bm) -> None:
        """After scheduler.advance: queue the blocks each sequence completed under its key
        (span blocks only with `spans_only`), marking where a new run (file) starts."""
        for e, j0 in zip(batch, ready_before):
            seq = e.seq
            hashes, lay, prev = seq.block_hashes or (), seq.layout, None
            for j in range(j0, min(seq.ready_ptr, len(hashes))):
                if j not in seq.owned or (self.spans_only and not _in_span(lay, j)):
                    continue
                b, h = seq.block_table[j], hashes[j]
                if bm.hash[b] != h or not bm.ready[b] or h in self.written:
                    continue
                self.written.add(h)
                new = prev != j - 1 or (j < len(lay.seg_start) and bool(lay.seg_start[j]))
                self.to_write.append((b, h, bm.confirm[b], namespace(seq.cache_salt), new))
                prev = j

    def dispatch_writes(self, mover, cache) -> None:
        """Gather the queued blocks (a device call ordered before the step that follows) and
        hand them to a writer thread."""
        if not self.to_write:
            return
        rows, self.to_write = self.to_write, []
        batch = mover.gather(cache, [b for b, *_ in rows])
        self.writes = [f for f in self.writes if not _written(f)]
        self.writes.append(self.to_host.submit(self._to_host, batch, rows))
        self.counters["writes_queued"] += len(rows)

    def _to_host(self, batch, rows) -> cf.Future | None:
        """The d2h thread: wait for the gathered blocks on the host, then queue their files
        (None: they never reached the host, a failed write)."""
        try:
            host = batch.materialize()
        except Exception as err:
            self.failures.record(len(rows), err)
            return None
        return self.writers.submit(self._write, host, rows)

    def _write(self, host, rows) -> None:
        cuts = [r for r, row in enumerate(rows) if r == 0 or row[4] or row[3] != rows[r - 1][3]]
        for r0, r1 in zip(cuts, cuts[1:] + [len(rows)]):
            part = rows[r0:r1]
            try:
                self.store.write(part[0][3], [h for _, h, *_ in part],
                                 b"".join(t for _, _, t, *_ in part), [a[r0:r1] for a in host])
            except Exception as err:  # full, read-only or damaged: these blocks miss
                self.failures.record(r1 - r0, err)

    def flush(self, mover, cache) -> None:
        """Write everything queued so far and wait for the files. Writes that failed are one
        warning (the blocks are not stored), never an exception: the results are made."""
        queued = len(self.to_write)
        try:
            self.dispatch_writes(mover, cache)
        except Exception as err:  # the blocks could not be gathered from the device
            self.to_write = []
            self.failures.record(queued, err)
        writes, self.writes = self.writes, []
        for f in writes:
            write = f.result()
            if write is not None:
                write.result()
        self.failures.report()

    def stats(self) -> dict:
        out = self.store.stats()
        out.update(self.counters, staged_blocks=len(self.staged), reads_in_flight=len(self.reads),
                   pending_blocks=len(self.pending), staged_bytes=self.staged.nbytes,
                   staging_bytes_limit=self.staging_bytes, peak_staging_bytes=self.peak_staging)
        return out


def _written(f: cf.Future) -> bool:
    """A write (a to_host future) is over: its copy to the host failed, or its file write
    finished (failures are recorded by the threads and told at `flush`)."""
    return f.done() and (f.result() is None or f.result().done())


def _in_span(lay, j: int) -> bool:
    """Block j lies in an SSEP span (generated blocks extend the prompt's last segment)."""
    sb = lay.span_block
    return bool(sb[j]) if j < len(sb) else bool(len(sb) and sb[-1])


class LowerTiers:
    """Host tier, then the disk tier, behind the host tier's `contains` / `get`."""

    def __init__(self, host, disk: KVStoreTier):
        self.host = host
        self.disk = disk

    def contains(self, h) -> bool:
        return (self.host is not None and self.host.contains(h)) or self.disk.contains(h)

    def ready(self, seq) -> bool:
        return self.disk.ready(seq)

    def get(self, h):
        if self.host is not None and self.host.contains(h):
            return self.host.get(h)
        return self.disk.get(h)


def open_kv_store(config, cache, num_blocks: int, keys, *, fingerprint: str, model_name: str,
                  markers: dict, bytes_per_block: int) -> KVStoreTier:
    """The disk tier over `config.kv_store.dir` (raises StoreMismatch, a ValueError, when the
    folder was made by another model or settings)."""
    from serving.tiers.disk_store import StoreIdentity
    from serving.cache.kv_pool import page_mask
    leaves = tuple((tuple(x.shape[1:]), x.dtype.name) for x, m in
                   zip(jax.tree.leaves(cache), page_mask(cache, num_blocks, config.block_size)) if m)
    identity = StoreIdentity(
        model=fingerprint, model_name=model_name, block_size=config.block_size,
        kv_mode=config.kv_mode, hash_algo=config.hash_algo,
        markers=(markers["pad_token_id"], markers["ssep_token_id"], markers["pdep_token_id"]),
        leaves=leaves)
    store = DiskStore(config.kv_store.dir, identity, int(config.kv_store.gb * (1 << 30)))
    return KVStoreTier(store, keys, bytes_per_block=bytes_per_block,
                       staging_bytes=staging_bytes(config),
                       lookahead=config.max_num_seqs, spans_only=config.kv_store.spans_only,
                       pinned=config.kv_store.pinned)
