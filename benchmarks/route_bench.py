"""`minipic-bench route`: span-aware vs random routing of a batch job over data-parallel replicas.

Workload (its own builder, MuSiQue multi-question): for each of the first `--samples` MuSiQue
samples, `--questions` requests over its 10 retrieved passages: the sample's own question and
questions of other samples, passages in a fresh random order per request (a retriever ranks them
differently each time). Prompt = [Prompt(header), Span(passage) x 10, Prompt(question)] with the
Llama 3 tokenizer; requests in a seeded random order (a dataset of prompts, not grouped).

Each of `--replicas` replicas is an LLM (tiny_llama3: the Llama 3 vocabulary, tiny layers) whose
jitted step is stubbed (engine_host.StubStep): the host path (scheduler, hashing, block
manager, LRU eviction) runs as in a real job, the device does nothing, so cache hits are exact and
times are host-only. Replicas run one after another in this process; a replica's figures are
its own. Policies: random (dataset order), routed (`route_by_spans`, dataset order), and each
with +order (`affinity_order`: requests sharing spans back to back on their replica).
Printed per policy: prefix-cache hit rate (cached / prompt tokens over all replicas),
computed prompt tokens (total and the busiest replica: the device work of the job's slowest
replica), requests per replica, and host-only throughput (requests / slowest replica's wall).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from benchmarks.engine_args import add_options, engine_options, out_option

HEADER = "You answer questions about the passages below. Reply with the answer only.\n\n"


def add_parser(p):
    p.add_argument("--samples", type=int, default=150, help="MuSiQue samples (passage sets)")
    p.add_argument("--questions", type=int, default=4, help="requests per passage set")
    p.add_argument("--replicas", type=int, default=4,
                   help="data-parallel replicas (default: %(default)s)")
    add_options(p, engine_options(num_kv_blocks=4096, block_size=16, max_tokens=8))
    p.add_argument("--passage-tokens", type=int, default=None, help="truncate passages (tests)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated routing policies (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="request order and random routing seed (default: %(default)s)")
    add_options(p, {"out": out_option("route_bench.json")})


def build_requests(samples: int, questions: int, seed: int = 0, passage_tokens=None) -> list:
    """Segment lists [Prompt(header), Span(p_1..p_10), Prompt(question)] (see module doc)."""
    from benchmarks.planner_workloads import _musique
    from minipic_jax import Prompt, Span
    from minipic_jax.loading.tokenizer import Llama3Tokenizer
    tok, memo = Llama3Tokenizer(), {}

    def enc(text):
        if text not in memo:
            memo[text] = tok.encode(text)[1:][:passage_tokens]
        return memo[text]

    data = _musique()
    if not 1 <= samples <= len(data):
        raise ValueError(f"--samples must be in [1, {len(data)}], got {samples}")
    rng = np.random.default_rng(seed)
    header = [tok.bos_token_id] + tok.encode(HEADER)[1:]
    reqs = []
    for s in range(samples):
        ctxs = data[s]["ctxs"]
        for k in range(questions):
            q = data[s if k == 0 else int(rng.integers(len(data)))]["question"]
            order = rng.permutation(len(ctxs))
            reqs.append([Prompt(header), *[Span(enc(ctxs[j]["text"])) for j in order],
                         Prompt(tok.encode(f"Question: {q}\nAnswer:")[1:])])
    return [reqs[i] for i in rng.permutation(len(reqs))]


def _replica(args):
    from benchmarks.engine_host import StubStep
    from minipic_jax import LLM
    llm = LLM("tiny_llama3", dtype="float32", seed=0, max_num_seqs=16,
              max_num_batched_tokens=2048, max_model_len=8192, block_size=args.block_size,
              num_kv_blocks=args.num_kv_blocks)
    llm.llm_engine.runner._step = StubStep(llm.llm_engine.vocab_size)
    return llm


def run_policy(prompts, routes, order, args) -> dict:
    """Each replica's share through a fresh stubbed engine; the policy's summary."""
    from minipic_jax import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    per = []
    for r in range(args.replicas):
        mine = [prompts[i] for i in order if routes[i] == r]
        llm = _replica(args)
        t0 = time.perf_counter()
        outs = llm.generate(mine, sp, use_tqdm=False) if mine else []
        wall = time.perf_counter() - t0
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
        per.append({"requests": len(mine), "prompt_tokens": prompt, "cached_tokens": cached,
                    "computed_tokens": prompt - cached, "wall_s": wall})
    prompt = sum(p["prompt_tokens"] for p in per)
    cached = sum(p["cached_tokens"] for p in per)
    slowest = max(p["wall_s"] for p in per)
    return {"hit_rate": cached / max(prompt, 1), "prompt_tokens": prompt,
            "computed_tokens": prompt - cached,
            "max_replica_computed_tokens": max(p["computed_tokens"] for p in per),
            "requests_per_replica": [p["requests"] for p in per],
            "host_only_requests_per_s": len(prompts) / slowest, "replicas": per}


POLICIES = ("random", "random+order", "routed", "routed+order")


def route(prompts, policy: str, args, markers: dict):
    """(replica per request, processing order) of a policy: random = random replicas in dataset
    order; routed = route_by_spans in dataset order; +order = each replica's share in
    affinity_order (requests sharing spans back to back)."""
    from minipic_jax.distributed import routing
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; use one of {POLICIES}")
    if policy == "random":
        return routing.route_random(len(prompts), args.replicas, seed=args.seed), \
            np.arange(len(prompts))
    memo: dict = {}
    spans = [routing.span_keys(p, block_size=args.block_size, markers=markers, memo=memo)
             for p in prompts]
    if policy.startswith("random"):
        routes = routing.route_random(len(prompts), args.replicas, seed=args.seed)
    else:
        routes = routing.route_by_spans(spans, args.replicas, loads=[len(p) for p in prompts])
    if policy.endswith("+order"):
        return routes, routing.affinity_order(spans, routes)
    return routes, np.arange(len(prompts))


def run(args) -> int:
    from minipic_jax import SamplingParams, build_prompt
    reqs = build_requests(args.samples, args.questions, args.seed, args.passage_tokens)
    warm = _replica(args)
    markers = warm.llm_engine.markers
    prompts = [build_prompt(r, block_size=args.block_size, **markers) for r in reqs]
    # one-time costs (imports, first calls) out of the timed runs
    warm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    results = {}
    print(f"route: {len(prompts)} requests ({args.samples} MuSiQue passage sets x "
          f"{args.questions} questions), {args.replicas} replicas, {args.num_kv_blocks} KV blocks "
          f"of {args.block_size} each, host-only (stubbed device step)")
    print("| policy | hit rate | computed prompt tokens | busiest replica | requests/replica "
          "| host-only req/s |")
    print("|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        routes, order = route(prompts, policy, args, markers)
        t_route = time.perf_counter() - t0
        res = results[policy] = run_policy(prompts, routes, order, args)
        res["route_s"] = t_route
        print(f"| {policy} | {res['hit_rate']:.3f} | {res['computed_tokens']} | "
              f"{res['max_replica_computed_tokens']} | {res['requests_per_replica']} | "
              f"{res['host_only_requests_per_s']:.1f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "route_bench.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1, default=str)
    return 0
