"""`minipic-bench hybrid-cache`: prefix caching of a hybrid model, per checkpoint strategy.

One engine (Qwen3.5-0.8B shape by default, random weights) compiles once; for each workload,
checkpoint budget (device slots; one slot = one checkpoint of every GDN layer, bytes printed) and
strategy (none, last, block, balanced, dp; checkpoint free room as --free-room, on by default
as in the engine), the prefix cache is reset and the workload's requests
run in order through `LLM.generate` (FCFS, max_num_seqs seats). Reported per run: prompt tokens
recomputed (matched by cached blocks but behind the resumed checkpoint), prompt tokens computed,
hit rate (cached / prompt tokens), prefill throughput (prompt tokens / wall), mean TTFT, wall, and
the share of greedy tokens equal to the `none` run. vLLM's Throughput line, JSON, PNG.

Workloads (built from benchmarks/data, see `workloads`): NarrativeQA document lengths with several
questions per document (document tokens synthetic: the CSV has no text; questions are real MuSiQue
questions in Llama 3 tokens), shared system prompts + MuSiQue questions, MuSiQue multi-hop RAG
(real passages, 2 more per round), and a drifting mix (RAG first, then system prompts).

  minipic-bench hybrid-cache [--model qwen3_5_0_8b] [--budgets 8 32] [--json out.json]
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
import os
import time

import numpy as np

from benchmarks import planner_workloads as wl

STRATEGIES = ("none", "last", "block", "balanced", "dp")
WORKLOADS = ("longdoc", "sysprompt", "rag-multihop", "drift")


def add_parser(p) -> None:
    p.add_argument("--model", default="qwen3_5_0_8b",
                   help="hybrid model preset or HF folder (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="weight and KV dtype (default: %(default)s)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                   help="workloads to run (default: all)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                   help="checkpoint strategies to compare (default: all)")
    p.add_argument("--budgets", type=int, nargs="+", default=[32],
                   help="device checkpoint slots (the same byte budget for every strategy)")
    p.add_argument("--per-prompt", type=int, default=None,
                   help="Config.hybrid_cache.per_prompt (default: the fair share of the budget)")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's requests")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--doc-cap", type=int, default=6000, help="longdoc: document tokens at most")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="output tokens per request (EOS ignored) (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="engine max_num_seqs (seats) (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="engine max tokens per step (default: %(default)s)")
    p.add_argument("--min-token-bucket", type=int, default=256,
                   help="engine smallest step token bucket (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="engine max_model_len; longer prompts are dropped (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: from free memory")
    p.add_argument("--stub-device", action="store_true",
                   help="replace the jitted step by a stub (random tokens): token counts only, "
                        "any backend (tokens recomputed depend only on the scheduler and store)")
    p.add_argument("--cost", action="store_true",
                   help="also time checkpoint extraction + restore: a captured prefill step "
                        "with the pool vs without it (benchmarks/hybrid_cache_cost.py)")
    p.add_argument("--bucket-fit", nargs="+", default=["off"], choices=["on", "off"],
                   help="Config.hybrid_cache.bucket_fit per pass (both: an A/B of the chunk cut at "
                        "token buckets, serving/hybrid/bucket_fit.py) (default: %(default)s)")
    p.add_argument("--free-room", default="on", choices=["on", "off"],
                   help="Config.hybrid_cache.free_room for every strategy (on: the engine "
                        "default; off: as RESULTS' hybrid-cache runs 4-5) (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="PNG of tokens recomputed vs budget")


# ----------------------------------------------------------------------------- workloads


def _text(s: str) -> list[int]:
    return list(wl.encode(s))


def _longdoc(rng, scale, doc_cap):
    with open(wl.DATA / "narrativeqa_documents.csv", newline="") as f:
        words = np.array([int(r["story_word_count"]) for r in csv.DictReader(f)])
    docs = rng.choice(words, max(2, int(8 * scale)), replace=False)
    header = _text("Read the story below, then answer the question about it.\n\n")
    qs = [_text(f"\nQuestion: {s['question']}\nAnswer:") for s in wl._musique()]
    bodies = [rng.integers(1000, 100000, min(int(wl.TOKENS_PER_WORD * w), doc_cap)).tolist()
              for w in docs]
    # round robin over documents: question k of every document, then question k + 1
    return [header + b + qs[rng.integers(len(qs))] for _ in range(4) for b in bodies]


def _sysprompt(rng, scale, n_prompts=4, requests=48, lengths=None):
    lengths = lengths or np.round(np.exp(rng.uniform(np.log(300), np.log(6000), n_prompts)))
    systems = [rng.integers(1000, 100000, int(n)).tolist() for n in lengths]
    pop = 1.0 / np.arange(1, len(systems) + 1)
    qs = [_text(f"User: {s['question']}\nAssistant:") for s in wl._musique()]
    return [systems[rng.choice(len(systems), p=pop / pop.sum())] + qs[rng.integers(len(qs))]
            for _ in range(max(2, int(requests * scale)))]


def _rag_multihop(rng, scale, first=0, samples=12):
    header = _text(wl.RAG_HEADER)
    data = wl._musique()[first:first + max(2, int(samples * scale))]
    per = []
    for s in data:
        passages = [_text(f"Passage {i + 1}: {c['text']}\n\n") for i, c in enumerate(s["ctxs"])]
        q = _text(f"Question: {s['question']}\nAnswer:")
        per.append([header + sum(passages[:k], []) + q for k in range(2, len(passages) + 1, 2)])
    return [p[r] for r in range(5) for p in per]  # round r of every sample, then round r + 1


def workloads(names, scale: float, doc_cap: int, seed: int = 0) -> dict:
    """Each workload draws from its own generator (seed, its index), so it is the same whichever
    others are selected (one process per workload sees the same requests as one for all)."""
    out = {}
    for name in names:
        rng = np.random.default_rng([seed, WORKLOADS.index(name)])
        if name == "longdoc":
            out[name] = _longdoc(rng, scale, doc_cap)
        elif name == "sysprompt":
            out[name] = _sysprompt(rng, scale)
        elif name == "rag-multihop":
            out[name] = _rag_multihop(rng, scale)
        else:  # drift: RAG traffic, then system-prompt traffic
            out[name] = (_rag_multihop(rng, scale * 0.5, first=12)
                         + _sysprompt(rng, scale * 0.5, n_prompts=2))
    return out


# ----------------------------------------------------------------------------- runs


def _run(llm, prompts, sp, log=None) -> dict:
    engine = llm.llm_engine
    if log is not None:
        log.reset()
    before = engine.get_stats()
    gc.collect()  # no collection pause inside a timed run (identical runs differed by 0.1 s)
    gc.disable()
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        wall = time.perf_counter() - t0
        gc.enable()
    after = engine.get_stats()
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in
             ("tokens_matched", "tokens_resumed", "checkpoint_hits", "checkpoints_stored",
              "checkpoints_evicted", "computed_query_tokens", "steps")}
    return dict(wall_s=wall, requests=len(outs), prompt_tokens=n_prompt, cached_tokens=cached,
                output_tokens=n_out, computed_prompt_tokens=n_prompt - cached,
                tokens_recomputed=delta["tokens_matched"] - delta["tokens_resumed"],
                hit_rate=cached / max(n_prompt, 1), prefill_tok_per_s=n_prompt / wall,
                mean_ttft_s=float(np.mean(ttft)), **delta,
                plan=after.get("checkpoint_plan"), tokens=[o.outputs[0].token_ids for o in outs],
                **(log.summary() if log is not None else {}))


def _engine(args, loaded, nbytes):
    from minipic_jax import LLM
    kw = dict(dtype=args.dtype, seed=0, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              min_token_bucket=args.min_token_bucket, max_model_len=args.max_model_len,
              checkpoint_gb=max(args.budgets) * nbytes / 2**30,
              checkpoints_per_prompt=args.per_prompt, num_kv_blocks=args.num_kv_blocks,
              checkpoint_free_room=args.free_room == "on")
    if not args.stub_device:
        return LLM(args.model, warmup=False, **kw)
    # the stub never reads positions: a tiny preset may take long prompts
    import dataclasses
    from unittest import mock

    import minipic_jax.llm
    from benchmarks.engine_host import StubStep
    long = dataclasses.replace(loaded, cfg=dataclasses.replace(
        loaded.cfg, max_position_embeddings=max(args.max_model_len,
                                                loaded.cfg.max_position_embeddings)))
    with mock.patch.object(minipic_jax.llm, "load_model", lambda *a, **k: long):
        llm = LLM(args.model, warmup=False, **kw)
    llm.llm_engine.runner._step = StubStep(llm.llm_engine.vocab_size)
    return llm


def _print_run(r):
    el = r["wall_s"]
    print(f"  budget {r['budget']:3d} fit {r['bucket_fit']:3s} {r['strategy']:8s} recomputed {r['tokens_recomputed']:7d} "
          f"computed {r['computed_prompt_tokens']:7d} hit {r['hit_rate']:.3f} "
          f"prefill {r['prefill_tok_per_s']:9.0f} tok/s TTFT {1e3 * r['mean_ttft_s']:7.1f} ms "
          f"wall {el:6.2f} s same-tokens {r['tokens_equal_none']}", flush=True)
    print(f"Throughput: {r['requests'] / el:.2f} requests/s, "
          f"{(r['prompt_tokens'] + r['output_tokens']) / el:.2f} total tokens/s, "
          f"{r['output_tokens'] / el:.2f} output tokens/s", flush=True)


def _savings(r, none):
    """Against `none` at the same budget: computed-token and wall-time savings, their ratio."""
    tok = 1 - r["computed_prompt_tokens"] / max(none["computed_prompt_tokens"], 1)
    wall = 1 - r["wall_s"] / none["wall_s"]
    r.update(wall_vs_none=r["wall_s"] / none["wall_s"], token_saving=tok, wall_saving=wall,
             saving_ratio=wall / tok if tok > 0 else None)


def run(args) -> int:
    import jax.numpy as jnp

    from minipic_jax import SamplingParams
    from minipic_jax.loading import load_model
    from serving.hybrid import checkpoint_pool
    loaded = load_model(args.model, dtype=args.dtype, seed=0)
    layout = checkpoint_pool.state_layout(loaded.family, loaded.cfg, 16, jnp.dtype(args.dtype))
    nbytes = checkpoint_pool.checkpoint_nbytes(layout)
    kv_token = 2 * loaded.cfg.num_kv_layers * loaded.cfg.num_kv_heads * loaded.cfg.head_dim * \
        jnp.dtype(args.dtype).itemsize
    print(f"checkpoint: {nbytes / 2**20:.2f} MiB (= KV of {nbytes / kv_token:.0f} tokens); "
          f"budgets {args.budgets} slots; free room {args.free_room}", flush=True)
    llm = _engine(args, loaded, nbytes)
    engine = llm.llm_engine
    cost = args.cost and not args.stub_device
    if cost:
        from benchmarks import hybrid_cache_cost
        plain = hybrid_cache_cost.start_plain_compile(engine.runner)
    t0 = time.perf_counter()
    if not args.stub_device:  # nothing to compile for the stub
        engine.warmup()
    if cost:
        plain.join()
        capture = hybrid_cache_cost.StepCapture(engine.runner)
    print(f"warmup (compile) {time.perf_counter() - t0:.1f} s", flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    from benchmarks.hybrid_cache_steps import StepLog
    log = StepLog(engine.runner)
    loads = workloads(args.workloads, args.scale, args.doc_cap, args.seed)
    room = args.max_model_len - args.max_tokens
    for name in loads:  # ids kept inside the vocabulary (below the marker ids), lengths in room
        vocab = loaded.cfg.vocab_size - 8
        loads[name] = [[t % vocab for t in p] for p in loads[name] if len(p) <= room]
    results, extra = [], {"free_room": engine.config.hybrid_cache.free_room}
    for name, prompts in loads.items():
        print(f"== {name}: {len(prompts)} requests, "
              f"{sum(map(len, prompts))} prompt tokens", flush=True)
        for budget in args.budgets:
            for fit in args.bucket_fit:
                _cell(llm, prompts, sp, log, args, dict(workload=name, budget=budget,
                                                        bucket_fit=fit, budget_bytes=budget * nbytes),
                      results, lambda: args.json and _write(args.json, nbytes, results, extra))
        if cost and "cost" not in extra:  # after the first workload: a timeout later keeps it
            capture.close()
            extra["cost"] = _cost(hybrid_cache_cost, engine, loaded.family, capture)
            if args.json:
                _write(args.json, nbytes, results, extra)
    _fit(results, extra)
    if args.json:
        _write(args.json, nbytes, results, extra)
    if args.plot:
        _plot(results, args.plot)
    _table(results)
    return 0


def _fit(results, extra) -> None:
    """The wall-time fit over all runs (benchmarks/hybrid_cache_steps.py), and per run the
    prefill-wall saving over the computed-token saving against `none`."""
    from benchmarks.hybrid_cache_steps import fit_wall
    fit = fit_wall(results)
    if fit is None:
        return
    extra["wall_fit"] = fit
    steps = ", ".join(f"{k} {v:.2f} ms" for k, v in fit["step_ms"].items())
    print(f"wall fit over {fit['runs']} runs, per step: {steps}; + {fit['rest_s']:.3f} s "
          f"(R^2 {fit['r2']:.3f}, residual std {fit['residual_std_s']:.3f} s)", flush=True)
    for r in results:
        none = [x for x in results if x["strategy"] == "none" and all(
            x[k] == r[k] for k in ("workload", "budget", "bucket_fit"))]
        if none and r.get("token_saving", 0) > 0:
            r["prefill_saving_ratio"] = (1 - r["prefill_wall_s"] / none[0]["prefill_wall_s"]) \
                / r["token_saving"]

def _cell(llm, prompts, sp, log, args, cell, results, save) -> None:
    """Every strategy on one workload at one budget (and bucket-fit setting), in order."""
    engine, ref = llm.llm_engine, None
    for strategy in args.strategies:
        engine.config.hybrid_cache = dataclasses.replace(  # groups are frozen: a new one
            engine.config.hybrid_cache, strategy=strategy,
            budget_gb=cell["budget_bytes"] / 2**30, bucket_fit=cell["bucket_fit"] == "on")
        engine.reset_prefix_cache()
        try:
            r = _run(llm, prompts, sp, log)
        except Exception as err:  # noqa: BLE001 - one failing run must not lose the rest
            print(f"  {strategy}: FAILED {type(err).__name__}: {err}", flush=True)
            continue
        toks = r.pop("tokens")
        ref = toks if strategy == "none" else ref
        r["tokens_equal_none"] = (float(np.mean([a == b for a, b in zip(toks, ref)]))
                                  if ref is not None else None)
        r.update(cell, strategy=strategy)
        none = [x for x in results if x["strategy"] == "none"
                and all(x.get(k) == v for k, v in cell.items())]
        if none:
            _savings(r, none[0])
        results.append(r)
        _print_run(r)
        save()


def _cost(mod, engine, family, capture) -> dict:
    c = mod.measure(engine.runner, family, capture)
    engine.reset_prefix_cache()
    nan = float("nan")
    print(f"checkpoint cost ({c.get('tokens')} tokens, {c.get('rows_restoring')} restoring, "
          f"{c.get('rows_checkpointing')} checkpointing rows): step "
          f"{c.get('step_ms_pool', nan):.2f} ms with the pool vs {c.get('step_ms_plain', nan):.2f}"
          f" ms without = {100 * c.get('overhead', nan):+.2f}%; restore "
          f"{c.get('restore_ms', nan):.3f} ms, store {c.get('store_ms', nan):.3f} ms", flush=True)
    return c


def _write(path, nbytes, results, extra):
    with open(path, "w") as f:
        json.dump({"checkpoint_bytes": nbytes, "results": results, **extra}, f, indent=1,
                  default=str)


def _table(results):
    print("\nworkload      budget fit strategy  recomputed  computed  hit    prefill tok/s  TTFT ms"
          "   wall s  wall/none  saving ratio (wall / tokens)  steps  padded tokens")
    for r in results:
        ratio = r.get("saving_ratio")
        print(f"{r['workload']:13s} {r['budget']:6d} {r['bucket_fit']:3s} {r['strategy']:9s} "
              f"{r['tokens_recomputed']:10d} {r['computed_prompt_tokens']:9d} "
              f"{r['hit_rate']:.3f} {r['prefill_tok_per_s']:14.0f} "
              f"{1e3 * r['mean_ttft_s']:8.1f} {r['wall_s']:8.2f} "
              f"{r.get('wall_vs_none', 1.0):9.2f}  {'-' if ratio is None else f'{ratio:.2f}':>28s}"
              f"  {r.get('steps', 0):5d}  {r.get('padded_tokens', 0):13d}")


def _plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    names = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for s in STRATEGIES:
            rows = sorted((r for r in results if r["workload"] == name and r["strategy"] == s
                           and r["bucket_fit"] == results[0]["bucket_fit"]),
                          key=lambda r: r["budget"])
            if rows:
                ax.plot([r["budget"] for r in rows], [r["tokens_recomputed"] for r in rows],
                        marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("checkpoint slots")
        ax.set_ylabel("tokens recomputed")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
