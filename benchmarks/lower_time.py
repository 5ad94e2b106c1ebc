"""Trace and lower time of the engine's step variants for a GPU, measured on this CPU.

Warm-up on the H100 spends more time tracing and lowering the step variants (host Python) than
XLA spends compiling them (RESULTS.md, engine warm-up). Both are host work that needs no GPU
and no weights: this builds a ModelRunner whose kernels are chosen as on a GPU
(`jax.default_backend` answers "gpu" while it is built and traced, as tests/
test_engine_gdn_kernel.py does), with abstract weights and KV pool (jax.ShapeDtypeStruct: no
16 GB of weights), takes the variants `ModelRunner.warmup_steps` lists, and times for each
`jitted.trace(...)` then `.lower(lowering_platforms=("cuda",))` under an abstract H100 (Triton's
lowering asks for the device kind). Nothing is compiled. The KV pool is abstract and no
checkpoint or span-map pool is made (a hybrid model's variants are those without prefix caching).

    minipic-bench lower-time --model llama3_8b --variants 3 --profile 25

Per variant it prints the seconds, the lowered text's custom calls and functions, and the
program's ops as XLA sees them once it inlines nested jits (`program_ops`: their count and a
digest, so two trees that lower the same program print the same digests when run from the same
folder with --no-locations: kernels embed source paths and lines). `--profile N` prints
cProfile's top N functions (`--sort`) over every trace and lower.
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import hashlib
import io
import json
import pstats
import re
import statistics
import time
import types

from benchmarks.engine_args import add_options, engine_options


def add_parser(p) -> None:
    add_options(p, engine_options(model="llama3_8b", dtype="bfloat16", max_num_seqs=64,
                                  max_num_batched_tokens=1024, min_token_bucket=128,
                                  max_model_len=2112, num_kv_blocks=4096, block_size=16))
    p.add_argument("--variants", type=int, default=None,
                   help="time only the first N warm-up variants (default: all)")
    p.add_argument("--spans", action="store_true", help="warmup(spans=True)'s list (hybrid)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print cProfile's top N functions by cumulative time")
    p.add_argument("--sort", default="cumulative", choices=("cumulative", "tottime"),
                   help="cProfile order (default: %(default)s)")
    p.add_argument("--no-locations", action="store_true",
                   help="lower without source locations (jax_traceback_in_locations_limit 0) "
                        "for digests that do not depend on line numbers (times are then not "
                        "the engine's); Mosaic kernels still embed file paths: run two trees "
                        "from one folder to compare their digests")
    p.add_argument("--json", default=None, help="also write the figures to this file")


@contextlib.contextmanager
def as_on_gpu():
    """jax.default_backend() answers "gpu" (kernel choices, Pallas compiled, not interpreted)."""
    import jax
    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = real


def on_h100():
    """An abstract H100 mesh made current (Triton's lowering asks for the device kind); its one
    axis is Auto, so the trace holds no sharding constraints (an Explicit axis adds them to
    the values of every nested jit), as the engine's on one GPU."""
    import jax
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                       platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
        (1,), ("gpu",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=h100))


def abstract(tree):
    """Every array leaf of `tree` as a jax.ShapeDtypeStruct (None stays None)."""
    import jax
    import numpy as np
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def build_runner(model, dtype_name: str, **engine):
    """A ModelRunner for `model` (a preset name or a ModelConfig) chosen as on a GPU (call it
    under `as_on_gpu`), its params and KV pool abstract (the pool of `engine["num_kv_blocks"]`
    blocks; a small real one is made, then replaced)."""
    import jax
    import jax.numpy as jnp

    from configs.presets import get_preset
    from minipic_jax.models import get_family
    from serving.config import Config
    from serving.step.model_runner import ModelRunner

    mcfg = get_preset(model) if isinstance(model, str) else model
    dtype = jnp.dtype(dtype_name)
    family = get_family(mcfg.model_type)
    params = jax.eval_shape(lambda: family.init_params(mcfg, jax.random.PRNGKey(0), dtype))
    fuse = hasattr(family, "fuse_params")
    if fuse:  # as Config.fuse_weights does at start, on shapes only
        params = jax.eval_shape(family.fuse_params, params)
    blocks = engine.pop("num_kv_blocks")
    config = Config.from_flat(fuse_weights=False, num_kv_blocks=4,
                              enable_prefix_caching=False, **engine)
    loaded = types.SimpleNamespace(cfg=mcfg, params=params, family=family, tokenizer=None)
    runner = ModelRunner(config, loaded, 4, dtype)
    runner.cache = jax.eval_shape(lambda: family.init_cache(
        runner.mcfg, blocks, config.block_size, config.num_seats + 1, dtype))
    runner.num_blocks = blocks
    return runner


def variant_args(runner, steps) -> list[tuple]:
    """(abstract step arguments, static keywords) of each warm-up step."""
    use_prev = runner.config.async_scheduling
    return [(abstract(runner._args(ints, floats, use_prev, kw)), kw) for ints, floats, kw in steps]


def time_variants(runner, variants, profiler=None) -> list[dict]:
    """Per variant: its static keywords, trace and lower seconds (lowered for CUDA, under an
    abstract H100)."""
    rows = []
    for args, kw in variants:
        if profiler is not None:
            profiler.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        with on_h100():
            traced = runner._step.jitted.trace(*args, **kw)
            t1, c1 = time.perf_counter(), time.process_time()
            lowered = traced.lower(lowering_platforms=("cuda",))
        t2, c2 = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.disable()
        text = lowered.as_text()
        ops = program_ops(text)
        rows.append({"kw": {k: repr(v) for k, v in kw.items()}, "trace_s": t1 - t0,
                     "lower_s": t2 - t1, "trace_cpu_s": c1 - c0, "lower_cpu_s": c2 - c1,
                     "ops": sum(ops.values()), "ops_digest": ops_digest(ops),
                     "custom_calls": text.count("stablehlo.custom_call"),
                     "funcs": text.count("func.func")})
        del traced, lowered, text
    return rows


_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([^\s(]+)")
_CALL = re.compile(r"^\s*(?:%[^=]+=\s*)?(?:func\.)?call @([^\s(]+)\(")
_OP = re.compile(r'^\s*(?:%[^=]+=\s*)?"?([a-z_]+\.[a-z_.]+)')
_SSA = re.compile(r"%[\w#:]+")


def program_ops(text: str) -> collections.Counter:
    """The ops of a lowered module's `main` with every call to a nested function (a nested
    jit) counted as that function's ops, as XLA sees the program once it inlines the calls:
    op name -> count, each custom call (a kernel) keyed by its target and a digest of its
    attributes (the kernel's IR, grid, options; SSA names left out). Two modules with the same
    counts run the same ops and the same kernels, however the calls were nested. A kernel's IR
    holds its source file paths (and, unless lowered without locations, lines): compare two
    trees' digests run from the same folder."""
    funcs: dict = {}
    body = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            body = funcs.setdefault(m.group(1), (collections.Counter(), []))
            continue
        if body is None:
            continue
        call = _CALL.match(line)
        if call:
            body[1].append(call.group(1))
            continue
        op = _OP.match(line)
        if op:
            name = op.group(1)
            if name == "stablehlo.custom_call":
                attrs = _SSA.sub("%", line.split("(", 1)[1])
                name += f" {line.split('@', 1)[1].split('(', 1)[0]} " + \
                    hashlib.sha1(attrs.encode()).hexdigest()[:12]
            body[0][name] += 1
    totals: dict = {}

    def total(name):
        if name not in totals:
            own, calls = funcs[name]
            totals[name] = sum((total(c) for c in calls), collections.Counter(own))
        return totals[name]
    return total("main")


def ops_digest(counts: collections.Counter) -> str:
    """A short digest of `program_ops`' counts (equal programs, equal digests)."""
    return hashlib.sha1(repr(sorted(counts.items())).encode()).hexdigest()[:12]


def run(args) -> int:
    engine = {k: getattr(args, k) for k in ("max_num_seqs", "max_num_batched_tokens",
                                            "min_token_bucket", "max_model_len", "block_size",
                                            "num_kv_blocks")}
    profiler = cProfile.Profile() if args.profile else None
    if args.no_locations:
        import jax
        jax.config.update("jax_traceback_in_locations_limit", 0)
    with as_on_gpu():
        t0 = time.perf_counter()
        runner = build_runner(args.model, args.dtype, **engine)
        setup_s = time.perf_counter() - t0
        steps = runner.warmup_steps(spans=args.spans)[:args.variants]
        rows = time_variants(runner, variant_args(runner, steps), profiler)
    total = {k: sum(r[k] for r in rows) for k in ("trace_s", "lower_s", "trace_cpu_s",
                                                  "lower_cpu_s")}
    for r in sorted(rows, key=lambda r: repr(sorted(r["kw"].items()))):
        kw = r["kw"]
        print(f"t={kw['t']:>5} decode_only={kw['decode_only']:5} plan={kw['attn_options'][:60]:60}"
              f" trace {r['trace_s']:6.2f} s  lower {r['lower_s']:6.2f} s  "
              f"custom calls {r['custom_calls']:3d}  funcs {r['funcs']:3d}  ops {r['ops']:6d} "
              f"{r['ops_digest']}")
    print(f"{args.model}: {len(rows)} variants, runner {setup_s:.1f} s; trace "
          f"{total['trace_s']:.2f} s (median {statistics.median(r['trace_s'] for r in rows):.2f}),"
          f" lower {total['lower_s']:.2f} s (median "
          f"{statistics.median(r['lower_s'] for r in rows):.2f}); process CPU: trace "
          f"{total['trace_cpu_s']:.2f} s, lower {total['lower_cpu_s']:.2f} s")
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(args.sort).print_stats(args.profile)
        print(out.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "engine": engine, "setup_s": setup_s, "rows": rows,
                       **total}, f, indent=1)
    return 0
