"""The engine's lower cache tiers, set up once at start: the host tier under `cpu_offload_gb`
(with its page mover) and the persistent span store under `kv_store_dir` (Config). Each returns
what the engine keeps; per step only `move_pages` runs (and `prefetch_stored` as requests are
queued)."""

from __future__ import annotations

from serving.tiers.disk_store import open_root
from serving.tiers.fingerprint import model_fingerprint
from serving.tiers.kv_store_moves import ChunkedPageMover
from serving.tiers.kv_store_tier import LowerTiers, open_kv_store
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


def host_tier(config, num_blocks: int, bytes_per_block: int, hybrid: bool):
    """(HostKVTier, PageMover) when `cpu_offload_gb` > 0 and prefix caching is on, else
    (None, None). Hybrid models keep the other half of cpu_offload_gb for recurrent
    checkpoints."""
    if not (config.cpu_offload_gb > 0 and config.enable_prefix_caching):
        return None, None
    cap = int(config.cpu_offload_gb * (1 << 30) / (2 if hybrid else 1)) // max(bytes_per_block, 1)
    return HostKVTier(cap), PageMover(num_blocks, config.block_size)


def span_store(config, cache, num_blocks: int, keys, fingerprint, *, model_name, markers,
               bytes_per_block: int, offload):
    """(store, the scheduler's lower tiers, the page mover) for `kv_store_dir`: the store sits
    under the host tier (`offload`, or none) and moves pages in chunks."""
    store = open_kv_store(config, cache, num_blocks, keys, fingerprint=fingerprint,
                          model_name=model_name, markers=markers,
                          bytes_per_block=bytes_per_block)
    mover = ChunkedPageMover(num_blocks, config.block_size, counters=store.counters)
    return store, LowerTiers(offload, store), mover


def move_pages(cache, mover, scheduler, offload, kv_store, evicted):
    """One step's page moves between the device pool and the lower tiers; returns the cache.
    The copy-ins the scheduler planned are looked up before the step's evictions enter the host
    tier: a put may drop the tier's oldest entries, which can be exactly the planned ones.
    Evicted pages (block, hash, confirm) are gathered before the scatter, which may reuse their
    device blocks; span-store writes are dispatched before copy-ins overwrite any block. Blocks
    copied in leave the block manager's fresh record: the step zeroes fresh pages first thing,
    which would wipe a copy dispatched before it (serving/cache/page_zeroing.py)."""
    if kv_store is not None:
        kv_store.dispatch_writes(mover, cache)
    copy_in = scheduler.pending_copy_in
    sources = [scheduler.offload.get(h) for _, h in copy_in]
    if evicted:
        batch = mover.gather(cache, [b for b, _, _ in evicted])
        offload.pending.append(batch)
        for row, (_, h, confirm) in enumerate(evicted):
            offload.put(h, confirm, batch, row)
    if copy_in:
        blocks = [b for b, _ in copy_in]
        cache = mover.scatter(cache, blocks, sources)
        scheduler.bm.filled(blocks)  # the step must not zero what was just copied in
        scheduler.pending_copy_in = []
    return cache


def prefetch_stored(engine) -> None:
    """Start the span-store reads of the waiting requests now, not at the next step (a batch
    job calls it after each request it queues, so the reads overlap tokenizing the next ones).
    No effect without a store."""
    if engine.kv_store is not None:
        engine.kv_store.prefetch(engine.scheduler.waiting, engine.bm, engine.offload)
