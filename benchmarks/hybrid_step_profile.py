"""`minipic-bench hybrid-step`: what one hybrid engine step costs, by kind, and where it goes.

The hybrid-cache bench's wall-time fit (benchmarks/hybrid_cache_steps.py) priced a prefill step
~10 ms above a decode step whatever its tokens. This replays real steps of the same engine (the
bench's configuration: Qwen3.5-0.8B shape, random weights, 4 seats, buckets 512 / 1,024 / 2,048,
checkpoint pool on) one kind at a time:

  decode       4 (or 1) sequences, one token each (the decode-only variant)
  prefill      1 sequence or 4 sequences filling the 512 / 1,024 / 2,048 bucket, with their
               checkpoint (strategy `last`) and the same step with none asked (`-1`s)

The steps are scheduled by the engine itself with its device step stubbed (host only), then each
is replayed on the device through two compiled programs:

  static  the engine's step: the recurrent layers' step kind is static (RecurrentMetadata.decode)
  cond    the same with a lax.cond per GDN layer picking decode or prefill on the device (XLA's
          GPU conditional copies the predicate to the host and blocks the stream)
  old     cond, the GDN row / chunk lookups by jnp.searchsorted's default method (a while loop
          per lookup) instead of compare_all, and the ragged scan over every static chunk (not
          only those holding tokens): the step as it was before the three changes

Per step and program: median wall of calls each waited for (what the engine pays: one host sync
per step), and for the chosen kinds a jax.profiler trace summarised on the device (kernels per
step, busy time, first-to-last kernel, top kernels). Also the conditionals / while loops /
kernels of each compiled program (optimised HLO). Prints a table; --json writes everything.
"""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np

SCENARIOS = {"1x480": (1, 480), "1x1000": (1, 1000), "1x2000": (1, 2000),
             "4x120": (4, 120), "4x250": (4, 250), "4x500": (4, 500)}
VARIANTS = ("static", "cond", "old")


def add_parser(p) -> None:
    p.add_argument("--model", default="qwen3_5_0_8b", help="hybrid preset (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="weights and KV (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="seats (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step (default: %(default)s)")
    p.add_argument("--min-token-bucket", type=int, default=512,
                   help="smallest token bucket (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=8192, help="(default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: from free memory")
    p.add_argument("--checkpoint-gb", type=float, default=0.5,
                   help="checkpoint pool bytes (default: %(default)s)")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS),
                   help="sequences x prompt tokens per prefill step (default: all)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="prompt lengths x this (tiny presets on CPU) (default: %(default)s)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="compiled programs to compare (default: all)")
    p.add_argument("--profile-variants", nargs="*", default=["static", "old"], choices=VARIANTS,
                   help="programs to trace (default: %(default)s)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per step (default: 20)")
    p.add_argument("--profile", nargs="*", default=["decode 4x", "prefill 1x480", "prefill 4x500"],
                   help="step labels to trace with jax.profiler (GPU only; default: %(default)s)")
    p.add_argument("--top", type=int, default=25, help="kernels kept per trace (JSON)")
    p.add_argument("--print-top", type=int, default=8, help="kernels printed per trace")
    p.add_argument("--json", default=None, help="write the results to this JSON file")


# ----------------------------------------------------------------------------- capture


def capture_steps(llm, scenarios: dict, scale: float, seed: int = 0) -> dict:
    """Schedule each scenario's requests through the engine with the device step stubbed; keep
    its first prefill step and first decode-only step: label -> (ints, floats, kw, use_prev)."""
    from benchmarks.engine_host import StubStep
    from minipic_jax import SamplingParams
    engine = llm.llm_engine
    runner = engine.runner
    real_step, orig = runner._step, runner._dispatch
    runner._step = StubStep(engine.vocab_size)
    steps, current = {}, {}

    def dispatch(ints, floats, use_prev, kw):
        kind = "decode" if kw.get("decode_only") else "prefill"
        current.setdefault(kind, (ints.copy(), floats.copy(), dict(kw), use_prev))
        return orig(ints, floats, use_prev, kw)

    runner._dispatch = dispatch
    rng = np.random.default_rng(seed)
    vocab = llm.llm_engine.vocab_size - 8
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    try:
        for name in scenarios:
            n, length = SCENARIOS[name]
            length = max(int(length * scale), 2)
            engine.reset_prefix_cache()
            current.clear()
            llm.generate([rng.integers(0, vocab, length).tolist() for _ in range(n)], sp,
                         use_tqdm=False)
            steps[f"prefill {name}"] = current["prefill"]
            if "decode" in current:
                steps.setdefault(f"decode {n}x", current["decode"])
    finally:
        runner._step, runner._dispatch = real_step, orig
        engine.reset_prefix_cache()
    return steps


def without_checkpoints(runner, ints, kw):
    """The same step's inputs with no checkpoint stored and no state restored."""
    from serving.step.step_inputs import S_FIELDS_CKPT, layout
    spec, _ = layout(kw["t"], kw["s"], runner.nb, True, bool(kw.get("spans")),
                     False, block_size=runner.block_size)  # no span-map pool (plain prompts)
    out = ints.copy()
    for name in S_FIELDS_CKPT:
        o, shape = spec[name]
        out[o:o + int(np.prod(shape))] = -1
    return out


def checkpoint_rows(runner, ints, kw) -> int:
    from serving.step.step_inputs import layout
    o, shape = layout(kw["t"], kw["s"], runner.nb, True, block_size=runner.block_size)[0]["ck_slot"]
    return int((ints[o:o + int(np.prod(shape))] >= 0).sum())  # [K] flat rows: checkpoints


# ----------------------------------------------------------------------------- programs


def _program_key(kw) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in kw.items()))


def compile_programs(runner, steps: dict, variants) -> dict:
    """(variant, program key) -> Compiled step, every one lowered in turn (the variant decides
    the trace: runner.static_recurrent_kind) and compiled in threads."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    lowered = {}
    for variant in variants:
        # a jit of its own per variant: one jit object reuses its trace for the same arguments
        jitted = jax.jit(runner._step_impl, donate_argnums=(1, 5, 6),
                         static_argnames=("t", "s", "all_greedy", "use_filter", "num_logprobs",
                                          "decode_only", "spans", "attn_options", "compose"))
        runner.static_recurrent_kind = variant == "static"
        try:
            with _old_gdn(variant == "old"):
                for ints, floats, kw, use_prev in steps.values():
                    key = (variant, _program_key(kw))
                    if key in lowered:
                        continue
                    prev = runner._prev() if use_prev else None
                    lowered[key] = jitted.lower(runner.params, runner.cache, ints, floats, prev,
                                                runner.ck_pool, None, **kw)
        finally:
            runner.static_recurrent_kind = True
    with ThreadPoolExecutor(max_workers=min(len(lowered), 8)) as pool:
        compiled = dict(zip(lowered, pool.map(lambda low: low.compile(), lowered.values())))
    return compiled


@contextlib.contextmanager
def _old_gdn(on: bool):
    """While tracing (bench-only stand-ins): jnp.searchsorted ignores `method` (its default, a
    while loop), as the GDN lookups were before compare_all, and the ragged scan runs every
    static chunk (no n_used)."""
    import jax.numpy as jnp

    from kernels_pallas.gated_delta import ragged_triton
    if not on:
        yield
        return
    search, packed = jnp.searchsorted, ragged_triton.packed_gated_delta
    jnp.searchsorted = lambda a, v, side="left", sorter=None, *, method=None: search(
        a, v, side=side, sorter=sorter)
    ragged_triton.packed_gated_delta = lambda *a, n_used=None, **kw: packed(*a, **kw)
    try:
        yield
    finally:
        jnp.searchsorted, ragged_triton.packed_gated_delta = search, packed


def hlo_counts(compiled) -> dict:
    """Conditionals, while loops, fusions and custom calls (kernels) of an optimised program."""
    try:
        text = compiled.as_text()
    except Exception as e:  # noqa: BLE001 - counts are a side figure
        return {"error": repr(e)}
    return {name: text.count(f" {op}(") for name, op in
            (("conditional", "conditional"), ("while", "while"), ("fusion", "fusion"),
             ("custom_call", "custom-call"))}


def make_call(runner, compiled, ints, floats, use_prev):
    """call() -> packed output: one step, the donated cache / pool / prev kept by the runner."""
    def call():
        prev = runner._prev() if use_prev else None
        runner.cache, packed, prev, runner.ck_pool, _ = compiled(
            runner.params, runner.cache, ints, floats, prev, runner.ck_pool, None)
        if use_prev:
            runner.prev_tokens = prev
        return packed
    return call


# ----------------------------------------------------------------------------- run


def _engine(args):
    from minipic_jax import LLM
    return LLM(args.model, dtype=args.dtype, seed=0, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               min_token_bucket=args.min_token_bucket, max_model_len=args.max_model_len,
               checkpoint_gb=args.checkpoint_gb, checkpoint_strategy="last",
               num_kv_blocks=args.num_kv_blocks)


def run(args) -> int:
    import jax
    start = t0 = time.perf_counter()
    llm = _engine(args)
    runner = llm.llm_engine.runner
    if runner.ck_pool is None:
        raise ValueError("hybrid-step: needs a hybrid model with prefix caching (checkpoint pool)")
    steps = capture_steps(llm, args.scenarios, args.scale)
    print(f"engine + schedule {time.perf_counter() - t0:.1f} s; separate decode variant "
          f"{runner.separate_decode}; steps: "
          + ", ".join(f"{k} (t={v[2]['t']})" for k, v in steps.items()), flush=True)
    t0 = time.perf_counter()
    compiled = compile_programs(runner, steps, args.variants)
    print(f"compile {len(compiled)} programs {time.perf_counter() - t0:.1f} s", flush=True)
    res = {"config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
           "device": str(jax.devices()[0].device_kind), "programs": {}, "steps": [],
           "profiles": {}}
    for (variant, key), comp in compiled.items():
        kw = dict(key)
        name = f"{variant} t={kw['t']} decode_only={kw['decode_only']}"
        res["programs"][name] = hlo_counts(comp)
        print(f"  program {name}: {res['programs'][name]}", flush=True)
    _time_steps(runner, steps, compiled, args, res)
    if jax.default_backend() == "gpu":
        for label in args.profile:
            if label not in steps:
                continue
            ints, floats, kw, use_prev = steps[label]
            for variant in args.profile_variants:
                comp = compiled.get((variant, _program_key(kw)))
                if comp is not None:
                    res["profiles"][f"{variant} {label}"] = _profile(
                        make_call(runner, comp, ints, floats, use_prev), f"{variant} {label}",
                        args)
            if args.json:
                _write(args.json, res)
    _summary(res)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)
    if args.json:
        _write(args.json, res)
    return 0


def _time_steps(runner, steps, compiled, args, res) -> None:
    """Each captured step through each program, with its checkpoints and without (prefill)."""
    from benchmarks.timing import blocked_ms
    for label, (ints, floats, kw, use_prev) in steps.items():
        inputs = [("ck", ints)] if label.startswith("decode") else [
            ("ck", ints), ("no_ck", without_checkpoints(runner, ints, kw))]
        for variant in args.variants:
            comp = compiled[(variant, _program_key(kw))]
            for ck_name, ii in inputs:
                row = dict(step=label, t=kw["t"], variant=variant, checkpoints=ck_name,
                           ck_rows=checkpoint_rows(runner, ii, kw),
                           **blocked_ms(make_call(runner, comp, ii, floats, use_prev), args.reps))
                res["steps"].append(row)
                print(f"  {label:14s} {variant:6s} {ck_name:5s} ({row['ck_rows']} rows) "
                      f"{row['ms']:7.2f} ms (min {row['min_ms']:.2f})", flush=True)
        if args.json:
            _write(args.json, res)


def _profile(call, name: str, args) -> dict:
    from benchmarks.timing import profile_kernels
    try:
        prof = profile_kernels(call, steps=3, top=args.top)
    except Exception as e:  # noqa: BLE001 - the timings stand without the trace
        print(f"  profile {name} failed: {e!r}", flush=True)
        return {"error": repr(e)}
    print(f"  trace {name}: {prof['kernels_per_step']:.0f} kernels/step, busy "
          f"{prof['kernel_busy_ms_per_step']:.2f} ms of "
          f"{prof['first_to_last_kernel_ms_per_step']:.2f} ms first-to-last", flush=True)
    for row in prof["top"][:args.print_top]:
        print(f"    {row['ms_per_step']:7.3f} ms x{row['calls_per_step']:4.0f} "
              f"{row['name'][:64]}", flush=True)
    return prof


def _summary(res) -> None:
    """A table of step ms (with checkpoints) per variant, and per variant the prefill steps'
    excess over its decode step (to compare with the step costs fitted over whole runs:
    benchmarks/RESULTS.md, Hybrid prefix caching)."""
    rows = [r for r in res["steps"] if r["checkpoints"] == "ck"]
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    table = {}
    for r in rows:
        table.setdefault(r["step"], {})[r["variant"]] = r["ms"]
    res["summary"] = table
    print("step (t, ck rows)      " + "".join(f"{v + ' ms':>11s}" for v in variants))
    for step, by in table.items():
        r = next(x for x in rows if x["step"] == step)
        print(f"{step:14s} {r['t']:5d} {r['ck_rows']:2d} "
              + "".join(f"{by.get(v, float('nan')):11.2f}" for v in variants))
    for v in variants:
        dec = table.get("decode 4x", {}).get(v)
        if dec is None:
            continue
        print(f"{v}: prefill - decode(4x) ms: " + ", ".join(
            f"{step.split()[1]} {by[v] - dec:+.1f}" for step, by in table.items()
            if step.startswith("prefill") and v in by))


def _write(path, res) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
