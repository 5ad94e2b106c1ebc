"""One `minipic-bench rag` configuration in this process: load, warm up, run the workloads.

`run_config(name, opts)` builds the engine for configuration `name` (CONFIGS), times its load and
warm-up, then runs every workload offline (all requests queued at once) and online (Poisson
arrivals at `opts.request_rate` requests/s), each under its own cache salt so no run reuses
another's cache; `opts.repeats` times each (salts of their own), reporting the run of median
requests/s with every repeat's figure beside it (a 24-request run lasts ~0.3 s on a GPU, where one
host stall moves its throughput 10-20%). Returns a JSON-able dict. The cached-span TTFT pair is
configuration `ttft` (benchmarks/rag_ttft.py).
"""

from __future__ import annotations

import numpy as np

from benchmarks import rag_engine as E
from benchmarks import rag_ttft
from benchmarks import rag_workloads as W

CONFIGS, PERCENTILES = E.CONFIGS, (50, 90, 99)
drive = E.drive  # rag_steps wraps this module's drive


def _prompts(llm, reqs, markers: bool) -> list[list[int]]:
    if not markers:
        return [W.plain(r) for r in reqs]
    return [llm.to_token_ids(W.segments(r), i)[0] for i, r in enumerate(reqs)]


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
    out.update({k: run[k] for k in E.SPAN_COUNTS if k in run})  # hybrid span maps
    out["request_throughput"] = out["requests_per_second"]
    out["total_token_throughput"] = out["tokens_per_second"]
    for key in ("ttft", "tpot"):
        xs = np.asarray(run[f"{key}_s"]) * 1e3
        out[f"mean_{key}_ms"] = float(xs.mean()) if xs.size else None
        for p in PERCENTILES:
            name = "median" if p == 50 else f"p{p}"
            out[f"{name}_{key}_ms"] = float(np.percentile(xs, p)) if xs.size else None
    return out


def median_run(runs: list, rows: list) -> tuple[dict, dict]:
    """The (run, metrics row) of median requests/s among repeats (the lower middle of an even
    count), the row holding every repeat's requests/s in run order (`requests_per_second_runs`)."""
    rps = [r["requests_per_second"] for r in rows]
    mid = int(np.argsort(rps, kind="stable")[(len(rps) - 1) // 2])
    return runs[mid], {**rows[mid], "requests_per_second_runs": rps}


def run_config(name: str, opts) -> dict:
    """Load + warm-up + every (workload, mode) run of one configuration (see module doc)."""
    if name == "ttft":
        return rag_ttft.run_ttft(opts)
    extra, markers = CONFIGS[name]
    from minipic_jax import SamplingParams
    samples = W.load_musique()
    llm, result = None, {"config": name}
    llm, timing = E.build_engine(opts, extra, opts.max_model_len, spans=markers)
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
            runs = [drive(llm.llm_engine, prompts, sp, salt=f"{wl}-{mode}" + (f"-{r}" if r else ""),
                          arrivals=arrivals) for r in range(getattr(opts, "repeats", 1))]
            run, row = median_run(runs, [metrics(x, n_samples) for x in runs])
            row.update(workload=wl, mode=mode, **W.summary(reqs))
            if mode == "online":
                row["request_rate"] = opts.request_rate
            row["outputs"] = run["outputs"]
            result.setdefault("runs", []).append(row)
    if capture is not None:  # after every run: the replays rewrite finished sequences' states
        capture.close()
        result["compose_cost"] = span_compose_cost.measure(llm.llm_engine, capture)
    return result
