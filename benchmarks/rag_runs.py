"""One `minipic-bench rag` configuration in this process: load, warm up, run the workloads.

`run_config(name, opts)` builds the engine for configuration `name` (CONFIGS), times its load and
warm-up, then runs every workload offline (all requests queued at once) and online (Poisson
arrivals at `opts.request_rate` requests/s), each under its own cache salt so no run reuses
another's cache. Returns a JSON-able dict. The cached-span TTFT pair is configuration `ttft`.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks import rag_workloads as W

# name -> (engine options, prompts with markers)
CONFIGS = {
    "rotated": ({"kv_mode": "rotated"}, False),
    "pic_off": ({"kv_mode": "pic_off"}, False),
    "fcfs": ({"kv_mode": "position_free", "scheduling_policy": "fcfs"}, True),
    "barrier": ({"kv_mode": "position_free", "scheduling_policy": "barrier"}, True),
    "isps": ({"kv_mode": "position_free", "scheduling_policy": "isps"}, True),
}
PERCENTILES = (50, 90, 99)


def _engine(opts, extra: dict, max_model_len: int, spans: bool = False):
    from minipic_jax import LLM
    t0 = time.perf_counter()
    llm = LLM(opts.model, dtype=opts.dtype, seed=0, max_num_seqs=opts.max_num_seqs, warmup=False,
              max_num_batched_tokens=opts.max_num_batched_tokens, max_model_len=max_model_len,
              min_token_bucket=opts.min_token_bucket, num_kv_blocks=opts.num_kv_blocks,
              attn_impl=opts.attn_impl,
              tensor_parallel_size=getattr(opts, "tensor_parallel_size", 1), **extra)
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


def _prompts(llm, reqs, markers: bool) -> list[list[int]]:
    if not markers:
        return [W.plain(r) for r in reqs]
    return [llm.to_token_ids(W.segments(r), i)[0] for i, r in enumerate(reqs)]


def drive(engine, prompts, sp, *, salt: str, arrivals=None) -> dict:
    """Run `prompts` through `engine`; arrivals (seconds after the start, sorted) or None = all at
    once. Returns wall time, per-request TTFT / TPOT, token counts and the prefix-cache share."""
    st = engine.stats
    before = (st.prompt_tokens, st.cached_prompt_tokens, st.steps, st.step_time,
              engine.runner.num_compiles)
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
            "outputs": {o.request_id: list(o.outputs[0].token_ids) for o in outs}}


def metrics(run: dict, samples: int) -> dict:
    """vLLM's throughput and serving keys from a `drive` result (times in ms)."""
    wall = run["elapsed_time"]
    total = run["prompt_tokens"] + run["output_tokens"]
    out = {k: run[k] for k in ("elapsed_time", "num_requests", "prompt_tokens",
                               "cached_prompt_tokens", "output_tokens", "steps",
                               "compiles_during_run", "variants_compiled_during_run")}
    out.update(requests_per_second=run["num_requests"] / wall, tokens_per_second=total / wall,
               total_num_tokens=total, output_throughput=run["output_tokens"] / wall,
               prompt_tokens_per_second=run["prompt_tokens"] / wall,
               computed_prompt_tokens_per_second=(run["prompt_tokens"]
                                                  - run["cached_prompt_tokens"]) / wall,
               samples_per_second=samples / wall,
               prefix_cache_hit_rate=run["cached_prompt_tokens"] / max(run["prompt_tokens"], 1))
    out["request_throughput"] = out["requests_per_second"]
    out["total_token_throughput"] = out["tokens_per_second"]
    for key in ("ttft", "tpot"):
        xs = np.asarray(run[f"{key}_s"]) * 1e3
        out[f"mean_{key}_ms"] = float(xs.mean()) if xs.size else None
        for p in PERCENTILES:
            name = "median" if p == 50 else f"p{p}"
            out[f"{name}_{key}_ms"] = float(np.percentile(xs, p)) if xs.size else None
    return out


def run_config(name: str, opts) -> dict:
    """Load + warm-up + every (workload, mode) run of one configuration (see module doc)."""
    if name == "ttft":
        return run_ttft(opts)
    extra, markers = CONFIGS[name]
    from minipic_jax import SamplingParams
    samples = W.load_musique()
    llm, result = None, {"config": name}
    llm, timing = _engine(opts, extra, opts.max_model_len, spans=markers)
    result.update(timing)
    enc = W.Encoder(llm.get_tokenizer(), opts.passage_tokens)
    sp = SamplingParams(temperature=0.0, max_tokens=opts.max_tokens, ignore_eos=True)
    capture = None
    runner = llm.llm_engine.runner
    if markers and getattr(opts, "compose_cost", 0) and runner.span_pool is not None:
        from benchmarks import span_compose_cost
        capture = span_compose_cost.WarmStepCapture(runner)
    for wl in opts.workloads:
        reqs = W.make_workload(wl, samples, enc, num_requests=opts.num_requests,
                               questions_per_set=opts.questions_per_set, zipf_s=opts.zipf_s,
                               seed=opts.seed)
        prompts = _prompts(llm, reqs, markers)
        n_samples = len(reqs) / (opts.questions_per_set if wl == "multi" else 1)
        for mode in opts.modes:
            arrivals = None
            if mode == "online":
                rng = np.random.default_rng(opts.seed + 1)
                arrivals = np.cumsum(rng.exponential(1.0 / opts.request_rate, len(prompts)))
                arrivals -= arrivals[0]
            run = drive(llm.llm_engine, prompts, sp, salt=f"{wl}-{mode}", arrivals=arrivals)
            row = metrics(run, n_samples)
            row.update(workload=wl, mode=mode, **W.summary(reqs))
            if mode == "online":
                row["request_rate"] = opts.request_rate
            row["outputs"] = run["outputs"]
            result.setdefault("runs", []).append(row)
    if capture is not None:  # after every run: the replays rewrite finished sequences' states
        capture.close()
        result["compose_cost"] = span_compose_cost.measure(llm.llm_engine, capture)
    return result


def run_ttft(opts) -> dict:
    """Cached-span TTFT: the cold request (every span computed), then `repeats` requests holding
    the same spans reordered with new questions (every span a cache hit), max_tokens=1 each."""
    from minipic_jax import SamplingParams
    samples = W.load_musique()
    n, length = opts.ttft_spans, opts.ttft_span_tokens
    llm, result = None, {"config": "ttft", "num_spans": n, "span_tokens": length}
    max_len = -(-(n * (length + 2 * 16) + 512) // 1024) * 1024
    llm, timing = _engine(opts, CONFIGS["fcfs"][0], max_len, spans=True)
    result.update(timing, max_model_len=max_len)
    enc = W.Encoder(llm.get_tokenizer())
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for r in range(1 + opts.ttft_repeats):
        cold, cached = W.ttft_spans(samples, enc, num_spans=n, span_tokens=length, seed=r)
        req = cold if r == 0 else cached
        ids = llm.to_token_ids(W.segments(req), 0)[0]
        run = drive(llm.llm_engine, [ids], sp, salt="ttft")
        rows.append({"cold": r == 0, "prompt_tokens": run["prompt_tokens"],
                     "cached_prompt_tokens": run["cached_prompt_tokens"],
                     "ttft_ms": 1e3 * run["ttft_s"][0], "steps": run["steps"],
                     "step_ms": 1e3 * run["step_time_s"] / max(run["steps"], 1)})
    if opts.ttft_profile and len(rows) > 1:  # the last cached request's one step, replayed
        result["cached_step_profile"] = _profile_last_step(llm.llm_engine)
    cached_ttft = float(np.median([x["ttft_ms"] for x in rows[1:]])) if len(rows) > 1 else None
    result.update(rows=rows, cold_ttft_ms=rows[0]["ttft_ms"], cached_ttft_ms=cached_ttft,
                  cached_step_ms=float(np.median([x["step_ms"] for x in rows[1:]]))
                  if len(rows) > 1 else None,
                  cold_over_cached=rows[0]["ttft_ms"] / cached_ttft if cached_ttft else None)
    return result


def _profile_last_step(engine, repeats: int = 5) -> dict:
    """The runner's last step (same inputs, same shapes) replayed alone: its median wall time, a
    profiler summary of its device kernels (benchmarks/timing.profile_kernels) and the op counts
    of its compiled program; a step planned without the decode part (MixedOptions.decode_rows
    False) is replayed with it too (`with_decode_part`, the A/B). Replaying rewrites the same
    K/V rows with the same values."""
    import dataclasses

    from benchmarks.timing import profile_kernels
    r = engine.runner
    ints, floats, kw = r.last_inputs
    out = _replay(r, ints, floats, kw, repeats, profile_kernels)
    plan = kw.get("attn_options")
    if getattr(plan, "decode_rows", True) is False:
        kw_b = dict(kw, attn_options=dataclasses.replace(plan, decode_rows=True))
        out["with_decode_part"] = _replay(r, ints, floats, kw_b, repeats, profile_kernels)
    return out


def _replay(r, ints, floats, kw, repeats, profile_kernels) -> dict:
    from benchmarks.timing import blocked_ms
    use_prev = r.config.async_scheduling

    def call():
        return r._dispatch(ints, floats, use_prev, kw)

    alone = blocked_ms(call, repeats)["ms"]
    prof = profile_kernels(call, steps=3, top=15)
    prof.pop("lines", None)
    try:  # the ops of the executable the replay ran (compiled or loaded at warm-up)
        args = r._args(ints, floats, use_prev, kw)
        text = r._step._table[r._step._key(args, kw)].as_text()
        hlo = {op: text.count(f" {op}(") for op in ("fusion", "custom-call", "while",
                                                    "conditional", "gather", "scatter")}
    except Exception as e:  # noqa: BLE001 - a side figure
        hlo = {"error": repr(e)[:200]}
    return {"step_alone_ms": alone, "tokens": kw["t"],
            "attn_options": repr(kw.get("attn_options")), "hlo_ops": hlo, **prof}
