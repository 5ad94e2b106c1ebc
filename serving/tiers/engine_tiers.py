"""The engine's lower cache tiers, set up once at start: the host tier under `cpu_offload_gb`
(with its page mover) and the persistent span store under `kv_store_dir` (Config), as one
`TierSet` the cache manager (serving/cache/manager.py) drives each step."""

from __future__ import annotations

from serving.tiers.disk_store import open_root
from serving.tiers.fingerprint import model_fingerprint
from serving.tiers.kv_store_moves import ChunkedPageMover
from serving.tiers.kv_store_tier import KVStoreTier, LowerTiers, open_kv_store
from serving.tiers.offload import HostKVTier, PageMover


def store_fingerprint(config, loaded, dtype, hybrid: bool):
    """The model fingerprint a span store is keyed by (None without `kv_store_dir`): every
    byte of the checkpoint files the params came from (`loaded.weight_files`, digests cached in
    the store folder), else of the loaded params before the runner fuses them. Hybrid models,
    or a kv_store_dir that is not a folder: ValueError."""
    if config.kv_store.dir is None:
        return None
    if hybrid:
        raise ValueError("kv_store_dir: the span store holds attention KV blocks only; a "
                         "hybrid model's recurrent checkpoints are not stored on disk yet")
    root = open_root(config.kv_store.dir)  # not a folder: a ValueError before any work
    return model_fingerprint(loaded.cfg, loaded.params, dtype, files=loaded.weight_files,
                             cache_dir=root)


def lower_tiers(config, cache, num_blocks: int, keys, fingerprint, *, bytes_per_block: int,
                hybrid: bool, model_name, markers):
    """The cache manager's lower tiers (serving/cache/manager.py), or None without any: the host
    tier when `cpu_offload_gb` > 0 and prefix caching is on (hybrid models keep the other half
    of cpu_offload_gb for recurrent checkpoints), and under it the span store when `fingerprint`
    (kv_store_dir) is given, whose pages move in chunks."""
    host = None
    if config.cpu_offload_gb > 0 and config.enable_prefix_caching:
        share = 2 if hybrid else 1
        host = HostKVTier(int(config.cpu_offload_gb * (1 << 30) / share)
                          // max(bytes_per_block, 1))
    if fingerprint is None:
        return None if host is None else TierSet(host, PageMover(num_blocks, config.block_size))
    store = open_kv_store(config, cache, num_blocks, keys, fingerprint=fingerprint,
                          model_name=model_name, markers=markers,
                          bytes_per_block=bytes_per_block)
    mover = ChunkedPageMover(num_blocks, config.block_size, counters=store.counters)
    return TierSet(host, mover, store)


class TierSet:
    """The host tier (or None) and the span store (or None) under the device pool, with the
    page mover between them: the `tiers` part of the cache manager."""

    def __init__(self, host: HostKVTier | None, mover, store: KVStoreTier | None = None):
        self.host, self.mover, self.store = host, mover, store
        self.lookup = host if store is None else LowerTiers(host, store)  # admission asks it

    def detach_store(self) -> None:
        """The span store is neither read nor written from now on (a weights update)."""
        self.store = None
        self.lookup = self.host

    def begin_step(self, waiting, bm) -> None:
        if self.store is not None:
            self.store.begin_step(waiting, bm, self.host)

    def prefetch(self, waiting, bm) -> None:
        if self.store is not None:
            self.store.prefetch(waiting, bm, self.host)

    def ready_marks(self, batch):
        """Each row's sequence's published-block mark before the advance (store only)."""
        return None if self.store is None else [e.seq.ready_ptr for e in batch]

    def after_advance(self, batch, ready_before, waiting, bm) -> None:
        """Queue the blocks the step completed for the store, read ahead for the waiting."""
        if self.store is not None:
            self.store.note_ready(batch, ready_before, bm)
            self.store.prefetch(waiting, bm, self.host)

    def move_pages(self, cache, bm, lookup, copy_in, evicted):
        """One step's page moves between the device pool and the lower tiers; returns the
        cache. The copy-ins planned are looked up (`lookup`) before the step's evictions enter
        the host tier: a put may drop the tier's oldest entries, which can be exactly the
        planned ones. Evicted pages (block, hash, confirm) are gathered before the scatter,
        which may reuse their device blocks; span-store writes are dispatched before copy-ins
        overwrite any block. Blocks copied in leave the block manager's fresh record: the step
        zeroes fresh pages first thing, which would wipe a copy dispatched before it
        (serving/cache/page_zeroing.py)."""
        mover, host = self.mover, self.host
        if self.store is not None:
            self.store.dispatch_writes(mover, cache)
        sources = [lookup.get(h) for _, h in copy_in]
        if evicted:
            batch = mover.gather(cache, [b for b, _, _ in evicted])
            host.pending.append(batch)
            for row, (_, h, confirm) in enumerate(evicted):
                host.put(h, confirm, batch, row)
        if copy_in:
            blocks = [b for b, _ in copy_in]
            cache = mover.scatter(cache, blocks, sources)
            bm.filled(blocks)  # the step must not zero what was just copied in
        return cache

    def flush(self, cache) -> None:
        self.store.flush(self.mover, cache)

    def warmup(self, cache):
        return self.mover.warmup(cache)

    def forget(self) -> None:
        """Forget every host-tier block (a prefix-cache reset)."""
        if self.host is not None:
            self.host.entries.clear()

    def drop_unverified(self) -> None:
        """After a failed device step: host copies not yet read back hold unknown pages."""
        tier = self.host
        if tier is not None and tier.pending:
            lost = {id(batch) for batch in tier.pending}
            for h in [h for h, (_, batch, _) in tier.entries.items() if id(batch) in lost]:
                del tier.entries[h]
            tier.pending = []


def prefetch_stored(engine) -> None:
    """Start the span-store reads of the waiting requests now, not at the next step (a batch
    job calls it after each request it queues, so the reads overlap tokenizing the next ones).
    No effect without a store."""
    engine.cache.prefetch(engine.scheduler.waiting)
