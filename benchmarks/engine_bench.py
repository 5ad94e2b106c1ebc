"""`minipic-bench engine`: the paged engine on one GPU (Llama-3-8B shape, random bf16 weights).

Three measurements, one engine, one run:
  1. copy rate: device-to-device copy of a large array (the anchor for the memory floor);
  2. decode step at batch B, context C (synthetic context: the KV pages are allocated and read
     in full, their values do not matter): engine.step() wall time, its host share (scheduling,
     hashing, metadata, postprocess = step time minus the wait for the device), the jitted step
     alone, and the memory floor (weight bytes + K/V bytes read) / copy rate. With async
     scheduling (the default; --no-async for the synchronous loop) one step() call dispatches
     step N+1 and then waits for step N, so in steady state its wall time is the device step
     time plus whatever host work does not fit under it;
  3. a R-request RAG-style run (shared system prompt, SSEP document spans, random questions and
     output lengths) after `engine.warmup()`: XLA backend compiles counted through
     jax.monitoring during the run (goal 0; persistent-cache loads counted apart:
     benchmarks/compile_counter.py), throughput in vLLM's line format, cache hit rate.
"""

from __future__ import annotations

import functools
import json
import os
import time

from benchmarks.compile_counter import CompileCounter
from benchmarks.engine_args import add_options, engine_options, out_option
from benchmarks.engine_workload import prime_decode, rag_workload

BLOCK_SIZE = 16


def add_parser(p):
    p.add_argument("--model", default=None,
                   help="preset name or HF folder (presets get random weights); default "
                        "llama3_8b, or tiny_llama3 with --host-only")
    p.add_argument("--batch", type=int, default=128,
                   help="sequences per decode step in the decode measurement (max_num_seqs)")
    p.add_argument("--ctx", type=int, default=2048,
                   help="context length of each sequence in the decode measurement; "
                        "max_model_len is ctx + 64")
    p.add_argument("--decode-steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--num-requests", type=int, default=1000,
                   help="requests in the RAG run (prompts shortened to fit --ctx)")
    add_options(p, engine_options(dtype="bfloat16", max_num_batched_tokens=1024,
                                  min_token_bucket=128, tensor_parallel_size=1))
    p.add_argument("--copy-gb", type=float, default=4.0,
                   help="size of the device copy that anchors the memory floor (GB)")
    p.add_argument("--attn-impl", default=None, help="paged_attention implementation (None = best)")
    p.add_argument("--write-impl", default=None, choices=("xla", "triton"),
                   help="write_kv implementation (None = triton on GPU)")
    p.add_argument("--decode-impl", default=None,
                   choices=("auto", "mosaic_decode", "triton_decode", "triton"),
                   help="kernel of decode-only steps (Config.decode_attn_impl; None = as "
                        "--attn-impl: the registry's choice, mosaic_decode for Llama-3-8B)")
    p.add_argument("--decode-rope", default=None,
                   choices=("trig", "table", "table_bf16"),
                   help="RoPE-at-read variant of triton_decode (Config.decode_attn_options)")
    p.add_argument("--skip-run", action="store_true", help="only the decode measurement")
    p.add_argument("--no-async", action="store_true",
                   help="synchronous engine loop (Config.async_scheduling=False): each step's "
                        "tokens are read back before the next step is scheduled")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip engine.warmup() (the decode step compiles on its first call)")
    p.add_argument("--no-fuse", action="store_true",
                   help="keep separate Q/K/V and gate/up weights (Config.fuse_weights=False)")
    p.add_argument("--breakdown", nargs="?", const="full", choices=("full", "lite"), default=None,
                   help="after the decode measurement: stage-removal variants, sampler variants "
                        "and a profiler summary of the decode step (benchmarks/decode_breakdown.py;"
                        " 'lite': step, 1 block, GEMM chain and weight read only)")
    add_options(p, {"out": out_option("the JSON results")})
    p.add_argument("--host-only", action="store_true",
                   help="CPU host-path profile: the R-request run with the jitted step stubbed out "
                        "(schedule / build / post timed, no device work; use a tiny --model)")
    p.add_argument("--profile", action="store_true", help="with --host-only: cProfile top 25")


def copy_rate(gb: float) -> float:
    """Device copy rate (bytes read + written per second) of a jitted elementwise pass over a
    `gb` GiB bf16 array: 10 calls back to back per rep (so dispatch latency is not counted), median
    of 5 reps, as the attention benchmark times its anchors."""
    import jax.numpy as jnp
    import jax
    from benchmarks.timing import time_calls
    n = int(gb * (1 << 30)) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
    t = time_calls(f, x, iters=10, reps=5)
    del x
    return 2 * n * 2 / t


@functools.cache
def _fill_program(sharding):
    """jit(x, key -> random normal values of x's shape and dtype), x donated, the output placed
    as x (`sharding`), so each new leaf takes its old leaf's buffer."""
    import jax
    import jax.numpy as jnp

    def fill(x, key):
        return (0.5 * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)

    # keep_unused: the program reads x for its shape only, and jit drops an argument it never
    # reads, donation and all: every new leaf then took fresh memory while the old one stayed
    # alive, the whole pool twice over by the last leaf (weights 16 GB + 2 x 35.6 GB: the H100
    # ran out at batch 128, 2026-12-05; tests/test_engine_bench_fill.py)
    return jax.jit(fill, donate_argnums=(0,), keep_unused=True, out_shardings=sharding)


def _randomize_cache(runner, seed: int = 1, after_leaf=None):
    """Random K/V in every page (never time on zeros), one leaf at a time in place (donated):
    the pool's memory plus one leaf's temporaries at most. after_leaf(i): called after leaf i
    (benchmarks/live_bytes.py reads the device's memory there)."""
    import jax

    leaves, treedef = jax.tree.flatten(runner.cache)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    runner.cache = None  # the leaves list holds the only references: each is replaced in turn
    try:
        for i, key in enumerate(keys):
            leaves[i] = _fill_program(leaves[i].sharding)(leaves[i], key)
            if after_leaf is not None:
                after_leaf(i)
    finally:
        runner.cache = jax.tree.unflatten(treedef, leaves)


def _load(args, res: dict, compiles: CompileCounter, t0: float):
    """The LLM for the decode batch, warmed up; records the load time (since t0, the run's start)
    and warm-up time and the bytes of weights a decode step reads. Returns (llm, read_bytes)."""
    import jax

    from minipic_jax import LLM
    max_len = args.ctx + 64
    llm = LLM(args.model, dtype=args.dtype, seed=0, max_num_seqs=args.batch, warmup=False,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
              block_size=BLOCK_SIZE, num_kv_blocks=args.batch * -(-max_len // BLOCK_SIZE) + 64,
              min_token_bucket=args.min_token_bucket, attn_impl=args.attn_impl,
              write_kv_impl=args.write_impl, tensor_parallel_size=args.tensor_parallel_size,
              decode_attn_impl=args.decode_impl,
              decode_attn_options={"rope": args.decode_rope} if args.decode_rope else None,
              fuse_weights=not args.no_fuse, async_scheduling=not args.no_async)
    engine = llm.llm_engine
    res["write_kv_impl"] = args.write_impl or "default (triton on GPU)"
    res["decode_rope"] = args.decode_rope or "engine default (table, max_model_len)"
    res["decode_impl"] = engine.runner.decode_impl
    res["decode_options"] = repr(engine.runner.decode_options)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.loaded.params))
    embed = getattr(engine.loaded.params, "embed", None)
    tied = getattr(engine.loaded.params, "lm_head", 0) is None
    # bytes a decode step must read: every weight except the embedding table (only B rows of it
    # are gathered), unless it doubles as the LM head
    read_bytes = weight_bytes - (embed.nbytes if embed is not None and not tied else 0)
    res.update(weight_GB=weight_bytes / 1e9, weight_read_GB=read_bytes / 1e9)
    res["load_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    if not args.no_warmup:
        engine.warmup()
    res["warmup_s"] = time.perf_counter() - t
    counted = compiles.read()  # since the run's start: the copy-rate program and the warm-up
    res["compiles_in_warmup"] = counted["xla_compiles"]
    res["cache_loads_in_warmup"] = counted["xla_cache_loads"]
    from benchmarks import startup
    res["startup"] = startup.collect(llm)
    print(f"loaded in {res['load_s']:.1f} s, warm-up readied {engine.runner.num_compiles} step "
          f"variants in {res['warmup_s']:.1f} s\nstart-up: {startup.line(res['startup'])}",
          flush=True)
    return llm, read_bytes


def _blocked_step_times(runner, async_scheduling: bool, short_inputs) -> tuple[list, list]:
    """Seconds per call of the runner's last jitted step called alone and waited for (10 calls
    after 2 warm-up calls), on its last inputs and on `short_inputs`; the cache is kept."""
    import jax
    ints, floats, kw = runner.last_inputs

    def blocked(ii, n=10):
        times = []
        for _ in range(n + 2):
            t = time.perf_counter()
            # the engine's own step variant and state (async: the device-side last tokens; the
            # device block tables), kept across calls as ModelRunner keeps them
            out = runner._dispatch(ii, floats, async_scheduling, kw)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t)
        return times[2:]

    return blocked(ints), blocked(short_inputs)


def _measure_decode(engine, args, res: dict, read_bytes: int, rng) -> None:
    """The decode step at batch x ctx: engine.step() wall (and its host share), the jitted step
    alone, the same with one context block, against the memory floor."""
    import jax
    import numpy as np

    from benchmarks.decode_breakdown import one_block_inputs
    prime_decode(engine, args.batch, args.ctx, args.decode_steps, rng)
    _randomize_cache(engine.runner)
    engine.step()  # first decode step (transfers, allocator warm-up)
    walls, waits, work, disp, outer = [], [], [], [], []
    st = engine.stats
    for _ in range(args.decode_steps):
        s0, w0, h0, d0 = st.step_time, st.device_wait, st.schedule + st.build + st.post, st.dispatch
        t0 = time.perf_counter()
        engine.step()
        outer.append(time.perf_counter() - t0)  # what the engine's own timer may leave out
        walls.append(st.step_time - s0)
        waits.append(st.device_wait - w0)
        work.append(st.schedule + st.build + st.post - h0)
        disp.append(st.dispatch - d0)
    r = engine.runner
    ints, _, kw = r.last_inputs
    # the same step with one context block per sequence: what is not KV reading
    dev, dev_short = _blocked_step_times(r, engine.config.async_scheduling,
                                         one_block_inputs(r, ints, kw))
    cfg = engine.loaded.cfg
    kv_bytes = (args.batch * args.ctx * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                * np.dtype(jax.numpy.dtype(args.dtype)).itemsize)
    rate = res["copy_rate_GBps"] * 1e9
    floor = (read_bytes + kv_bytes) / rate
    step_wall = float(np.median(walls))
    res.update(kv_GB=kv_bytes / 1e9, floor_ms=floor * 1e3,
               floor_ms_all_weights=(res["weight_GB"] * 1e9 + kv_bytes) / rate * 1e3,
               decode_step_wall_ms=step_wall * 1e3, decode_step_outer_ms=float(np.median(outer)) * 1e3, decode_step_device_ms=float(np.median(dev)) * 1e3,
               decode_host_share=float(np.median([(w - d) / w for w, d in zip(walls, waits)])),
               decode_host_work_share=float(np.median([h / w for w, h in zip(walls, work)])),
               decode_host_work_ms=float(np.median(work)) * 1e3,
               decode_dispatch_ms=float(np.median(disp)) * 1e3,
               decode_step_no_context_ms=float(np.median(dev_short)) * 1e3,
               decode_kv_read_TBps=kv_bytes / ((np.median(dev) - np.median(dev_short)) * 1e12),
               host_ms_per_step=dict(engine.get_stats()["host_ms_per_step"]),
               decode_wall_over_floor=step_wall / floor,
               decode_device_over_floor=float(np.median(dev)) / floor)
    print(f"decode batch {args.batch} ctx {args.ctx} "
          f"({'async' if engine.config.async_scheduling else 'sync'} loop): "
          f"step {res['decode_step_wall_ms']:.2f} ms (outside clock {res['decode_step_outer_ms']:.2f}) "
          f"(jitted step alone {res['decode_step_device_ms']:.2f} ms), floor {floor * 1e3:.2f} ms "
          f"-> {res['decode_wall_over_floor']:.2f}x floor; host work "
          f"{res['decode_host_work_ms']:.2f} ms = {100 * res['decode_host_work_share']:.1f}% "
          f"(1 - wait/wall: {100 * res['decode_host_share']:.1f}%; the jitted call returns "
          f"after {res['decode_dispatch_ms']:.2f} ms); same step with 1 context "
          f"block {res['decode_step_no_context_ms']:.2f} ms -> attention reads K/V at "
          f"{res['decode_kv_read_TBps']:.2f} TB/s", flush=True)


def _measure_run(llm, args, res: dict, compiles: CompileCounter, rng) -> None:
    """The R-request RAG run after warm-up: throughput (vLLM's line), compiles, host share."""
    from minipic_jax import SamplingParams
    engine = llm.llm_engine
    st = engine.stats
    prompts, max_tokens = rag_workload(args.num_requests, rng, BLOCK_SIZE, engine.markers,
                                       max_len=args.ctx + 64)
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    before = dict(engine.get_stats())
    c0 = compiles.read()
    dw0 = st.device_wait
    hw0 = st.schedule + st.build + st.post
    t = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    elapsed = time.perf_counter() - t
    after = engine.get_stats()
    c1 = compiles.read()
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after["steps"] - before["steps"]
    step_time = after["step_time_s"] - before["step_time_s"]
    res.update(
        run_requests=len(outs), run_elapsed_s=elapsed, requests_per_second=len(outs) / elapsed,
        tokens_per_second=(n_in + n_out) / elapsed, output_tokens_per_second=n_out / elapsed,
        run_compiles_after_warmup=c1["xla_compiles"] - c0["xla_compiles"],
        run_cache_loads_after_warmup=c1["xla_cache_loads"] - c0["xla_cache_loads"],
        run_step_shapes_added=after["num_compiles"] - before["num_compiles"],
        run_steps=steps, run_prompt_tokens=n_in, run_output_tokens=n_out,
        run_cached_tokens=sum(o.num_cached_tokens for o in outs),
        run_preemptions=after["preemptions"] - before["preemptions"],
        run_host_share=1 - (step_time and (st.device_wait - dw0) / step_time),
        run_host_work_share=(st.schedule + st.build + st.post - hw0) / step_time)
    print(f"Throughput: {len(outs) / elapsed:.2f} requests/s, {(n_in + n_out) / elapsed:.2f} "
          f"total tokens/s, {n_out / elapsed:.2f} output tokens/s")
    print(f"{len(outs)} requests in {steps} steps: compiles after warm-up "
          f"{res['run_compiles_after_warmup']} (persistent-cache loads "
          f"{res['run_cache_loads_after_warmup']}), cache hits {res['run_cached_tokens']} of "
          f"{n_in} prompt tokens, preemptions {res['run_preemptions']}, host work "
          f"{100 * res['run_host_work_share']:.1f}% of step time (per step ms: "
          + ", ".join(f"{k} {v:.2f}" for k, v in after["host_ms_per_step"].items())
          + "; overlap = frontier updates done while the device computes; with async "
          "scheduling all host work but the first schedule/build overlaps the device)",
          flush=True)


def _write(args, name: str, data: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(data, f, indent=2, default=str)


def run(args) -> int:
    if args.model is None:
        args.model = "tiny_llama3" if args.host_only else "llama3_8b"
    if args.host_only:
        from benchmarks.engine_host import run_host_only
        return run_host_only(args)
    import jax
    import numpy as np

    compiles = CompileCounter()
    res = {"device": str(jax.devices()[0].device_kind), "model": args.model, "dtype": args.dtype,
           "batch": args.batch, "ctx": args.ctx, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "fuse_weights": not args.no_fuse, "async_scheduling": not args.no_async,
           "tensor_parallel_size": args.tensor_parallel_size}
    t0 = time.perf_counter()
    res["copy_rate_GBps"] = copy_rate(args.copy_gb) / 1e9
    print(f"copy rate: {res['copy_rate_GBps']:.0f} GB/s", flush=True)
    llm, read_bytes = _load(args, res, compiles, t0)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    _measure_decode(engine, args, res, read_bytes, rng)
    if args.breakdown:
        from benchmarks.decode_breakdown import run_breakdown
        bd = run_breakdown(engine, args)
        _write(args, "breakdown.json",
               dict(bd, floor_ms=res["floor_ms"], copy_rate_GBps=res["copy_rate_GBps"]))
    for i in range(args.batch):
        engine.abort_request(f"decode-{i}")
    _write(args, "engine_bench.json", res)  # partial results
    if not args.skip_run:
        _measure_run(llm, args, res, compiles, rng)
    res["engine_stats"] = engine.get_stats()
    res["total_s"] = time.perf_counter() - t0
    _write(args, "engine_bench.json", res)
    print(json.dumps({k: v for k, v in res.items() if k != "engine_stats"}, default=str))
    return 0
