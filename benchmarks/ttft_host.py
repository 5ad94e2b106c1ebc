"""`minipic-bench ttft-host`: the host time of the cached-span TTFT request, device step stubbed.

The request of issue 28: [Prompt(40 ids), Span(4,096 ids) x 8, Prompt(30 ids)], max_tokens=1,
through `LLM.generate` on the `tiny_llama3` preset (the step is a `StubStep`, so only host work is
timed, on any backend). First the cold call (every block computed, stubbed), then calls with the
spans reordered and a new question (all spans cached). Per call: the wall of `generate`, split
into its parts by exclusive time (a part nested in another is counted once, in the inner one):

    prompt    Prompt/Span -> ids (LLM.prompt_ids: minipic_jax/prompts.py)
    validate  request checks and the layout (LLMEngine.validate)
    hashing   block keys (PrefixKeys.hashes)
    admission cache admission (CacheManager.admit: lookup, hit confirmation, table fill)
    build     the step's host inputs (ModelRunner.launch less the stubbed step)
    output    tokens applied and RequestOutputs made (LLMEngine._postprocess)
    stub      the stubbed device step (not host work); with `--step null*`, the call of a
              compiled step that computes nothing (benchmarks/null_step.py): the step call's
              own host cost (argument checks, input copies, output arrays), host work again
    other     the rest of `generate` (queueing, scheduling, ...)

`--fresh-lists` builds new id lists for every call from the ids kept (`Span(list(ids))`, as
`rag --configs ttft` does through rag_workloads.segments), instead of passing the same lists.
Each call's minor page faults are counted too (`faults`: they cost more on the GPU hosts'
virtual machines than here), and the main thread's CPU time (`thread_cpu`: the host time less
the time the thread was off the CPU, steadier than the wall on a loaded machine).

    minipic-bench ttft-host [--calls 3] [--repeats 5] [--fresh-lists] [--profile] [--floors]
    minipic-bench ttft-host --fresh-lists --max-num-seqs 64 --min-token-bucket 128  # as `rag`
    ... --step null-llama8b  # the step call's host cost with Llama-3.1-8B's params/cache leaves
    ... --model tiny_qwen3_5 --stretch-positions --spans 6 --span-tokens 900  # a hybrid
        # span request (issue 29's shape; its system prompt 40 ids, question 30)
"""

from __future__ import annotations

import numpy as np

PARTS = ("prompt", "validate", "hashing", "admission", "build", "output", "stub")


def add_parser(p) -> None:
    p.add_argument("--model", default="tiny_llama3",
                   help="preset or HF folder (default: %(default)s; the step is stubbed)")
    p.add_argument("--spans", type=int, default=8, help="spans per request (default: %(default)s)")
    p.add_argument("--span-tokens", type=int, default=4096,
                   help="token ids per span (default: %(default)s)")
    p.add_argument("--calls", type=int, default=3, help="cached calls (reordered spans)")
    p.add_argument("--repeats", type=int, default=5, help="runs of the cached calls (median)")
    p.add_argument("--max-num-seqs", type=int, default=4,
                   help="seats (default: %(default)s; `rag --configs ttft` runs 64)")
    p.add_argument("--min-token-bucket", type=int, default=None,
                   help="smallest token bucket (default: the engine's; `rag` passes 128)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size (default: 3 requests' blocks + 64, ~6,200; Llama-3.1-8B on "
                        "an 80 GB card has ~30,000 blocks of 16: pool-sized host work shows)")
    p.add_argument("--fresh-lists", action="store_true",
                   help="new id lists per call from the ids kept (as the rag ttft bench)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile 50 cached calls (us per call)")
    p.add_argument("--floors", action="store_true",
                   help="also time the whole-list passes a call cannot avoid over its span ids "
                        "on this host (the floors of the prompt part)")
    p.add_argument("--stretch-positions", action="store_true",
                   help="a preset whose max_position_embeddings is below the request's length "
                        "runs as a copy with enough positions (the step is stubbed: host work "
                        "only), e.g. tiny_qwen3_5 for a hybrid span request")
    p.add_argument("--step", choices=("stub", "null", "null-llama8b"), default="stub",
                   help="stub: a Python stand-in (default); null: a compiled step computing "
                        "nothing, called as the runner calls its step (the engine's params and "
                        "cache; null-llama8b: Llama-3.1-8B-like leaves instead)")


def wrap(timer, owner, name: str, part: str) -> None:
    """Charge the time inside `owner.name` to `part` (exclusive: serving/step_timer.StepTimer)."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        with timer.phase(part):
            return inner(*args, **kwargs)
    setattr(owner, name, timed)


def make_llm(args):
    from benchmarks.engine_host import StubStep
    from minipic_jax import LLM
    bs = 16
    max_len = args.spans * (args.span_tokens + bs) + 256
    max_len = -(-max_len // 1024) * 1024
    extra = {} if args.min_token_bucket is None else {"min_token_bucket": args.min_token_bucket}
    model = stretched(args.model, max_len) if getattr(args, "stretch_positions", False) \
        else args.model
    llm = LLM(model, dtype="float32", seed=0, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=8192, max_model_len=max_len, block_size=bs,
              num_kv_blocks=getattr(args, "num_kv_blocks", None) or 3 * (max_len // bs) + 64,
              **extra)
    engine = llm.llm_engine
    step = getattr(args, "step", "stub")
    if step == "stub":
        engine.runner._step = StubStep(engine.vocab_size)
    else:
        from benchmarks import null_step
        null_step.install(engine.runner, "llama8b" if step == "null-llama8b" else "engine")
    return llm


def stretched(name: str, max_len: int) -> str:
    """A preset registered again as "<name>_stretched" with max_position_embeddings >= max_len
    (configs/presets.PRESETS, this process only); the name itself when it has enough."""
    import dataclasses

    from configs import presets
    cfg = presets.get_preset(name)
    if cfg.max_position_embeddings >= max_len:
        return name
    key = presets.normalize_name(name) + "_stretched"
    presets.PRESETS[key] = dataclasses.replace(cfg, max_position_embeddings=max_len)
    return key


def instrument(llm):
    """A StepTimer over PARTS + "other" (the rest of `generate`), its parts' entry points wrapped
    on this LLM's objects (instances, not classes)."""
    from serving.step_timer import StepTimer
    pt = StepTimer(PARTS + ("other",), base="other")
    engine = llm.llm_engine
    runner = engine.runner
    wrap(pt, llm, "prompt_ids", "prompt")
    wrap(pt, engine, "validate", "validate")
    wrap(pt, engine.cache.keys, "hashes", "hashing")
    wrap(pt, engine.cache, "admit", "admission")
    wrap(pt, runner, "launch", "build")
    wrap(pt, runner, "_step", "stub")
    wrap(pt, engine, "_postprocess", "output")
    return pt


def id_ceiling(engine) -> int:
    """The bound random token ids stay under: below the vocabulary's end and below every marker
    (pad, SSEP, PDEP) and EOS id, so a drawn span holds no primitive (Llama 3's specials sit at
    the vocabulary's top; a drawn pad would be an invisible token)."""
    special = [i for i in (*engine.markers.values(), *engine.eos_ids) if i is not None]
    return min([engine.vocab_size - 10, *special])


def request(rng, spans, order, vocab: int, fresh: bool = False):
    """[Prompt(system: 40 ids, the same in every call), spans in `order`, Prompt(a new
    question: 30 ids)]; `fresh`: each span a new list of the ids kept."""
    from minipic_jax.prompts import Prompt, Span
    system = np.random.default_rng(1).integers(10, vocab - 10, 40).tolist()
    return ([Prompt(system)] +
            [Span(list(spans[k]) if fresh else spans[k]) for k in order] +
            [Prompt(rng.integers(10, vocab - 10, 30).tolist())])


def timed_call(llm, pt, prompt, sp) -> dict:
    import resource
    import time
    faults0, cpu0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
    pt.start()
    out = llm.generate(prompt, sp, use_tqdm=False)
    parts = {k: 1e3 * v for k, v in pt.stop().items()}
    cpu = time.thread_time() - cpu0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    parts["wall"] = sum(parts.values())
    parts["thread_cpu"] = 1e3 * cpu  # this thread's CPU time, ms
    parts["faults"] = faults
    parts["host"] = parts["wall"] - parts["stub"]
    parts["cached"] = out[0].num_cached_tokens
    return parts


def run(args) -> int:
    import statistics

    from minipic_jax import SamplingParams
    llm = make_llm(args)
    vocab = id_ceiling(llm.llm_engine)
    rng = np.random.default_rng(0)
    spans = [rng.integers(10, vocab - 10, args.span_tokens).tolist() for _ in range(args.spans)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    pt = instrument(llm)
    fresh = args.fresh_lists
    rows = [("cold", timed_call(llm, pt, request(rng, spans, range(args.spans), vocab, fresh),
                                sp))]
    cached: list[list[dict]] = [[] for _ in range(args.calls)]
    for _ in range(args.repeats):
        for c in range(args.calls):
            order = rng.permutation(args.spans)
            cached[c].append(timed_call(llm, pt, request(rng, spans, order, vocab, fresh), sp))
    keys = ("wall", "host", "thread_cpu") + PARTS[:-1] + ("other", "stub", "faults")
    for c in range(args.calls):
        rows.append((f"cached {c + 1}", {k: statistics.median(r[k] for r in cached[c])
                                         for k in keys + ("cached",)}))
    step = {"stub": "stubbed", "null": "a null compiled step",
            "null-llama8b": "a null compiled step on Llama-3.1-8B-like leaves"}[args.step]
    print(f"ttft-host: {args.model}, [Prompt(40), Span({args.span_tokens}) x {args.spans}, "
          f"Prompt(30)], max_tokens=1, step {step}, {'new' if fresh else 'the same'} span lists "
          f"per call; ms (cached calls: median of {args.repeats}), minor page faults")
    print(f"{'call':>9} " + " ".join(f"{k:>9}" for k in keys) + "  cached_tokens")
    for name, r in rows:
        print(f"{name:>9} " + " ".join(f"{r[k]:9.3f}" for k in keys[:-1]) +
              f" {r['faults']:9.0f}  {int(r['cached'])}")
    if args.profile:
        _profile(llm, rng, spans, sp, vocab, args.spans, fresh)
    if args.floors:
        print_floors(spans)
    return 0


def print_floors(spans) -> None:
    """us per call of the passes over all span ids that bound the prompt part from below: a
    list converted to int64 (array("q"): the floor for ids seen for the first time), the type
    check of a new list equal to a remembered one (sum: stays an int only over Python ints),
    the equality with the remembered copy (pointer compares), the same objects as remembered
    (items: their pointers compared in place, minipic_jax/list_items.py: what a new list of
    the ids kept costs now, with neither of the two before), and the prompt's list of ids
    (extend); then the int64 concatenation and the list's copy for the output (gone: a
    finished request hands its list over)."""
    import array
    import timeit

    from minipic_jax.list_items import item_bytes, same_items
    fresh = [list(ids) for ids in spans]
    arrays = [np.asarray(ids, np.int64) for ids in spans]
    kept = [item_bytes(ids) for ids in spans]

    def extend():
        out = []
        for ids in fresh:
            out += ids
        return out
    flat = extend()
    passes = {"array(q)": lambda: [array.array("q", ids) for ids in fresh],
              "sum": lambda: [sum(ids) for ids in fresh],
              "equal": lambda: [a == b for a, b in zip(fresh, spans)],
              "items": lambda: [same_items(a, b) for a, b in zip(fresh, kept)],
              "extend": extend, "concat": lambda: np.concatenate(arrays),
              "out_copy": lambda: flat[:]}
    print(f"floors, us per call over {len(spans)} x {len(spans[0])} ids (min of 7 x 50):")
    for name, f in passes.items():
        us = 1e6 * min(timeit.repeat(f, number=50, repeat=7)) / 50
        print(f"  {name:>9} {us:9.1f}")


def _profile(llm, rng, spans, sp, vocab: int, n: int, fresh: bool, calls: int = 50) -> None:
    """cProfile over `calls` cached calls, printed as us per call (one call's times round to
    0.000 s in pstats' table): the 25 functions of most own time, with their cumulative time
    and calls per call (cProfile's overhead inflates the many small ones)."""
    import cProfile
    import pstats
    prompts = [request(rng, spans, rng.permutation(n), vocab, fresh) for _ in range(calls)]
    prof = cProfile.Profile()
    prof.enable()
    for prompt in prompts:
        llm.generate(prompt, sp, use_tqdm=False)
    prof.disable()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:25]
    print(f"cProfile over {calls} cached calls, per call: own us, cumulative us, calls")
    for (path, line, name), (_, ncalls, own, cum, _) in rows:
        where = "/".join(path.split("/")[-2:])
        print(f"  {1e6 * own / calls:8.1f} {1e6 * cum / calls:8.1f} {ncalls / calls:6.1f}  "
              f"{where}:{line}({name})")
