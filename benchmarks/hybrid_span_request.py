"""`minipic-bench hybrid-spans`: issue 29's span request goals on one started engine.

The request: `[Prompt(200 ids), Span(900 ids) x 6, Prompt(120 ids)]`, max_tokens=8, through the
public `LLM.generate`, on a hybrid model (default: the qwen3_5_0_8b preset, bf16, the engine's
default options; max_model_len made long enough for the 4,096-token spans of call g). One engine
is started (its start-up and warm-up seconds and the variants warmed are reported), then, in this
order, each call with fresh random ids (seeded, below every marker and EOS id:
benchmarks/ttft_host.id_ceiling):

    a  plain          one Prompt of as many tokens as the span request (nothing cached)
    b  spans cold     the span request, new spans (first time on the started engine)
    c  reordered      b's system prompt and spans, spans permuted, a new question
    d  spans cold 2   a second new span set (the span kind once compiled)
    e  reordered 2    d's spans permuted, a new question
    f  plain 2        a plain prompt again (the plain kind once compiled)
    g  long spans     spans of --long-span-tokens (4,096): as many as max_model_len holds (6 at
                      most); accepted, or the error text

Per call: the wall ms of `generate`, the compiles during the call (step variants the engine
compiled or loaded: StepExecutables.counts; XLA backend compiles and persistent-cache loads:
jax.monitoring events, so programs outside the step count too) and the cached prompt tokens.
Goals printed: b compiles 0; b/a <= 1.3 and d/f <= 1.3; c/b <= 0.2 and e/d <= 0.2; g accepted.
`--steps` (on; `--no-steps` off) adds each call's engine steps (benchmarks/hybrid_span_steps.py:
kind, rows, host / dispatch / wait / ready ms, admission, moves, composition, the time outside
the steps): a table per call (sums per kind) and the rows in the JSON (`trace`); `--steps-sync`
also waits for each program right after its dispatch (exact device ms per step and composition;
the calls' walls then include the waits, so the goals are not comparable); `--sync-repeat`
keeps a-g as they are and adds, after g, calls h and i: c and e again (a new order and question;
no longer the first reordered calls), traced with those waits:

    h  reordered sync     b's spans permuted anew, a new question
    i  reordered 2 sync   d's spans permuted anew, a new question

`--profile-top N` (after the calls above): b's spans reordered twice more with a new question,
max_tokens 1 and 2, and each call's last step (the reordered prefill step, then a decode step at
that context) replayed alone and profiled: its device ms and N costliest kernels
(benchmarks/fixed_step_work._time_last_step); `--profile-forms` replays both again under each
form, a comma list of program switches (serving/step/program_switches.py) NAME=0|1, recompiled.

    minipic-bench hybrid-spans [--json PATH]                      # the GPU run
    minipic-bench hybrid-spans --model tiny_qwen3_5 --dtype float32 --max-num-seqs 4 \\
        --max-num-batched-tokens 64 --min-token-bucket 64 --max-model-len 512 --block-size 16 \\
        --num-kv-blocks 96 --system-tokens 20 --spans 3 --span-tokens 40 --question-tokens 12 \\
        --long-span-tokens 100                                    # the CPU check
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.compile_counter import CompileCounter
from benchmarks.engine_args import add_options, engine_options
from benchmarks.program_forms import parse_form, program_form
from benchmarks.ttft_host import id_ceiling

CALLS = (("a", "plain"), ("b", "spans cold"), ("c", "reordered"), ("d", "spans cold 2"),
         ("e", "reordered 2"), ("f", "plain 2"), ("g", "long spans"))
# --sync-repeat: c and e again (new order and question), each program waited for (device ms)
SYNC_CALLS = (("h", "reordered sync"), ("i", "reordered 2 sync"))
# (numerator, denominator, bound, what): the ratio goals of issue 29
RATIO_GOALS = (("b", "a", 1.3, "cold spans <= 1.3x the same tokens as a plain prompt"),
               ("d", "f", 1.3, "cold spans <= 1.3x plain, both kinds compiled"),
               ("c", "b", 0.2, "reordered with a new question <= 0.2x its cold time"),
               ("e", "d", 0.2, "reordered <= 0.2x its cold time, second set"))
ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "min_token_bucket", "max_model_len",
                "num_kv_blocks", "block_size", "step_command_buffer")


def add_parser(p) -> None:
    add_options(p, engine_options(model="qwen3_5_0_8b", dtype="bfloat16", max_tokens=8,
                                  **dict.fromkeys(ENGINE_FLAGS)))
    p.add_argument("--system-tokens", type=int, default=200, help="first Prompt's ids")
    p.add_argument("--spans", type=int, default=6, help="spans per request (default: 6)")
    p.add_argument("--span-tokens", type=int, default=900, help="ids per span (default: 900)")
    p.add_argument("--question-tokens", type=int, default=120, help="last Prompt's ids")
    p.add_argument("--long-span-tokens", type=int, default=4096,
                   help="ids per span of call g (default: 4096)")
    p.add_argument("--no-warmup", action="store_true",
                   help="LLM(warmup=False): the variants compile on first use (counted)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random ids")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--steps", action=argparse.BooleanOptionalAction, default=True,
                   help="per-call engine steps (benchmarks/hybrid_span_steps.py; default: on)")
    p.add_argument("--steps-sync", action="store_true",
                   help="with --steps: wait for each program after its dispatch (device ms)")
    p.add_argument("--sync-repeat", action="store_true",
                   help="with --steps: after g, calls h / i = c / e again (new order and "
                        "question), each program waited for: their device ms")
    p.add_argument("--profile-top", type=int, default=0, metavar="N",
                   help="after the calls: the reordered prefill step and a decode step replayed "
                        "alone, each with its N costliest kernels (a jax.profiler trace)")
    p.add_argument("--host-trace", type=int, default=0, metavar="N",
                   help="calls a-f each under a jax.profiler trace: their N costliest host events "
                        "(driver calls, XLA / PjRt scopes) by name, to compare a call that "
                        "first uses a program with its repeat (a / f, b / d, c / e)")
    p.add_argument("--device-trace", action="store_true",
                   help="after the calls: one more reordered call under a jax.profiler trace, its "
                        "GPU kernels grouped into bursts by idle gaps (a step each): device busy "
                        "and idle time per step in the engine (benchmarks/timing.device_bursts)")
    p.add_argument("--admit-profile", default=None, metavar="FILE",
                   help="cProfile every CacheManager.admit of the calls into FILE (the 20 "
                        "costliest functions by own time: the engine's admission against "
                        "benchmarks.span_admission_host's stub)")
    p.add_argument("--profile-forms", nargs="*", default=[], metavar="NAME=0|1,...",
                   help="with --profile-top: both steps again under each form (program "
                        "switches, e.g. RAGGED_SPLITS=0,WIDE_SPLITS=0)")


def timed_generate(llm, prompt, sp, counter: CompileCounter, trace=None,
                   host_trace: int = 0) -> dict:
    """One `llm.generate([prompt])`: wall ms, compiles during it, prompt and cached tokens;
    with a StepTrace (benchmarks/hybrid_span_steps.py) its steps too (`trace`); host_trace N:
    the call under a jax.profiler trace, its N costliest host events by name (`host_events`;
    the wall then includes the tracer's cost)."""
    before = counter.read(llm)
    if trace is not None:
        trace.begin()
    t0 = time.perf_counter()
    events = None
    if host_trace:
        from benchmarks.timing import host_events
        out, events = host_events(lambda: llm.generate([prompt], sp, use_tqdm=False),
                                  top=host_trace)
        out = out[0]
    else:
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    steps = None if trace is None else trace.end()
    after = counter.read(llm)
    row = {"wall_ms": 1e3 * wall, "prompt_tokens": len(out.prompt_token_ids),
           "cached_tokens": int(out.num_cached_tokens), "accepted": True}
    row.update({k: after[k] - before[k] for k in after})
    row["compiles"] = row["step_compiles"] + row["xla_compiles"] + row["xla_cache_loads"]
    if steps is not None:
        row["trace"] = steps
    if events is not None:
        row["host_events"] = events
    return row


def make_llm(args, counter: CompileCounter):
    """The engine (default options unless given), and its start-up figures."""
    from minipic_jax import LLM
    options = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if "max_model_len" not in options:  # call g's spans fit, rounded up to 1,024
        need = (args.system_tokens + args.question_tokens + args.max_tokens
                + args.spans * (args.long_span_tokens + 64))
        options["max_model_len"] = -(-need // 1024) * 1024
    c0, t0 = counter.read(), time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, seed=0, warmup=not args.no_warmup, **options)
    total = time.perf_counter() - t0
    c1 = counter.read(llm)
    s = llm.startup
    startup = {"start_s": total - s.get("warmup_s", 0.0), "warmup_s": s.get("warmup_s", 0.0),
               "warmup_variants": s.get("warmup_variants", 0),
               "warmup_compiled": s.get("warmup_compiled", 0),
               "xla_compiles_at_start": c1["xla_compiles"] - c0["xla_compiles"],
               "xla_cache_loads_at_start": c1["xla_cache_loads"] - c0["xla_cache_loads"],
               "engine_options": {**options, "max_model_len": llm.config.max_model_len,
                                  "max_num_seqs": llm.config.max_num_seqs,
                                  "max_num_batched_tokens": llm.config.max_num_batched_tokens,
                                  "block_size": llm.config.block_size}}
    return llm, startup


def span_calls(llm, args, counter: CompileCounter, on_row=None, trace=None) -> dict:
    """Calls a-g (module doc) on the started engine: name -> row; `on_row(key, row)` after each
    (a run cut off by its time limit still shows the calls it made); `trace`: a StepTrace."""
    from minipic_jax import SamplingParams
    from minipic_jax.prompts import Prompt, Span
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ceiling = id_ceiling(llm.llm_engine)
    rng = np.random.default_rng(args.seed)

    def ids(n):
        return rng.integers(10, ceiling - 10, n).tolist()
    total = args.system_tokens + args.spans * args.span_tokens + args.question_tokens

    def cold():
        return [Prompt(ids(args.system_tokens)),
                *(Span(ids(args.span_tokens)) for _ in range(args.spans)),
                Prompt(ids(args.question_tokens))]

    def reordered(request):
        order = rng.permutation(args.spans)
        if args.spans > 1 and (order == np.arange(args.spans)).all():
            order = order[::-1]  # a real reordering
        spans = request[1:-1]
        return [request[0], *(spans[i] for i in order), Prompt(ids(args.question_tokens))]
    rows = {}
    first = cold()
    second = cold()
    prompts = {"a": [Prompt(ids(total))], "b": first, "c": reordered(first), "d": second,
               "e": reordered(second), "f": [Prompt(ids(total))]}
    on_row = on_row or (lambda key, row: None)
    for key, _ in CALLS[:-1]:
        rows[key] = timed_generate(llm, prompts[key], sp, counter, trace, args.host_trace)
        on_row(key, rows[key])
    rows["g"] = long_span_call(llm, args, counter, sp, ids, trace)
    on_row("g", rows["g"])
    if trace is not None and args.sync_repeat:  # after g: a-g's ids are as without it
        for (key, _), request in zip(SYNC_CALLS, (first, second)):
            trace.sync = True
            rows[key] = timed_generate(llm, reordered(request), sp, counter, trace)
            trace.sync = args.steps_sync
            on_row(key, rows[key])
    if args.profile_top:
        rows["profile"] = profile_reordered(llm, args, lambda: reordered(first), trace)
    if args.device_trace:
        rows["device_bursts"] = device_timeline(llm, [reordered(first)], sp)
    return rows


def device_timeline(llm, prompts, sp) -> list[dict]:
    """--device-trace: the call's GPU kernels in bursts (timing.device_bursts), printed."""
    from benchmarks.timing import device_bursts
    _, found = device_bursts(lambda: llm.generate(prompts, sp, use_tqdm=False))
    print(f"device timeline of a reordered call: {len(found)} bursts (idle > 50 us splits them)")
    for i, b in enumerate(found):
        print(f"  burst {i:2d}: {b['kernels']:4d} kernels, busy {b['busy_ms']:7.3f} ms over "
              f"{b['span_ms']:7.3f} ms, device idle {b['idle_before_ms']:7.3f} ms before it; "
              f"first {b['first_kernel'][:40]}")
        for key in ("host_in_idle", "python_in_idle"):
            if b[key]:
                print(f"      {key}: " + "; ".join(f"{n} {ms:.3f}" for n, ms in b[key]))
    return found


def profile_reordered(llm, args, make_request, trace=None) -> list[str]:
    """--profile-top: a reordered call with max_tokens 1, then 2; each call's last step (the
    prefill, then a decode step) replayed alone with its costliest kernels. Printed lines."""
    from benchmarks.fixed_step_work import _time_last_step
    from minipic_jax import SamplingParams
    if trace is not None:
        trace.detach()
    runner, steps, lines, t0 = llm.llm_engine.runner, {}, [], time.perf_counter()
    for max_tokens, kind in ((1, "reordered prefill"), (2, "reordered decode")):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([make_request()], sp, use_tqdm=False)
        steps[kind] = runner.last_inputs
    for form in [""] + list(args.profile_forms):
        with program_form(form, runner, "--profile-forms"):
            for kind, inputs in steps.items():
                runner.last_inputs = inputs
                lines += _time_last_step(runner, 20, args.profile_top, kind,
                                         f"profile-top{' ' + form if form else ''}", t0)
    return lines


def long_span_call(llm, args, counter, sp, ids, trace=None) -> dict:
    """Call g: as many spans of --long-span-tokens as max_model_len holds (--spans at most)."""
    from minipic_jax.prompts import Prompt, Span
    room = (llm.config.max_model_len - args.system_tokens - args.question_tokens
            - args.max_tokens)
    n = min(args.spans, room // (args.long_span_tokens + 2 * llm.config.block_size))
    if n < 1:
        return {"accepted": False, "num_spans": 0,
                "error": f"no span of {args.long_span_tokens} tokens fits max_model_len "
                         f"{llm.config.max_model_len}"}
    request = [Prompt(ids(args.system_tokens)),
               *(Span(ids(args.long_span_tokens)) for _ in range(n)),
               Prompt(ids(args.question_tokens))]
    try:
        row = timed_generate(llm, request, sp, counter, trace)
    except Exception as err:  # noqa: BLE001 - the goal is "accepted": its error is the figure
        return {"accepted": False, "num_spans": n, "error": f"{type(err).__name__}: {err}"}
    return {**row, "num_spans": n}


def goal_lines(rows: dict) -> list[dict]:
    """Issue 29's goals as (what, value, met) records."""
    goals = [{"goal": "compiles in b (spans cold, first time) == 0",
              "value": rows["b"]["compiles"], "met": rows["b"]["compiles"] == 0}]
    for num, den, bound, what in RATIO_GOALS:
        ratio = rows[num]["wall_ms"] / rows[den]["wall_ms"]
        goals.append({"goal": f"{num}/{den} <= {bound}: {what}", "value": round(ratio, 3),
                      "met": ratio <= bound})
    g = rows["g"]
    goals.append({"goal": "spans of the long size accepted", "met": bool(g["accepted"]),
                  "value": f"{g['num_spans']} spans" if g["accepted"] else g["error"]})
    return goals


def print_startup(args, startup: dict) -> None:
    print(f"hybrid-spans: {args.model} {args.dtype}, [Prompt({args.system_tokens}), "
          f"Span({args.span_tokens}) x {args.spans}, Prompt({args.question_tokens})], "
          f"max_tokens={args.max_tokens}; engine {startup['engine_options']}")
    print(f"start-up {startup['start_s']:.1f} s, warm-up {startup['warmup_s']:.1f} s "
          f"({startup['warmup_variants']} variants, {startup['warmup_compiled']} compiled; XLA "
          f"compiles at start {startup['xla_compiles_at_start']}, cache loads "
          f"{startup['xla_cache_loads_at_start']})")
    print(f"{'call':<16} {'wall_ms':>10} {'prompt':>7} {'cached':>7} {'steps_c':>7} "
          f"{'xla_c':>6} {'xla_ld':>6}", flush=True)


def print_row(key: str, r: dict, sync: bool = False) -> None:
    name = dict(CALLS + SYNC_CALLS)[key]
    if not r["accepted"]:
        print(f"{key} {name:<14} not accepted: {r['error']}", flush=True)
        return
    print(f"{key} {name:<14} {r['wall_ms']:10.1f} {r['prompt_tokens']:7d} "
          f"{r['cached_tokens']:7d} {r['step_compiles']:7d} {r['xla_compiles']:6d} "
          f"{r['xla_cache_loads']:6d}", flush=True)
    if "trace" in r:
        from benchmarks.hybrid_span_steps import table_lines
        print("\n".join(table_lines(r["trace"], sync=sync)), flush=True)
    for name, count, ms in r.get("host_events", []):
        print(f"    host {ms:9.3f} ms {count:6d}  {name}", flush=True)


def run(args) -> int:
    for form in args.profile_forms:  # bad names fail before the engine starts
        parse_form(form, "--profile-forms")
    counter = CompileCounter()
    llm, startup = make_llm(args, counter)
    print_startup(args, startup)
    result = {"model": args.model, "dtype": args.dtype, "startup": startup,
              "request": {k: getattr(args, k) for k in (
                  "system_tokens", "spans", "span_tokens", "question_tokens",
                  "long_span_tokens", "max_tokens", "seed")}, "rows": {}}

    done = {}

    def on_row(key, row):
        print_row(key, row, sync=args.steps_sync or key in dict(SYNC_CALLS))
        result["rows"][f"{key} {dict(CALLS + SYNC_CALLS)[key]}"] = done[key] = row
        if key == CALLS[-1][0]:  # a-g done: the goals, before the repeats and the profile
            result["goals"] = goal_lines(done)
            for g in result["goals"]:
                print(f"goal {'MET ' if g['met'] else 'MISS'} {g['goal']}: {g['value']}",
                      flush=True)
        write_json(args.json, result)  # after every call: a cut-off run keeps what it measured
    trace = None
    if args.steps:  # after the warm-up: its steps are no call's
        from benchmarks.hybrid_span_steps import StepTrace
        trace = StepTrace(llm, sync=args.steps_sync).attach()
    prof = profiled_admit(llm) if args.admit_profile else None
    rows = span_calls(llm, args, counter, on_row, trace)
    result["profile"] = rows.get("profile")
    result["device_bursts"] = rows.get("device_bursts")
    write_json(args.json, result)
    if prof is not None:
        import pstats
        with open(args.admit_profile, "w") as fh:
            pstats.Stats(prof, stream=fh).sort_stats("tottime").print_stats(20)
    return 0


def profiled_admit(llm):
    """A cProfile.Profile on every later CacheManager.admit call (an instance attribute; the
    StepTrace's wrapper, if any, stays inside it)."""
    import cProfile
    prof, cache = cProfile.Profile(), llm.llm_engine.cache
    admit = cache.admit

    def wrapper(*a, **k):
        prof.enable()
        try:
            return admit(*a, **k)
        finally:
            prof.disable()
    cache.admit = wrapper
    return prof


def write_json(path, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
