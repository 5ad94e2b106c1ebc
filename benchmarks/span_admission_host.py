"""Host time of admitting issue 29's reordered span request on a hybrid engine, device stubbed.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.span_admission_host [--repeats 20]
        [--parts] [--profile]

The request of `minipic-bench hybrid-spans` (`[Prompt(200), Span(900) x 6, Prompt(120)]`,
block 16, 64 seats, max_model_len 25,600: the H100 trace's shape) on tiny_qwen3_5 with its
positions widened to 64K (the host work does not depend on the widths), the jitted step replaced
by benchmarks/engine_host.StubStep (blocks are published as if computed). A cold request computes
the spans, one reordered request warms the maps' bookkeeping, then `repeats` requests hold the
same spans in a new order with a new question. Prints the median wall ms of
`CacheManager.admit` per request (the admission the H100 trace timed at 7.7 / 4.2 ms in the
reordered calls e / i, session 20); `--parts` adds the main parts' ms per request (wrapped, so
their sum is a little above the median), `--profile` a cProfile of the second half.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import dataclasses
import pstats
import time

import numpy as np

PARTS = (("serving.hybrid.hybrid_prefix", "HybridPrefixCache", "match"),
         ("serving.hybrid.hybrid_prefix", "HybridPrefixCache", "count_admission"),
         ("planner.estimate", "Replanner", "observe"),
         ("serving.hybrid.span_cache", "SpanMapCache", "_plan_skips"),
         ("serving.hybrid.span_cache", "SpanMapCache", "_checkpoints"),
         ("serving.hybrid.checkpoint_plan", "CheckpointPlanner", "_priced"))


def _timed(fn, bucket: list):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            bucket.append(time.perf_counter() - t0)
    return wrapper


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--parts", action="store_true", help="time the main parts too")
    ap.add_argument("--profile", action="store_true", help="cProfile the second half")
    args = ap.parse_args(argv)

    import importlib

    from benchmarks.engine_host import StubStep
    from benchmarks.ttft_host import id_ceiling
    from configs.presets import PRESETS
    from minipic_jax import LLM, Prompt, SamplingParams, Span
    PRESETS.setdefault("tiny_qwen3_5_long", dataclasses.replace(
        PRESETS["tiny_qwen3_5"], max_position_embeddings=65536))
    llm = LLM("tiny_qwen3_5_long", dtype="float32", seed=0, max_num_seqs=64,
              max_model_len=25600, block_size=16, warmup=False, scheduling_policy="fcfs")
    engine = llm.llm_engine
    engine.runner._step = StubStep(engine.vocab_size)
    rng = np.random.default_rng(0)
    vocab = id_ceiling(engine)  # no marker or EOS id among the drawn ones
    spans = [rng.integers(0, vocab, 900).tolist() for _ in range(6)]
    system = rng.integers(0, vocab, 200).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(order):
        """One request through `generate`: the system prompt, the spans in `order`, a new
        question; its cached prompt tokens."""
        question = rng.integers(0, vocab, 120).tolist()
        segs = [Prompt(system), *[Span(spans[j]) for j in order], Prompt(question)]
        return llm.generate([segs], sp, use_tqdm=False)[0].num_cached_tokens

    run(range(6))  # cold: computes the spans
    run(rng.permutation(6))  # warm: the maps' bookkeeping
    admits, parts = [], collections.defaultdict(list)
    mgr = engine.scheduler.cache
    mgr.admit = _timed(mgr.admit, admits)
    if args.parts:
        for mod, cls, name in PARTS:
            owner = getattr(importlib.import_module(mod), cls)
            setattr(owner, name, _timed(getattr(owner, name), parts[f"{cls}.{name}"]))
    prof = cProfile.Profile() if args.profile else None
    cached = []
    for r in range(args.repeats):
        if prof is not None and r == args.repeats // 2:
            prof.enable()
        cached.append(run(rng.permutation(6)))
    if prof is not None:
        prof.disable()
    print(f"reordered 6 x 900 span request, {int(np.median(cached))} of its tokens cached: "
          f"admit {1e3 * np.median(admits):.3f} ms per request (median of {args.repeats}; "
          f"min {1e3 * min(admits):.3f})")
    for name, xs in parts.items():
        print(f"  {name:34s} {1e3 * sum(xs) / args.repeats:.3f} ms per request")
    if prof is not None:
        pstats.Stats(prof).sort_stats(os.environ.get("PSTATS_SORT", "cumulative")).print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
