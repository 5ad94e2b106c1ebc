"""The cache manager: the one object in front of the scheduler that owns every cached thing.

It owns the paged block pool (BlockManager), the blocks' prefix keys (PrefixKeys), the lower
tiers under the pool (host tier, span store, their page mover; `tiers`, built by
serving/tiers/engine_tiers.py) with this step's planned copy-ins and evicted pages, and for hybrid
models the recurrent part (`recurrent`: checkpoints and span maps, serving/hybrid/
recurrent_part.py). The tier and recurrent parts are handed in by the engine (this package
imports neither), typed by what they do:

  tiers:     lookup (contains/get[/ready]), host, store, begin_step, move_pages, ready_marks,
             after_advance, prefetch, flush, warmup, forget, drop_unverified, detach_store, stats
  recurrent: caches, plan_admission, commit, cancel, release, chunk_stop, cut_chunk, annotate,
             after_launch, move_slots, abandon_step, drop_dependent, stats, cache

The scheduler sees `admit`, `release`, `plan_chunk`, `annotate`, `num_free`/`append_block`,
`advance_many`, `span_jobs_for`, `ready_to_admit`, `prepare`; the engine `begin_step`,
`before_launch`, `after_launch`, `ready_marks`/`after_advance`, `flush`, `reset`, `abandon_step`
(recovery) and `stats`. Admission is one routine for every model (serving/cache/admission.py):
a part plans, the manager counts, shares, allocates, registers, queues copy-ins and seats.
"""

from __future__ import annotations

from serving.cache import admission, block_manager, chunks, span_jobs
from serving.cache.admission import AdmissionPlan, Refused
from serving.cache.block_manager import BlockManager


class CacheManager:
    def __init__(self, config, num_blocks: int, keys, *, tiers=None, recurrent=None):
        self.config = config
        self.block_size = config.block_size
        self.keys = keys  # PrefixKeys (its `caching` says whether blocks are cached at all)
        self.caching = keys.caching
        self.tiers = tiers
        self.offload = None if tiers is None else tiers.lookup  # what admission asks
        self.recurrent = recurrent
        on_evict = None
        if self.host is not None:  # a ready block evicted for good goes to the host tier
            on_evict = self._evicted_page
        elif recurrent is not None and recurrent.caches:  # checkpoints above it die too
            on_evict = self._dropped_page
        self.bm = BlockManager(num_blocks, config.block_size,
                               enable_caching=config.enable_prefix_caching, on_evict=on_evict)
        self.pending_copy_in: list[tuple[int, int]] = []  # (block, key) copied in this step
        self.evicted: list[tuple[int, int, bytes]] = []  # (block, key, confirm) this step
        self.seated: dict[int, object] = {}  # seq_id -> admitted sequence holding blocks

    @property
    def host(self):
        """The host tier (HostKVTier) or None."""
        return None if self.tiers is None else self.tiers.host

    @property
    def store(self):
        """The span store (KVStoreTier) or None."""
        return None if self.tiers is None else self.tiers.store

    def _evicted_page(self, block, h, confirm) -> None:
        self.evicted.append((block, h, confirm))

    def _dropped_page(self, block, h, confirm) -> None:
        self.recurrent.drop_dependent(h)

    # -- the scheduler's side ------------------------------------------------------------------
    def admit(self, seq, seats: list[int]) -> bool | Refused:
        """Admit `seq` into one of `seats` if its blocks fit (watermark kept, span jobs aside):
        the one admission routine for every model. True, or a falsy Refused saying
        why not (FULL: no seat or blocks; WAITS: work it needs is in flight); a refusal changes
        nothing."""
        if not seats:
            return Refused.FULL
        plan = self._plan(seq)
        if plan is None:  # the recurrent part waits (a checkpoint or span on its way)
            return Refused.WAITS
        hits = plan.hits()
        # a cached request's ~2,000 hits as one array, for the count, the share and the table:
        # the plan's (its spans' remembered arrays), else converted once here
        arr = plan.hits_array
        if arr is None and len(hits) >= block_manager.BULK:
            arr = block_manager.block_array(hits)
        spare = self.bm.num_free - self.config.watermark_blocks * (not seq.is_span_job)
        if plan.blocks_needed(self.bm, hits, arr) > spare:
            self._cancel(plan)
            return Refused.FULL
        self.fill_table(seq, plan, hits, arr)
        if plan.detail is not None:
            self.recurrent.commit(self, seq, plan)
        admission.seat(seq, seats, plan.resume)
        self.seated[seq.seq_id] = seq
        return True

    def _plan(self, seq) -> AdmissionPlan | None:
        if self.recurrent is not None and self.recurrent.caches:
            return self.recurrent.plan_admission(self, seq)
        keys = self.keys
        blocks, misses, host, arr = keys.admission_plan(seq, self.bm, keys.hit_limit(seq),
                                                        self.offload)
        return AdmissionPlan(blocks, misses, host, hits_array=arr)

    def _cancel(self, plan: AdmissionPlan) -> None:
        if plan.detail is not None:
            self.recurrent.cancel(plan)

    def fill_table(self, seq, plan: AdmissionPlan, hits: list[int], arr=None) -> None:
        """Share the plan's `hits` (`arr`: them as an int64 array, or None), then fill the block
        table (admission.fill_table); on an exception part way, everything taken is given back
        (the sequence is as it was) and the plan's pins released. Sets num_cached_tokens on a
        first admission."""
        shared, empty = [], not seq.block_table
        try:
            # take every planned hit off the free list before allocating: an allocation evicts
            # the least recently freed block, which may be a cached block planned as a later hit
            distinct = self.bm.share_many(hits, arr)  # shares none if it raises
            shared = hits
            cached = admission.fill_table(self.bm, self.keys, seq, plan, hits,
                                          self.pending_copy_in, self.offload)
        except BaseException:
            admission.undo_fill(self.bm, seq, plan, shared, self.pending_copy_in)
            self._cancel(plan)
            raise
        if arr is not None and empty:
            admission.seed_table_array(seq, plan, arr)
        # distinct hits, and every other block allocated (so held by no one before): no block
        # repeats in this table while it is only appended to (append_block allocates too)
        seq.memo.distinct_table = seq.block_table if empty and distinct else None
        if not seq.ever_admitted:
            seq.num_cached_tokens = cached * self.block_size

    def release(self, seq) -> None:
        """`seq` leaves (preempted, finished, aborted): its blocks and pins go."""
        if self.recurrent is not None:
            self.recurrent.release(seq)
        table = seq.block_table
        self.bm.release(table, seq.seq_id,
                        seq.table_array() if len(table) >= block_manager.BULK else None,
                        distinct=seq.memo.distinct_table is table)
        seq.memo.distinct_table = None
        seq.block_table = []
        seq.owned = set()
        self.seated.pop(seq.seq_id, None)

    def plan_chunk(self, seq, budget: int, stop_at: int | None = None):
        """Token indices `seq` computes next (at most `budget` valid ones, not past `stop_at`)
        and the new frontier (serving/cache/chunks.py; the recurrent part may stop it sooner)."""
        rec = self.recurrent
        if rec is not None:
            stop_at = rec.chunk_stop(seq, stop_at, budget)
        total = len(seq) if stop_at is None else min(stop_at, len(seq))
        idx, frontier = chunks.plan_chunk(self.bm, seq, budget, total, self.block_size)
        if rec is not None:
            idx, frontier = rec.cut_chunk(seq, idx, frontier)
        return idx, frontier

    @property
    def span_capture(self):
        """The capture policy of a hybrid model's span maps (serving/hybrid/span_capture.py), or
        None (no span-map cache)."""
        cache = None if self.recurrent is None else self.recurrent.cache
        spans = None if cache is None else cache.spans
        return None if spans is None else spans.capture

    def note_request(self, seq) -> None:
        """A request was added to the engine (hybrid spans: the capture policy counts them)."""
        if self.recurrent is not None:
            self.recurrent.note_request(self, seq)

    def annotate(self, entry) -> None:
        """A scheduled chunk's restore, checkpoint and span-map fields (hybrid models)."""
        if self.recurrent is not None:
            self.recurrent.annotate(self, entry)

    @property
    def num_free(self) -> int:
        return self.bm.num_free

    def append_block(self, seq) -> bool:
        """Decode growth: one new owned block at the end of `seq`'s table; False if none is
        free (the scheduler then preempts)."""
        if self.bm.num_free == 0:
            return False
        seq.block_table.append(self.bm.allocate())
        seq.owned.add(len(seq.block_table) - 1)
        return True

    def advance_many(self, seqs) -> None:
        """The step's sequences' frontiers moved: publish the blocks each completed
        (chunks.publish_computed), in order; one call per step."""
        bm, keys, caching = self.bm, self.keys, self.caching
        for seq in seqs:
            chunks.publish_computed(bm, keys, seq, caching)

    def span_jobs_for(self, seq) -> list:
        """isps: span jobs for `seq`'s spans nobody has cached or is computing."""
        return span_jobs.jobs_for(seq, self.block_size, self.keys, self.bm, self.offload,
                                  self.keys.markers)

    def ready_to_admit(self, seq) -> bool:
        """False while the span store still reads `seq`'s stored blocks."""
        ready = getattr(self.offload, "ready", None)
        return ready is None or ready(seq)

    def prepare(self, seq) -> None:
        """Hash `seq`'s prompt blocks ahead of its admission."""
        self.keys.hashes(seq)

    # -- the engine's side ---------------------------------------------------------------------
    def begin_step(self, waiting) -> None:
        """Before scheduling: the span store's reads of the waiting requests that are done."""
        self.pending_copy_in = []
        if self.tiers is not None:
            self.tiers.begin_step(waiting, self.bm)

    def before_launch(self, runner) -> None:
        """The scheduled step's page moves (lower tiers) and checkpoint/span-map slot moves,
        applied to the runner's pools before its launch."""
        if self.tiers is not None:
            evicted, self.evicted = self.evicted, []
            runner.cache = self.tiers.move_pages(runner.cache, self.bm, self.offload,
                                                 self.pending_copy_in, evicted)
            self.pending_copy_in = []
        if self.recurrent is not None:
            self.recurrent.move_slots(runner)

    def after_launch(self) -> None:
        """The step built from this schedule is launched: the recurrent part's pins go."""
        if self.recurrent is not None:
            self.recurrent.after_launch()

    def after_read_back(self) -> None:
        """A step's tokens are read back: the pages gathered for the host tier by then are read
        into numpy (HostKVTier.materialize), which frees their device copies."""
        if self.host is not None:
            self.host.materialize()

    def ready_marks(self, batch):
        """What `after_advance` needs from before the scheduler's advance (None: nothing)."""
        return None if self.tiers is None else self.tiers.ready_marks(batch)

    def after_advance(self, batch, marks, waiting) -> None:
        """Blocks completed by the step go to the span store; the waiting prompts' stored
        blocks start to be read."""
        if marks is not None:
            self.tiers.after_advance(batch, marks, waiting, self.bm)

    def prefetch(self, waiting) -> None:
        if self.tiers is not None:
            self.tiers.prefetch(waiting, self.bm)

    def flush(self, runner) -> None:
        """Write every block computed so far to the span store and wait for the files."""
        if self.store is not None:
            self.tiers.flush(runner.cache)

    def warmup(self, cache):
        """Compile the span store's page moves; returns the cache."""
        return cache if self.store is None else self.tiers.warmup(cache)

    def take_fresh(self) -> list[int]:
        """Blocks handed out since the last call, to be zeroed on the device (page_zeroing.py)."""
        return self.bm.take_fresh()

    def detach_store(self) -> None:
        """Stop reading and writing the span store (the host tier above it stays)."""
        if self.tiers is not None:
            self.tiers.detach_store()
            self.offload = self.tiers.lookup

    def reset(self, recurrent_cache=None) -> None:
        """Forget every cached block and host-tier block; hybrid models take a fresh checkpoint
        cache (`recurrent_cache`)."""
        self.bm.forget_cached()
        if self.tiers is not None:
            self.tiers.forget()
        if recurrent_cache is not None:
            self.recurrent.cache = recurrent_cache

    def abandon_step(self, device_ok: bool) -> None:
        """After a fault (serving/recovery.py, every sequence preempted): copy-ins the failed
        step planned never ran (their blocks are published ready but hold stale pages), evicted
        pages were never gathered (only their host copies are lost), the recurrent part's
        reservations go; with device_ok False the pages' contents are unknown: every cached
        block and the host copies not yet read back are forgotten."""
        bm = self.bm
        for b, h in self.pending_copy_in:
            if bm.hash[b] == h:
                bm.unregister(b)
        self.pending_copy_in = []
        self.evicted = []
        if self.recurrent is not None:
            self.recurrent.abandon_step(device_ok)
        if not device_ok:
            for b in range(bm.num_blocks):
                if bm.ref[b] == 0 and bm.hash[b] != -1:
                    bm.unregister(b)
            if self.tiers is not None:
                self.tiers.drop_unverified()

    def stats(self) -> dict:
        """Block counts, the lower tiers' and the recurrent part's counters."""
        host = self.host
        out = {"blocks_used": self.bm.num_used, "blocks_evicted": self.bm.num_evicted,
               "blocks_offloaded": host.num_offloaded if host else 0,
               "blocks_restored": host.num_restored if host else 0,
               "host_blocks": len(host.entries) if host else 0}
        if self.store is not None:
            out["kv_store"] = self.store.stats()
        if self.recurrent is not None:
            out.update(self.recurrent.stats())
        return out
