"""`LLM`: the vLLM-shaped batch API over the paged engine."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp

from minipic_jax import array_generate, compile_cache, weights_update
from minipic_jax import warmup as warmup_steps
from minipic_jax.batch.progress import Progress
from minipic_jax.loading import load_model
from minipic_jax.loading.chat_template import render_conversations
from minipic_jax.parallel_samples import fan_out, merge_samples
from minipic_jax.prompts import (as_prompt_list, build_prompt, build_prompt_ids,
                                 is_structured, segment_of)
from minipic_jax.segment_ids import SegmentMemo
from minipic_jax.sampling_params import SamplingParams
from serving.config import Config
from serving.config_groups import grouped_kwargs
from serving.llm_engine import LLMEngine


def _host_device_if_sharded(tensor_parallel_size: int):
    """Under tensor parallelism a checkpoint is only mapped (`load_model(host=True)`) and the
    engine streams each tensor's shards to their devices; a preset's random weights are made in
    host memory and then sent shard by shard. Either way no accelerator holds the whole model."""
    if tensor_parallel_size <= 1:
        return contextlib.nullcontext()
    try:
        return jax.default_device(jax.devices("cpu")[0])
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu): load on the default
        return contextlib.nullcontext()


def _serialized(method):
    """Run `method` holding the LLM's lock: one engine, stepped by one call at a time. A second
    thread's call waits for the first to finish, then runs (both get the results they would
    get alone); the lock is reentrant, so a serialized call may make another."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


def _check_span_caching(config) -> None:
    """cache_spans' work is only the cache it leaves: with prefix caching off nothing is kept
    (the call would compute every span and drop it), and rotated keys hold no span reusable at
    another offset (its prompts would fail the marker check as an unnamed 'request 0')."""
    if not config.enable_prefix_caching:
        raise ValueError("cache_spans needs enable_prefix_caching=True: with it off no span's KV "
                         "is kept for a later request")
    if config.kv_mode == "rotated":
        raise ValueError("cache_spans needs kv_mode='position_free' or 'pic_off', got "
                         "kv_mode='rotated' (rotated keys cannot reuse a span at another offset)")


class LLM:
    """Batch generation.

    Thread safety: `generate` and `cache_spans` may be called from several threads; the calls
    are serialized (one runs at a time, each gets the results it would get alone). Driving
    `llm_engine` directly from several threads is not supported.

    Args:
      model: an HF folder (config.json + safetensors), a Llama GGUF file (or a folder holding
        one), or a preset name (configs/presets.py).
      dtype: "float32" or "bfloat16". seed: preset weights and unseeded sampling.
      **engine_args: `serving.config.Config` options (vLLM names): max_num_seqs,
        max_num_batched_tokens, max_model_len, block_size, num_kv_blocks, enable_prefix_caching,
        kv_mode ("position_free" | "rotated" | "pic_off"), scheduling_policy ("fcfs" | "barrier" |
        "isps"), cpu_offload_gb, pad_token_id / ssep_token_id / pdep_token_id (defaults: Llama-3
        vocab -> 128004 / 128002 / 128003; any other vocab: vocab_size, +1, +2, ids no text
        tokenizes to, fed to the model as its three highest non-BOS/EOS ids: serving/config.py),
        hash_algo, kv_store_dir / kv_store_gb / kv_store_spans_only / kv_store_staging_gb /
        kv_store_pinned (a persistent span store on disk shared by processes:
        serving/tiers/disk_store.py; Config.kv_store), checkpoint_* and span_map_* (hybrid
        models: Config.hybrid_cache, Config.span_maps), tensor_parallel_size (split the model over
        that many devices: serving/step/sharding.py). Group objects (kv_store=KVStoreConfig(...))
        are taken too; an unknown name is a TypeError (Config.from_flat).
      warmup: compile every step variant a greedy request needs (span steps too on a hybrid
        model) and update_weights' write programs before returning, with a line on stderr and
        the cost in `startup` (minipic_jax/warmup.py); None: on for hybrid models only
        (minipic_jax/warmup.DEFAULT).
        False: variants compile on first use (generate's bar says so).
      compilation_cache: JAX's persistent compilation cache folder (None: JAX's setting, else
        $MINIPIC_COMPILATION_CACHE_DIR ("off" disables it), else ~/.cache/minipic_jax/xla;
        False: leave JAX's setting alone). See minipic_jax/compile_cache.py.
    """

    def __init__(self, model: str, *, dtype: str = "float32", seed: int = 0,
                 compilation_cache: str | bool | None = None, warmup: bool | None = None,
                 **engine_args: Any):
        # flat keywords into their groups; an unknown one is a TypeError before any work
        options = grouped_kwargs(Config, engine_args)
        self.compilation_cache_dir = compile_cache.configure(compilation_cache)
        t0 = time.perf_counter()
        jax.devices()  # the backend starts here (timed apart from the weights)
        t1 = time.perf_counter()
        tp = engine_args.get("tensor_parallel_size", 1)
        with _host_device_if_sharded(tp):
            loaded = load_model(model, dtype=dtype, seed=seed, host=tp > 1)
            jax.block_until_ready(loaded.params)
            spec = weights_update.params_spec(loaded.params, dtype)
        t2 = time.perf_counter()
        if "max_model_len" not in options:
            options["max_model_len"] = min(loaded.cfg.max_position_embeddings, 2048)
        self.llm_engine = LLMEngine(loaded, Config(**options), dtype=jnp.dtype(dtype), seed=seed)
        self.config = self.llm_engine.config  # what runs (the engine's copy where it changed one)
        self.weights_version = weights_update.attach(self.llm_engine, spec)
        # start-up seconds: backend, weights (read or drawn), the engine (see runner.startup)
        self.startup = {"backend_s": t1 - t0, "weights_s": t2 - t1,
                        "engine_s": time.perf_counter() - t2}
        self.tokenizer = loaded.tokenizer
        self._next_id = 0
        self._lock = threading.RLock()  # see _serialized
        self._segments = SegmentMemo()  # segment id lists converted (prompt_ids)
        warm = warmup_steps.DEFAULT if warmup is None else warmup
        if warm or warm is None and self.llm_engine.hybrid:
            self.startup.update(warmup_steps.run(self))

    @_serialized
    def update_weights(self, params, *, donate: bool = False) -> int:
        """Serve `params` from now on: the family's params dict (unfused, as `load_model` or
        minipic-train give it), or a Flax NNX State / module of it, of exactly the served
        shapes and dtypes. No reload, and the step never re-traces: the new weights are
        written into the served buffers (small write programs, compiled by the warm-up or else
        the first update; under tensor parallelism per device, each new leaf placed by the
        rules table first), so beyond the caller's arrays the update holds one layer's
        temporaries at most. `donate=True`: the caller's arrays are deleted once written (the
        engine never serves them, so a caller may also donate or delete them itself after the
        call). KV, checkpoints and span maps cached under the old weights never hit again.
        Between generate() calls only. A missing or deleted leaf, or one of another shape or
        dtype: ValueError naming it, and the old weights keep serving. Returns the weights generation
        (minipic_jax/weights_update.py)."""
        return weights_update.update_weights(self, params, donate=donate)

    def generate_arrays(self, prompt_ids, prompt_lens, sampling_params=None, *,
                        cache_salt: str | None = None):
        """Ragged prompts as arrays ([B, L] ids + [B] lengths) -> `ArrayOutputs`: sampled
        tokens, their logprobs ([B * n, T], padded) and lengths ([B * n]) as device arrays, row
        b * n + k = sample k of prompt b. One SamplingParams or one per prompt (same n and
        max_tokens) (minipic_jax/array_generate.py)."""
        return array_generate.generate_arrays(self, prompt_ids, prompt_lens, sampling_params,
                                              cache_salt=cache_salt)

    def get_tokenizer(self):
        return self.tokenizer

    def to_token_ids(self, prompt, index: int = 0) -> tuple[list, str | None]:
        """A prompt (str, token ids, {"prompt_token_ids"}/{"prompt"} dict, or segments) -> ids.
        Token ids are returned as given: `LLMEngine.validate` checks them (ints, vocabulary)."""
        ids, text, _ = self.prompt_ids(prompt, index)
        return ids, text

    def prompt_ids(self, prompt, index: int = 0) -> tuple[list, str | None, Any]:
        """`to_token_ids` plus, for segments, the ids as an int64 array (else None): built from
        each segment's ids, converted once per list object (minipic_jax/segment_ids.py), so a
        cached span request's validation converts nothing again."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise TypeError(f"request {index}: prompt_token_ids must be a list of ints, "
                                    f"got {type(ids).__name__}")
                return list(ids), prompt.get("prompt"), None
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"request {index}: dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {index}: text prompt but the model has no tokenizer")
            return list(self.tokenizer.encode(prompt)), prompt, None
        if is_structured(prompt):
            m = self.llm_engine.markers
            try:
                ids, arr = build_prompt_ids(prompt, block_size=self.config.block_size,
                                            tokenizer=self.tokenizer, memo=self._segments, **m)
            except (TypeError, ValueError) as err:
                raise type(err)(f"request {index}: {err}") from None
            return ids, None, arr
        if isinstance(prompt, (list, tuple)):
            return list(prompt), None, None
        raise TypeError(f"request {index}: unsupported prompt type {type(prompt).__name__} "
                        f"(a str, a list of token ids, a dict or a list of Prompt/Span)")

    @_serialized
    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True,
                 cache_salt: str | None = None):
        """Generate for every prompt; returns RequestOutputs in input order.

        Every request is validated before any work starts (a bad one raises a ValueError or
        TypeError naming it, and nothing runs). If anything raises while the batch runs
        (KeyboardInterrupt included), this call's requests are aborted and their blocks freed
        before the exception propagates; the engine stays usable. A request with
        `SamplingParams.n > 1` runs as n requests over the same prompt (its cached blocks are
        shared) whose completions come back in one RequestOutput.

        A prompt is a str, token ids (a list, or a 1-D integer numpy/JAX array), a
        {"prompt_token_ids"} / {"prompt"} dict or a list of Prompt/Span segments. `cache_salt`
        names a tenant (no cached block is shared across tenants): "" is the same as None, and
        salts are compared as given, without Unicode normalization. Calls from several threads
        are serialized (see the class docstring).
        """
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        sps = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
               else [sampling_params] * len(prompts))
        if len(sps) != len(prompts):
            raise ValueError(f"{len(sps)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        self._skip_ids_in_use(len(prompts))
        reqs = []  # (request id, ids, text, params, layout, parent index, sample index)
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            ids, text, arr = self.prompt_ids(p, i)
            rid = str(self._next_id + i)
            # segments come with their int64 array: the checks take it as it is
            try:
                layout = engine.validate(rid, ids if arr is None else arr, sp,
                                         label=f"request {i}", cache_salt=cache_salt)
            except ValueError as err:
                where = self._in_segment(err, p, i)
                if where is None:
                    raise
                raise ValueError(where) from None
            if not is_structured(p):  # build_prompt gives Python ints already
                # validated integers (numpy ones included) as Python ints: the layout's int64
                # copy converts in C (a per-token int() cost ~2 ms of a 33K-token prompt's TTFT)
                ids = (layout.tokens.tolist() if layout.tokens is not None
                       else [int(t) for t in ids])
            for k, child in enumerate(fan_out(sp)):
                reqs.append((rid if sp.n == 1 else f"{rid}:{k}", ids, text, child, layout, i, k))
        self._next_id += len(prompts)
        order = {r[0]: (r[5], r[6]) for r in reqs}
        results: list = [[None] * sp.n for sp in sps]
        # the bar also says when a step variant compiles (one the warm-up did not cover)
        bar = Progress(self, len(reqs), use_tqdm, desc="Processed prompts", unit="it")
        others = []  # outputs of a custom loop's requests (add_request): given back, not lost
        try:
            for rid, ids, text, sp, layout, i, _ in reqs:
                # `ids` is this call's own list: the one sequence of a request takes it
                engine._enqueue(rid, ids, sp, layout, cache_salt=cache_salt, prompt=text,
                                own_ids=sps[i].n == 1)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.request_id not in order:
                        others.append(out)
                        continue
                    i, k = order[out.request_id]
                    results[i][k] = out
                    bar.update(1)
            engine.flush_kv_store()
        except BaseException:
            engine.recover(list(order))
            raise
        finally:
            bar.close()
            engine.give_back(others)  # the custom loop's next step() returns them
        return [merge_samples(str(self._next_id - len(prompts) + i), r) if len(r) > 1 else r[0]
                for i, r in enumerate(results)]

    def _in_segment(self, err: ValueError, prompt, index: int) -> str | None:
        """A token id the request checks refused (`err`: its index in the prompt) inside a
        segment of a structured prompt, named by its segment and its index there, as a
        segment's type errors are; None where `err` is no such error."""
        k = getattr(err, "token_index", None)
        if k is None or not is_structured(prompt):
            return None
        where = segment_of(prompt, k, block_size=self.config.block_size,
                           tokenizer=self.tokenizer, **self.llm_engine.markers)
        if where is None:
            return None
        seg, kind, j = where
        what, problem = err.parts
        return f"request {index}: segment {seg}: {kind} {what} at index {j} {problem}"

    def _skip_ids_in_use(self, count: int) -> None:
        """generate's request ids are str(k) (samples "k:j") for k from _next_id, vLLM's: moved
        past every id a custom loop's add_request holds, so neither takes the other's."""
        live = {str(s.request_id).split(":")[0] for s in self.llm_engine.live_sequences()}
        while live and any(str(self._next_id + i) in live for i in range(count)):
            self._next_id += 1

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools=None,
             chat_template_kwargs: dict | None = None, cache_salt: str | None = None):
        """vLLM's `LLM.chat`: every conversation through the model's chat template (or
        `chat_template`), then `generate`. `messages`: one conversation (a list of {"role",
        "content"} dicts) or a list of them; one RequestOutput per conversation, in order, its
        `prompt` the rendered text. chat_template_kwargs reach the template as variables (e.g.
        enable_thinking). Every conversation is rendered and checked before any work."""
        prompts = render_conversations(
            self.tokenizer, messages, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)

    @_serialized
    def cache_spans(self, spans, *, cache_salt: str | None = None, use_tqdm: bool = False) -> dict:
        """Compute the KV of SSEP spans without generating (the corpus pass of a RAG job): each
        span (text or token ids) is prefilled as it would sit inside a structured prompt, so a
        later `Span(same content)` hits it at any offset, in this process and, with
        `kv_store_dir`, in any later one (this call returns once the blocks are on disk).
        Duplicates are computed once; all spans go through one batched prefill.

        Returns {"spans", "span_tokens", "blocks_written"}. An engine that cannot keep a span
        for later (enable_prefix_caching=False, kv_mode="rotated") is a ValueError naming the
        option, before any work.
        """
        from minipic_jax.prompts import Span
        _check_span_caching(self.config)
        m = self.llm_engine.markers
        seen, prompts = set(), []
        for k, content in enumerate(spans):
            if not isinstance(content, str):
                content = tuple(int(t) for t in content)
            if content in seen:
                continue
            seen.add(content)
            try:
                ids = build_prompt([Span(content)], block_size=self.config.block_size,
                                   tokenizer=self.tokenizer, **m)
            except ValueError as err:
                raise ValueError(f"span {k}: {err}") from None
            # pad the span's last block full (as inside a prompt), then one PDEP marker: the
            # token whose logits end the request, so every span block is a cacheable full block
            ids += [m["pad_token_id"]] * (-len(ids) % self.config.block_size)
            prompts.append(ids + [m["pdep_token_id"]])
        stats = self.llm_engine.get_stats().get("kv_store", {})
        before = stats.get("blocks_written", 0)
        policy = self.llm_engine.cache.span_capture  # a hybrid's span maps: every one captured
        with contextlib.nullcontext() if policy is None else policy.capture_all():
            self.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1),
                          use_tqdm=use_tqdm, cache_salt=cache_salt)
        after = self.llm_engine.get_stats().get("kv_store", {}).get("blocks_written", 0)
        return {"spans": len(prompts), "span_tokens": sum(len(p) - 1 for p in prompts),
                "blocks_written": after - before}
