"""The engine: add_request / step / has_unfinished over scheduler + block manager + runner.

One `step()` = schedule (host) -> host-tier page moves -> one jitted device call -> advance
frontiers, append sampled tokens, finish requests. Public so custom loops and Ray actors can
drive it; `minipic_jax.LLM` is a thin batch wrapper over it.

Async scheduling (Config.async_scheduling, the default) overlaps the host with the device, one step
in flight: step() schedules and dispatches step N+1, then reads back step N's tokens (the one sync,
while N+1 runs), finishes requests, and advances N+1's frontiers. A token sampled by the step in
flight is a placeholder on the host (Sequence.num_pending) whose value the next decode reads on
device. Consequences: requests finished at step N are returned by the next step() call; a request
that stops on a stop/EOS token at step N had a row in N+1 whose output is discarded (its KV write
lands in its own freed block, rewritten before any reader; its block is never published). Before
preempting, the scheduler has the engine read back the step in flight (`_read_back_early`, counted
in get_stats()["sync_fallbacks"]): a preempted sequence never holds a pending token.
"""

from __future__ import annotations

import itertools
import time

from serving import engine_warmup
from serving.hybrid import hybrid_prefix
from serving.outputs import RequestOutput
from serving.cache.manager import CacheManager
from serving.cache.prefix_keys import PrefixKeys
from serving.config import (Config, check_model_len, check_watermark, effective_config,
                            eos_and_markers)
from serving.cache.hashing import make_hash_fn, root_hash
from serving.cache.kv_pool import default_num_blocks, kv_bytes_per_block
from serving.hybrid.recurrent_part import RecurrentCheckpoints
from serving.tiers.engine_tiers import lower_tiers, store_fingerprint
from serving.metrics import EngineStats
from serving.model_contract import EngineModel, check_family
from serving.step.kernel_choices import gdn_choice
from serving.step.model_runner import ModelRunner
from serving.recovery import recover
from serving.request_checks import check_request
from serving.request_output import request_output
from serving.scheduler import Scheduler
from serving.step_timer import StepTimer
from serving.sequence import Sequence, Status  # noqa: F401
from serving.token_apply import append_row, finish_reason, step_num_logprobs


class LLMEngine:
    def __init__(self, loaded: EngineModel, config: Config, *, dtype, seed: int = 0):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.cfg
        self.vocab_size = mcfg.vocab_size
        check_family(loaded.family)
        check_model_len(config, mcfg)
        gdn_choice(config, loaded.family, mcfg, dtype)  # one it cannot run: before the pools
        self.hybrid = loaded.family.IS_HYBRID
        # the engine's own Config: a copy where it differs from the caller's (never mutated)
        self.config = config = effective_config(config, self.hybrid)
        self.eos_ids, self.markers, self.marker_rows = eos_and_markers(config, mcfg, self.tokenizer)
        hybrid_cache, ck_pool = None, None
        if self.hybrid and config.enable_prefix_caching:  # before the KV pool takes the memory
            hybrid_cache, ck_pool = hybrid_prefix.build(config, loaded.family, mcfg, dtype)
        num_blocks = config.num_kv_blocks or default_num_blocks(config, mcfg, dtype)
        fingerprint = store_fingerprint(config, loaded, dtype, self.hybrid)
        self.runner = ModelRunner(config, loaded, num_blocks, dtype, marker_rows=self.marker_rows,
                                  ck_pool=ck_pool,
                                  span_pool=hybrid_prefix.take_span_pool(hybrid_cache),
                                  fresh_pages=lambda: self.cache.take_fresh())  # page_zeroing
        self.num_blocks = num_blocks = check_watermark(config, self.runner.num_blocks)  # may shrink
        self.bytes_per_block = kv_bytes_per_block(self.runner.cache, num_blocks, config.block_size)
        hash_fn = make_hash_fn(config.hash_algo)
        # hybrid models cache only with a checkpoint store (serving/hybrid/hybrid_prefix.py)
        caching = config.enable_prefix_caching and (not self.hybrid or hybrid_cache is not None)
        keys = PrefixKeys(config.block_size, hash_fn, lambda s: root_hash(hash_fn, s),
                          {"pad": self.markers["pad_token_id"],
                           "ssep": self.markers["ssep_token_id"],
                           "pdep": self.markers["pdep_token_id"]}, caching)
        tiers = lower_tiers(config, self.runner.cache, num_blocks, keys, fingerprint,
                            bytes_per_block=self.bytes_per_block, hybrid=self.hybrid,
                            model_name=loaded.source, markers=self.markers)
        recurrent = RecurrentCheckpoints(config.block_size, hybrid_cache) if self.hybrid else None
        # every cached thing (blocks, keys, lower tiers, checkpoints): serving/cache/manager.py
        self.cache = CacheManager(config, num_blocks, keys, tiers=tiers, recurrent=recurrent)
        self.scheduler = Scheduler(config, self.cache, hybrid=self.hybrid,
                                   before_preempt=self._read_back_early)
        self.seed = seed
        self._counter = itertools.count()
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        # (batch, runner handle) of each step launched and not read back, oldest first
        self._in_flight: list[tuple] = []
        self._timer = StepTimer()  # the current step's phases (EngineStats.record_step)
        self._early: list[RequestOutput] = []
        self.num_sync_fallbacks = 0  # read-backs forced before a preemption
        self.num_discarded_rows = 0  # rows of requests that had finished (or were aborted)

    def warmup(self, modes=((True, False, 0),), spans: bool | None = None) -> None:
        """Ready the step of each bucket and (all_greedy, use_filter, num_logprobs) mode: a run
        compiles nothing (serving/engine_warmup.py). spans: the span steps too (None: hybrids)."""
        engine_warmup.warmup(self, modes, spans)

    def first_calls(self) -> None:
        """Every warmed program run once more (engine_warmup.first_calls)."""
        engine_warmup.first_calls(self)

    # -- requests ------------------------------------------------------------------------------
    def validate(self, request_id, prompt_token_ids, sampling_params, *, label: str | None = None,
                 cache_salt: str | None = None):
        """Raise a ValueError/TypeError naming the request for input the engine cannot run;
        returns the prompt layout. Nothing is touched, so other requests are unaffected."""
        return check_request(request_id, prompt_token_ids, sampling_params,
                             who=label or f"request {request_id!r}", cache_salt=cache_salt,
                             engine=self, in_use=request_id in self._seqs)

    def add_request(self, request_id, prompt_token_ids, sampling_params, *,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt: str | None = None) -> None:
        """Queue one request (validated first; a bad one raises and changes nothing). One
        sample: `LLM.generate` runs SamplingParams.n > 1 as n requests."""
        layout = self.validate(request_id, prompt_token_ids, sampling_params,
                               cache_salt=cache_salt)
        if sampling_params.n != 1:
            raise ValueError(f"request {request_id!r}: SamplingParams.n={sampling_params.n}, but "
                             f"add_request runs one sample (add n requests, or use LLM.generate)")
        self._enqueue(request_id, prompt_token_ids, sampling_params, layout,
                      cache_salt=cache_salt, arrival_time=arrival_time, prompt=prompt)

    def _enqueue(self, request_id, prompt_token_ids, sampling_params, layout, *,
                 cache_salt=None, arrival_time=None, prompt=None, own_ids: bool = False) -> None:
        """Queue a request that `validate` accepted, with the layout it returned. `own_ids`:
        the caller hands over its list of ids (Sequence keeps it uncopied)."""
        seed = sampling_params.seed
        if seed is None:
            seed = hash((self.seed, next(self._counter))) & 0x7FFFFFFF
        seq = Sequence(request_id, prompt_token_ids, layout, sampling_params,
                       self.config.block_size, seed=seed, cache_salt=cache_salt,
                       arrival_time=arrival_time, own_ids=own_ids)
        seq.prompt_text = prompt
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            seq.ends_with_pending = False  # async: its in-flight token is discarded
        if seq is None or seq.is_finished:
            return
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
            seq.status = Status.FINISHED
        else:
            self.scheduler.finish(seq)

    def recover(self, request_ids) -> None:
        """After an exception inside `step()` (or an interrupt): abort `request_ids`, free their
        blocks, and leave the other requests runnable (serving/recovery.py)."""
        recover(self, request_ids)

    def has_unfinished(self) -> bool:
        return bool(self._early) or self.scheduler.has_unfinished()
    has_unfinished_requests = has_unfinished

    @property
    def num_in_flight(self) -> int:
        """Steps launched and not read back (async scheduling: one between step() calls)."""
        return len(self._in_flight)

    # -- recovery (serving/recovery.py) --------------------------------------------------------
    def drop_in_flight(self) -> bool:
        """Wait for every step in flight and forget it, its tokens unapplied (after a fault the
        host and those steps may be out of step). Returns whether each completed on device: if
        not, the pages it wrote cannot be trusted."""
        device_ok = True
        for _, handle in self._in_flight:
            try:
                self.runner.fetch(handle)
            except Exception:  # noqa: BLE001 -- the caller re-raises the original error
                device_ok = False
        self._in_flight = []
        return device_ok

    def live_sequences(self) -> list[Sequence]:
        """The sequences of the requests added and not yet returned or aborted."""
        return list(self._seqs.values())

    def discard_results(self, request_ids) -> None:
        """Forget the finished outputs of `request_ids` that no step() has returned yet."""
        ids = set(request_ids)
        self._early = [o for o in self._early if o.request_id not in ids]

    def give_back(self, outputs) -> None:
        """Outputs another caller stepped (generate beside a custom loop), for the next step()."""
        self._early[:0] = outputs

    # -- the cache manager's parts, for code that reads them ---------------------------------
    @property
    def bm(self):
        """The block pool (serving/cache/block_manager.py), owned by the cache manager."""
        return self.cache.bm

    @property
    def offload(self):
        """The host tier (HostKVTier) or None."""
        return self.cache.host

    @property
    def kv_store(self):
        """The span store (KVStoreTier) or None."""
        return self.cache.store

    @property
    def hybrid_cache(self):
        """The hybrid checkpoint cache (HybridPrefixCache) or None."""
        rec = self.cache.recurrent
        return None if rec is None else rec.cache

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (async scheduling:
        those whose last token the previous step sampled, see the module docstring). One loop
        for both modes: schedule, launch, read back the earlier step (its tokens, while this one
        runs), advance this step's frontiers (host work needing no sampled token), then read
        back what may not stay in flight: sync keeps nothing; async keeps this step unless
        nothing is left to overlap it with."""
        timer = self._timer
        timer.start()
        with timer.phase("schedule"):
            batch = self._schedule()
        if batch:
            self._launch(batch)
        elif not self._in_flight:
            self._check_progress()
            return self._take_finished()
        read = self._read_back_until(1 if batch else 0)  # freed on return, after the timer
        if batch:
            with timer.phase("overlap"):
                self._advance(batch)
                if self.config.async_scheduling:
                    self._hold_placeholders(batch)
        keep = self.config.async_scheduling and self.scheduler.has_unfinished()
        read += self._read_back_until(1 if keep else 0)
        self.cache.after_read_back()
        seconds = timer.stop()
        if batch:
            self.stats.record_step(batch, total=sum(seconds.values()), **seconds)
        else:  # only read back the step in flight: its time counts, it is no device step
            self.stats.record_read_back(sum(seconds.values()), seconds["device_wait"])
        return self._take_finished()

    def _launch(self, batch) -> None:
        """Build and dispatch the step (async: reading the tokens still in flight on device)."""
        with self._timer.phase("build"):
            num_lp = step_num_logprobs(batch, self.config.max_logprobs)
            handle = self.runner.launch(batch, num_logprobs=num_lp,
                                        use_prev=self.config.async_scheduling)
            self._in_flight.append((batch, handle))
            self.cache.after_launch()
        self._timer.move(self.runner.last_dispatch, "build", "dispatch")

    def _read_back_until(self, keep: int) -> list:
        """Read back the oldest steps in flight (waits for each) and apply their tokens until
        `keep` are left. A step leaves `_in_flight` only once read, so after a failed read-back
        recovery waits for it again (engine.drop_in_flight). Returns the steps read, (batch,
        handle, outputs): step() drops them once its timer has stopped, so freeing them is
        not charged to the step's phases (as the loops before 8e11161's redesign did)."""
        read = []
        while len(self._in_flight) > keep:
            batch, handle = self._in_flight[0]
            with self._timer.phase("device_wait"):
                out = self.runner.fetch(handle)
            del self._in_flight[0]
            read.append((batch, handle, out))
            self._early += self._postprocess(batch, out, handle[1],
                                             pending=self.config.async_scheduling)
        return read

    def _read_back_early(self) -> bool:
        """Scheduler hook before a preemption: read back the step in flight now (a synchronous
        step), so no preempted sequence holds a pending token. Returns whether there was one
        (never with sync scheduling: nothing is in flight while it schedules)."""
        if not self._in_flight:
            return False
        with self._timer.phase("post"):  # not scheduling time
            self._read_back_until(0)
        self.num_sync_fallbacks += 1
        return True

    def _schedule(self):
        """Schedule the step, then the page and checkpoint moves that must precede its launch."""
        self.cache.begin_step(self.scheduler.waiting)
        batch = self.scheduler.schedule()
        self.cache.before_launch(self.runner)
        return batch

    def _check_progress(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError("engine made no progress: nothing schedulable (pool too small "
                               "for the waiting request?)")

    def _hold_placeholders(self, batch) -> None:
        """Async: each sampling row's token is a placeholder until read back; a sequence that
        ends by length whatever the token is finished (blocks and seat freed) now, as the sync
        loop would here."""
        running, max_len = Status.RUNNING, self.config.max_model_len
        for e in batch:
            seq = e.seq
            if e.sample and seq.status is running:
                seq.append_placeholder()
                if len(seq.token_ids) >= max_len or seq.will_finish_by_length:
                    self.scheduler.finish(seq)
                    seq.ends_with_pending = True

    def _take_finished(self) -> list[RequestOutput]:
        """The step's finished requests. They are gathered in `_early` as they are made (also
        by a read-back before a preemption), so a step that raises later loses none of them."""
        finished, self._early = self._early, []
        return finished

    def _advance(self, batch) -> None:
        """Move frontiers (scheduler.advance), queue the blocks completed for the span store,
        hash and prefetch the next waiting prompts: host work done while the device computes."""
        sched = self.scheduler
        marks = self.cache.ready_marks(batch)
        sched.advance(batch)
        sched.prepare_waiting()
        self.cache.after_advance(batch, marks, sched.waiting)

    def flush_kv_store(self) -> None:
        """Write every block computed so far to the span store and wait for the files."""
        self.cache.flush(self.runner)

    def _postprocess(self, batch, out, num_lp, pending: bool = False) -> list[RequestOutput]:
        """Append (sync) or fill in (`pending`: async placeholders) each sampling row's token,
        then apply stop conditions. Async rows of requests that are no longer running (finished
        at the previous step, or aborted) are discarded."""
        finished = []
        try:
            self._apply_tokens(batch, out, num_lp, pending, finished)
        except BaseException:
            self._early += finished  # a fault part way: results already made are not lost
            raise
        return finished

    def _apply_tokens(self, batch, out, num_lp, pending, finished) -> None:
        running = Status.RUNNING
        now = time.time()
        tokens = out["tokens"].tolist()
        logprob = out["logprob"].tolist()
        eos, max_len = self.eos_ids, self.config.max_model_len
        for i, e in enumerate(batch):
            if not e.sample:
                continue
            seq = e.seq
            if pending and (not seq.num_pending or
                            (seq.status is not running and not seq.ends_with_pending)):
                self.num_discarded_rows += 1
                self.stats.query_tokens -= e.token_idx.size
                continue
            tok = tokens[i]
            append_row(seq, out, i, tok, logprob[i], pending=pending, now=now)
            reason = finish_reason(seq, tok, eos, max_len, self.tokenizer)
            if reason is not None:
                seq.finish_reason = reason
                if seq.ends_with_pending:  # async: already finished by length
                    seq.ends_with_pending = False
                    seq.finished_time = time.time()  # its last token arrives now
                else:
                    self.scheduler.finish(seq)
                self.stats.record_finish(seq)
                finished.append(self.make_output(seq))
                self._seqs.pop(seq.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (and host-tier block); hybrid models also get a fresh
        checkpoint store and placement from the current Config (strategy, budget; the device pool
        is kept, so the budget may not exceed what the engine started with). Only when idle."""
        if self.has_unfinished() or self._in_flight:
            raise RuntimeError("reset_prefix_cache: requests are still running")
        fresh = None
        if self.hybrid_cache is not None:
            runner = self.runner
            fresh, ck_pool = hybrid_prefix.build(
                self.config, self.loaded.family, self.loaded.cfg, runner.cache_dtype,
                pool=runner.ck_pool, span_pool=runner.span_pool)
            runner.use_recurrent_pools(ck_pool, hybrid_prefix.take_span_pool(fresh))
        self.cache.reset(recurrent_cache=fresh)

    def make_output(self, seq: Sequence) -> RequestOutput:
        return request_output(seq, self.tokenizer)

    def get_stats(self) -> dict:
        """Counters, hit rates and host/device time shares: `EngineStats.summary`."""
        return self.stats.summary(self)
