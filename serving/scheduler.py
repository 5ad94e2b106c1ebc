"""Continuous batching: what runs this step (decodes, prefill chunks, span prefills).

Order of a step: decodes of running sequences (one token each; a sequence that needs a new block
when none is free preempts the newest running one, which is recomputed later), then prefill
chunks of running sequences, then admissions from the waiting queue (FCFS), all under
`max_num_batched_tokens`. Policies:
  * fcfs:    as above.
  * barrier: a sequence may compute its final segment only when no running sequence still has
             span (non-final) tokens to compute -- the paper's baseline.
  * isps:    as fcfs, plus leftover budget prefills SSEP spans of *waiting* requests as span
             jobs (position-free KV does not care where a span is computed), so their spans are
             cache hits by the time they get a seat.
A chunk walks a sequence's blocks in order: a ready cached block is skipped, a block another live
sequence is still computing stalls the chunk (computed once), pads are skipped for free.
"""

from __future__ import annotations

import collections
import itertools
import dataclasses
import time

import numpy as np

from serving.cache.prefix_keys import PrefixKeys
from serving.cache import span_jobs
from serving.hybrid import span_rows
from serving.sequence import Sequence, Status


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    token_idx: np.ndarray  # [n] int token indices fed as queries this step
    new_computed: int  # frontier after the step
    sample: bool  # the sequence's last token is computed: sample its next token
    reset: bool  # recurrent state starts from zero
    ck_pos: int = -1  # hybrid: logical position of a checkpoint this step takes (-1: none)
    ck_slot: int = -1  # hybrid: its checkpoint-pool slot
    restore_slot: int = -1  # hybrid: pool slot the state is restored from before the step
    map_chain: tuple = ()  # hybrid spans: map-pool slots of the cached spans entered first
    map_caps: tuple = ()  # hybrid spans: (span start token index, map-pool slot) captured


class Scheduler:
    def __init__(self, config, block_manager, hash_fn, root_hash_fn, *, offload=None,
                 markers: dict | None = None, hybrid: bool = False, hybrid_cache=None,
                 before_preempt=None):
        self.cfg = config
        self.bm = block_manager
        self.offload = offload
        self.markers = markers or {}
        self.hybrid = hybrid
        # hybrid models cache only with a checkpoint store (serving/hybrid/hybrid_prefix.py)
        self.hybrid_cache = hybrid_cache
        self.caching = config.enable_prefix_caching and (not hybrid or hybrid_cache is not None)
        self.keys = PrefixKeys(config.block_size, hash_fn, root_hash_fn, self.markers,
                               self.caching)
        self._arange = np.arange(config.max_model_len + 1)  # decode token_idx = 1-row views
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.span_jobs: list[Sequence] = []
        self.free_seats = list(range(config.max_num_seqs))[::-1]
        self.free_span_seats = list(range(config.max_num_seqs, config.num_seats))[::-1]
        self.pending_copy_in: list[tuple[int, int]] = []  # (block, host hash) for this step
        self.num_preemptions = 0
        # engine hook before a preemption: reads back a step in flight first (_ensure_block)
        self.before_preempt = before_preempt
        self._resolved_early = False
        self.hit_tokens = 0
        self.query_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.span_jobs)

    # -- admission ----------------------------------------------------------------------------
    def _try_allocate(self, seq: Sequence, seats: list[int]) -> bool:
        if not seats:
            return False
        if self.hybrid_cache is not None:
            return self.hybrid_cache.admit(self, seq, seats)
        bm, hashes, limit = self.bm, self.keys.hashes(seq), self.keys.hit_limit(seq)
        plan, misses, host = self.keys.admission_plan(seq, bm, limit, self.offload)
        hits = [b for b in plan if b is not None]
        need = len(plan) - len(hits) + list(map(bm.ref.__getitem__, hits)).count(0)
        if need > bm.num_free - self.cfg.watermark_blocks * (not seq.is_span_job):
            return False
        # take every planned hit off the free list before allocating: an allocation evicts the
        # least recently freed block, which may be a cached block planned as a later hit
        shared = []
        try:
            bm.share_many(hits)  # shares none if it raises
            shared = hits
            self._take_blocks(seq, plan, misses, host, hashes, len(hits))
        except BaseException:
            self._undo_admission(seq, plan, shared)
            raise
        seq.seat = seats.pop()
        seq.synced_blocks = 0  # the runner's host block-table row for this seat is stale
        seq.status = Status.RUNNING
        seq.needs_reset = True
        seq.ready_ptr = 0
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.time()
        seq.ever_admitted = True
        return True

    def _take_blocks(self, seq: Sequence, plan, misses, host: set, hashes,
                     num_hits: int) -> None:
        """Fill the block table from the admission plan (block per logical block: a hit, already
        shared, or None at the indices `misses`): the hits as they are, in block order with
        blocks copied in from the host tier (`host`) and new blocks (registered, owned)."""
        bm, table, bs = self.bm, seq.block_table, self.cfg.block_size
        if not seq.ever_admitted:  # every hit is a hashed block (admission_plan)
            seq.num_cached_tokens += bs * num_hits
        start = 0
        for j in misses:
            table.extend(plan[start:j])  # the hits before block j
            start = j + 1
            b = bm.allocate()
            table.append(b)
            h = hashes[j] if j < len(hashes) else None
            if j in host and self.offload.contains(h):
                bm.register(b, h, self.keys.confirm(seq, j), seq.seq_id, ready=True)
                if bm.hash[b] == h:
                    self.pending_copy_in.append((b, h))
                    if not seq.ever_admitted:
                        seq.num_cached_tokens += bs
                    continue
            seq.owned.add(j)
            if h is not None:
                bm.register(b, h, self.keys.confirm(seq, j), seq.seq_id)
        table.extend(plan[start:])

    def _undo_admission(self, seq: Sequence, plan, shared: list[int]) -> None:
        """An admission that raised part way (a fault in allocation): give back every block it
        took, so the sequence is as it was in the queue."""
        mine = set(seq.block_table)
        copy_ins = [(b, h) for b, h in self.pending_copy_in if b in mine]
        self.pending_copy_in = [x for x in self.pending_copy_in if x[0] not in mine]
        for b, h in copy_ins:  # published as ready, but the page never arrived
            if self.bm.hash[b] == h:
                self.bm._unregister(b)
        new = [b for j, b in enumerate(seq.block_table) if plan[j] is None]
        self.bm.release(new + shared, seq.seq_id)
        seq.block_table = []
        seq.owned = set()
        if not seq.ever_admitted:
            seq.num_cached_tokens = 0

    def _free(self, seq: Sequence) -> None:
        if self.hybrid_cache is not None:
            self.hybrid_cache.drop_restore(seq)
        self.bm.release(seq.block_table, seq.seq_id)
        seq.block_table = []
        seq.owned = set()
        if seq.seat >= 0:
            (self.free_span_seats if seq.is_span_job else self.free_seats).append(seq.seat)
        seq.seat = -1

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop blocks, keep the generated tokens."""
        self._free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq.is_span_job:
            self.span_jobs.remove(seq)
        else:
            self.running.remove(seq)
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self._free(seq)
        seq.status = Status.FINISHED
        seq.finished_time = time.time()
        if seq.is_span_job:
            self.span_jobs.remove(seq)
        else:
            self.running.remove(seq)

    # -- chunk planning -----------------------------------------------------------------------
    def _plan_chunk(self, seq: Sequence, budget: int, stop_at: int | None = None):
        """Token indices to compute next (at most `budget` valid ones), and the new frontier."""
        bs, bm = self.cfg.block_size, self.bm
        if self.hybrid_cache is not None:  # at most one checkpoint per chunk
            stop_at = self.hybrid_cache.chunk_stop(seq, stop_at, budget)
        total = len(seq) if stop_at is None else min(stop_at, len(seq))
        i, parts, n = seq.num_computed, [], 0
        while i < total and n < budget:
            j = i // bs
            if j not in seq.owned:  # a shared (hit or waited-for) block, entered at its start
                b = seq.block_table[j]
                if bm.ready[b] or bm.hash[b] == -1:
                    i = self._skip_shared(seq, j + 1, total) * bs
                    continue
                if bm.owner[b] != -1:
                    break  # another sequence is computing it: wait
                bm.owner[b] = seq.seq_id  # its owner went away: claim it
                seq.owned.add(j)
            end = min((j + 1) * bs, total)
            idx = np.arange(i, end)
            if i < seq.num_prompt_tokens:
                idx = idx[~seq.layout.is_pad[np.minimum(idx, seq.num_prompt_tokens - 1)]
                          | (idx >= seq.num_prompt_tokens)]
            if idx.size > budget - n:
                idx = idx[:budget - n]
                end = int(idx[-1]) + 1
                if end < seq.num_prompt_tokens:  # trailing pads of the block come for free
                    rest = seq.layout.is_pad[end:min((j + 1) * bs, seq.num_prompt_tokens)]
                    if rest.size and rest.all():
                        end += rest.size
            parts.append(idx)
            n += idx.size
            i = end
        idx = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if self.hybrid and seq.layout.span_block.any():  # a non-final span stays in one step
            idx, i = span_rows.cut_chunk(seq, idx, i, bs)
        return idx, i

    def _skip_shared(self, seq: Sequence, j: int, total: int) -> int:
        """First block >= j a chunk cannot skip (owned, shared and pending, or past `total`):
        a cached request's 2,000 ready blocks are passed in one tight loop."""
        owned, table, ready, hashes = seq.owned, seq.block_table, self.bm.ready, self.bm.hash
        bs = self.cfg.block_size
        while j * bs < total and j not in owned:
            b = table[j]
            if not ready[b] and hashes[b] != -1:
                break
            j += 1
        return j

    def _final_start(self, seq: Sequence) -> int:
        """Token index where the final segment begins (0 if the prompt is one segment)."""
        if seq.memo.final_start is None:
            lay, bs = seq.layout, self.cfg.block_size
            starts = np.flatnonzero(lay.seg_start)
            seq.memo.final_start = int(starts[-1]) * bs if starts.size else 0
        return seq.memo.final_start

    def _entry(self, seq, idx, new_computed) -> ScheduledSeq:
        sample = (not seq.is_span_job) and new_computed >= len(seq)
        e = ScheduledSeq(seq, idx, new_computed, sample, seq.needs_reset)
        if self.hybrid_cache is not None:
            self.hybrid_cache.annotate(self, e)
        return e

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """This step's rows within max_num_batched_tokens (order: module docstring)."""
        cfg = self.cfg
        self.pending_copy_in = []
        batch = self._decodes()
        budget = cfg.max_num_batched_tokens - len(batch)
        barrier = cfg.scheduling_policy == "barrier"
        barrier_open = not (barrier and self._any_before_final())
        for seq in self.running:  # running prefills
            if budget <= 0:
                break
            if seq.is_prefilling:
                budget = self._add_chunk(batch, seq, budget,
                                         None if barrier_open else self._final_start(seq))
        budget = self._admit(batch, budget, barrier, barrier_open)
        # barrier: a final segment another request waits on can hold the barrier shut; when
        # nothing else can move, open it for this step (progress over strict phase order)
        if not batch and barrier:
            for seq in self.running:
                if budget <= 0:
                    break
                if seq.is_prefilling:
                    budget = self._add_chunk(batch, seq, budget)
        if cfg.scheduling_policy == "isps" and self.caching:
            self._add_span_jobs(batch, budget)
        for e in batch:
            self.query_tokens += e.token_idx.size
        return batch

    def _decodes(self) -> list[ScheduledSeq]:
        """One row per running sequence whose prompt is computed (a new block when it needs one;
        a sequence that cannot get it preempts itself)."""
        bs, running, ar = self.cfg.block_size, Status.RUNNING, self._arange
        batch = []
        for seq in list(self.running):
            n = len(seq.token_ids)
            if seq.status is not running or seq.num_computed < n - 1:
                continue
            if (n - 1) // bs >= len(seq.block_table) and not self._ensure_block(seq):
                continue  # preempted itself
            batch.append(ScheduledSeq(seq, ar[n - 1:n], n, True, seq.needs_reset))
        if self._resolved_early:  # sequences finished by the read-back lose their rows
            self._resolved_early = False
            batch = [e for e in batch if e.seq.status is running]
        return batch

    def _any_before_final(self) -> bool:
        return any(s.num_computed < self._final_start(s) for s in self.running)

    def _add_chunk(self, batch, seq, budget: int, stop: int | None = None) -> int:
        """Plan `seq`'s next chunk within `budget` (not past `stop`) and add its row; returns
        the budget left."""
        idx, new = self._plan_chunk(seq, budget, stop)
        if new > seq.num_computed:
            batch.append(self._entry(seq, idx, new))
            budget -= idx.size
        return budget

    def _admit(self, batch, budget: int, barrier: bool, barrier_open: bool) -> int:
        """Admit waiting requests in order while seats, blocks and budget allow; returns the
        budget left."""
        ready = getattr(self.offload, "ready", None)  # the span store's reads of a request
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if batch and ready is not None and not ready(seq):
                break  # still reading its stored blocks: this step runs without it
            if not self._try_allocate(seq, self.free_seats):
                break
            self.waiting.popleft()
            self.running.append(seq)
            stop = None
            if barrier and (not barrier_open or self._any_before_final()):
                stop = self._final_start(seq)
            budget = self._add_chunk(batch, seq, budget, stop)
        return budget

    def _add_span_jobs(self, batch, budget: int) -> None:
        """isps: running span jobs, then new ones for waiting requests' spans."""
        if self.hybrid:  # a hybrid request computes its spans' rows itself (delta inputs)
            return
        for job in self.span_jobs:
            if budget <= 0:
                break
            budget = self._add_chunk(batch, job, budget)
        for seq in itertools.islice(self.waiting, 4 * self.cfg.max_num_seqs):
            if budget <= 0 or not self.free_span_seats:
                break
            for job in span_jobs.jobs_for(seq, self.cfg.block_size, self.keys, self.bm,
                                          self.offload, self.markers):
                if not self.free_span_seats or not self._try_allocate(job, self.free_span_seats):
                    break
                self.span_jobs.append(job)
                budget = self._add_chunk(batch, job, budget)

    def _ensure_block(self, seq: Sequence) -> bool:
        """Make room for the token at index len-1; preempt newest sequences if needed."""
        need = (len(seq) - 1) // self.cfg.block_size + 1
        while len(seq.block_table) < need:
            if self.bm.num_free == 0 and self.before_preempt is not None and self.before_preempt():
                self._resolved_early = True
                if seq.status is not Status.RUNNING:
                    return False  # it finished with the token read back
                continue  # finished sequences may have freed blocks
            if self.bm.num_free == 0:
                victim = self.span_jobs[-1] if self.span_jobs else self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.block_table.append(self.bm.allocate())
            seq.owned.add(len(seq.block_table) - 1)
        return True

    def prepare_waiting(self, max_seqs: int = 8) -> None:
        """Hash the next waiting requests' prompt blocks ahead of their admission (no effect on
        what is scheduled; the engine calls it while the device computes a step)."""
        for seq in itertools.islice(self.waiting, max_seqs):
            self.keys.hashes(seq)

    # -- after the step -----------------------------------------------------------------------
    def advance(self, batch: list[ScheduledSeq]) -> None:
        """Move frontiers, publish finished blocks, retire span jobs."""
        bs, bm = self.cfg.block_size, self.bm
        for e in batch:
            seq = e.seq
            if seq.status != Status.RUNNING:
                continue
            seq.num_computed = e.new_computed
            seq.needs_reset = False
            j0, owned = seq.ready_ptr, seq.owned
            end = min(seq.num_computed // bs, len(seq.block_table))
            # completed blocks [j0, end): only owned ones change (few, after a cached prefix)
            todo = range(j0, end) if len(owned) >= end - j0 else sorted(
                j for j in owned if j0 <= j < end)
            for j in todo:
                if j not in owned:
                    continue
                b = seq.block_table[j]
                if bm.is_pending(b) and bm.owner[b] == seq.seq_id:
                    bm.mark_ready(b)
                elif (self.caching and j == len(seq.block_hashes) and bm.hash[b] == -1
                      and seq.chain_tail is not None and not seq.is_span_job):
                    self.keys.publish_generated(seq, j, b, bm)
            seq.ready_ptr = max(j0, end)
            if seq.is_span_job and seq.num_computed >= len(seq):
                self.finish(seq)

