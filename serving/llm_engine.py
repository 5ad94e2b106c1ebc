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

import numpy as np

from minipic_jax.outputs import Logprob, RequestOutput
from serving import checkpoint_pool, hybrid_prefix, span_rows
from serving.block_manager import BlockManager
from serving.config import Config, resolve_markers
from serving.hashing import make_hash_fn, root_hash
from serving.kv_pool import default_num_blocks, kv_bytes_per_block
from serving.layout import build_layout
from serving.metrics import EngineStats
from serving.model_runner import ModelRunner
from serving.offload import HostKVTier, PageMover
from serving.request_output import request_output
from serving.scheduler import Scheduler
from serving.sequence import Sequence, Status  # noqa: F401


class LLMEngine:
    def __init__(self, loaded, config: Config, *, dtype, seed: int = 0):
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.cfg
        self.vocab_size = mcfg.vocab_size
        self.hybrid = bool(getattr(loaded.family, "IS_HYBRID", False))
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
        self.runner = ModelRunner(config, loaded, num_blocks, dtype)
        self.runner.ck_pool = ck_pool
        self.num_blocks = num_blocks = self.runner.num_blocks  # a default pool may have shrunk
        self.bytes_per_block = kv_bytes_per_block(self.runner.cache, num_blocks, config.block_size)
        self.offload = None
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
            on_evict = lambda b, h, confirm: self.hybrid_cache.store.drop_dependent(h)  # noqa
        self.bm = BlockManager(num_blocks, config.block_size, enable_caching=caching,
                               on_evict=on_evict)
        hash_fn = make_hash_fn(config.hash_algo)
        self.scheduler = Scheduler(config, self.bm, hash_fn, lambda s: root_hash(hash_fn, s),
                                   offload=self.offload, hybrid=self.hybrid,
                                   hybrid_cache=self.hybrid_cache,
                                   markers={"pad": self.markers["pad_token_id"],
                                            "ssep": self.markers["ssep_token_id"],
                                            "pdep": self.markers["pdep_token_id"]})
        self.seed = seed
        self._counter = itertools.count()
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        # async scheduling: (batch, runner handle) of the step in flight, per-call timers
        self._inflight = None
        self._early: list[RequestOutput] = []
        self._t_wait = self._t_early = 0.0
        self.num_sync_fallbacks = 0  # read-backs forced before a preemption
        self.num_discarded_rows = 0  # rows of requests that had finished (or were aborted)
        if config.async_scheduling:
            self.scheduler.before_preempt = self._read_back_early

    def warmup(self, modes=((True, False, 0),)) -> None:
        """Compile the step for every token bucket and each (all_greedy, use_filter,
        num_logprobs) sampling mode, so a run that follows compiles nothing."""
        for all_greedy, use_filter, num_logprobs in modes:
            self.runner.warmup(all_greedy=all_greedy, use_filter=use_filter,
                               num_logprobs=num_logprobs)
        # Tracing and compiling leave millions of long-lived objects (jaxprs, caches): move
        # them out of the cyclic GC's reach so collections during serving stay short.
        gc.collect()
        gc.freeze()

    # -- requests ------------------------------------------------------------------------------
    def validate(self, request_id, prompt_token_ids, sampling_params, *, label: str | None = None):
        """Raise a ValueError naming the request for input the engine cannot run; returns the
        prompt layout. Nothing is touched, so other requests are unaffected."""
        cfg = self.config
        who = label or f"request {request_id!r}"
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError(f"{who}: empty prompt")
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{who}: prompt token ids must be integers")
        bad = np.flatnonzero((arr < 0) | (arr >= self.vocab_size))
        if bad.size:
            k = int(bad[0])
            raise ValueError(f"{who}: token id {ids[k]} at index {k} is outside "
                             f"the vocabulary [0, {self.vocab_size})")
        if len(ids) >= cfg.max_model_len:
            raise ValueError(f"{who}: prompt of {len(ids)} tokens is too long "
                             f"for max_model_len={cfg.max_model_len} (it needs room for at "
                             f"least one generated token)")
        m = self.markers
        layout = build_layout(ids, cfg.block_size, pad_id=m["pad_token_id"],
                              ssep_id=m["ssep_token_id"], pdep_id=m["pdep_token_id"],
                              markers=cfg.kv_mode != "pic_off")
        if layout.num_valid == 0:
            raise ValueError(f"{who}: prompt holds only pad tokens "
                             f"(pad_token_id={m['pad_token_id']})")
        if self.hybrid and layout.span_block.any():  # docs/DESIGN.md section 5 (cold path)
            span_rows.check_prompt(layout, cfg.block_size, len(ids),
                                   cfg.max_num_batched_tokens - cfg.max_num_seqs, who)
        if cfg.kv_mode == "rotated" and layout.has_markers:
            blk = int(np.flatnonzero(layout.seg_start[1:])[0]) + 1 if layout.seg_start[1:].any() else 0
            raise ValueError(f"{who}: SSEP/PDEP marker at token index "
                             f"{blk * cfg.block_size} but kv_mode='rotated' cannot reuse spans at "
                             f"other offsets; use kv_mode='position_free' or remove the markers")
        max_tokens = sampling_params.max_tokens or cfg.max_model_len
        total = min(len(ids) + max_tokens, cfg.max_model_len)
        need = -(-total // cfg.block_size)
        if need > self.num_blocks:
            raise ValueError(f"{who}: needs {need} KV blocks "
                             f"({total} tokens / block_size {cfg.block_size}) but the pool has "
                             f"only {self.num_blocks}; raise num_kv_blocks or lower max_tokens")
        if sampling_params.logprobs is not None and sampling_params.logprobs > cfg.max_logprobs:
            raise ValueError(f"{who}: logprobs={sampling_params.logprobs} > "
                             f"max_logprobs={cfg.max_logprobs}")
        if request_id in self._seqs:
            raise ValueError(f"{who}: request id already in use")
        return layout

    def add_request(self, request_id, prompt_token_ids, sampling_params, *,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt: str | None = None) -> None:
        """Queue one request (validated first; a bad one raises and changes nothing)."""
        layout = self.validate(request_id, prompt_token_ids, sampling_params)
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

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    has_unfinished_requests = has_unfinished

    # -- offload -------------------------------------------------------------------------------
    def _on_evict(self, block, h, confirm):
        self._evicted.append((block, h, confirm))

    def _move_pages(self):
        if self._evicted:
            blocks = [b for b, _, _ in self._evicted]
            batch = self.mover.gather(self.runner.cache, blocks)
            self.offload.pending.append(batch)
            for row, (_, h, confirm) in enumerate(self._evicted):
                self.offload.put(h, confirm, batch, row)
            self._evicted = []
        copy_in = self.scheduler.pending_copy_in
        if copy_in:
            sources = [self.offload.get(h) for _, h in copy_in]
            self.runner.cache = self.mover.scatter(self.runner.cache, [b for b, _ in copy_in],
                                                   sources)
            self.scheduler.pending_copy_in = []

    def _move_checkpoints(self):
        """Hybrid models: the checkpoint store's slot moves of this step, before its launch."""
        if self.hybrid_cache is None or self.runner.ck_pool is None:
            return
        out, inn = self.hybrid_cache.store.take_moves()
        if out or inn:
            self.runner.ck_pool = checkpoint_pool.apply_moves(self.runner.ck_pool, out, inn)

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
        batch = sched.schedule()
        if self.offload is not None:
            self._move_pages()
        self._move_checkpoints()
        finished, self._early = self._early, []
        t1 = time.perf_counter()
        dispatch = overlap = 0.0
        if batch:
            handle = self.runner.launch(batch, num_logprobs=self._num_logprobs(batch),
                                        use_prev=True)
            if self.hybrid_cache is not None:
                self.hybrid_cache.store.after_launch()
            dispatch = self.runner.last_dispatch
            t2 = time.perf_counter()
            inflight, self._inflight = self._inflight, (batch, handle)
            if inflight is not None:  # step N's tokens, while step N+1 runs
                finished += self._resolve(inflight)
            t3 = time.perf_counter()
            sched.advance(batch)
            sched.prepare_waiting()
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
            finished += self._resolve(inflight)
        elif sched.has_unfinished():
            raise RuntimeError("engine made no progress: nothing schedulable (pool too small "
                               "for the waiting request?)")
        else:
            return finished
        if self._inflight is not None and not sched.has_unfinished():
            inflight, self._inflight = self._inflight, None  # drain: nothing left to overlap
            finished += self._resolve(inflight)
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
        return finished

    def _step_sync(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler
        batch = sched.schedule()
        if self.offload is not None:
            self._move_pages()
        self._move_checkpoints()
        if not batch:
            if sched.has_unfinished():
                raise RuntimeError("engine made no progress: nothing schedulable (pool too small "
                                   "for the waiting request?)")
            return []
        num_lp = self._num_logprobs(batch)
        t1 = time.perf_counter()
        tw = [0.0, 0.0, 0.0]
        # while the device computes: frontiers move (advance needs no sampled token) and the
        # next waiting prompts get their block hashes
        out = self.runner.run(batch, num_logprobs=num_lp, timer=tw,
                              during=lambda: (sched.advance(batch), sched.prepare_waiting()))
        if self.hybrid_cache is not None:
            self.hybrid_cache.store.after_launch()
        t2 = time.perf_counter()
        finished = self._postprocess(batch, out, num_lp)
        if self.offload is not None:
            self.offload.materialize()
        t3 = time.perf_counter()
        self.stats.record_step(batch, total=t3 - t0, device_wait=tw[1], dispatch=tw[0],
                               schedule=t1 - t0, build=t2 - t1 - tw[0] - tw[1] - tw[2],
                               post=t3 - t2, overlap=tw[2])
        return finished

    def _postprocess(self, batch, out, num_lp, pending: bool = False) -> list[RequestOutput]:
        """Append (sync) or fill in (`pending`: async placeholders) each sampling row's token,
        then apply stop conditions. Async rows of requests that are no longer running (finished
        at the previous step, or aborted) are discarded."""
        finished = []
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
        return finished

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
                pool=self.runner.ck_pool)
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
        if self.hybrid_cache is not None:
            out.update(self.hybrid_cache.stats())
        return out

