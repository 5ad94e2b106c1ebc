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


from serving import checkpoint_pool, hybrid_prefix, span_maps, span_rows
from serving.outputs import Logprob, RequestOutput
from serving.block_manager import BlockManager
from serving.config import Config, resolve_markers
from serving.hashing import make_hash_fn, root_hash
from serving.fingerprint import model_fingerprint
from serving.kv_pool import default_num_blocks, kv_bytes_per_block
from serving.kv_store_tier import ChunkedPageMover, LowerTiers, open_kv_store
from serving.metrics import EngineStats
from serving.model_contract import EngineModel, check_family
from serving.model_runner import ModelRunner
from serving.offload import HostKVTier, PageMover
from serving.recovery import recover
from serving.request_checks import check_fits, check_prompt, check_sampling, check_token_ids
from serving.request_output import request_output
from serving.scheduler import Scheduler
from serving.sequence import Sequence, Status  # noqa: F401
from serving.stop_strings import find_stop_string


class LLMEngine:
    def __init__(self, loaded: EngineModel, config: Config, *, dtype, seed: int = 0):
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.cfg
        self.vocab_size = mcfg.vocab_size
        check_family(loaded.family)
        if config.max_model_len > (mcfg.max_position_embeddings or config.max_model_len):
            raise ValueError(f"Config.max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        self.hybrid = loaded.family.IS_HYBRID
        if self.hybrid and config.scheduling_policy == "isps":
            config.scheduling_policy = "fcfs"
        self.eos_ids = set(mcfg.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        reserved = self.eos_ids | {i for i in (mcfg.bos_token_id,
                                               getattr(self.tokenizer, "bos_token_id", None))
                                   if i is not None}
        self.markers = resolve_markers(config, mcfg.vocab_size, reserved)
        self.hybrid_cache, ck_pool = None, None
        if self.hybrid and config.enable_prefix_caching:  # before the KV pool takes the memory
            self.hybrid_cache, ck_pool = hybrid_prefix.build(config, loaded.family, mcfg, dtype)
        num_blocks = config.num_kv_blocks or default_num_blocks(config, mcfg, dtype)
        fingerprint = None
        if config.kv_store_dir is not None:  # before the runner fuses weights
            if self.hybrid:
                raise ValueError("kv_store_dir: the span store holds attention KV blocks only; a "
                                 "hybrid model's recurrent checkpoints are not stored on disk yet")
            fingerprint = model_fingerprint(mcfg, loaded.params, dtype)
        self.runner = ModelRunner(config, loaded, num_blocks, dtype)
        self.runner.ck_pool = ck_pool
        self._take_span_pool()
        self.num_blocks = num_blocks = self.runner.num_blocks  # a default pool may have shrunk
        self.bytes_per_block = kv_bytes_per_block(self.runner.cache, num_blocks, config.block_size)
        self.offload = self.mover = self.kv_store = None
        self._evicted: list[tuple[int, int, tuple]] = []
        caching = config.enable_prefix_caching
        if config.cpu_offload_gb > 0 and caching:
            # hybrid models: the other half of cpu_offload_gb holds recurrent checkpoints
            cap = int(config.cpu_offload_gb * (1 << 30) / (2 if self.hybrid else 1)
                      ) // max(self.bytes_per_block, 1)
            self.offload = HostKVTier(cap)
            self.mover = PageMover(num_blocks, config.block_size)
        on_evict = self._on_evict if self.offload else None
        if self.hybrid_cache is not None and self.offload is None:  # checkpoints above die too
            on_evict = lambda b, h, confirm: self.hybrid_cache.drop_dependent(h)  # noqa
        self.bm = BlockManager(num_blocks, config.block_size, enable_caching=caching,
                               on_evict=on_evict)
        hash_fn = make_hash_fn(config.hash_algo)
        self.scheduler = Scheduler(config, self.bm, hash_fn, lambda s: root_hash(hash_fn, s),
                                   offload=self.offload, hybrid=self.hybrid,
                                   hybrid_cache=self.hybrid_cache,
                                   markers={"pad": self.markers["pad_token_id"],
                                            "ssep": self.markers["ssep_token_id"],
                                            "pdep": self.markers["pdep_token_id"]})
        if fingerprint is not None:
            self.kv_store = open_kv_store(config, self.runner.cache, num_blocks,
                                          self.scheduler.keys, fingerprint=fingerprint,
                                          model_name=loaded.source, markers=self.markers,
                                          bytes_per_block=self.bytes_per_block)
            self.scheduler.offload = LowerTiers(self.offload, self.kv_store)
            self.mover = ChunkedPageMover(num_blocks, config.block_size)
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
        """Compile the step for every token bucket and each (all_greedy, use_filter,
        num_logprobs) sampling mode, so a run that follows compiles nothing. spans: also the
        span steps of a hybrid model (runner.warmup)."""
        for all_greedy, use_filter, num_logprobs in modes:
            self.runner.warmup(all_greedy=all_greedy, use_filter=use_filter,
                               num_logprobs=num_logprobs, spans=spans)
        if self.kv_store is not None:  # the span store's page moves (chunk buckets)
            self.runner.cache = self.mover.warmup(self.runner.cache)
        # Tracing and compiling leave millions of long-lived objects (jaxprs, caches): move
        # them out of the cyclic GC's reach so collections during serving stay short.
        gc.collect()
        gc.freeze()

    # -- requests ------------------------------------------------------------------------------
    def validate(self, request_id, prompt_token_ids, sampling_params, *, label: str | None = None,
                 cache_salt: str | None = None):
        """Raise a ValueError/TypeError naming the request for input the engine cannot run;
        returns the prompt layout. Nothing is touched, so other requests are unaffected."""
        who = label or f"request {request_id!r}"
        check_sampling(sampling_params, who, self.vocab_size, self.tokenizer)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"{who}: cache_salt must be a str or None, "
                            f"got {type(cache_salt).__name__}")
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
            raise TypeError(f"{who}: prompt token ids must be a list of ints, "
                            f"got {type(prompt_token_ids).__name__}")
        ids = check_token_ids(prompt_token_ids, who, self.vocab_size)
        layout = check_prompt(ids, who, self.config, self.markers)
        check_fits(len(ids), sampling_params, who, self.config, self.num_blocks)
        cfg = self.config
        if self.hybrid and layout.span_block.any():  # docs/DESIGN.md section 5 (cold path)
            span_rows.check_prompt(layout, cfg.block_size, len(ids),
                                   cfg.max_num_batched_tokens - cfg.max_num_seqs, who)
        if request_id in self._seqs:
            raise ValueError(f"{who}: request id already in use")
        return layout

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

    # -- offload -------------------------------------------------------------------------------
    def _on_evict(self, block, h, confirm):
        self._evicted.append((block, h, confirm))

    def _move_pages(self):
        """This step's page moves. The copy-ins the scheduler planned are looked up before the
        step's evictions enter the host tier: a put may drop the tier's oldest entries, which
        can be exactly the planned ones. Evicted pages are gathered before the scatter, which
        may reuse their device blocks."""
        if self.kv_store is not None:  # before copy-ins overwrite any block
            self.kv_store.dispatch_writes(self.mover, self.runner.cache)
        copy_in = self.scheduler.pending_copy_in
        sources = [self.scheduler.offload.get(h) for _, h in copy_in]
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            batch = self.mover.gather(self.runner.cache, [b for b, _, _ in evicted])
            self.offload.pending.append(batch)
            for row, (_, h, confirm) in enumerate(evicted):
                self.offload.put(h, confirm, batch, row)
        if copy_in:
            self.runner.cache = self.mover.scatter(self.runner.cache, [b for b, _ in copy_in],
                                                   sources)
            self.scheduler.pending_copy_in = []

    def _move_checkpoints(self):
        """Hybrid models: the checkpoint store's slot moves of this step, before its launch."""
        if self.hybrid_cache is None:
            return
        spans = self.hybrid_cache.spans
        if spans is not None:  # span maps (serving/span_cache.py), the same store bookkeeping
            out, inn = spans.store.take_moves()
            if out or inn:
                self.runner.span_pool = span_maps.apply_moves(self.runner.span_pool, out, inn)
        if self.runner.ck_pool is None:
            return
        out, inn = self.hybrid_cache.store.take_moves()
        if out or inn:
            self.runner.ck_pool = checkpoint_pool.apply_moves(self.runner.ck_pool, out, inn)

    def _take_span_pool(self) -> None:
        """The span-map device pool moves from the hybrid cache's builder to the runner."""
        spans = self.hybrid_cache.spans if self.hybrid_cache is not None else None
        self.runner.span_pool = None if spans is None else spans.pool  # None: spans run cold
        if spans is not None:
            spans.pool = None

    # -- the step ------------------------------------------------------------------------------
    def _num_logprobs(self, batch) -> int:
        num_lp = 0
        for e in batch:
            if e.sample and e.seq.sampling_params.logprobs is not None:
                num_lp = max(num_lp, e.seq.sampling_params.logprobs)
        if num_lp:
            num_lp = min(1 << (num_lp - 1).bit_length() if num_lp > 1 else 1,
                         self.config.max_logprobs)
        return num_lp

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
        sched = self.scheduler
        self._t_wait = self._t_early = 0.0
        if self.kv_store is not None:
            self.kv_store.begin_step(sched.waiting, self.bm, self.offload)
        batch = sched.schedule()
        if self.mover is not None:
            self._move_pages()
        self._move_checkpoints()
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
            running, max_len = Status.RUNNING, self.config.max_model_len
            for e in batch:
                seq = e.seq
                if e.sample and seq.status is running:
                    seq.append_placeholder()
                    if len(seq.token_ids) >= max_len or seq.will_finish_by_length:
                        # finished whatever the token: free now, as the sync loop would here
                        sched.finish(seq)
                        seq.ends_with_pending = True
            overlap = time.perf_counter() - t3
        elif self._inflight is not None:
            t2 = t1
            inflight, self._inflight = self._inflight, None
            self._early += self._resolve(inflight)
        elif sched.has_unfinished():
            raise RuntimeError("engine made no progress: nothing schedulable (pool too small "
                               "for the waiting request?)")
        else:
            return self._take_finished()
        if self._inflight is not None and not sched.has_unfinished():
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
        else:  # a read-back only: its time counts, it is no device step
            st.step_time += total
            st.device_wait += self._t_wait
            st.post += total - self._t_wait
        return self._take_finished()

    def _step_sync(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler
        if self.kv_store is not None:
            self.kv_store.begin_step(sched.waiting, self.bm, self.offload)
        batch = sched.schedule()
        if self.mover is not None:
            self._move_pages()
        self._move_checkpoints()
        if not batch:
            if sched.has_unfinished():
                raise RuntimeError("engine made no progress: nothing schedulable (pool too small "
                                   "for the waiting request?)")
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

    def _take_finished(self) -> list[RequestOutput]:
        """The step's finished requests. They are gathered in `_early` as they are made (also
        by a read-back before a preemption), so a step that raises later loses none of them."""
        finished, self._early = self._early, []
        return finished

    def _advance(self, batch) -> None:
        """Move frontiers (scheduler.advance), queue the blocks completed for the span store,
        hash and prefetch the next waiting prompts: host work done while the device computes."""
        sched = self.scheduler
        ready_before = [e.seq.ready_ptr for e in batch] if self.kv_store is not None else None
        sched.advance(batch)
        sched.prepare_waiting()
        if ready_before is not None:
            self.kv_store.note_ready(batch, ready_before, self.bm)
            self.kv_store.prefetch(sched.waiting, self.bm, self.offload)

    def flush_kv_store(self) -> None:
        """Write every block computed so far to the span store and wait for the files."""
        if self.kv_store is not None:
            self.kv_store.flush(self.mover, self.runner.cache)

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
            sp = seq.sampling_params
            tok = tokens[i]
            if sp.logprobs is not None:
                # rank only for logprobs >= 1 (the step computes ranks when any row asks for
                # top logprobs; with logprobs=0 it would depend on the batch's other rows)
                d = {tok: Logprob(logprob[i], int(out["rank"][i]) if sp.logprobs else None)}
                if sp.logprobs:
                    for r in range(sp.logprobs):
                        tid = int(out["top_ids"][i, r])
                        if tid not in d:
                            d[tid] = Logprob(float(out["top_logprobs"][i, r]), r + 1)
                seq.output_logprobs.append(d)
            seq.cum_logprob += logprob[i]
            if pending:
                seq.resolve_placeholder(tok)
            else:
                seq.append_token(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = seq.stop_check(tok, eos, max_len)
            if sp.stop and reason != "stop" and find_stop_string(
                    seq, self.tokenizer, armed=seq.num_output_tokens >= sp.min_tokens):
                reason = "stop"
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
        bm = self.bm
        for b in range(bm.num_blocks):
            if bm.hash[b] != -1:
                bm._unregister(b)
        if self.offload is not None:
            self.offload.entries.clear()
        if self.hybrid_cache is not None:
            self.hybrid_cache, self.runner.ck_pool = hybrid_prefix.build(
                self.config, self.loaded.family, self.loaded.cfg, self.runner.cache_dtype,
                pool=self.runner.ck_pool, span_pool=self.runner.span_pool)
            self._take_span_pool()
            self.scheduler.hybrid_cache = self.hybrid_cache

    def make_output(self, seq: Sequence) -> RequestOutput:
        return request_output(seq, self.tokenizer)

    def get_stats(self) -> dict:
        """EngineStats.summary plus the async-scheduling counters. With async scheduling the
        host works while the device computes: host_time_share (1 - wait / wall) is then the
        host's busy share, not device idle time; host_work_share stays host work / step time."""
        out = self.stats.summary(self)
        out.update(async_scheduling=self.config.async_scheduling,
                   sync_fallbacks=self.num_sync_fallbacks,
                   discarded_rows=self.num_discarded_rows)
        if self.kv_store is not None:
            out["kv_store"] = self.kv_store.stats()
        if self.hybrid_cache is not None:
            out.update(self.hybrid_cache.stats())
        return out

