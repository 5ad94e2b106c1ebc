"""`minipic-bench rag`: MiniPIC's RAG headline, reproducible by one command.

    minipic-bench rag                                   # Tulu3-Block-FT shape, random bf16
    minipic-bench rag --configs rotated fcfs --workloads multi --modes offline
    JAX_PLATFORMS=cpu minipic-bench rag --model tiny_llama3 --dtype float32 \
        --num-requests 8 --passage-tokens 32 --max-num-batched-tokens 256 --ttft-span-tokens 64

Configurations (benchmarks/rag_engine.py CONFIGS), each in its own process so each gets the whole
GPU: `rotated` (classic prefix caching, the vLLM baseline), `pic_off` (position-free keys, plain
prompts), `position_free` with the `fcfs`, `barrier` and `isps` schedulers (Span/Prompt
segments), and `ttft` (the cached-span TTFT pair). Workloads: benchmarks/rag_workloads.py.
Each configuration reports its load and warm-up times; each run prints vLLM's throughput line
and its serving metrics, and the speed-up over `rotated` on the same workload and mode. Writes
rag_bench.json (every row, including each request's output tokens, so runs can be compared
token for token) and rag_bench.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from benchmarks.rag_workloads import WORKLOADS

ALL_CONFIGS = ("rotated", "pic_off", "fcfs", "barrier", "isps", "ttft")
EXTRA_CONFIGS = ("fcfs_all",)  # on request only (rag_engine.CONFIGS)
# option -> argparse kwargs; also the list of options a worker process is handed
OPTIONS = {
    "model": dict(default="tulu3_block_ft", help="preset or HF folder (random weights for presets)"),
    "dtype": dict(default="bfloat16", help="weight and KV dtype (default: %(default)s)"),
    "configs": dict(nargs="+", default=list(ALL_CONFIGS), choices=ALL_CONFIGS + EXTRA_CONFIGS,
                    help="configurations to run (default: all)"),
    "workloads": dict(nargs="+", default=["single", "multi"], choices=WORKLOADS,
                      help="workloads to run (default: single multi)"),
    "modes": dict(nargs="+", default=["offline", "online"], choices=("offline", "online"),
                  help="offline (all at once) and/or online (Poisson arrivals)"),
    "num_requests": dict(type=int, default=100, help="requests per workload"),
    "questions_per_set": dict(type=int, default=4, help="multi: questions per passage set"),
    "zipf_s": dict(type=float, default=1.0, help="zipf: popularity exponent"),
    "request_rate": dict(type=float, default=4.0, help="online: Poisson arrivals per second"),
    "max_tokens": dict(type=int, default=32, help="output tokens per request (EOS ignored)"),
    "passage_tokens": dict(type=int, default=None, help="truncate passages (tiny test runs)"),
    "max_num_seqs": dict(type=int, default=64, help="engine max_num_seqs (default: %(default)s)"),
    "max_num_batched_tokens": dict(type=int, default=8192,
                                   help="engine max tokens per step (default: %(default)s)"),
    "max_model_len": dict(type=int, default=8192,
                          help="engine max_model_len (default: %(default)s)"),
    "min_token_bucket": dict(type=int, default=128,
                             help="engine smallest step token bucket (default: %(default)s)"),
    "num_kv_blocks": dict(type=int, default=None,
                          help="KV pool blocks (default: from free memory)"),
    "attn_impl": dict(default=None, help="Config.attn_impl (None = the engine's choice)"),
    "tensor_parallel_size": dict(type=int, default=1,
                                 help="devices each engine's model is split over "
                                      "(Config.tensor_parallel_size; default: %(default)s)"),
    "ttft_spans": dict(type=int, default=8, help="ttft: spans per request (default: %(default)s)"),
    "ttft_span_tokens": dict(type=int, default=4096,
                             help="ttft: tokens per span (default: %(default)s)"),
    "ttft_repeats": dict(type=int, default=3, help="cached requests timed (median)"),
    "ttft_profile": dict(type=int, default=0,
                         help="ttft: 1 = replay the cached step alone, time it and summarise "
                              "its device kernels (jax.profiler)"),
    "ttft_command_buffers": dict(nargs="+", default=None,
                                 help="ttft with --ttft-profile 1: step_command_buffer settings "
                                      "the cached step is also compiled with and timed in the "
                                      "same process, e.g. off on (benchmarks/step_variants.py)"),
    "step_command_buffer": dict(default=None,
                                help="Config.compilation.command_buffer of every engine: xla, "
                                     "off, on or XLA command-buffer types (FUSION,CUBLAS,...); "
                                     "default: the engine's"),
    "compose_cost": dict(type=int, default=0,
                         help="hybrid position_free configs: 1 = time the warm span step with "
                              "the most cached maps and its span-map composition alone "
                              "(benchmarks/span_compose_cost.py)"),
    "seed": dict(type=int, default=0, help="workload seed (default: %(default)s)"),
    "repeats": dict(type=lambda x: _at_least_one(x, "--repeats"), default=1,
                    help="runs of each workload and mode on one engine, each under its own cache "
                         "salt; the median by requests/s is reported (default: %(default)s)"),
    "program_form": dict(default="", metavar="NAME=0|1,...",
                         help="program switches (serving/step/program_switches.py) every "
                              "configuration's engine is built and run under, e.g. "
                              "TRANSITIONS_IN_STREAM=0 (default: as they are)"),
}


def _at_least_one(text: str, flag: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {n}")
    return n


def add_parser(p):
    for name, kw in OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), **kw)
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="folder for rag_bench.json and rag_bench.png (default: $OUT or .)")
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (tests; no fresh GPU each)")
    p.add_argument("--worker", default=None, help=argparse_hidden())
    p.add_argument("--worker-out", default=None, help=argparse_hidden())


def _run_config(name: str, args) -> dict:
    """rag_runs.run_config under --program-form's switches."""
    from benchmarks.program_forms import program_form
    from benchmarks.rag_runs import run_config
    with program_form(args.program_form or "", flag="--program-form"):
        return run_config(name, args)


def argparse_hidden():
    return argparse.SUPPRESS


def _worker_argv(args, name: str, path: str) -> list[str]:
    argv = [sys.executable, "-m", "benchmarks.cli", "rag", "--worker", name, "--worker-out", path]
    for opt in OPTIONS:
        val = getattr(args, opt)
        if val is None:
            continue
        argv.append("--" + opt.replace("_", "-"))
        argv += [str(v) for v in val] if isinstance(val, list) else [str(val)]
    return argv


def _run_one(args, name: str) -> dict:
    if args.in_process:
        return _run_config(name, args)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(pathlib.Path(tmp) / f"{name}.json")
        proc = subprocess.run(_worker_argv(args, name, path), env=os.environ.copy())
        if proc.returncode != 0:
            return {"config": name, "error": f"worker exited with {proc.returncode}"}
        return json.loads(pathlib.Path(path).read_text())


def baseline(results: list) -> str | None:
    """The configuration the others are compared with: rotated where it ran, else the first."""
    names = [res["config"] for res in results if "runs" in res]
    return "rotated" if "rotated" in names else (names[0] if names else None)


def speedups(results: list) -> None:
    """Adds speedup (requests/s over the baseline's), same_outputs (share of requests whose
    greedy tokens equal the baseline's) and baseline to every run that has a baseline
    counterpart (`baseline`)."""
    name = baseline(results)
    base = {(r["workload"], r["mode"]): r for res in results if res.get("config") == name
            for r in res.get("runs", [])}
    for res in results:
        for r in res.get("runs", []):
            b = base.get((r["workload"], r["mode"]))
            if b is None:
                continue
            r["baseline"] = name
            r["speedup"] = r["requests_per_second"] / b["requests_per_second"]
            ours, theirs = list(r["outputs"].values()), list(b["outputs"].values())
            same = sum(x == y for x, y in zip(ours, theirs))
            r["same_outputs"] = same / max(len(ours), 1)


def report(results: list) -> None:
    for res in results:
        name = res.get("config")
        if "error" in res:
            print(f"[{name}] FAILED: {res['error']}")
            continue
        print(f"[{name}] load {res['load_s']:.1f} s, warm-up {res['warmup_s']:.1f} s "
              f"({res['compiles_in_warmup']} step variants)")
        if "startup" in res:
            from benchmarks.startup import line
            print(f"[{name}] start-up: {line(res['startup'])}")
        for r in res.get("runs", []):
            sp = r.get("speedup")
            print(f"[{name}] {r['workload']} {r['mode']}: Throughput: "
                  f"{r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total "
                  f"tokens/s, {r['output_throughput']:.2f} output tokens/s | "
                  f"{r['samples_per_second']:.2f} samples/s, hit rate "
                  f"{r['prefix_cache_hit_rate']:.1%}, prompt {r['prompt_tokens_per_second']:.0f} "
                  f"tok/s (computed {r['computed_prompt_tokens_per_second']:.0f}), TTFT p50/p99 "
                  f"{_ms(r['median_ttft_ms'])}/{_ms(r['p99_ttft_ms'])} ms, TPOT p50 "
                  f"{_ms(r['median_tpot_ms'])} ms"
                  + (f", {sp:.3f}x {r['baseline']}" if sp is not None else ""))
            if len(r.get("requests_per_second_runs", ())) > 1:
                print(f"[{name}] {r['workload']} {r['mode']}: requests/s of the repeats "
                      + " ".join(f"{x:.2f}" for x in r["requests_per_second_runs"])
                      + " (the median's row above)")
            if "span_maps_captured" in r:
                print(f"[{name}] {r['workload']} {r['mode']}: span maps captured "
                      f"{r['span_maps_captured']}, declined {r['span_maps_declined']}, spans "
                      f"skipped {r['spans_skipped']}, steps {r['steps']}")
        if "compose_cost" in res:
            from benchmarks.span_compose_cost import report as compose_report
            for line in compose_report(res["compose_cost"]).splitlines():
                print(f"[{name}] {line}")
        if name == "ttft":
            print(f"[ttft] {res['num_spans']} x {res['span_tokens']} spans: cold "
                  f"{res['cold_ttft_ms']:.1f} ms, cached {_ms(res['cached_ttft_ms'])} ms "
                  f"(one step {_ms(res['cached_step_ms'])} ms), cold / cached "
                  f"{_ms(res['cold_over_cached'])}x")
            g = res.get("generate")
            if g and "cached_ms" in g:
                print(f"[ttft] through LLM.generate: cold {g['cold_ms']:.1f} ms, cached "
                      f"{g['cached_ms']:.1f} ms (host {g['cached_host_ms']:.2f} ms), cold / cached "
                      f"{g['cold_over_cached']:.1f}x")
            prof = res.get("cached_step_profile")
            if prof:
                print(f"[ttft] cached step replayed alone: {prof['step_alone_ms']:.2f} ms wall, "
                      f"kernels busy {prof['kernel_busy_ms_per_step']:.2f} ms, first to last "
                      f"kernel {prof['first_to_last_kernel_ms_per_step']:.2f} ms, "
                      f"{prof['kernels_per_step']:.0f} kernels")
                print(f"[ttft] its call returns after {prof['dispatch_ms']:.2f} ms "
                      f"({prof['dispatch_inputs_on_device_ms']:.2f} ms with its "
                      f"{prof['int_bytes'] / 1e6:.2f} MB of int inputs already on device)")
                for k in prof["top"][:10]:
                    print(f"[ttft]   {k['ms_per_step']:7.3f} ms {k['calls_per_step']:5.0f}x "
                          f"{k['name']}")
                if prof.get("command_buffer_ab"):
                    from benchmarks.step_variants import table
                    for line in table(prof["command_buffer_ab"]):
                        print(f"[ttft] {line}")
                for label, p in (("planned", prof), ("with decode part",
                                                     prof.get("with_decode_part"))):
                    if p:
                        print(f"[ttft] {label}: {p['step_alone_ms']:.2f} ms alone, busy "
                              f"{p['kernel_busy_ms_per_step']:.2f} ms, "
                              f"{p['kernels_per_step']:.0f} kernels, compiled {p['hlo_ops']}")


def _ms(x):
    return "-" if x is None else f"{x:.1f}"


def plot(results: list, path: pathlib.Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install matplotlib)")
        return None
    runs = [(res["config"], r) for res in results for r in res.get("runs", [])]
    keys = sorted({(r["workload"], r["mode"]) for _, r in runs})
    names = [res["config"] for res in results if res.get("runs")]
    ttft = [res for res in results if res.get("config") == "ttft" and "rows" in res]
    fig, axes = plt.subplots(1, 1 + bool(ttft), figsize=(6 + 3 * len(keys) / 2, 3.8),
                             squeeze=False)
    ax, width = axes[0][0], 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        vals = [next((r["requests_per_second"] for c, r in runs if c == name
                      and (r["workload"], r["mode"]) == k), 0.0) for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], vals, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))],
                  [f"{w}\n{m}" for w, m in keys])
    ax.set(ylabel="requests/s", title="RAG throughput")
    ax.legend(fontsize=7)
    if ttft:
        t = ttft[0]
        ax2 = axes[0][1]
        ax2.bar(["cold", "cached"], [t["cold_ttft_ms"], t["cached_ttft_ms"] or 0.0])
        ax2.set(yscale="log", ylabel="TTFT ms",
                title=f"{t['num_spans']} x {t['span_tokens']} spans")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def run(args) -> int:
    if args.worker:
        res = _run_config(args.worker, args)
        pathlib.Path(args.worker_out).write_text(json.dumps(res))
        return 0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.configs:  # each configuration's lines as soon as it is done
        results.append(_run_one(args, name))
        report(results[-1:])
        speedups(results)
        (out / "rag_bench.json").write_text(json.dumps(
            {"options": {k: getattr(args, k) for k in OPTIONS}, "results": results}, indent=1))
    print(f"speed-up over {baseline(results)} (requests/s), same greedy tokens as it:")
    for res in results:
        for r in res.get("runs", []):
            if "speedup" in r:
                print(f"  {res['config']:8s} {r['workload']:6s} {r['mode']:7s} "
                      f"{r['speedup']:.3f}x  {r['same_outputs']:.0%}")
    png = plot(results, out / "rag_bench.png")
    print(f"wrote {out / 'rag_bench.json'}" + (f" and {png}" if png else ""))
    return 1 if any("error" in r for r in results) else 0
