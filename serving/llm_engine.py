"""The engine: add_request / step / has_unfinished over scheduler + block manager + runner.

One `step()` = schedule (host) -> host-tier page moves -> one jitted device call -> advance
frontiers, append sampled tokens, finish requests. Public so custom loops and Ray actors can
drive it; `minipic_jax.LLM` is a thin batch wrapper over it.

Async scheduling (Config.async_scheduling, the default) overlaps the host with the device, one
step in flight: step() schedules and dispatches step N+1, then reads back step N's tokens (the
one sync, while N+1 runs), finishes requests, and advances N+1's frontiers. A token sampled by
the step in flight is a placeholder on the host (Sequence.num_pending) whose value the next
decode reads on device. Consequences: requests finished at step N are returned by the next
step() call; a request that stops on a stop/EOS token at step N had a row in N+1 whose output
is discarded (its KV write lands in its own freed block, rewritten before any reader; its block
is never published). Explicit synchronous fallback: before preempting, the scheduler has the
engine read back the step in flight first (`_read_back_early`), so preempted sequences never hold
a pending token (counted in get_stats()["sync_fallbacks"]).
"""

from __future__ import annotations

import gc
import itertools
import time

from serving.hybrid import hybrid_prefix
from serving.outputs import RequestOutput
from serving.cache.manager import CacheManager
from serving.cache.prefix_keys import PrefixKeys
from serving.config import Config, check_model_len, check_watermark, eos_and_markers
from serving.cache.hashing import make_hash_fn, root_hash
from serving.cache.kv_pool import default_num_blocks, kv_bytes_per_block
from serving.hybrid.recurrent_part import RecurrentCheckpoints
from serving.tiers.engine_tiers import lower_tiers, store_fingerprint
from serving.metrics import EngineStats
from serving.model_contract import EngineModel, check_family
from serving.step.model_runner import ModelRunner
from serving.recovery import recover
from serving.request_checks import check_request
from serving.request_output import request_output
from serving.scheduler import Scheduler
from serving.sequence import Sequence, Status  # noqa: F401
from serving.token_apply import append_row, finish_reason, step_num_logprobs


class LLMEngine:
    def __init__(self, loaded: EngineModel, config: Config, *, dtype, seed: int = 0):
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.cfg
        self.vocab_size = mcfg.vocab_size
        check_family(loaded.family)
        check_model_len(config, mcfg)
        self.hybrid = loaded.family.IS_HYBRID
        if self.hybrid and config.scheduling_policy == "isps":
            config.scheduling_policy = "fcfs"
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
        self.scheduler = Scheduler(config, self.cache, hybrid=self.hybrid)
        self.seed = seed
        self._counter = itertools.count()
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        # async scheduling: (batch, runner handle) of the step in flight, per-call timers
        self._inflight = None
        self._step_unread = False  # sync: a dispatched step not read back yet
        self._early: list[RequestOutput] = []
        self._t_wait = self._t_early = 0.0
        self.num_sync_fallbacks = 0  # read-backs forced before a preemption
        self.num_discarded_rows = 0  # rows of requests that had finished (or were aborted)
        if config.async_scheduling:
            self.scheduler.before_preempt = self._read_back_early

    def warmup(self, modes=((True, False, 0),), spans: bool = False) -> None:
        """Ready the step of each bucket and (all_greedy, use_filter, num_logprobs) mode, so a run
        compiles nothing (runner.warmup; spans: a hybrid's span steps; seconds: runner.startup)."""
        for all_greedy, use_filter, num_logprobs in modes:
            self.runner.warmup(all_greedy=all_greedy, use_filter=use_filter,
                               num_logprobs=num_logprobs, spans=spans)
        t0 = time.perf_counter()
        self.runner.cache = self.cache.warmup(self.runner.cache)  # span store's page moves
        t1 = time.perf_counter()
        gc.collect()  # tracing leaves millions of long-lived objects: out of the GC's reach
        gc.freeze()
        self.runner.startup.update(movers_s=t1 - t0, gc_s=time.perf_counter() - t1)

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
                 cache_salt=None, arrival_time=None, prompt=None) -> None:
        """Queue a request that `validate` accepted, with the layout it returned."""
        seed = sampling_params.seed
        if seed is None:
            seed = hash((self.seed, next(self._counter))) & 0x7FFFFFFF
        seq = Sequence(request_id, prompt_token_ids, layout, sampling_params,
                       self.config.block_size, seed=seed, cache_salt=cache_salt,
                       arrival_time=arrival_time)
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
    def _num_logprobs(self, batch) -> int:
        return step_num_logprobs(batch, self.config.max_logprobs)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (async scheduling:
        those whose last token the previous step sampled, see the module docstring)."""
        if self.config.async_scheduling:
            return self._step_async()
        return self._step_sync()

    def _resolve(self, inflight) -> list[RequestOutput]:
        """Read back a dispatched step's outputs (waits for it) and apply them."""
        batch, handle = inflight
        t0 = time.perf_counter()
        out = self.runner.fetch(handle)
        t1 = time.perf_counter()
        self._t_wait += t1 - t0
        return self._postprocess(batch, out, handle[1], pending=True)

    def _read_back_early(self) -> bool:
        """Scheduler hook before a preemption: read back the step in flight now (a synchronous
        step). Returns whether there was one."""
        if self._inflight is None:
            return False
        t0 = time.perf_counter()
        inflight, self._inflight = self._inflight, None
        self._early += self._resolve(inflight)
        self.num_sync_fallbacks += 1
        self._t_early += time.perf_counter() - t0
        return True

    def _step_async(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._t_wait = self._t_early = 0.0
        batch = self._schedule()
        t1 = time.perf_counter()
        dispatch = overlap = 0.0
        if batch:
            handle = self.runner.launch(batch, num_logprobs=self._num_logprobs(batch),
                                        use_prev=True)
            if self.hybrid_cache is not None:
                self.hybrid_cache.after_launch()
            dispatch = self.runner.last_dispatch
            t2 = time.perf_counter()
            inflight, self._inflight = self._inflight, (batch, handle)
            if inflight is not None:  # step N's tokens, while step N+1 runs
                self._early += self._resolve(inflight)
            t3 = time.perf_counter()
            self._advance(batch)
            self._hold_placeholders(batch)
            overlap = time.perf_counter() - t3
        elif self._inflight is not None:
            t2 = t1
            inflight, self._inflight = self._inflight, None
            self._early += self._resolve(inflight)
        else:
            self._check_progress()
            return self._take_finished()
        if self._inflight is not None and not self.scheduler.has_unfinished():
            inflight, self._inflight = self._inflight, None  # drain: nothing left to overlap
            self._early += self._resolve(inflight)
        if self.offload is not None:
            self.offload.materialize()
        total = time.perf_counter() - t0
        st = self.stats
        if batch:
            schedule, build = t1 - t0 - self._t_early, t2 - t1 - dispatch
            st.record_step(batch, total=total, device_wait=self._t_wait, dispatch=dispatch,
                           schedule=schedule, build=build, overlap=overlap,
                           post=total - schedule - build - dispatch - self._t_wait - overlap)
        else:
            st.record_read_back(total, self._t_wait)
        return self._take_finished()

    def _step_sync(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self._schedule()
        if not batch:
            self._check_progress()
            return self._take_finished()
        num_lp = self._num_logprobs(batch)
        t1 = time.perf_counter()
        tw = [0.0, 0.0, 0.0]
        # while the device computes: frontiers move (advance needs no sampled token) and the
        # next waiting prompts get their block hashes
        self._step_unread = True  # until read back, this step's pages are unverified
        out = self.runner.run(batch, num_logprobs=num_lp, timer=tw,
                              during=lambda: self._advance(batch))
        self._step_unread = False
        if self.hybrid_cache is not None:
            self.hybrid_cache.after_launch()
        t2 = time.perf_counter()
        self._early += self._postprocess(batch, out, num_lp)
        if self.offload is not None:
            self.offload.materialize()
        t3 = time.perf_counter()
        self.stats.record_step(batch, total=t3 - t0, device_wait=tw[1], dispatch=tw[0],
                               schedule=t1 - t0, build=t2 - t1 - tw[0] - tw[1] - tw[2],
                               post=t3 - t2, overlap=tw[2])
        return self._take_finished()

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
        if self.has_unfinished() or self._inflight is not None:
            raise RuntimeError("reset_prefix_cache: requests are still running")
        fresh = None
        if self.hybrid_cache is not None:
            fresh, self.runner.ck_pool = hybrid_prefix.build(
                self.config, self.loaded.family, self.loaded.cfg, self.runner.cache_dtype,
                pool=self.runner.ck_pool, span_pool=self.runner.span_pool)
            self.runner.span_pool = hybrid_prefix.take_span_pool(fresh)
        self.cache.reset(recurrent_cache=fresh)

    def make_output(self, seq: Sequence) -> RequestOutput:
        return request_output(seq, self.tokenizer)

    def get_stats(self) -> dict:
        """Counters, hit rates and host/device time shares: `EngineStats.summary`."""
        return self.stats.summary(self)
