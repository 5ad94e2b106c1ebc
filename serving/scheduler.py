"""Continuous batching: what runs this step (decodes, prefill chunks, span prefills).

Order of a step: decodes of running sequences (one token each; a sequence that needs a new block
when none is free preempts the newest running one, which is recomputed later), then prefill
chunks of running sequences, then admissions from the waiting queue (FCFS; a request that waits
on work in flight, such as a span another request is computing, keeps its place while a few
behind it may go first), all under `max_num_batched_tokens`. Policies:
  * fcfs:    as above.
  * barrier: a sequence may compute its final segment only when no running sequence still has
             span (non-final) tokens to compute -- the paper's baseline.
  * isps:    as fcfs, plus leftover budget prefills SSEP spans of *waiting* requests as span
             jobs (position-free KV does not care where a span is computed), so their spans are
             cache hits by the time they get a seat.
What is cached, and so what an admission takes and where a chunk goes, is the cache manager's
(serving/cache/manager.py): the scheduler decides only what runs -- queues, seats, the token
budget, the policy and preemption.
"""

from __future__ import annotations

import collections
import itertools
import dataclasses
import time

import numpy as np

from serving.cache.manager import Refused
from serving.sequence import Sequence, Status

# Requests a step may look past that wait on work in flight (Refused.WAITS): on rag's zipf
# workload at 16 seats (qwen3_5 spans, CPU step counts, host decisions as on a GPU) fcfs took
# 42 steps with none, 37 / 36 / 38 with 4 / 8 / 16 (multi 26 -> 23 / 22 / 26; pic_off, whose
# steps are full, 44 either way). Each look plans one admission (host time), so it is bounded.
LOOK_PAST_WAITING = 8


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    token_idx: np.ndarray  # [n] int token indices fed as queries this step
    new_computed: int  # frontier after the step
    sample: bool  # the sequence's last token is computed: sample its next token
    reset: bool  # recurrent state starts from zero
    ck_pos: int = -1  # hybrid: logical position of a checkpoint this step takes (-1: none)
    ck_slot: int = -1  # hybrid: its checkpoint-pool slot
    # hybrid: further (position, slot) checkpoints the step takes for this sequence, deeper than
    # ck_pos (up to checkpoint_plan.CHECKPOINTS_PER_STEP in all)
    ck_more: tuple = ()
    restore_slot: int = -1  # hybrid: pool slot the state is restored from before the step
    map_chain: tuple = ()  # hybrid spans: map-pool slots of the cached spans entered first
    map_caps: tuple = ()  # hybrid spans: (piece start token, map-pool slot, continues) captured


class Scheduler:
    def __init__(self, config, cache, *, hybrid: bool = False, before_preempt=None):
        self.cfg = config
        # the cache manager (serving/cache/manager.py): blocks, keys, tiers, checkpoints
        self.cache = cache
        self.hybrid = hybrid
        self._arange = np.arange(config.max_model_len + 1)  # decode token_idx = 1-row views
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.span_jobs: list[Sequence] = []
        self.free_seats = list(range(config.max_num_seqs))[::-1]
        self.free_span_seats = list(range(config.max_num_seqs, config.num_seats))[::-1]
        self.num_preemptions = 0
        # engine hook before a preemption: reads back a step in flight first (_ensure_block)
        self.before_preempt = before_preempt
        self._resolved_early = False
        self.query_tokens = 0

    def forget_early_read(self) -> None:
        """After a fault (serving/recovery.py): no read-back happened inside this schedule."""
        self._resolved_early = False

    def add(self, seq: Sequence) -> None:
        self.cache.note_request(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.span_jobs)

    def _free(self, seq: Sequence) -> None:
        self.cache.release(seq)
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
        self.cache.annotate(e)
        return e

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """This step's rows within max_num_batched_tokens (order: module docstring)."""
        cfg = self.cfg
        batch = self._decodes()
        budget = cfg.max_num_batched_tokens - len(batch)
        barrier = cfg.scheduling_policy == "barrier"
        barrier_open = not (barrier and self._any_before_final())
        for seq in self.running:  # running prefills
            if budget <= 0:
                break
            if self._needs_chunk(seq):
                budget = self._add_chunk(batch, seq, budget,
                                         None if barrier_open else self._final_start(seq))
        budget = self._admit(batch, budget, barrier, barrier_open)
        # barrier: a final segment another request waits on can hold the barrier shut; when
        # nothing else can move, open it for this step (progress over strict phase order)
        if not batch and barrier:
            for seq in self.running:
                if budget <= 0:
                    break
                if self._needs_chunk(seq):
                    budget = self._add_chunk(batch, seq, budget)
        if cfg.scheduling_policy == "isps" and self.cache.caching:
            self._add_span_jobs(batch, budget)
        for e in batch:
            self.query_tokens += e.token_idx.size
        return batch

    def _decodes(self) -> list[ScheduledSeq]:
        """One row per running sequence whose prompt is computed (a new block when it needs one;
        a sequence that cannot get it preempts itself). A hybrid sequence resumed at n - 1 whose
        checkpoint restore has not run yet takes its last prompt token as a prefill chunk, where
        the restore rides (`_entry` -> cache.annotate)."""
        bs, running, ar = self.cfg.block_size, Status.RUNNING, self._arange
        batch = []
        for seq in list(self.running):
            n = len(seq.token_ids)
            if seq.status is not running or self._needs_chunk(seq):
                continue
            if (n - 1) // bs >= len(seq.block_table) and not self._ensure_block(seq):
                continue  # preempted itself
            batch.append(ScheduledSeq(seq, ar[n - 1:n], n, True, seq.needs_reset))
        if self._resolved_early:  # sequences finished by the read-back lose their rows
            self._resolved_early = False
            batch = [e for e in batch if e.seq.status is running]
        return batch

    @staticmethod
    def _needs_chunk(seq: Sequence) -> bool:
        """Prompt rows left beyond the last token, or a hybrid checkpoint restore still to run
        (it rides a prefill chunk: a sequence resumed at n - 1 is no decode row until it ran)."""
        return seq.is_prefilling or seq.hybrid.restore_entry is not None

    def _any_before_final(self) -> bool:
        return any(s.num_computed < self._final_start(s) for s in self.running)

    def _add_chunk(self, batch, seq, budget: int, stop: int | None = None) -> int:
        """Plan `seq`'s next chunk within `budget` (not past `stop`) and add its row; returns
        the budget left."""
        idx, new = self.cache.plan_chunk(seq, budget, stop)
        if new > seq.num_computed:
            batch.append(self._entry(seq, idx, new))
            budget -= idx.size
        return budget

    def _admit(self, batch, budget: int, barrier: bool, barrier_open: bool) -> int:
        """Admit waiting requests in order while seats, blocks and budget allow; returns the
        budget left. A request that waits on work in flight (a span or checkpoint another
        request is computing: Refused.WAITS) keeps its place while up to LOOK_PAST_WAITING
        requests behind it may go first; one refused for room (FULL) stops admission (FCFS)."""
        i, passed = 0, 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if batch and not self.cache.ready_to_admit(seq):
                break  # still reading its stored blocks: this step runs without it
            got = self.cache.admit(seq, self.free_seats)
            if got is Refused.WAITS and passed < LOOK_PAST_WAITING:
                i, passed = i + 1, passed + 1
                continue
            if not got:
                break
            del self.waiting[i]
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
            for job in self.cache.span_jobs_for(seq):
                if not self.free_span_seats or not self.cache.admit(job, self.free_span_seats):
                    break
                self.span_jobs.append(job)
                budget = self._add_chunk(batch, job, budget)

    def _ensure_block(self, seq: Sequence) -> bool:
        """Make room for the token at index len-1; preempt newest sequences if needed."""
        need = (len(seq) - 1) // self.cfg.block_size + 1
        while len(seq.block_table) < need:
            if self.cache.append_block(seq):
                continue
            if self.before_preempt is not None and self.before_preempt():
                self._resolved_early = True
                if seq.status is not Status.RUNNING:
                    return False  # it finished with the token read back
                continue  # finished sequences may have freed blocks
            victim = self.span_jobs[-1] if self.span_jobs else self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def prepare_waiting(self, max_seqs: int = 8) -> None:
        """Hash the next waiting requests' prompt blocks ahead of their admission (no effect on
        what is scheduled; the engine calls it while the device computes a step)."""
        for seq in itertools.islice(self.waiting, max_seqs):
            self.cache.prepare(seq)

    # -- after the step -----------------------------------------------------------------------
    def advance(self, batch: list[ScheduledSeq]) -> None:
        """Move frontiers, publish finished blocks (one cache call for the step), retire span
        jobs."""
        running, moved = Status.RUNNING, []
        for e in batch:
            seq = e.seq
            if seq.status is running:
                seq.num_computed = e.new_computed
                seq.needs_reset = False
                moved.append(seq)
        self.cache.advance_many(moved)
        for seq in moved:
            if seq.is_span_job and seq.num_computed >= len(seq):
                self.finish(seq)
