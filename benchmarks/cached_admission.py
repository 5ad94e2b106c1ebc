"""Host time of a fully cached span request (the cached-span TTFT's host part), device stubbed.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.cached_admission [--spans 8
        --span-tokens 4096 --repeats 15]

A cold request computes `spans` random spans (StubStep stands in for the device step, so the
blocks are published as if computed); then `repeats` requests hold the same spans reordered with
a new question, every span block a prefix-cache hit, max_tokens=1. Per cached request, the
thread CPU time of add_request and of the host phases of its steps (wrapped functions; nested
ones are also counted in their callers), medians over the repeats. Thread CPU time, not wall:
the dev machine's cores are shared.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import numpy as np

# (label, owner attribute path from the engine, method): timed with thread CPU time
PHASES = (
    ("add_request", "", "add_request"),
    ("schedule", "scheduler", "schedule"),
    ("  hashes", "cache.keys", "hashes"),
    ("  admission_plan", "cache.keys", "admission_plan"),
    ("  admit", "cache", "admit"),
    ("  fill_table", "cache", "fill_table"),
    ("  plan_chunk", "cache", "plan_chunk"),
    ("launch (build)", "runner", "launch"),
    ("advance", "", "_advance"),
    ("postprocess", "", "_postprocess"),
    ("step", "", "step"),
)


def _wrap(totals, label, owner, name):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            totals[label] += time.thread_time() - t0
    setattr(owner, name, timed)


def _owner(engine, path):
    obj = engine
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spans", type=int, default=8)
    ap.add_argument("--span-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--model", default="tiny_llama3")
    args = ap.parse_args(argv)

    from benchmarks.engine_host import StubStep
    from minipic_jax import LLM, Prompt, SamplingParams, Span
    bs = 16
    max_len = -(-(args.spans * (args.span_tokens + 2 * bs) + 512) // 1024) * 1024
    llm = LLM(args.model, dtype="float32", seed=0, max_num_seqs=4, max_model_len=max_len,
              block_size=bs, num_kv_blocks=3 * max_len // bs + 64, kv_mode="position_free",
              scheduling_policy="fcfs")
    engine = llm.llm_engine
    engine.runner._step = StubStep(engine.vocab_size)
    rng = np.random.default_rng(0)
    vocab = min(engine.vocab_size, 120000) - 8
    spans = [rng.integers(0, vocab, args.span_tokens).tolist() for _ in range(args.spans)]
    system = rng.integers(0, vocab, 90).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def request(order):
        q = rng.integers(0, vocab, 40).tolist()
        segs = [Prompt(system), *[Span(spans[j]) for j in order], Prompt(q)]
        return llm.to_token_ids(segs)[0]

    def run(rid, ids):
        engine.add_request(rid, ids, sp)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        return outs

    run("cold", request(range(args.spans)))
    totals = collections.Counter()
    for label, path, name in PHASES:
        _wrap(totals, label, _owner(engine, path), name)
    rows, cached = [], []
    for r in range(args.repeats):
        totals.clear()
        out = run(f"cached{r}", request(rng.permutation(args.spans)))
        rows.append(dict(totals))
        cached.append(out[0].num_cached_tokens)
    print(f"{args.spans} x {args.span_tokens}-token spans, cached prompt tokens "
          f"{int(np.median(cached))}; thread CPU ms per cached request, median [min-max] of "
          f"{args.repeats}:")
    for label, _, _ in PHASES:
        xs = 1e3 * np.asarray([row.get(label, 0.0) for row in rows])
        print(f"  {label:18s} {np.median(xs):7.3f}  [{xs.min():.3f}-{xs.max():.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
