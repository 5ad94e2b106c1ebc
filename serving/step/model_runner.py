"""Runs one engine step on device: host metadata -> one jitted (forward + sample) call.

Per step the host packs every int input (tokens, attention metadata, recurrent slots, logits rows,
sampling ints) into one int32 buffer and the float sampling inputs into one float32 buffer, so a
step is one dispatch with two transfers in and one device_get out (the only host sync). Shapes are
bucketed by `Config.token_buckets` (see serving/config.py); the KV cache is donated. Block-table
rows live in host arrays indexed by seat and are updated incrementally.

Async scheduling (Config.async_scheduling): the step also takes `prev` [seats + 1], the last
token sampled per seat, kept on device. An input token -(seat + 1) is read from it (a decode
whose token the previous step sampled and the host has not read yet), and every sampling row
writes its token to prev[sample_seat] (other rows write the scratch entry). So step N+1 is
dispatched before step N's tokens reach the host (`launch` now, `fetch` later).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention.api import step_options
from kernels_pallas.paged_attention.metadata import AttentionMetadata
from serving.hybrid import checkpoint_pool as ckpt_pool, span_compose, span_step
from serving.step import (compile_options, program_switches, resident_tables, sharding,
                          state_placement)
from serving.step.kernel_choices import attention_choices, gdn_choice
from serving.cache.kv_pool import size_pool
from serving.config_groups import step_key_fields
from serving.model_contract import EngineModel, RecurrentMetadata
from serving.cache.page_zeroing import PageZeroer, zero_pages
from serving.step.sampler import SamplingMetadata, pack_outputs, sample, unpack_outputs
from serving.step.step_executables import StepExecutables
from serving.step.step_inputs import (S_FIELDS_CKPT, SeatTables, clear_ints, fill_checkpoints,
                                      fill_sampling, layout)

class ModelRunner:
    def __init__(self, config, loaded: EngineModel, num_blocks: int, dtype, *, marker_rows=None,
                 ck_pool=None, span_pool=None, fresh_pages=None):
        self.config = config
        self.family = loaded.family
        self.mcfg = loaded.cfg
        # the gated delta kernel, refused before any work when it cannot take the model
        self.gdn_impl = gdn_choice(config, loaded.family, loaded.cfg, dtype)
        t0 = time.perf_counter()
        tp = config.tensor_parallel_size
        self.mesh = None
        if tp > 1:  # Megatron split by logical axes (serving/step/sharding.py), weights unfused
            self.mesh, self.mcfg = sharding.place_model(loaded, tp, dtype)
        elif config.fuse_weights:
            # one layer at a time, originals deleted as they are fused (peak: one extra layer)
            params, loaded.params = loaded.params, None
            loaded.params = loaded.family.fuse_params(params, consume=True)
            del params
        self.params = loaded.params
        jax.block_until_ready(self.params)
        t1 = time.perf_counter()
        self.cache_dtype = dtype
        self.hybrid = bool(getattr(self.family, "IS_HYBRID", False))  # spans: span_rows.py
        self.block_size = config.block_size
        self.nb = config.max_blocks_per_seq
        self.chain_length = span_step.chain_length(self.nb)  # span chains: one static length
        seats = config.num_seats
        self.scratch_slot = seats  # recurrent slot for padding rows
        self.composer = span_compose.ComposeInputs(  # chains' programs (span_compose.py)
            config.seq_bucket(config.token_buckets[-1]), self.chain_length, self.scratch_slot,
            config.span_maps.compose_precision)

        def make_cache(n):
            def make():
                return self.family.init_cache(self.mcfg, n, config.block_size, seats + 1, dtype)
            if self.mesh is None:
                return make()
            return sharding.init_sharded(make, self.family.cache_axes(self.mcfg), self.mesh)

        self.num_blocks = num_blocks  # the step's trace reads it (kv_pool.size_pool)
        self.kv_mode = config.attention_kv_mode
        self.tables = SeatTables(seats, self.nb, self.block_size, self.mcfg.vocab_size, marker_rows)
        self._bufs: dict = {}
        self._table_rows: dict = {}  # id(int buffer) -> block-table rows its last step wrote
        self._parity = 0  # async: two host buffer sets alternate (one step in flight)
        self.prev_tokens = None  # async: [seats + 1] int32 device array, last token per seat
        # the seats' block tables on device, updated by each step (resident_tables.py)
        self.dev_tables = resident_tables.DeviceTables(self.tables, self.mesh, seats)
        self.use_recurrent_pools(ck_pool, span_pool)  # hybrid: checkpoint_pool, span_maps
        # the static arguments are _step_body's keyword-only parameters
        self._step = StepExecutables(self._step_impl, signature_of=self._step_body,
                                     donate_argnums=(1, 5, 6, 7), context=self._program_context,
                                     source_dirs=(os.path.dirname(self.family.__file__),),
                                     store_setting=config.step_cache,
                                     compiler_options=compile_options.for_config(config))
        general, decode = attention_choices(config, self.mcfg, dtype)
        self.attn_impl, self.attn_options = general
        self.decode_impl, self.decode_options = decode
        # decode-only steps compile their own variant only when it differs from the general one
        self.separate_decode = decode != general
        self.static_recurrent_kind = True  # see _recurrent_kind
        # the pool last: a default one is sized now the weights are placed, less the traced step
        self.cache, self.num_blocks, self.step_reserve = size_pool(
            self, make_cache, num_blocks, loaded.cfg, step=(self._args, self._step_impl))
        self.zeroer = PageZeroer(self.num_blocks, config, source=fresh_pages)  # page_zeroing.py
        # seconds per start-up phase (weights placed / fused, KV pool, warm-up); warmed variants
        self.startup: dict = {"weights_place_s": t1 - t0, "pool_s": time.perf_counter() - t1}
        self._warm_steps: dict = {}  # variant -> (ints, floats, use_prev, kw)

    @property
    def num_compiles(self) -> int:
        """Step variants ready (compiled or loaded) in this process."""
        return self._step._cache_size()

    def _program_context(self) -> str:
        """What the traced step depends on besides its arguments (executable_store.py keys stored
        executables by it; StepExecutables adds the compiler options): the model, the Config
        fields that can reach the step (host-only ones left out: fcfs and barrier share programs)
        and the attention plan, and the module switches' values (program_switches.py)."""
        fields = step_key_fields(self.config)  # all but the fields marked host_only
        return repr((program_switches.values(), self.family.__name__, self.mcfg,
                     sorted(fields.items()), self.kv_mode,
                     self.attn_impl, self.attn_options, self.decode_impl, self.decode_options,
                     self.separate_decode, self.gdn_impl, self.nb, self.block_size, self.scratch_slot,
                     str(jnp.dtype(self.cache_dtype)), repr(self.mesh),
                     None if self.mesh is None else [d.id for d in self.mesh.devices.flat]))

    # -- device --------------------------------------------------------------------------------
    def _step_impl(self, params, cache, ints, floats, prev=None, pool=None, maps=None,
                   tables=None, **kw):
        if self.mesh is None:
            return self._step_body(params, cache, ints, floats, prev, pool, maps, tables, **kw)
        # the kernels run per head shard under this mesh (kernels_pallas/sharding.py); the state
        # comes out where it went in, so every variant takes it (state_placement.py)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            out = self._step_body(params, cache, ints, floats, prev, pool, maps, tables, **kw)
        tables = None if out[5] is None else resident_tables.pin(out[5], self.mesh)
        return state_placement.pin_outputs(self.family, self.mcfg, self.mesh, out[:5]) + (tables,)

    def _step_body(self, params, cache, ints, floats, prev=None, pool=None, maps=None,
                   tables=None, *, t, s, all_greedy, use_filter, num_logprobs, decode_only=False,
                   spans=False, attn_options=None, compose=()):
        if compose:  # the chains of cached span maps, before the step (span_compose.py)
            return span_compose.program(self.family, cache, pool, maps, ints, *compose,
                                        precision=self.composer.precision), None, prev, pool, \
                maps, tables
        warm = spans and maps is not None  # the span-map warm path (serving/hybrid/span_step.py)
        spec, size = layout(t, s, self.nb, pool is not None, spans, warm,
                            block_size=self.block_size, resident=tables is not None)
        if ints.shape[0] != size:  # e.g. a replay passing a resident-table step's ints, no tables
            raise ValueError(f"step ints hold {ints.shape[0]} entries, the layout needs {size} "
                             f"(resident tables: {tables is not None}; see resident_tables.py)")
        f = {k: jax.lax.dynamic_slice_in_dim(ints, o, int(np.prod(shape))).reshape(shape)
             for k, (o, shape) in spec.items()}
        if tables is not None:  # this step's changes applied, then its seats' rows gathered
            tables, rows = resident_tables.apply(tables, f)
            f["block_tables"], f["block_pos_start"], f["block_num_valid"] = rows
        # fresh pages are zeroed before anything writes (serving/cache/page_zeroing.py)
        cache = zero_pages(cache, f["zero_pages"], self.num_blocks, self.block_size)
        md = AttentionMetadata(
            q_positions=f["q_positions"], q_window_start=f["q_window_start"], q_seq=f["q_seq"],
            cu_q_lens=f["cu_q_lens"], num_blocks=f["num_blocks"], block_tables=f["block_tables"],
            block_pos_start=f["block_pos_start"], block_num_valid=f["block_num_valid"],
            slot_mapping=f["slot_mapping"])
        reset = f["reset"] > 0
        warm = warm and not decode_only
        rec = RecurrentMetadata(state_slots=f["state_slots"], reset=reset,
                                decode=self._recurrent_kind(decode_only))
        tokens = f["tokens"]
        if prev is not None:  # -(seat + 1): the token the previous step sampled for that seat
            tokens = jnp.where(tokens < 0, prev[jnp.maximum(-tokens - 1, 0)], tokens)
        extra = {"write_impl": self.config.write_kv_impl} if self.config.write_kv_impl else {}
        if self.gdn_impl is not None:
            extra["gdn_impl"] = self.gdn_impl
        if spans:
            extra["span_pieces"] = span_step.pieces(f, maps, warm, t, s)
        if attn_options is None:  # a caller without the step's plan (launch always has one)
            attn_options = self.attn_options
        kw = dict(recurrent=rec, logits_indices=f["logits_indices"], kv_mode=self.kv_mode,
                  attn_impl=self.decode_impl if decode_only else self.attn_impl,
                  attn_options=self.decode_options if decode_only else attn_options, **extra)
        if warm:
            logits, cache, pool, maps = span_step.forward(
                self.family, params, tokens, md, cache, self.mcfg, pool, maps, f, kw)
        elif pool is None:
            logits, cache = self.family.forward(params, tokens, md, cache, self.mcfg, **kw)
        else:
            logits, cache, pool = ckpt_pool.checkpointed_forward(
                self.family, params, tokens, md, cache, self.mcfg, pool, f, decode_only, kw)
        sm = SamplingMetadata(temperature=floats[:s], top_k=f["top_k"], top_p=floats[s:],
                              seed=f["seed"].astype(jnp.uint32), step=f["step"])
        out = sample(logits, sm, all_greedy=all_greedy, use_filter=use_filter,
                     num_logprobs=num_logprobs)
        if prev is not None:
            prev = prev.at[f["sample_seat"]].set(out["tokens"])  # [seats + 1]
        return cache, pack_outputs(out, num_logprobs), prev, pool, maps, tables

    def _recurrent_kind(self, decode_only: bool):
        """RecurrentMetadata.decode of a step (static): decode-only steps run the one-step
        recurrence; with a separate decode variant every other step holds a prefill row, so it
        runs the chunked prefill; else (an all-decode step may take the general variant) the
        device decides, a lax.cond per recurrent layer (cheap on CPU; on a GPU a host sync per
        layer: `static_recurrent_kind` False restores it for A/B, hybrid_step_profile.py)."""
        if not self.static_recurrent_kind:
            return None
        return True if decode_only else (False if self.separate_decode else None)

    def use_recurrent_pools(self, ck_pool, span_pool) -> None:
        """Step with these checkpoint and span-map pools from now on (a fresh hybrid store over
        the same device memory: LLMEngine.reset_prefix_cache), placed as the step takes them."""
        self.ck_pool, self.span_pool = state_placement.place_pools(
            self.family, self.mcfg, self.mesh, ck_pool, span_pool)

    def _args(self, ints, floats, use_prev: bool, kw) -> tuple:
        """The step's arguments: the span map pool goes only to span steps and compose programs
        (span_compose.py; they never take the previous tokens)."""
        maps = kw.get("spans") or kw.get("compose")
        compose = kw.get("compose")
        return (self.params, self.cache, ints, floats,
                self._prev() if use_prev and not compose else None,
                self.ck_pool, self.span_pool if maps else None,
                None if compose else self.dev_tables.arg())

    def _dispatch(self, ints, floats, use_prev: bool, kw):
        """One step; keeps the donated cache (and prev tokens, checkpoint pool, span map pool)."""
        args = self._args(ints, floats, use_prev, kw)
        self.cache, packed, prev, pool, maps, tables = self._step(*args, **kw)
        if args[4] is not None:
            self.prev_tokens = prev
        if args[7] is not None:
            self.dev_tables.keep(tables)
        self.ck_pool = pool
        if args[6] is not None:
            self.span_pool = maps
        return packed

    def _prev(self):
        if self.prev_tokens is None:
            self.prev_tokens = jnp.zeros(self.config.num_seats + 1, jnp.int32)
        return self.prev_tokens

    def warmup(self, *, all_greedy: bool = True, use_filter: bool = False,
               num_logprobs: int = 0, spans: bool = False, run: bool = True) -> None:
        """Ready the step of every token bucket for one sampling mode, with every per-step
        attention plan a step of that bucket can take (fits / overflows), then (`run`) run each
        once, empty (`first_calls`). spans (hybrid models): each bucket's span step too, and with
        a span-map pool the compose program of every chain-row bucket at the engine's one chain
        length (serving/hybrid/span_compose.py). Ready = loaded from the executable store or
        traced, lowered and compiled in threads (serving/step/step_executables.py)."""
        warm = [(*w[:2], self.config.async_scheduling, w[2]) for w in self.warmup_steps(
            all_greedy=all_greedy, use_filter=use_filter, num_logprobs=num_logprobs, spans=spans)]
        t0 = time.perf_counter()
        self._step.prepare([(self._args(*w), w[3]) for w in warm])
        self._warm_steps.update((repr(sorted(w[3].items())), w) for w in warm)
        st = self.startup
        st["prepare_s"] = st.get("prepare_s", 0.0) + time.perf_counter() - t0
        st.update(self._step.timings, **self._step.counts, variants=len(self._warm_steps))
        if run:
            self.first_calls(warm)  # one-time costs of each executable's first run

    def first_calls(self, steps=None) -> None:
        """The zeroer and `steps` (default: all warmed) run once, empty: XLA drops every CUDA graph
        when it makes a program, rebuilt at a run (3-6 ms, serving/engine_warmup.py)."""
        t0, st = time.perf_counter(), self.startup
        self.cache = self.zeroer.warmup(self.cache)
        for args in self._warm_steps.values() if steps is None else steps:
            jax.block_until_ready(self._dispatch(*args))
        st["first_calls_s"] = st.get("first_calls_s", 0.0) + time.perf_counter() - t0

    def warmup_steps(self, *, all_greedy: bool = True, use_filter: bool = False,
                     num_logprobs: int = 0, spans: bool = False) -> list:
        """The (ints, floats, static kwargs) of every empty step `warmup` runs."""
        variants = []
        for t in self.config.token_buckets:
            for s in self.config.seq_buckets(t):
                plans = {self._plan(t, s, n, d) for n, d in ((0, 1), (min(s, t // 2), 1), (1, 0))}
                variants += [(t, s, False, plan, False) for plan in plans]
                if spans and self.hybrid:
                    variants += [(t, s, False, plan, True) for plan in plans]
        if self.separate_decode:  # n decodes run at T = token_bucket(n): a small S only there
            cfg = self.config
            top = cfg.token_bucket(cfg.num_seats)
            variants += [(t, s, True, None, False) for t in cfg.token_buckets if t <= top
                         for s in cfg.seq_buckets(t)
                         if s == cfg.seq_bucket(t) or t <= cfg.token_bucket(s)]
        steps = []
        for t, s, decode_only, plan, span_step_ in variants:
            warm = span_step_ and self.span_pool is not None
            spec, size = layout(t, s, self.nb, self.ck_pool is not None, span_step_, warm,
                                block_size=self.block_size, resident=self.dev_tables.on)
            ints = np.zeros(size, np.int32)
            for name in ("slot_mapping",) + (S_FIELDS_CKPT if self.ck_pool is not None else ()) \
                    + (("cap_piece", "cap_slot") if warm else ()):
                o, shape = spec[name]
                ints[o:o + int(np.prod(shape))] = -1
            scratch = self.scratch_slot
            for name, fill in (("state_slots", scratch), ("table_seat", scratch),
                               ("sample_seat", scratch), ("zero_pages", self.num_blocks)):
                o, (n,) = spec.get(name, (0, (0,)))
                ints[o:o + n] = fill
            floats = np.ones(2 * s, np.float32)
            kw = dict(t=t, s=s, all_greedy=all_greedy, use_filter=use_filter,
                      num_logprobs=num_logprobs, decode_only=decode_only, attn_options=plan)
            if span_step_:
                kw["spans"] = True
            steps.append((ints, floats, kw))
        if spans and self.hybrid and self.span_pool is not None:
            steps += self.composer.warmup_steps(self.ck_pool is not None)
        return steps

    # -- host ----------------------------------------------------------------------------------
    def fetch(self, handle) -> dict:
        """Wait for a launched step and read its outputs, the step's one host sync (one
        transfer): host numpy arrays, rows in batch order: tokens [S], logprob [S], and with
        num_logprobs: rank [S], top_ids / top_logprobs [S, k]."""
        packed, num_logprobs = handle
        return unpack_outputs(np.asarray(packed), num_logprobs)

    def launch(self, batch, *, num_logprobs: int = 0, use_prev: bool = False):
        """Build one scheduled batch's inputs and dispatch its step without waiting; returns the
        handle `fetch` reads. With `use_prev` (async scheduling) a sequence whose last token is
        pending (Sequence.num_pending) takes it from the device-side `prev_tokens`, and the
        step's sampled tokens update `prev_tokens`; the host input buffers then alternate
        between two sets, so building step N+1 never touches step N's (still in flight)."""
        cfg = self.config
        real = sum(e.token_idx.size for e in batch)
        # S rows must hold every entry, also one without a query token this step: the smallest
        # sequence bucket that does (Config.small_seq_bucket), else min(T, seats)
        t = cfg.token_bucket(max(real, len(batch), 1))
        s = cfg.seq_bucket(t, len(batch))
        if use_prev:
            self._parity ^= 1
        spans = self.hybrid and span_step.step_has_spans(batch, self.block_size)
        warm = spans and self.span_pool is not None
        ints, floats, v = self._buffers(t, s, self._parity if use_prev else 0, spans, warm)
        clear_ints(ints, v, self._table_rows.get(id(ints), 0))
        self._table_rows[id(ints)] = len(batch)  # the rows copy_rows writes below
        floats[:s] = 0.0
        floats[s:] = 1.0
        v["slot_mapping"][:] = -1
        v["state_slots"][:] = self.scratch_slot
        v["sample_seat"][:] = self.scratch_slot
        n_seq = len(batch)
        if self.ck_pool is not None:
            fill_checkpoints(batch, v)
        seats = [e.seq.seat for e in batch]
        # Decodes come first (scheduler order): one generated token each, filled vectorised.
        d = 0
        while d < n_seq and batch[d].token_idx.size == 1 and batch[d].sample and \
                batch[d].token_idx[0] >= batch[d].seq.num_prompt_tokens and \
                batch[d].restore_slot < 0:  # a restore is a prefill row (decode steps skip it)
            d += 1
        if d:
            self.tables.decode_rows(batch[:d], seats[:d], v)
        row = self.tables.prefill_rows(batch, d, v)
        v["cu_q_lens"][n_seq + 1:] = row
        v["state_slots"][:n_seq] = seats
        v["reset"][:n_seq] = [e.reset for e in batch]
        all_greedy, use_filter = fill_sampling(batch, seats, v, floats, s)
        self.dev_tables.fill(seats, v)
        decode_only = d == n_seq and self.separate_decode
        n_pre = sum(e.token_idx.size > 1 for e in batch)
        plan = None if decode_only else self._plan(t, s, n_pre, n_seq - n_pre)
        kw = dict(t=t, s=s, all_greedy=all_greedy, use_filter=use_filter,
                  num_logprobs=num_logprobs, decode_only=decode_only, attn_options=plan)
        if spans:
            starts = span_step.fill_rows(batch, v, row, self.block_size, t, s)
            kw["spans"] = True
            if warm and not decode_only:
                span_step.fill_maps(batch, v, starts)
        if self.span_pool is not None and not decode_only:
            compose = self.composer.build(batch, v, self._parity if use_prev else 0)
            if compose:  # cached maps' chains, a program of its own before the step (any kind)
                self._dispatch(compose[0], None, False, compose[1])
        self.cache = self.zeroer.fill(v["zero_pages"], self.cache)  # the fresh pages
        self.last_inputs = (ints, floats, kw)  # for benchmarks that time the jitted step alone
        t0 = time.perf_counter()
        packed = self._dispatch(ints, floats, use_prev, kw)
        self.last_dispatch = time.perf_counter() - t0
        return packed, num_logprobs

    def _plan(self, t: int, s: int, prefill_count: int, decode_count: int):
        """The attention options of a general step (static: the kernel's per-step plan, decided
        here on the host from the step's sequences; paged_attention.api.step_options)."""
        return step_options(self.attn_impl, self.attn_options, tokens=t, seqs=s,
                            prefill_count=prefill_count, decode_count=decode_count)

    def _buffers(self, t: int, s: int, parity: int = 0, spans: bool = False, maps: bool = False):
        """Host input buffers of one bucket, reused across steps: a step's inputs have reached
        the device before its outputs are read, which happens before the next build of the
        same buffer set (sync: the next step; async: the step after next, see `launch`).
        Reuse also avoids fresh page faults every step."""
        key = (t, s, parity, spans, maps, self.dev_tables.on)
        if key not in self._bufs:
            spec, size = layout(t, s, self.nb, self.ck_pool is not None, spans, maps,
                                block_size=self.block_size, resident=self.dev_tables.on)
            ints = np.zeros(size, np.int32)
            v = {k: ints[o:o + int(np.prod(shape))].reshape(shape)
                 for k, (o, shape) in spec.items()}
            self._bufs[key] = (ints, np.ones(2 * s, np.float32), v)
        return self._bufs[key]
