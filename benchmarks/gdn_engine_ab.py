"""`minipic-bench gdn-engine`: the hybrid engine with one gated delta kernel against another
(Config.gdn.impl, default pallas_fused vs mosaic) on a prefill-heavy workload.

One engine per kernel, the same model (Qwen3.5-0.8B preset, random bf16 weights, seeded), the
same prompts (random ids below 500, --prompts of --prompt-len each, prefix caching off so every prompt
is prefilled in full) and greedy sampling of --max-tokens tokens with their logprobs:
  * agreement: greedy tokens equal to the first kernel's, and the largest logprob difference
    (bf16 steps round differently: test_engine_decode_kernel.py holds 2e-2);
  * the prefill step alone: one prompt of --prompt-len tokens (one step of that bucket), its
    jitted step replayed blocked, median ms over --reps;
  * the workload's wall time after a first, compiling run.
Prints one line per kernel; --json writes them. Before it, one progress line per phase of each
engine (start, first generate = its compiles, timed generate, prefill step: seconds, step variants
compiled so far), flushed: a run killed by a timeout shows the phase it was in.
"""

from __future__ import annotations

import gc
import json
import time

from benchmarks.engine_args import add_options, engine_options, out_option


def add_parser(p):
    add_options(p, engine_options(model="qwen3_5_0_8b", dtype="bfloat16", max_num_seqs=4,
                                  max_num_batched_tokens=2048, max_tokens=8, num_kv_blocks=1024))
    p.add_argument("--impls", nargs="+", default=["pallas_fused", "mosaic"],
                   help="Config.gdn.impl values to compare (the first is the reference)")
    p.add_argument("--prompts", type=int, default=8, help="prompts in the workload")
    p.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt")
    p.add_argument("--reps", type=int, default=10, help="timed replays of the prefill step")
    p.add_argument("--json", action="store_true", help="write gdn_engine_ab.json to --out")
    add_options(p, {"out": out_option("gdn_engine_ab.json")})


def _engine(args, impl):
    from minipic_jax import LLM
    return LLM(args.model, dtype=args.dtype, gdn_impl=impl, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.prompt_len + args.max_tokens + 64,
               num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False,
               async_scheduling=False, warmup=False)  # a fixed pool: two engines, one device


def _prefill_step_ms(llm, prompt, reps):
    """Median ms of the engine's jitted step for one prompt's prefill (its only step when one
    token is asked), replayed on the same inputs and waited for each time."""
    import jax
    import numpy as np
    from minipic_jax import SamplingParams
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    runner = llm.llm_engine.runner
    ints, floats, kw = runner.last_inputs
    args = runner._args(ints, floats, False, kw)
    times, cache = [], args[1]
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        cache, out = runner._step(args[0], cache, *args[2:], **kw)[:2]
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    runner.cache = cache
    return float(np.median(times[2:])) * 1e3


class _Progress:
    """One flushed line per phase of one engine: `phase(name)` starts one (and prints the one
    before it as done); each line says the seconds it took and the step variants compiled."""

    def __init__(self, impl):
        self.impl, self.runner, self.name, self.t0, self.s = impl, None, None, 0.0, {}

    def phase(self, name=None):
        now = time.perf_counter()
        if self.name is not None:
            self.s[self.name] = now - self.t0
            compiled = "-" if self.runner is None else self.runner.num_compiles
            print(f"gdn-engine {self.impl}: {self.name} done in {now - self.t0:.1f} s "
                  f"(step variants compiled: {compiled})", flush=True)
        if name is not None:
            print(f"gdn-engine {self.impl}: {name} ...", flush=True)
        self.name, self.t0 = name, now


def _one(args, impl, prompts, params):
    progress = _Progress(impl)
    progress.phase("start")
    llm = _engine(args, impl)
    progress.runner = llm.llm_engine.runner
    progress.phase("first generate (compiles its steps)")
    outs = llm.generate(prompts, params, use_tqdm=False)
    progress.phase("timed generate")
    outs = llm.generate(prompts, params, use_tqdm=False)
    progress.phase("prefill step")
    step_ms = _prefill_step_ms(llm, prompts[0], args.reps)
    progress.phase()
    res = dict(impl=impl, ran=llm.llm_engine.runner.gdn_impl, start_s=progress.s["start"],
               wall_s=progress.s["timed generate"], prefill_step_ms=step_ms,
               first_generate_s=progress.s["first generate (compiles its steps)"],
               step_variants=llm.llm_engine.runner.num_compiles)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs]
    return res, tokens, logprobs


def run(args):
    import numpy as np
    from minipic_jax import SamplingParams
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, size=args.prompt_len).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1,
                            ignore_eos=True)
    rows, ref = [], None
    for impl in args.impls:
        res, tokens, logprobs = _one(args, impl, prompts, params)
        gc.collect()  # the engine's device buffers, before the next one starts
        if ref is None:
            ref = (tokens, logprobs)
        same = [a == b for a, b in zip(tokens, ref[0])]
        res["tokens_equal"] = f"{sum(same)}/{len(same)}"
        res["max_logprob_diff"] = max(abs(x - y) for a, b in zip(logprobs, ref[1])
                                      for x, y in zip(a, b))
        rows.append(res)
        print(f"gdn {impl:>14} (ran {res['ran']}): prefill step {args.prompt_len} tokens "
              f"{res['prefill_step_ms']:.2f} ms | workload {args.prompts}x{args.prompt_len} "
              f"+{args.max_tokens} wall {res['wall_s']:.3f} s | greedy tokens equal to "
              f"{args.impls[0]}: {res['tokens_equal']}, max |dlogprob| "
              f"{res['max_logprob_diff']:.2e} | start {res['start_s']:.1f} s, first generate "
              f"{res['first_generate_s']:.1f} s ({res['step_variants']} step variants)",
              flush=True)
    if args.json:
        import os
        with open(os.path.join(args.out, "gdn_engine_ab.json"), "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if k != "_run"},
                           rows=rows), f, indent=1)
