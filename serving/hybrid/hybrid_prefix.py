"""Prefix caching for hybrid models: admission with a checkpoint restore, checkpoints per chunk.

Attention layers keep the paged prefix cache as for Llama (same hashes, block manager, KV modes).
A recurrent layer cannot skip cached tokens without their state, so on admission:

  d = ready cached blocks (device, or the KV host tier) matching the request from its start, up to
      the hit limit (the block holding the last token to compute is never a hit);
  c = the deepest stored checkpoint at a block boundary <= d (0 if none; one the step being
      scheduled writes is not stored yet: serving/hybrid/checkpoint_store.py);
  the request resumes at c: blocks below c are shared hits, the recurrent state comes from the
  checkpoint, and [c, end) is computed through all layers into blocks of its own (cached blocks in
  [c, d) are not shared: their KV would be rewritten by the recompute). num_cached_tokens = c.

During prefill, checkpoints are taken at the positions serving/hybrid/checkpoint_plan.py chooses
for the prompt; a chunk holds up to M = CHECKPOINTS_PER_STEP of them (it stops before one more),
all stored by its one step (a step's checkpoints and restores are flat rows, at most
checkpoint_plan.step_rows / restore_rows: `rows_left`, `restores_left`). With
Config.hybrid_cache.free_room, while the store has a free slot, a chunk that holds no planned
checkpoint takes one at the deepest candidate it passes (`_free_position`), and a prefill also
takes its halving cover (`ck_cuts`: 64, 128, 256... from where it resumed,
checkpoint_plan.halving_cover), so every depth d >= 64 it computes has a checkpoint in [d/2, d]
at any chunk size; they ride in the chunk's step, costing no step while a chunk holds <= M
positions. Full, the store takes the plan's alone.
Prompts with SSEP spans go to the span-map cache (serving/hybrid/span_cache.py: a
cached span is skipped, its recurrent effect composed from its map); their checkpoints sit after
PDEP blocks, one at the first span's start (span_cache.py `_checkpoints`).
"""

from __future__ import annotations

from serving.cache.admission import AdmissionPlan
from serving.cache.prefix_keys import device_run
from serving.hybrid import span_rows
from serving.hybrid.bucket_fit import BucketFit
from serving.hybrid.checkpoint_plan import (CHECKPOINT_ROWS, CHECKPOINTS_PER_STEP, RESTORE_ROWS,
                                            candidates, halving_cover, on_grid, positions_of)
from serving.hybrid.resume import Resume
from serving.model_contract import CHECKPOINT_BREAKS


class HybridPrefixCache:
    def __init__(self, store, planner, block_size: int, spans=None, fit=None,
                 wait_tokens: float = 0.0, free_room: bool = False):
        self.store, self.planner, self.block_size = store, planner, block_size
        self.fit = fit  # serving/bucket_fit.BucketFit or None (chunks not cut at buckets)
        self.wait_tokens = wait_tokens  # see _wait (0: never wait for an in-flight checkpoint)
        self.free_room = free_room  # see _free_position (Config.hybrid_cache.free_room)
        self.spans = spans  # serving/span_cache.SpanMapCache or None (span prompts run cold)
        self.admissions = self.checkpoint_hits = 0
        self.tokens_matched = self.tokens_resumed = 0
        self.prompt_len: dict[int, int] = {}  # block hash -> length of the prompt that made it
        self.rows_left = CHECKPOINT_ROWS  # the step being scheduled: checkpoint rows still free
        self.restores_left = RESTORE_ROWS  # ... and restore rows
        self.breaks_left = CHECKPOINT_BREAKS  # ... and off-grid checkpoints inside a chunk

    # -- admission (the recurrent part of CacheManager.admit) ----------------------------------
    def match(self, mgr, seq):
        """(kinds, shared): per block from the start, ("hit", block) / ("host", None) while they
        match; `shared` counts on through blocks still being computed by another sequence (what
        the request shares with cached and in-flight prompts: the placement's statistic)."""
        bm, keys, bs = mgr.bm, mgr.keys, self.block_size
        hashes, limit = keys.hashes(seq), keys.hit_limit(seq)
        raw, step = keys.token_bytes(seq), 8 * bs
        run, ready = device_run(bm, hashes[:limit], raw, bs)  # the device's leading run, whole
        kinds, shared = [("hit", b) for b in run[:ready]], len(run)
        for j in range(shared, limit):  # the host tier, and matches past it (as block by block)
            b = bm.table.get(hashes[j])
            same = b is not None and bm.confirm[b] == raw[j * step:(j + 1) * step]
            host = b is None and mgr.offload is not None and mgr.offload.contains(hashes[j])
            if not (same or host):
                break
            if len(kinds) == j and (host or bm.ready[b]):
                kinds.append(("host", None) if host else ("hit", b))
            shared = j + 1
        return kinds, shared

    def deepest(self, seq, hashes, raw, depth_blocks: int):
        """(blocks below the checkpoint, pinned entry) of the deepest usable checkpoint. A
        preempted sequence matches its generated blocks too: they are keyed as a prompt repeating
        them would key them (serving/cache/prefix_keys.py), so a checkpoint that prompt took serves."""
        step, bs = 8 * self.block_size, self.block_size
        # a span block's key does not cover what is before it: only other blocks' depths
        for k in span_rows.depths_outside_spans(seq.layout, depth_blocks):
            e = self.store.get(hashes[k - 1], raw[(k - 1) * step:k * step])
            if e is None or e.position != _position(seq, k * bs):
                continue
            if self.store.acquire(e):
                return k, e
        return 0, None

    def plan_admission(self, mgr, seq) -> AdmissionPlan | None:
        """The hybrid plan (module docstring): resume at the deepest checkpoint, the blocks below
        it shared or copied in (never recomputed), every other block new; None to wait, also
        when it would restore and the step has no restore row left (it keeps its place in the
        queue and the next step admits it: nothing taken, nothing lost)."""
        plan = self._plan_admission(mgr, seq)
        if plan is not None and plan.detail.entry is not None and not self.restores_left:
            self.cancel(plan.detail)
            return None
        return plan

    def _plan_admission(self, mgr, seq) -> AdmissionPlan | None:
        spans = bool(seq.layout.span_block.any())
        if spans and self.spans is not None:  # warm span path (serving/hybrid/span_cache.py)
            return self.spans.plan_admission(mgr, seq, self)
        kinds, shared = ([], 0) if spans else self.match(mgr, seq)  # spans without maps: cold
        hashes, raw = mgr.keys.hashes(seq), mgr.keys.token_bytes(seq)
        kc, entry = self.deepest(seq, hashes, raw, len(kinds))
        if not seq.ever_admitted and self._wait(mgr, seq, hashes, len(kinds), shared, kc):
            if entry is not None:
                self.store.release(entry)
            return None
        return AdmissionPlan.from_kinds(seq.num_blocks_needed, dict(enumerate(kinds[:kc])),
                                        kc * self.block_size, Resume(kinds, kc, shared, entry))

    def commit(self, mgr, seq, r: Resume) -> None:
        """The admission planned as `r` took its blocks: plan the prompt's checkpoints (first
        admission), count it, and hand the sequence its restore entry."""
        if r.skips is not None:
            self.spans.commit(mgr, seq, r, self)
        elif not seq.ever_admitted:
            bs, hashes = self.block_size, mgr.keys.hashes(seq)
            free = {} if self.free_room else None
            planned = ([], []) if seq.layout.span_block.any() else self.planner.prompt_plan(
                seq.layout, seq.num_prompt_tokens, bs, hashes[:seq.num_prompt_tokens // bs],
                r.shared, free)
            seq.hybrid.ck_positions, seq.hybrid.ck_values = planned
            seq.hybrid.ck_free = free or {}
            if free:
                seq.hybrid.ck_cuts = halving_cover(
                    candidates(seq.layout, seq.num_prompt_tokens, bs, self.planner.chunk),
                    r.kc * bs, planned[0], seq.num_prompt_tokens)
        self.count_admission(seq, r.kinds, r.kc, r.shared, r.entry)
        seq.hybrid.restore_entry = r.entry

    def cancel(self, r: Resume) -> None:
        """The admission planned as `r` does not happen: its pins go."""
        for _, _, e in r.skips or ():
            self.spans.store.release(e)
        if r.entry is not None:
            self.store.release(r.entry)

    def _wait(self, mgr, seq, hashes, ready: int, shared: int, kc: int) -> bool:
        """Whether `seq` should wait rather than resume at block kc now: its prefix runs on
        through blocks another sequence is still computing (`ready` blocks are done, `shared`
        match), that sequence stores a checkpoint at p in (kc B, shared B] within its next
        step, and resuming at p would save at least `wait_tokens` (what a step of waiting costs,
        Config.hybrid_cache.step_tokens). A few steps at most (async scheduling marks blocks
        ready a step late)."""
        bs, waited = self.block_size, seq.hybrid.ck_waits
        if shared <= ready or waited >= 3 or not self.wait_tokens:
            return False
        bm = mgr.bm
        b = bm.table.get(hashes[ready])
        own = None if b is None else mgr.seated.get(bm.owner[b])
        if own is None:
            return False
        ps = [p for p in own.hybrid.ck_positions if kc * bs < p <= shared * bs]
        if not ps or max(ps) - own.num_computed > mgr.config.max_num_batched_tokens or \
                max(ps) - kc * bs < self.wait_tokens:
            return False
        seq.hybrid.ck_waits = waited + 1
        return True

    def count_admission(self, seq, kinds, kc: int, shared: int, entry) -> None:
        """An admission matched `kinds` blocks (`shared` counting blocks in flight too) and
        resumes at block kc from `entry`: on the first admission the placement's statistics
        (the overlap depth, the prompt lengths behind each block, the entry's value now), then
        the counters."""
        bs, hashes = self.block_size, seq.block_hashes or []
        if not seq.ever_admitted:
            blocks = hashes[:seq.num_prompt_tokens // bs]
            self.planner.observe(blocks, shared,
                                 self.prompt_len.get(hashes[shared - 1]) if shared else None)
            if entry is not None:  # worth now what a recurrence to its depth would save
                self.store.revalue(entry, kc * bs * self.planner.overlap.share(hashes[kc - 1]))
            if len(self.prompt_len) > (1 << 20):
                self.prompt_len.clear()
            known = self.prompt_len
            known.update((h, seq.num_prompt_tokens) for h in blocks if h not in known)
        self.admissions += 1
        self.checkpoint_hits += kc > 0
        self.tokens_matched += len(kinds) * bs
        self.tokens_resumed += kc * bs

    def drop_restore(self, seq) -> None:
        """The sequence leaves (preempted, finished, aborted) before its restore ran."""
        e = seq.hybrid.restore_entry
        if e is not None:
            self.store.release(e)
            seq.hybrid.restore_entry = None
        if self.spans is not None:
            self.spans.drop(seq)

    # -- chunks --------------------------------------------------------------------------------
    def _ahead(self, seq) -> list[int]:
        """The checkpoint positions still ahead of `seq`'s frontier: the planned ones, and while
        the store has a free slot the free-room cover not stored yet (`ck_cuts`, see `commit`)."""
        h, done = seq.hybrid, seq.num_computed
        ahead = [p for p in h.ck_positions if p >= done]
        if h.ck_cuts and self.store.free_slots:
            hashes, bs = seq.block_hashes, self.block_size
            ahead = sorted(ahead + [p for p in h.ck_cuts if p >= done
                                    and not self.store.contains(hashes[p // bs - 1])])
        return ahead

    def chunk_stop(self, seq, stop_at, budget: int = 0):
        """A chunk [s, e] takes the first M = CHECKPOINTS_PER_STEP positions ahead in [s, e]
        (one at s: the state it starts from, which the kernel returns as is; fewer when fewer of
        the step's rows are left; with none left and one at s, no chunk: it waits a step), all in
        its one step; it stops at the next, which the next chunk takes at its start, and at a
        span prompt's position off the GDN chunk grid (its first span start) unless the step has
        a break left (the packing then starts a chunk there: CHECKPOINT_BREAKS). A plain prompt's
        chunk that would overflow a token bucket by a little stops there
        (serving/hybrid/bucket_fit.py; `budget` more tokens fit in the step)."""
        if not self.restores_left and seq.hybrid.restore_entry is not None:
            return seq.num_computed  # its restore waits for a step with a row left: no chunk
        ahead, m = self._ahead(seq), min(CHECKPOINTS_PER_STEP, self.rows_left)
        if not m and ahead and ahead[0] <= seq.num_computed:
            return seq.num_computed  # the one at s waits for a step with a row (moving on loses it)
        if len(ahead) > m:
            stop_at = ahead[m] if stop_at is None else min(stop_at, ahead[m])
        spans = seq.layout.span_block.any()
        if spans:  # a position off the GDN chunk grid (a span start) is exact as a last row, or
            # as the chunk's break (model_contract.CHECKPOINT_BREAKS a step): it stops at the next
            near = [p for p in ahead[:CHECKPOINTS_PER_STEP] if p > seq.num_computed]
            off = [p for p, ok in zip(near, on_grid(seq.layout, near, self.planner.chunk))
                   if not ok]
            if off and self.breaks_left and (stop_at is None or off[0] < stop_at):
                off = off[1:]  # counted where its checkpoint is taken (`annotate`)
            if off:
                stop_at = off[0] if stop_at is None else min(stop_at, off[0])
        if self.fit is not None and not spans:
            total = len(seq) if stop_at is None else min(stop_at, len(seq))
            cut = self.fit.stop(seq.num_computed, total, budget)
            if cut is not None:
                stop_at = cut
        return stop_at

    def annotate(self, mgr, e) -> None:
        """Restore and checkpoint fields of a scheduled chunk (and its span maps)."""
        seq = e.seq
        if self.spans is not None:
            self.spans.annotate(mgr, e)
        entry = seq.hybrid.restore_entry
        if entry is not None:
            e.restore_slot = entry.slot
            e.reset = False
            self.restores_left -= 1
            self.store.hand_to_launch(entry)
            seq.hybrid.restore_entry = None
        if seq.is_span_job:
            return
        h = seq.hybrid
        take, inner = [p for p in self._ahead(seq) if p <= e.new_computed], []
        if take and seq.layout.span_block.any():  # off the chunk grid: at a chunk's ends, or
            grid = on_grid(seq.layout, take, self.planner.chunk)  # one break while a step has
            inner = [p for p, ok in zip(take, grid) if not ok and seq.num_computed < p
                     < e.new_computed][:1 if self.breaks_left else 0]  # one (chunk_stop)
            take = [p for p, ok in zip(take, grid) if ok or p in (seq.num_computed,
                                                                  e.new_computed, *inner)]
        take = take[:min(CHECKPOINTS_PER_STEP, self.rows_left)]
        got = []
        for p in take:  # a cover position (not planned): only into a free slot
            value = h.ck_values[h.ck_positions.index(p)] if p in h.ck_positions else \
                h.ck_free[p] if self.store.free_slots else None
            got.append(None if value is None else self._reserve(mgr, seq, p, value))
            self.breaks_left -= p in inner and got[-1] is not None
        if not take and self.rows_left:
            p = self._free_position(mgr, seq, e.new_computed)
            if p is not None:
                got.append(self._reserve(mgr, seq, p, h.ck_free[p]))
        got = [x for x in got if x is not None]
        self.rows_left -= len(got)
        if got:
            (e.ck_pos, e.ck_slot), e.ck_more = got[0], tuple(got[1:])

    def _reserve(self, mgr, seq, p: int, value: float):
        """(logical position, slot) of a checkpoint at token p the step takes, or None (stored
        already, or no slot can be freed)."""
        bs, hashes = self.block_size, mgr.keys.hashes(seq)
        k = p // bs
        pos = int(positions_of(seq.layout, [p])[0])
        slot = self.store.reserve(hashes[k - 1], mgr.keys.confirm(seq, k - 1), pos, hashes[:k],
                                  value)
        return (pos, slot) if slot >= 0 else None

    def _free_position(self, mgr, seq, end: int) -> int | None:
        """A chunk [s, end] that holds no planned checkpoint takes, while the store has a free
        slot (nothing is evicted for it), the deepest candidate it passes that is not stored yet:
        the one a later request sharing the most of this chunk resumes from. The store's
        GreedyDual evicts it by its value once the pool is full, so the planned ones (the DP's)
        stay for the budgeted case."""
        if not seq.hybrid.ck_free or not self.store.free_slots:
            return None
        hashes, bs = mgr.keys.hashes(seq), self.block_size
        for p in sorted(seq.hybrid.ck_free, reverse=True):
            if p > end:
                continue
            if p < seq.num_computed:
                return None
            if not self.store.contains(hashes[p // bs - 1]):
                return p
        return None

    def after_launch(self) -> None:
        """The step built from this schedule is launched: its pins go."""
        self.store.after_launch()
        self.rows_left, self.restores_left = CHECKPOINT_ROWS, RESTORE_ROWS
        self.breaks_left = CHECKPOINT_BREAKS
        if self.spans is not None:
            self.spans.after_launch()

    def abandon_step(self, device_ok: bool) -> None:
        """After a fault (serving/recovery.py, every sequence preempted): the checkpoints and
        span maps of a step that was never launched go; with device_ok False (a device step
        failed: the pools' contents are unknown) all of them go."""
        self.rows_left, self.restores_left = CHECKPOINT_ROWS, RESTORE_ROWS
        self.breaks_left = CHECKPOINT_BREAKS
        for store in [self.store] + ([self.spans.store] if self.spans is not None else []):
            if device_ok:
                store.abandon_launch()
            else:
                store.clear()
        if self.spans is not None:
            self.spans.captures = 0

    def drop_dependent(self, block_hash: int) -> None:
        """A cached attention block left for good: checkpoints and span maps above it go."""
        self.store.drop_dependent(block_hash)
        if self.spans is not None:
            self.spans.store.drop_dependent(block_hash)

    def stats(self) -> dict:
        out = {"checkpoint_hits": self.checkpoint_hits, "tokens_resumed": self.tokens_resumed,
               "tokens_matched": self.tokens_matched,
               "tokens_recomputed": self.tokens_matched - self.tokens_resumed,
               "checkpoint_strategy": self.planner.strategy,
               "checkpoint_plan": self.planner.plan,
               "checkpoint_replans": self.planner.replanner.replans}
        out.update(self.store.stats())
        if self.spans is not None:
            out.update(self.spans.stats())
        return out


def _position(seq, c: int) -> int:
    """Logical position of token index c of `seq` (a generated token takes the next one)."""
    n = seq.num_prompt_tokens
    return int(positions_of(seq.layout, [c])[0]) if c <= n else seq.layout.num_valid + c - n


def build(config, family, mcfg, dtype, pool=None, span_pool=None):
    """(HybridPrefixCache, CheckpointPool or None) for a hybrid model with prefix caching on.
    The pool is allocated here, before the KV pool sizes itself from the memory left; with
    `pool` (an engine's reset) it is kept, and the store may use at most its slots."""
    from serving.hybrid import checkpoint_pool
    from serving.hybrid.checkpoint_plan import BLOCK_TOKENS, CheckpointPlanner
    from serving.hybrid.checkpoint_store import CheckpointStore
    chunk = getattr(family, "CHUNK", 64)
    layout = checkpoint_pool.state_layout(family, mcfg, config.block_size, dtype)
    nbytes = checkpoint_pool.checkpoint_nbytes(layout)
    strategy = config.hybrid_cache.strategy
    slots = 0 if strategy == "none" else checkpoint_pool.default_slots(config, nbytes)
    host = int(config.cpu_offload_gb * (1 << 30) / 2) // max(nbytes, 1) if slots else 0
    per_prompt = config.hybrid_cache.per_prompt
    if per_prompt is None:  # a fair share of the device tier: twice as many prompts as seats
        per_prompt = min(4, max(1, slots // (2 * config.max_num_seqs)))
    planner = CheckpointPlanner(strategy, per_prompt,
                                BLOCK_TOKENS, config.max_model_len, chunk,
                                block_size=config.block_size,
                                half_life=config.hybrid_cache.half_life,
                                # a later request's share of a split: the tier turns over every
                                # slots / per_prompt admissions
                                extra_price=config.hybrid_cache.step_tokens * per_prompt
                                / max(slots, 1), step_tokens=config.max_num_batched_tokens,
                                per_step=CHECKPOINTS_PER_STEP)
    if pool is not None:
        if slots > pool.slots:
            raise ValueError(f"checkpoint_gb (Config.hybrid_cache.budget_gb) asks for {slots} "
                             f"checkpoints but the engine's pool has {pool.slots}; a reset "
                             f"cannot grow it")
    elif slots:
        pool = checkpoint_pool.allocate(layout, slots)
    from serving.hybrid import span_cache
    spans = span_cache.build(config, family, mcfg, dtype, pool=span_pool)
    cache = HybridPrefixCache(CheckpointStore(slots, host, nbytes), planner, config.block_size,
                              spans, BucketFit.from_config(config), config.hybrid_cache.step_tokens,
                              config.hybrid_cache.free_room)
    return cache, pool


def take_span_pool(cache: HybridPrefixCache | None):
    """The span-map device pool, moved from the hybrid cache's builder to the caller (the
    runner), or None: span prompts run cold."""
    spans = cache.spans if cache is not None else None
    if spans is None:
        return None
    pool, spans.pool = spans.pool, None
    return pool
