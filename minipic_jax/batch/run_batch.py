"""`minipic run-batch -i requests.jsonl -o results.jsonl --model M`: an offline batch job.

Streams the input (a bounded number of requests in the engine at a time, so memory does not grow
with the file), writes each result as it finishes, and resumes: a rerun skips the requests the
output file already answers. A bad line (bad JSON, unknown field, prompt too long, ...) gets an
error record and the job goes on. With --kv-store-dir, spans computed by any earlier job or
`LLM.cache_spans` prewarm are read from disk instead of recomputed.
"""

from __future__ import annotations

import json
import sys
import time

from minipic_jax import warmup
from minipic_jax.batch.options import build_parser, check_paths, engine_args
from minipic_jax.batch.progress import Progress
from minipic_jax.batch.reading import LineError, iter_lines, parse_line
from minipic_jax.batch.records import dumps, error_record, result_record
from minipic_jax.batch.resume import answered, drop_error_records, open_for_append
from minipic_jax.loading.chat_template import render_conversations
from serving.config import Config
from serving.tiers.engine_tiers import prefetch_stored
from serving.cache.kv_pool import device_memory


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
        self.out.write(dumps(rec))
        self.out.flush()

    def submit(self, n: int, raw: bytes) -> bool:
        """Queue line n (True), or skip it / answer it with an error record (False). Lines with
        an error record and custom_ids with a result record are skipped (resume.py); a custom_id
        is claimed by the first line that runs (or ran) with it, so its duplicates get error
        records on every run, and the original is answered even after a kill."""
        if n in self.done_lines:
            self.counts["skipped"] += 1
            return False
        try:
            req = parse_line(n, raw, render_chat=self.render, seed=self.seed)
        except LineError as err:
            return self.error(n, err.custom_id, str(err))
        cid = req.custom_id
        if cid in self.seen:
            return self.error(n, cid, f"line {n}: duplicate custom_id {cid!r} "
                                      f"(first at line {self.seen[cid]})")
        if cid in self.done_ids:
            self.seen[cid] = n
            self.counts["skipped"] += 1
            return False
        try:
            ids, text = self.llm.to_token_ids(req.prompt, n)
            rid = f"batch-{n}"
            self.engine.add_request(rid, ids, req.sampling, cache_salt=req.cache_salt,
                                    prompt=text)
            prefetch_stored(self.engine)  # its span-store reads start while the next lines
            # are parsed and tokenized
        except (ValueError, TypeError) as err:
            msg = str(err).replace(f"request {n}: ", "").replace(f"request 'batch-{n}': ", "")
            return self.error(n, cid, f"line {n}: {msg}")
        self.seen[cid] = n
        self.pending[rid] = req
        return True

    def error(self, n: int, cid, message: str) -> bool:
        self.counts["errors"] += 1
        self.write(error_record(n, cid, message))
        return False

    def collect(self, outs) -> int:
        for out in outs:
            req = self.pending.pop(out.request_id)
            self.write(result_record(req, out, self.model, self.llm.get_tokenizer()))
            self.counts["ok"] += 1
            self.prompt_tokens += len(out.prompt_token_ids)
            self.output_tokens += len(out.outputs[0].token_ids)
            self.cached_tokens += out.num_cached_tokens
        return len(outs)


class Interrupted(Exception):
    """Ctrl-C during the job: every record written so far is whole; a rerun resumes."""

    def __init__(self, counts: dict):
        super().__init__("interrupted")
        self.counts = counts


def run(args, llm=None) -> dict:
    """Run the job `args` (build_parser's namespace); returns the stats. `llm`: an LLM to use
    instead of building one from args (its engine options then apply). Bad paths or options
    raise ValueError/OSError before the model is built; Ctrl-C raises `Interrupted`."""
    from minipic_jax import LLM
    check_paths(args)
    t0 = time.perf_counter()
    if llm is None:
        Config.from_flat(**engine_args(args))  # bad engine options: an error now, not after the weights
        llm = LLM(args.model, dtype=args.dtype, seed=args.seed, warmup=False,  # --warmup: below
                  **engine_args(args))
    if args.retry_errors:
        drop_error_records(args.output_file)
    if args.warmup:
        warmup.run(llm, show=not args.no_progress)
    setup_s = time.perf_counter() - t0
    progress = Progress(llm, _count_lines(args.input_file), not args.no_progress)
    engine = llm.llm_engine
    job = None
    try:
        with open_for_append(args.output_file) as out:
            job = _Job(llm, args, out)
            t1 = time.perf_counter()
            _feed(job, engine, iter_lines(args.input_file), progress, t1,
                  args.max_inflight or 4 * args.max_num_seqs)
            engine.flush_kv_store()
    except BaseException as err:
        if job is not None:  # the engine (maybe the caller's) is left with no request of ours
            engine.recover(list(job.pending))
        if isinstance(err, KeyboardInterrupt):
            raise Interrupted(job.counts if job else {}) from None
        raise
    finally:
        progress.close()
    return _summary(job, engine, time.perf_counter() - t1, setup_s)


def _feed(job, engine, lines, progress, t1: float, max_inflight: int) -> None:
    """Keep up to max_inflight requests in the engine, write results as they come."""
    exhausted = False
    while True:
        while not exhausted and len(job.pending) < max_inflight:
            item = next(lines, None)
            if item is None:
                exhausted = True
                break
            if not job.submit(*item):
                progress.update(1)  # skipped, or answered with an error record
        if not engine.has_unfinished():
            if exhausted:
                break
            continue
        n = job.collect(engine.step())
        el = time.perf_counter() - t1
        progress.update(n, f"{job.counts['ok'] / el:.2f} req/s, hit "
                           f"{100 * job.cached_tokens / max(job.prompt_tokens, 1):.0f}%")


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
    except Interrupted as stop:
        c = stop.counts
        print(f"\nminipic run-batch: interrupted ({c.get('ok', 0)} results and "
              f"{c.get('errors', 0)} error records written this run, all whole); rerun the same "
              f"command to resume", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # while the model was being built: nothing written
        print("\nminipic run-batch: interrupted before the job started", file=sys.stderr)
        return 130
    except (ValueError, OSError) as err:  # setup problems (paths, options, model, store)
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
              f"{kv['corrupt']} corrupt files skipped, {kv['blocks_not_written']} blocks not "
              f"written (store write errors)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(stats, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
