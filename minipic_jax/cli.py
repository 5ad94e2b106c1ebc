"""`minipic-generate`: batch generation on the embedded default model (no download).

Builds a small RAG-style batch (a shared system prompt, documents as reusable SSEP spans in
varying orders, a question per request), runs it through `LLM.generate`, and prints throughput in
vLLM's line format, the prefix-cache hits and a few generated texts. The default model is a preset
with deterministic random weights, so the texts are gibberish: the point is the engine.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from minipic_jax.cli_args import (DefaultsFormatter, int_at_least, non_negative_float,
                                  non_negative_int, positive_int, seed_int)

_WORDS = ("river bank loan water bridge city north market harbor stone garden winter library "
          "engine signal forest mountain valley letter number paper window silver orbit planet "
          "music theory method record system memory cache block span token").split()


def _workload(n: int, num_docs: int, seed: int):
    from minipic_jax import Prompt, Span
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(40, 90)))
            for _ in range(num_docs)]
    system = "You answer questions using only the documents below."
    prompts = []
    for i in range(n):
        picked = rng.sample(range(num_docs), k=min(3, num_docs))
        question = f"Question {i}: what links {rng.choice(_WORDS)} and {rng.choice(_WORDS)}?"
        prompts.append([Prompt(system), *[Span(docs[d]) for d in picked], Prompt(question)])
    return prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="minipic-generate", description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsFormatter)
    ap.add_argument("--model", default="tiny-llama3", help="preset name or HF folder")
    ap.add_argument("--num-prompts", type=positive_int, default=64, help="requests in the batch")
    ap.add_argument("--num-docs", type=positive_int, default=8,
                    help="shared documents; each request uses 3 of them as SSEP spans")
    ap.add_argument("--max-tokens", type=positive_int, default=32, help="tokens generated per request")
    ap.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 = greedy")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--kv-mode", default="position_free",
                    choices=("position_free", "rotated", "pic_off"),
                    help="position_free = MiniPIC; rotated = classic prefix caching (plain "
                         "prompts); pic_off = position-free keys, markers as plain text")
    ap.add_argument("--policy", default="fcfs", choices=("fcfs", "barrier", "isps"),
                    help="scheduling policy (Config.scheduling_policy)")
    ap.add_argument("--max-num-seqs", type=positive_int, default=32, help="sequences per step")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=1024,
                    help="query tokens per step")
    ap.add_argument("--num-kv-blocks", type=int_at_least(2), default=1024, help="KV pool size in blocks")
    ap.add_argument("--show", type=non_negative_int, default=3, help="generated texts to print")
    ap.add_argument("--seed", type=seed_int, default=0, help="workload, weights and sampling seed")
    ap.add_argument("--output-json", default=None,
                    help="write throughput and engine stats (vLLM's JSON keys) here")
    args = ap.parse_args(argv)

    from minipic_jax import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, seed=args.seed, max_model_len=1024, warmup=False,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_kv_blocks=args.num_kv_blocks, kv_mode=args.kv_mode,
              scheduling_policy=args.policy)
    prompts = _workload(args.num_prompts, args.num_docs, args.seed)
    if args.kv_mode == "rotated":  # no markers in the baseline: plain concatenated prompts
        prompts = [" ".join(seg.content for seg in p) for p in prompts]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                        ignore_eos=True)  # unseeded: per-request seeds from the engine seed
    # compile every step shape up front, so the timed run measures the engine
    llm.llm_engine.warmup([(args.temperature == 0, False, 0)])
    setup_s = time.perf_counter() - t0
    before = dict(llm.llm_engine.get_stats())

    t1 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    elapsed = time.perf_counter() - t1
    stats = llm.llm_engine.get_stats()
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    print(f"Model: {args.model} ({args.dtype}, random weights), kv_mode={args.kv_mode}, "
          f"policy={args.policy}; setup + compile {setup_s:.1f} s")
    print(f"Throughput: {len(outs) / elapsed:.2f} requests/s, {(n_prompt + n_out) / elapsed:.2f} "
          f"total tokens/s, {n_out / elapsed:.2f} output tokens/s")
    print(f"Prefix cache: {cached} of {n_prompt} prompt tokens were cache hits "
          f"({100 * cached / max(n_prompt, 1):.1f}%); computed "
          f"{stats['computed_query_tokens'] - before['computed_query_tokens']} query tokens; "
          f"preemptions {stats['preemptions'] - before['preemptions']}; "
          f"compiles after warm-up {stats['num_compiles'] - before['num_compiles']}")
    for i, o in enumerate(outs[:args.show]):
        c = o.outputs[0]
        print(f"--- request {i}: {len(o.prompt_token_ids)} prompt tokens ({o.num_cached_tokens} "
              f"cached), {len(c.token_ids)} generated, finish={c.finish_reason}")
        print(f"    token ids: {c.token_ids[:12]}{' ...' if len(c.token_ids) > 12 else ''}")
        print(f"    text: {c.text[:120]!r}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"elapsed_time": elapsed, "num_requests": len(outs),
                       "total_num_tokens": n_prompt + n_out, "requests_per_second":
                       len(outs) / elapsed, "tokens_per_second": (n_prompt + n_out) / elapsed,
                       "num_cached_tokens": cached, "engine_stats": stats}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
