"""The engine of one `minipic-bench rag` configuration and the loop that drives it.

CONFIGS names each configuration's engine options; `build_engine` loads an engine and warms it
up (timed); `drive` runs token-id prompts through it, all at once or at given arrival times.
"""

from __future__ import annotations

import time

import numpy as np

# name -> (engine options, prompts with markers)
CONFIGS = {
    "rotated": ({"kv_mode": "rotated"}, False),
    "pic_off": ({"kv_mode": "pic_off"}, False),
    "fcfs": ({"kv_mode": "position_free", "scheduling_policy": "fcfs"}, True),
    # fcfs capturing every computed span's map on a hybrid (span_map_capture's default "auto"
    # captures those another request holds, and the rest while spans mostly recur)
    "fcfs_all": ({"kv_mode": "position_free", "scheduling_policy": "fcfs",
                  "span_map_capture": "always"}, True),
    "barrier": ({"kv_mode": "position_free", "scheduling_policy": "barrier"}, True),
    "isps": ({"kv_mode": "position_free", "scheduling_policy": "isps"}, True),
}


def build_engine(opts, extra: dict, max_model_len: int, spans: bool = False):
    from minipic_jax import LLM
    t0 = time.perf_counter()
    llm = LLM(opts.model, dtype=opts.dtype, seed=0, max_num_seqs=opts.max_num_seqs, warmup=False,
              max_num_batched_tokens=opts.max_num_batched_tokens, max_model_len=max_model_len,
              min_token_bucket=opts.min_token_bucket, num_kv_blocks=opts.num_kv_blocks,
              attn_impl=opts.attn_impl,
              tensor_parallel_size=getattr(opts, "tensor_parallel_size", 1),
              step_command_buffer=getattr(opts, "step_command_buffer", None), **extra)
    load = time.perf_counter() - t0
    print(f"loaded {opts.model} in {load:.1f} s; warming up", flush=True)
    t1 = time.perf_counter()
    llm.llm_engine.warmup(spans=spans)  # spans: a hybrid's span steps too
    from benchmarks import startup
    return llm, {"load_s": load, "warmup_s": time.perf_counter() - t1,
                 "startup": startup.collect(llm),
                 "compiles_in_warmup": llm.llm_engine.runner.num_compiles,
                 "compilation_cache_dir": llm.compilation_cache_dir,
                 "prefill_impl": llm.llm_engine.runner.attn_impl,
                 "decode_impl": llm.llm_engine.runner.decode_impl}


def drive(engine, prompts, sp, *, salt: str, arrivals=None) -> dict:
    """Run `prompts` through `engine`; arrivals (seconds after the start, sorted) or None = all at
    once. Returns wall time, per-request TTFT / TPOT, token counts and the prefix-cache share."""
    st = engine.stats
    before = (st.prompt_tokens, st.cached_prompt_tokens, st.steps, st.step_time,
              engine.runner.num_compiles)
    spans_before = _span_counts(engine)
    start = time.time()
    offsets = np.zeros(len(prompts)) if arrivals is None else np.asarray(arrivals)
    nxt, outs, compiled = 0, [], []
    while nxt < len(prompts) or engine.has_unfinished():
        now = time.time() - start
        while nxt < len(prompts) and offsets[nxt] <= now:
            engine.add_request(f"{salt}-{nxt}", prompts[nxt], sp, cache_salt=salt,
                               arrival_time=start + offsets[nxt])
            nxt += 1
        if engine.has_unfinished():
            n_compiles = engine.runner.num_compiles
            outs += engine.step()
            if engine.runner.num_compiles > n_compiles:  # a step variant warm-up did not make
                kw = engine.runner.last_inputs[2]
                compiled.append({k: repr(v) for k, v in kw.items()})
        elif nxt < len(prompts):
            time.sleep(max(0.0, offsets[nxt] - (time.time() - start)))
    wall = time.time() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]
    prompt_tok = st.prompt_tokens - before[0]
    return {"elapsed_time": wall, "num_requests": len(outs),
            "prompt_tokens": prompt_tok, "cached_prompt_tokens": st.cached_prompt_tokens - before[1],
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "steps": st.steps - before[2], "step_time_s": st.step_time - before[3],
            "compiles_during_run": engine.runner.num_compiles - before[4],
            "variants_compiled_during_run": compiled,
            "ttft_s": ttft, "tpot_s": tpot,
            **{k: v - spans_before[k] for k, v in _span_counts(engine).items()},
            "outputs": {o.request_id: list(o.outputs[0].token_ids) for o in outs}}


SPAN_COUNTS = ("span_maps_captured", "span_maps_declined", "spans_skipped")


def _span_counts(engine) -> dict:
    """A hybrid engine's span-map counts so far (serving/hybrid/span_cache.py stats); {} else."""
    stats = engine.cache.stats()
    return {k: stats[k] for k in SPAN_COUNTS if k in stats}
