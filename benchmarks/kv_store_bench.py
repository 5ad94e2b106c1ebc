"""Span store across processes: MuSiQue corpus stored by one process, then `run-batch` over the
one-question-per-sample workload in a fresh process, against the same job on an empty store.

    python -m benchmarks.kv_store_bench --out /tmp/kvb [--samples 150] [--model llama3_2_1b]

Phases, in the order given, each a fresh process under `timeout` (JAX compile cache shared
through JAX_COMPILATION_CACHE_DIR), all on one store folder <out>/store, emptied first:
  nostore   run-batch without a store (the compute-only anchor)
  cold      run-batch with an empty store (computes every passage, fills the store)
  prewarm   LLM.cache_spans over every passage of the samples (the corpus pass; after `cold`
            it finds them all stored)
  warm      run-batch on the filled store (--drop-page-cache: from the disk, not memory)
`--io` first times the file layer alone (write, then read with 1..16 threads), in a process of
its own: the orchestrator never touches the GPU (at c5c63e6..d811fac `--io` sent to the device
from the orchestrator, whose XLA pool then held 75% of the H200 for the whole run, so every phase
got ~33 GiB and the warm phases ran out of memory; session 9).
A phase name may carry options after `_`: `pinned` (pinned host buffers), `disk` (page cache
dropped first), `nopre` (XLA_PYTHON_CLIENT_PREALLOCATE=false), `sN` (kv_store_staging_gb N).
Requests: [header][10 passages as spans, retrieved order][question], greedy, 16 tokens; the
store keeps span blocks only (`--kv-store-spans-only`) unless --all-blocks. Prints vLLM's lines
per phase and a table; writes <out>/kv_store_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

DATA = pathlib.Path(__file__).resolve().parent / "data" / "musique_s.json"
HEADER = ("You answer questions about the passages below. Read all of them, then reply with the "
          "answer only, in a few words.\n\n")


def write_workload(out: pathlib.Path, samples: int, max_tokens: int,
                   per_sample: int = 10) -> tuple[int, int]:
    data = json.loads(DATA.read_text())[:samples]
    passages, lines = [], []
    for i, s in enumerate(data):
        texts = [c["text"] for c in s["ctxs"]][:per_sample]
        passages += texts
        segs = [{"kind": "prompt", "text": HEADER}] + [{"kind": "span", "text": t}
                                                       for t in texts]
        segs.append({"kind": "prompt", "text": f"Question: {s['question']}\nAnswer:"})
        lines.append(json.dumps({"custom_id": f"musique-{i}", "method": "POST",
                                 "url": "/v1/completions",
                                 "body": {"segments": segs, "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True}}))
    (out / "requests.jsonl").write_text("\n".join(lines) + "\n")
    unique = list(dict.fromkeys(passages))
    (out / "corpus.json").write_text(json.dumps(unique))
    return len(lines), len(unique)


def engine_flags(args) -> list[str]:
    return ["--model", args.model, "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
            str(args.max_num_batched_tokens), "--min-token-bucket", str(args.min_token_bucket),
            "--num-kv-blocks", str(args.num_kv_blocks)]


def prewarm(args) -> None:
    """Child process: cache_spans over the corpus into --store."""
    from minipic_jax import LLM
    from serving.cache.kv_pool import device_memory
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, warmup=False,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              min_token_bucket=args.min_token_bucket, num_kv_blocks=args.num_kv_blocks,
              kv_store_dir=args.store)
    llm.llm_engine.warmup()
    setup = time.perf_counter() - t0
    corpus = json.loads((pathlib.Path(args.out) / "corpus.json").read_text())
    t1 = time.perf_counter()
    got = llm.cache_spans(corpus)
    elapsed = time.perf_counter() - t1
    kv = llm.llm_engine.get_stats()["kv_store"]
    print(f"Prewarm: {got['spans']} passages, {got['span_tokens']} tokens, "
          f"{got['blocks_written']} blocks in {elapsed:.2f} s (setup {setup:.1f} s); wrote "
          f"{kv['bytes_written'] / 1e9:.2f} GB")
    with open(pathlib.Path(args.out) / "prewarm.json", "w") as f:
        json.dump({"elapsed_time": elapsed, "setup_time": setup, **got, "kv_store": kv,
                   "device_memory": device_memory()}, f)


def _run(cmd, env, log, limit_s: int):
    t0 = time.perf_counter()
    p = subprocess.run(["timeout", str(limit_s)] + cmd, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    text = p.stdout.decode(errors="replace")
    log.write_text(text)
    tail = [ln for ln in text.splitlines() if not ln.startswith(("Running batch", "\r"))][-6:]
    print("\n".join(tail), flush=True)
    if p.returncode:
        print(f"phase failed ({p.returncode}, 124 = timeout): {' '.join(cmd)}", flush=True)
        return None
    return time.perf_counter() - t0


def _drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def io_in_child(out: str, runs: int = 64, run_blocks: int = 36) -> dict:
    """io_bench in a process of its own (its sends take the GPU; this one must stay off it)."""
    p = subprocess.run([sys.executable, "-m", "benchmarks.kv_store_bench", "--io-only", "--out",
                        out, "--io-runs", str(runs), "--io-blocks", str(run_blocks)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = p.stdout.strip().splitlines()
    print("\n".join(lines[:-1][-3:]), flush=True)
    if p.returncode or not lines or not lines[-1].startswith("{"):
        print(f"io bench failed ({p.returncode}): {p.stdout[-2000:]}", flush=True)
        return {}
    return json.loads(lines[-1])


def off_the_device() -> None:
    """Raise when this (orchestrating) process has imported JAX: a backend it starts holds a
    memory pool that would shrink every phase's, and JAX exports no test of whether one has
    started, so the orchestrator keeps off JAX altogether (as
    tests/test_kv_store_staging.py checks)."""
    if "jax" in sys.modules:
        raise RuntimeError("kv_store_bench: the orchestrator imported jax; device work belongs "
                           "in the phase processes")


def orchestrate(args) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    io = io_in_child(args.out, args.io_runs, args.io_blocks) if args.io else None
    n_req, n_pass = write_workload(out, args.samples, args.max_tokens, args.passages)
    print(f"Workload: {n_req} requests, {n_pass} unique passages; model {args.model} "
          f"({args.dtype}, random weights)", flush=True)
    py = [sys.executable]
    phases = args.phases.split(",")
    store = out / "store"
    # with a prewarm phase the empty-store job gets a store of its own (the setup:
    # warm reads what prewarm stored)
    cold_store = out / "store_cold" if "prewarm" in phases else store
    for d in {store, cold_store}:
        shutil.rmtree(d, ignore_errors=True)
    job = py + ["-m", "minipic_jax", "run-batch", "-i", str(out / "requests.jsonl"),
                "--warmup", "--no-progress"] + engine_flags(args)
    wall, dropped = {}, None
    for phase in phases:
        print(f"== {phase}", flush=True)
        kind, *opts = phase.split("_")  # warm_pinned: pinned host buffers; warm_disk: page
        kind = kind.rstrip("0123456789")  # cache dropped first; warm2: a second warm run
        env = dict(os.environ)
        if "nopre" in opts:  # warm_nopre: XLA's allocator grows on demand, no preallocation
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        staging = [o[1:] for o in opts if o[:1] == "s" and o[1:].isdigit()]  # warm_s16
        if kind == "prewarm":
            cmd = py + ["-m", "benchmarks.kv_store_bench", "--child-prewarm", "--out", str(out),
                        "--store", str(store)] + _model_flags(args)
        else:
            (out / f"results_{phase}.jsonl").unlink(missing_ok=True)  # not a resume
            cmd = job + ["-o", str(out / f"results_{phase}.jsonl"),
                         "--output-json", str(out / f"{phase}.json")]
            if kind in ("cold", "warm"):
                cmd += ["--kv-store-dir", str(cold_store if kind == "cold" else store)]
                cmd += [] if args.all_blocks else ["--kv-store-spans-only"]
                cmd += ["--kv-store-pinned"] if "pinned" in opts else []
                cmd += ["--kv-store-staging-gb", staging[0]] if staging else []
            if kind == "warm" and (args.drop_page_cache or "disk" in opts):
                dropped = _drop_page_cache()
        off_the_device()
        took = _run(cmd, env, out / f"{phase}.log", args.phase_timeout)
        if took is not None:
            wall[phase] = took
        if kind == "cold" and cold_store != store:
            shutil.rmtree(cold_store, ignore_errors=True)  # frees its page cache too
        report(out, wall, dropped, io, quiet=phase != phases[-1])


def _model_flags(args) -> list[str]:
    return ["--model", args.model, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(args.max_model_len), "--passages", str(args.passages),
            "--num-kv-blocks", str(args.num_kv_blocks),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--min-token-bucket",
            str(args.min_token_bucket)]


def _row(p: str, r: dict) -> tuple:
    kv = r.get("kv_store") or r.get("engine_stats", {}).get("kv_store") or {}
    el, n = r["elapsed_time"], max(r.get("num_requests", 0), 1)
    got = kv.get("bytes_read", 0)
    return (p, el, r.get("requests_per_second", 0.0), 1e3 * el / n,
            r.get("prefix_cache_hit_rate", 0), got / 1e9, got / 1e6 / n, got / 1e9 / el,
            kv.get("read_GBps", 0.0), kv.get("read_wait_s", 0.0), kv.get("send_s", 0.0),
            kv.get("copy_in_s", 0.0), kv.get("bytes_written", 0) / 1e9,
            r.get("setup_time", 0.0), kv.get("pinned", "-"))


def _memory_row(p: str, r: dict) -> str:
    """Device memory of a phase: the pool its process got (small when another process holds
    the GPU), the peak in use, and the span store's peak staging."""
    mem = r.get("device_memory") or {}
    kv = r.get("kv_store") or r.get("engine_stats", {}).get("kv_store") or {}
    gib = lambda x: f"{x / (1 << 30):.2f}" if x is not None else "-"  # noqa: E731
    return (f"| {p} | {gib(mem.get('bytes_limit'))} | {gib(mem.get('peak_bytes_in_use'))} | "
            f"{gib(kv.get('peak_staging_bytes'))} ({gib(kv.get('staging_bytes_limit'))}) |")


def _texts(path: pathlib.Path) -> dict:
    """custom_id -> completion text of a run-batch output file (errors: None)."""
    if not path.exists():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["custom_id"]: (r["response"]["body"] or {}).get("choices", [{}])[0].get("text")
            for r in recs}


def same_outputs(out: pathlib.Path, phases) -> dict:
    """For every pair of phases with outputs: how many requests got the same completion (greedy:
    a store read must not change a token in float32; with random bf16 weights near-tied logits
    flip when a block is computed in another step composition, so `cold` vs `nostore`, computed
    alike, is the pair to read first)."""
    runs = [p for p in phases if (out / f"results_{p}.jsonl").exists()]
    texts = {p: _texts(out / f"results_{p}.jsonl") for p in runs}
    res = {}
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            res[f"{a}_vs_{b}"] = [sum(texts[a].get(k) == v for k, v in texts[b].items()),
                                  len(texts[b])]
    return res


def report(out: pathlib.Path, wall: dict, dropped, io, quiet: bool = False) -> None:
    """Write <out>/kv_store_bench.json (after every phase) and, unless quiet, print the table."""
    res = {p: json.loads((out / f"{p}.json").read_text()) for p in wall
           if (out / f"{p}.json").exists()}
    summary = {"phases": res, "process_wall_s": wall, "page_cache_dropped_before_warm": dropped,
               "io_bench": io, "same_outputs": same_outputs(out, list(wall))}
    warm = [p for p in res if p.split("_")[0].rstrip("0123456789") == "warm"]
    for a, b in [(w, x) for w in warm for x in ("cold", "nostore")] + [("nostore", "cold")]:
        if a in res and b in res and res[b].get("requests_per_second"):
            summary[f"{a}_over_{b}"] = res[a]["requests_per_second"] / \
                res[b]["requests_per_second"]
    (out / "kv_store_bench.json").write_text(json.dumps(summary, indent=1, default=str))
    if quiet:
        return
    print(f"page cache dropped before warm: {dropped}")
    print("| phase | job s | req/s | ms/req | hit rate | GB read | MB read/req | GB/s over job "
          "| GB/s per read thread | read wait s | send s (threads) | copy-in s | GB written "
          "| setup s | pinned |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p, r in res.items():
        if "requests_per_second" in r:
            print("| {} | {:.2f} | {:.2f} | {:.1f} | {:.1%} | {:.2f} | {:.1f} | {:.2f} | {:.2f} "
                  "| {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.1f} | {} |".format(*_row(p, r)))
        else:
            print(f"| {p} | {r.get('elapsed_time', 0):.2f} s (cache_spans, "
                  f"{r.get('kv_store', {}).get('bytes_written', 0) / 1e9:.2f} GB written) |")
    print("| phase | XLA pool GiB | peak in use GiB | peak staged GiB (limit) |")
    print("|---|---|---|---|")
    for p, r in res.items():
        print(_memory_row(p, r))
    for k, v in summary.items():
        if k.endswith(("_over_cold", "_over_nostore")):
            print(f"{k}: {v:.2f}x")
    for k, (same, n) in summary["same_outputs"].items():
        print(f"outputs {k}: {same} of {n} equal")


def io_bench(out: str, runs: int = 64, run_blocks: int = 36, layers: int = 16,
             threads: tuple = (1, 2, 8)) -> dict:
    """The file layer alone (no engine): write `runs` runs of `run_blocks` blocks (a MuSiQue
    passage) of a Llama-3.2-1B shaped page (2 x layers leaves of [16, 8, 64] bf16, 512 KiB per
    block), then read them back (verified, into bucket-padded arrays) with 1..N threads, and
    read + send to the device from plain and from pinned buffers (`_io_reads`)."""
    import concurrent.futures as cf
    import ml_dtypes
    import numpy as np
    from serving.tiers.disk_store import DiskStore, StoreIdentity
    leaves = (((16, 8, 64), "bfloat16"),) * (2 * layers)
    ident = StoreIdentity(model="io", model_name="io", block_size=16, kv_mode="position_free",
                          hash_algo="xxhash64", markers=(0, 1, 2), leaves=leaves)
    root = pathlib.Path(out) / "io_store"
    shutil.rmtree(root, ignore_errors=True)
    store = DiskStore(root, ident, 1 << 40)
    rng = np.random.default_rng(0)
    pages = [rng.standard_normal((run_blocks, 16, 8, 64)).astype(ml_dtypes.bfloat16)
             for _ in leaves]
    tokens = bytes(8 * 16 * run_blocks)
    starts = [int(h) * 1000 for h in range(1, runs + 1)]
    t0 = time.perf_counter()
    for h in starts:
        store.write("shared", list(range(h, h + run_blocks)), tokens, pages)
    t1 = time.perf_counter()
    size = store.stats()["bytes_stored"]
    res = {"bytes": size, "runs": runs, "run_blocks": run_blocks,
           "write_GBps": size / (t1 - t0) / 1e9}
    res.update(_io_reads(store, starts, size, run_blocks, threads))
    print(f"file layer, {runs} runs of {run_blocks} blocks ({size / runs / 1e6:.1f} MB each) "
          f"under {root}: write {res['write_GBps']:.2f} GB/s (1 thread); GB/s by threads: "
          + "; ".join(f"{mode} " + ", ".join(f"{n}: {res[f'read_GBps_{mode}_{n}_threads']:.2f}"
                                            for n in threads)
                      for mode in ("fresh", "reused", "send_plain", "send_pinned")
                      if f"read_GBps_{mode}_{threads[0]}_threads" in res))
    shutil.rmtree(root, ignore_errors=True)
    return res


def _io_reads(store, starts, size: int, run_blocks: int, threads: tuple) -> dict:
    """GB/s of run reads by thread count: into fresh arrays, into reused ones, and read + sent
    to the device (what a reader thread of the tier does) from plain and pinned buffers."""
    import concurrent.futures as cf
    from serving.tiers.kv_store_buffers import RunBuffers, pinned_shardings
    from serving.tiers.run_file import run_rows
    res = {}

    def job(buffers, send):
        def one(h):
            run = store.read(h, "shared", pad=run_rows, alloc=buffers.take)
            if send:
                run.dev, _ = buffers.send(run.kv)
            else:
                buffers.give(run.kv)
            return run
        return one
    modes = [("fresh", lambda h: store.read(h, "shared", pad=run_rows))]
    modes += [("reused", job(RunBuffers(2 * max(threads), pinned=False), False)),
              ("send_plain", job(RunBuffers(2 * max(threads), pinned=False), True))]
    if pinned_shardings() is not None:
        modes.append(("send_pinned", job(RunBuffers(2 * max(threads), pinned=True), True)))
    for mode, fn in modes:
        with cf.ThreadPoolExecutor(max(threads)) as pool:  # untimed: fills the buffer pools
            list(pool.map(fn, starts[:2 * max(threads)]))
        for n in threads:
            with cf.ThreadPoolExecutor(n) as pool:
                t2 = time.perf_counter()
                got = list(pool.map(fn, starts))
                t3 = time.perf_counter()
            assert all(r is not None and r.n == run_blocks for r in got)
            res[f"read_GBps_{mode}_{n}_threads"] = size / (t3 - t2) / 1e9
            del got
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--passages", type=int, default=10, help="passages per request (first k)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=40000)
    ap.add_argument("--model", default="llama3_2_1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--min-token-bucket", type=int, default=2048)
    ap.add_argument("--phases", default="nostore,cold,prewarm,warm")
    ap.add_argument("--phase-timeout", type=int, default=300, help="seconds per phase process")
    ap.add_argument("--io", action="store_true", help="time the file layer first")
    ap.add_argument("--all-blocks", action="store_true",
                    help="store every block, not span blocks only")
    ap.add_argument("--drop-page-cache", action="store_true",
                    help="drop the OS page cache before the warm phase (root; a machine of "
                         "your own only), so its reads come from the disk")
    ap.add_argument("--io-only", action="store_true",
                    help="time the file layer alone (one thread) under --out and exit")
    ap.add_argument("--io-runs", type=int, default=64, help="runs the file-layer bench writes")
    ap.add_argument("--io-blocks", type=int, default=36, help="blocks per run (36: a passage)")
    ap.add_argument("--child-prewarm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.io_only:
        print(json.dumps(io_bench(args.out, args.io_runs, args.io_blocks, threads=(1, 4, 16))))
    elif args.child_prewarm:
        prewarm(args)
    else:
        orchestrate(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
