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
     jax.monitoring during the run (goal 0), throughput in vLLM's line format, cache hit rate.
"""

from __future__ import annotations

import functools
import json
import os
import time


def add_parser(p):
    p.add_argument("--model", default="llama3_8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--min-token-bucket", type=int, default=128)
    p.add_argument("--copy-gb", type=float, default=4.0)
    p.add_argument("--attn-impl", default=None, help="paged_attention implementation (None = best)")
    p.add_argument("--write-impl", default=None, choices=("xla", "triton"),
                   help="write_kv implementation (None = triton on GPU)")
    p.add_argument("--decode-impl", default=None, choices=("decode", "triton_decode", "triton"),
                   help="kernel of decode-only steps (Config.decode_attn_impl; None = the "
                        "engine default, 'decode' on a GPU)")
    p.add_argument("--decode-rope", default=None,
                   choices=("trig", "table", "table_bf16"),
                   help="RoPE-at-read variant of the decode kernel (Config.decode_attn_options)")
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
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--host-only", action="store_true",
                   help="CPU host-path profile: the R-request run with the jitted step stubbed out "
                        "(schedule / build / post timed, no device work; use a tiny --model)")
    p.add_argument("--profile", action="store_true", help="with --host-only: cProfile top 25")


def _copy_rate(gb: float) -> float:
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


def _prime_decode(engine, batch: int, ctx: int, steps: int, rng):
    """Admit `batch` requests with ctx-1 prompt tokens as if their prompts were computed."""
    from minipic_jax import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{i}", rng.integers(0, 120000, ctx - 1).tolist(), sp)
    sched = engine.scheduler
    while sched.waiting:
        seq = sched.waiting[0]
        if not sched._try_allocate(seq, sched.free_seats):
            raise RuntimeError("pool too small for the decode batch")
        sched.waiting.popleft()
        sched.running.append(seq)
        seq.num_computed = len(seq) - 1  # synthetic context: the next step is a decode


def _randomize_cache(runner, seed: int = 1):
    """Random K/V in every page (never time on zeros), one leaf at a time to bound memory."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, donate_argnums=(0,))
    def fill(x, key):
        return (0.5 * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)

    leaves, treedef = jax.tree.flatten(runner.cache)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    runner.cache = jax.tree.unflatten(treedef, [fill(x, k) for x, k in zip(leaves, keys)])


def _rag_workload(n: int, rng, block_size: int, markers: dict):
    from minipic_jax import Prompt, Span, build_prompt
    system = rng.integers(0, 120000, 90).tolist()
    docs = [rng.integers(0, 120000, int(rng.integers(30, 250))).tolist() for _ in range(64)]
    prompts, max_tokens = [], []
    for _ in range(n):
        picked = rng.choice(len(docs), size=int(rng.integers(1, 5)), replace=False)
        q = rng.integers(0, 120000, int(rng.integers(5, 60))).tolist()
        segs = [Prompt(system), *[Span(docs[d]) for d in picked], Prompt(q)]
        prompts.append(build_prompt(segs, block_size=block_size, **markers))
        max_tokens.append(int(rng.integers(4, 48)))
    return prompts, max_tokens


class _StubStep:
    """Stands in for the runner's jitted step: returns the cache and a packed [S, C] output with
    random token ids, so the host path runs exactly as in a real step without device work."""

    def __init__(self, vocab: int, seed: int = 0):
        import numpy as np
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def __call__(self, params, cache, ints, floats, prev=None, pool=None, *, t, s,
                 num_logprobs=0, **_):
        import numpy as np
        out = np.zeros((s, 2 + (1 + 2 * num_logprobs if num_logprobs else 0)), np.float32)
        out[:, 0] = self.rng.integers(0, self.vocab, s)
        return cache, out, prev, pool

    def _cache_size(self) -> int:
        return 0


def run_host_only(args) -> int:
    """The R-request RAG run with the device step stubbed (host time only, any backend)."""
    import cProfile
    import pstats

    import numpy as np

    from minipic_jax import LLM, SamplingParams
    bs = 16
    llm = LLM(args.model, dtype="float32", seed=0, max_num_seqs=args.batch,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.ctx + 64,
              block_size=bs, num_kv_blocks=args.batch * (-(-(args.ctx + 64) // bs)) + 64,
              min_token_bucket=args.min_token_bucket, attn_impl=args.attn_impl,
              async_scheduling=not args.no_async)
    engine = llm.llm_engine
    engine.runner._step = _StubStep(engine.vocab_size)
    rng = np.random.default_rng(0)
    prompts, max_tokens = _rag_workload(args.num_requests, rng, bs, engine.markers)
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    for i, (ids, sp) in enumerate(zip(prompts, sps)):
        engine.add_request(str(i), ids, sp)
    prof = cProfile.Profile() if args.profile else None
    outs = []
    t, cpu0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    while engine.has_unfinished():
        outs += engine.step()
    if prof:
        prof.disable()
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu0
    st = engine.get_stats()
    ms = st["host_ms_per_step"]
    print(f"host-only: {len(outs)} requests, {st['steps']} steps in {elapsed:.2f} s; per step (ms): "
          f"schedule {ms['schedule']:.3f} build {ms['build']:.3f} post {ms['post']:.3f} "
          f"dispatch(stub) {ms['dispatch']:.3f} overlapped {ms.get('overlap', 0.0):.3f}; host work "
          f"{ms['schedule'] + ms['build'] + ms['post']:.3f} ms/step; "
          f"cached {sum(o.num_cached_tokens for o in outs)} prompt tokens; process CPU "
          f"{1e3 * cpu / max(st['steps'], 1):.3f} ms/step")
    # pure decode steps at batch B, context C (as in the GPU decode measurement)
    _prime_decode(engine, args.batch, args.ctx, args.decode_steps, rng)
    engine.step()
    h = engine.stats
    h0, n0 = h.schedule + h.build + h.post, h.steps
    for _ in range(args.decode_steps):
        engine.step()
    print(f"host-only decode steps (batch {args.batch}, ctx {args.ctx}): host work "
          f"{1e3 * (h.schedule + h.build + h.post - h0) / (h.steps - n0):.3f} ms/step")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


def run(args) -> int:
    if args.host_only:
        return run_host_only(args)
    import jax
    import numpy as np
    from jax import monitoring

    from minipic_jax import LLM, SamplingParams

    compiles = {"n": 0}

    def on_event(name, *a, **k):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles["n"] += 1

    monitoring.register_event_duration_secs_listener(on_event)
    res = {"device": str(jax.devices()[0].device_kind), "model": args.model, "dtype": args.dtype,
           "batch": args.batch, "ctx": args.ctx, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "fuse_weights": not args.no_fuse, "async_scheduling": not args.no_async}
    t0 = time.perf_counter()
    res["copy_rate_GBps"] = _copy_rate(args.copy_gb) / 1e9
    print(f"copy rate: {res['copy_rate_GBps']:.0f} GB/s", flush=True)

    bs = 16
    max_len = args.ctx + 64
    nb_per_seq = -(-max_len // bs)
    llm = LLM(args.model, dtype=args.dtype, seed=0, max_num_seqs=args.batch,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
              block_size=bs, num_kv_blocks=args.batch * nb_per_seq + 64,
              min_token_bucket=args.min_token_bucket, attn_impl=args.attn_impl,
              write_kv_impl=args.write_impl,
              decode_attn_impl=args.decode_impl,
              decode_attn_options={"rope": args.decode_rope} if args.decode_rope else None,
              fuse_weights=not args.no_fuse, async_scheduling=not args.no_async)
    engine = llm.llm_engine
    cfg = engine.loaded.cfg
    res["write_kv_impl"] = args.write_impl or "default (triton on GPU)"
    res["decode_rope"] = args.decode_rope or "engine default (table, max_model_len)"
    res["decode_impl"] = engine.runner.decode_impl
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.loaded.params))
    embed = getattr(engine.loaded.params, "embed", None)
    tied = getattr(engine.loaded.params, "lm_head", 0) is None
    # bytes a decode step must read: every weight except the embedding table (only B rows of it
    # are gathered), unless it doubles as the LM head
    read_bytes = weight_bytes - (embed.nbytes if embed is not None and not tied else 0)
    res["load_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    if not args.no_warmup:
        engine.warmup()
    res["warmup_s"] = time.perf_counter() - t
    res["compiles_in_warmup"] = compiles["n"]
    print(f"loaded in {res['load_s']:.1f} s, warm-up compiled {engine.runner.num_compiles} step "
          f"shapes in {res['warmup_s']:.1f} s", flush=True)

    # -- decode step ------------------------------------------------------------------------
    rng = np.random.default_rng(0)
    _prime_decode(engine, args.batch, args.ctx, args.decode_steps, rng)
    _randomize_cache(engine.runner)
    engine.step()  # first decode step (transfers, allocator warm-up)
    walls, waits, work, disp = [], [], [], []
    st = engine.stats
    for _ in range(args.decode_steps):
        s0, w0, h0, d0 = st.step_time, st.device_wait, st.schedule + st.build + st.post, st.dispatch
        engine.step()
        walls.append(st.step_time - s0)
        waits.append(st.device_wait - w0)
        work.append(st.schedule + st.build + st.post - h0)
        disp.append(st.dispatch - d0)
    r = engine.runner
    ints, floats, kw = r.last_inputs
    # the engine's own step variant (async: with the device-side last tokens, see ModelRunner)
    prev = (r.prev_tokens,) if engine.config.async_scheduling else ()

    def jitted(cache, ii):
        return r._step(r.params, cache, ii, floats, *prev, **kw)[:2]

    cache = r.cache

    def blocked(ii, n=10):  # seconds per call, each waited for, after 2 warm-up calls
        nonlocal cache
        times = []
        for _ in range(n + 2):
            t = time.perf_counter()
            cache, out = jitted(cache, ii)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t)
        return times[2:]

    dev = blocked(ints)
    # the same step with one context block per sequence: what is not KV reading
    from benchmarks.decode_breakdown import one_block_inputs
    dev_short = blocked(one_block_inputs(r, ints, kw))
    r.cache = cache
    kv_bytes = (args.batch * args.ctx * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                * np.dtype(jax.numpy.dtype(args.dtype)).itemsize)
    floor = (read_bytes + kv_bytes) / (res["copy_rate_GBps"] * 1e9)
    step_wall = float(np.median(walls))
    res.update(weight_GB=weight_bytes / 1e9, weight_read_GB=read_bytes / 1e9, kv_GB=kv_bytes / 1e9,
               floor_ms=floor * 1e3,
               floor_ms_all_weights=(weight_bytes + kv_bytes) / (res["copy_rate_GBps"] * 1e9) * 1e3,
               decode_step_wall_ms=step_wall * 1e3, decode_step_device_ms=float(np.median(dev)) * 1e3,
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
          f"step {res['decode_step_wall_ms']:.2f} ms "
          f"(jitted step alone {res['decode_step_device_ms']:.2f} ms), floor {floor * 1e3:.2f} ms "
          f"-> {res['decode_wall_over_floor']:.2f}x floor; host work "
          f"{res['decode_host_work_ms']:.2f} ms = {100 * res['decode_host_work_share']:.1f}% "
          f"(1 - wait/wall: {100 * res['decode_host_share']:.1f}%; the jitted call returns "
          f"after {res['decode_dispatch_ms']:.2f} ms); same step with 1 context "
          f"block {res['decode_step_no_context_ms']:.2f} ms -> attention reads K/V at "
          f"{res['decode_kv_read_TBps']:.2f} TB/s", flush=True)
    if args.breakdown:
        from benchmarks.decode_breakdown import run_breakdown
        bd = run_breakdown(engine, args)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "breakdown.json"), "w") as f:
            json.dump(dict(bd, floor_ms=res["floor_ms"], copy_rate_GBps=res["copy_rate_GBps"]),
                      f, indent=2, default=str)
    for i in range(args.batch):
        engine.abort_request(f"decode-{i}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine_bench.json"), "w") as f:  # partial results
        json.dump(res, f, indent=2, default=str)

    # -- R-request run ----------------------------------------------------------------------
    if not args.skip_run:
        prompts, max_tokens = _rag_workload(args.num_requests, rng, bs, engine.markers)
        sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        before = dict(engine.get_stats())
        c0 = compiles["n"]
        dw0 = engine.stats.device_wait
        hw0 = st.schedule + st.build + st.post
        t = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        elapsed = time.perf_counter() - t
        after = engine.get_stats()
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = after["steps"] - before["steps"]
        res.update(
            run_requests=len(outs), run_elapsed_s=elapsed, requests_per_second=len(outs) / elapsed,
            tokens_per_second=(n_in + n_out) / elapsed, output_tokens_per_second=n_out / elapsed,
            run_compiles_after_warmup=compiles["n"] - c0,
            run_step_shapes_added=after["num_compiles"] - before["num_compiles"],
            run_steps=steps, run_prompt_tokens=n_in, run_output_tokens=n_out,
            run_cached_tokens=sum(o.num_cached_tokens for o in outs),
            run_preemptions=after["preemptions"] - before["preemptions"],
            run_host_share=1 - ((after["step_time_s"] - before["step_time_s"]) and
                                (engine.stats.device_wait - dw0) /
                                (after["step_time_s"] - before["step_time_s"])),
            run_host_work_share=(st.schedule + st.build + st.post - hw0) /
            (after["step_time_s"] - before["step_time_s"]))
        print(f"Throughput: {len(outs) / elapsed:.2f} requests/s, {(n_in + n_out) / elapsed:.2f} "
              f"total tokens/s, {n_out / elapsed:.2f} output tokens/s")
        print(f"{len(outs)} requests in {steps} steps: compiles after warm-up "
              f"{res['run_compiles_after_warmup']}, cache hits {res['run_cached_tokens']} of "
              f"{n_in} prompt tokens, preemptions {res['run_preemptions']}, host work "
              f"{100 * res['run_host_work_share']:.1f}% of step time (per step ms: "
              + ", ".join(f"{k} {v:.2f}" for k, v in after["host_ms_per_step"].items())
              + "; overlap = frontier updates done while the device computes; with async "
              "scheduling all host work but the first schedule/build overlaps the device)",
              flush=True)
    res["engine_stats"] = engine.get_stats()
    res["total_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine_bench.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    print(json.dumps({k: v for k, v in res.items() if k != "engine_stats"}, default=str))
    return 0
