"""`minipic run-batch -i requests.jsonl -o results.jsonl --model M`: an offline batch job.

Streams the input (a bounded number of requests in the engine at a time, so memory does not grow
with the file), writes each result as it finishes, and resumes: a rerun skips the requests the
output file already answers. A bad line (bad JSON, unknown field, prompt too long, ...) gets an
error record and the job goes on. With --kv-store-dir, spans computed by any earlier job or
`LLM.cache_spans` prewarm are read from disk instead of recomputed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from minipic_jax.batch.reading import LineError, iter_lines, parse_line
from minipic_jax.batch.records import error_record, result_record
from minipic_jax.batch.resume import answered, open_for_append
from minipic_jax.loading.chat_template import render_conversations
from serving.engine_tiers import prefetch_stored
from serving.kv_pool import device_memory


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minipic run-batch", description=__doc__.split("\n\n")[0])
    ap.add_argument("-i", "--input-file", required=True, help="JSONL requests (OpenAI batch)")
    ap.add_argument("-o", "--output-file", required=True, help="JSONL results (appended)")
    ap.add_argument("--model", default="tiny-llama3", help="preset name or HF folder")
    ap.add_argument("--served-model-name", default=None, help="'model' in the responses")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--min-token-bucket", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--kv-mode", default="position_free",
                    choices=("position_free", "rotated", "pic_off"))
    ap.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "barrier", "isps"))
    ap.add_argument("--cpu-offload-gb", type=float, default=0.0)
    ap.add_argument("--kv-store-dir", default=None, help="persistent span store folder")
    ap.add_argument("--kv-store-gb", type=float, default=64.0)
    ap.add_argument("--kv-store-spans-only", action="store_true",
                    help="store SSEP span blocks only (not questions or other prompt parts)")
    ap.add_argument("--kv-store-staging-gb", type=float, default=None,
                    help="device memory for store runs read ahead of their copy-in (default: "
                         "min(16 GiB, 16%% of the device's memory))")
    ap.add_argument("--max-inflight", type=int, default=None,
                    help="requests in the engine at once (default 4 x max-num-seqs)")
    ap.add_argument("--warmup", action="store_true", help="compile every step shape first")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--output-json", default=None, help="write the job's stats here")
    return ap


def _engine_args(args) -> dict:
    out = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               min_token_bucket=args.min_token_bucket,
               block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_mode=args.kv_mode,
               scheduling_policy=args.scheduling_policy, cpu_offload_gb=args.cpu_offload_gb,
               kv_store_dir=args.kv_store_dir, kv_store_gb=args.kv_store_gb,
               kv_store_spans_only=args.kv_store_spans_only,
               kv_store_staging_gb=args.kv_store_staging_gb)
    if args.max_model_len is not None:
        out["max_model_len"] = args.max_model_len
    return out


def _render_chat(tokenizer):
    def render(messages):  # {"prompt_token_ids", "prompt"} (LLM.to_token_ids reads both)
        return render_conversations(tokenizer, messages)[0]
    return render


def _count_lines(path) -> int:
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            n += chunk.count(b"\n")
    return n


class _Job:
    """Feeds requests to the engine and writes what comes back."""

    def __init__(self, llm, args, out):
        self.llm, self.engine, self.out = llm, llm.llm_engine, out
        self.model = args.served_model_name or args.model
        self.seed = args.seed
        self.render = _render_chat(llm.get_tokenizer())
        self.pending: dict[str, object] = {}  # engine request id -> BatchRequest
        self.seen: dict[str, int] = {}  # custom_id -> line, this run
        self.done_ids, self.done_lines = answered(args.output_file)
        self.counts = dict(ok=0, errors=0, skipped=0)
        self.prompt_tokens = self.output_tokens = self.cached_tokens = 0

    def write(self, rec: dict) -> None:
        self.out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.out.flush()

    def submit(self, n: int, raw: bytes) -> bool:
        """Queue line n (True), or skip it / answer it with an error record (False)."""
        try:
            req = parse_line(n, raw, render_chat=self.render, seed=self.seed)
        except LineError as err:
            if err.custom_id in self.done_ids or (err.custom_id is None and n in self.done_lines):
                self.counts["skipped"] += 1
                return False
            self.counts["errors"] += 1
            self.write(error_record(n, err.custom_id, str(err)))
            return False
        cid = req.custom_id
        if cid in self.done_ids:
            self.counts["skipped"] += 1
            return False
        try:
            if cid in self.seen:
                raise ValueError(f"duplicate custom_id {cid!r} (first at line {self.seen[cid]})")
            self.seen[cid] = n
            ids, text = self.llm.to_token_ids(req.prompt, n)
            rid = f"batch-{n}"
            self.engine.add_request(rid, ids, req.sampling, cache_salt=req.cache_salt,
                                    prompt=text)
            prefetch_stored(self.engine)  # its span-store reads start while the next lines
            # are parsed and tokenized
        except ValueError as err:
            self.counts["errors"] += 1
            msg = str(err).replace(f"request {n}: ", "").replace(f"request 'batch-{n}': ", "")
            self.write(error_record(n, cid, f"line {n}: {msg}"))
            return False
        self.pending[rid] = req
        return True

    def collect(self, outs) -> int:
        for out in outs:
            req = self.pending.pop(out.request_id)
            self.write(result_record(req, out, self.model, self.llm.get_tokenizer()))
            self.counts["ok"] += 1
            self.prompt_tokens += len(out.prompt_token_ids)
            self.output_tokens += len(out.outputs[0].token_ids)
            self.cached_tokens += out.num_cached_tokens
        return len(outs)


def run(args, llm=None) -> dict:
    """Run the job `args` (build_parser's namespace); returns the stats. `llm`: an LLM to use
    instead of building one from args (its engine options then apply)."""
    from minipic_jax import LLM
    t0 = time.perf_counter()
    if llm is None:
        llm = LLM(args.model, dtype=args.dtype, seed=args.seed, **_engine_args(args))
    if args.warmup:
        llm.llm_engine.warmup()
    setup_s = time.perf_counter() - t0
    total = _count_lines(args.input_file)
    max_inflight = args.max_inflight or 4 * args.max_num_seqs
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc="Running batch", unit="req", dynamic_ncols=True)
    engine = llm.llm_engine
    with open_for_append(args.output_file) as out:
        job = _Job(llm, args, out)
        lines = iter_lines(args.input_file)
        exhausted = False
        t1 = time.perf_counter()
        while True:
            while not exhausted and len(job.pending) < max_inflight:
                item = next(lines, None)
                if item is None:
                    exhausted = True
                    break
                if not job.submit(*item) and bar is not None:
                    bar.update(1)  # skipped, or answered with an error record
            if not engine.has_unfinished():
                if exhausted:
                    break
                continue
            n = job.collect(engine.step())
            if bar is not None and n:
                bar.update(n)
                el = time.perf_counter() - t1
                bar.set_postfix_str(f"{job.counts['ok'] / el:.2f} req/s, hit "
                                    f"{100 * job.cached_tokens / max(job.prompt_tokens, 1):.0f}%")
        engine.flush_kv_store()
    elapsed = time.perf_counter() - t1
    if bar is not None:
        bar.close()
    return _summary(job, engine, elapsed, setup_s)


def _summary(job, engine, elapsed: float, setup_s: float) -> dict:
    el = max(elapsed, 1e-9)
    toks = job.prompt_tokens + job.output_tokens
    return {"elapsed_time": elapsed, "setup_time": setup_s, "num_requests": job.counts["ok"],
            "num_errors": job.counts["errors"], "num_skipped": job.counts["skipped"],
            "requests_per_second": job.counts["ok"] / el, "tokens_per_second": toks / el,
            "output_tokens_per_second": job.output_tokens / el,
            "total_num_tokens": toks, "total_output_tokens": job.output_tokens,
            "num_cached_tokens": job.cached_tokens,
            "prefix_cache_hit_rate": job.cached_tokens / max(job.prompt_tokens, 1),
            "engine_stats": engine.get_stats(), "device_memory": device_memory()}


def main(argv=None, llm=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        stats = run(args, llm)
    except (ValueError, FileNotFoundError) as err:  # setup problems (model, store, files)
        print(f"minipic run-batch: error: {err}", file=sys.stderr)
        return 2
    print(f"Requests: {stats['num_requests']} done, {stats['num_errors']} error records, "
          f"{stats['num_skipped']} already in the output file")
    print(f"Throughput: {stats['requests_per_second']:.2f} requests/s, "
          f"{stats['tokens_per_second']:.2f} total tokens/s, "
          f"{stats['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Prefix cache: {stats['num_cached_tokens']} of "
          f"{stats['total_num_tokens'] - stats['total_output_tokens']} prompt tokens were cache "
          f"hits ({100 * stats['prefix_cache_hit_rate']:.1f}%)")
    kv = stats["engine_stats"].get("kv_store")
    if kv:
        print(f"Span store: read {kv['bytes_read'] / 1e6:.1f} MB ({kv['read_GBps']:.2f} GB/s), "
              f"wrote {kv['bytes_written'] / 1e6:.1f} MB, store {kv['bytes_stored'] / 1e6:.1f} MB in "
              f"{kv['runs_stored']} files, "
              f"{kv['corrupt']} corrupt files skipped")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(stats, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
