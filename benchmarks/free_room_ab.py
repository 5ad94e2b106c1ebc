"""Free room on vs off (Config.hybrid_cache.free_room) on one engine: steps, prefill steps, step
time and tokens resumed of small cold workloads, the two settings alternated `--repeats` times
(the prefix cache and checkpoint store are reset before every run, so each run starts cold; the
step programs are the same for both settings, compiled once by a warm-up run of each).

  python -m benchmarks.free_room_ab [--model tiny_qwen3_5] [--repeats 3] [--json out.json]

Workloads, each request sent alone after the one before finished:
  lone    4 unrelated 1,000-token prompts, 8 output tokens (nothing to resume: the cost side)
  shared  issue 29's cold start: a 480-token prompt, then six sharing 300, 137, 213, 90, 470 and
          400 tokens with it, 4 output tokens (the gain side: tokens resumed)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

SHARES = [300, 137, 213, 90, 470, 400]


def workloads() -> dict:
    """name -> (prompts, max_tokens)."""
    rng = np.random.default_rng(0)
    lone = [rng.integers(0, 256, 1000).tolist() for _ in range(4)]
    rng = np.random.default_rng(29)
    first = rng.integers(0, 256, 480).tolist()
    shared = [first] + [first[:d] + rng.integers(0, 256, 12).tolist() for d in SHARES]
    return {"lone": (lone, 8), "shared": (shared, 4)}


def run_once(llm, free_room: bool, prompts, max_tokens: int) -> dict:
    """One cold run of `prompts` (one at a time) with free room on or off."""
    from minipic_jax import SamplingParams
    eng = llm.llm_engine
    eng.config.hybrid_cache = dataclasses.replace(eng.config.hybrid_cache, free_room=free_room)
    eng.reset_prefix_cache()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sizes, launch = [], eng.runner.launch
    eng.runner.launch = lambda batch, **kw: sizes.append(
        max(e.token_idx.size for e in batch)) or launch(batch, **kw)
    try:
        t0 = time.perf_counter()
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        wall = time.perf_counter() - t0
    finally:
        eng.runner.launch = launch
    stats = eng.hybrid_cache.stats()
    return dict(free_room=free_room, steps=len(sizes), prefill_steps=sum(n > 1 for n in sizes),
                wall_s=wall, step_ms=1e3 * wall / len(sizes),
                resumed=[o.num_cached_tokens for o in outs],
                checkpoints_stored=stats["checkpoints_stored"],
                tokens=[o.outputs[0].token_ids for o in outs])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny_qwen3_5")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write every run to this JSON file")
    args = p.parse_args(argv)
    from minipic_jax import LLM
    llm = LLM(args.model, dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=1024,
              min_token_bucket=64, max_model_len=1280, block_size=16, num_kv_blocks=400)
    rows = []
    for name, (prompts, max_tokens) in workloads().items():
        for free_room in (True, False):  # warm-up: every step variant both settings use
            run_once(llm, free_room, prompts, max_tokens)
        for rep in range(args.repeats):
            for free_room in ((True, False) if rep % 2 == 0 else (False, True)):
                r = run_once(llm, free_room, prompts, max_tokens)
                rows.append(dict(workload=name, repeat=rep, **r))
                print(f"{name:6s} rep {rep} free_room {str(free_room):5s} steps {r['steps']:3d} "
                      f"(prefill {r['prefill_steps']}) step {r['step_ms']:7.2f} ms "
                      f"stored {r['checkpoints_stored']:2d} resumed {r['resumed']}", flush=True)
        on = [r for r in rows if r["workload"] == name and r["free_room"]]
        off = [r for r in rows if r["workload"] == name and not r["free_room"]]
        same = all(a["tokens"] == b["tokens"] for a, b in zip(on, off))
        print(f"{name}: median step {np.median([r['step_ms'] for r in on]):.2f} ms on vs "
              f"{np.median([r['step_ms'] for r in off]):.2f} ms off; same tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
