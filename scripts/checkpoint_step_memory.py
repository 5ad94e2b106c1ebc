"""Device memory of a hybrid prefill step with K = checkpoint_plan.step_rows(S) checkpoint rows
against the same step with K = 1 (the model's checkpoint states are [Lg, K, ...]; before issue
29's flat rows they were [Lg, S, M, ...]). Compiles the top token bucket's general step twice in
one process and prints XLA's memory analysis of each.

  PYTHONPATH=. python scripts/checkpoint_step_memory.py [--model qwen3_5_0_8b]
      [--dtype bfloat16] [--max-num-seqs 256] [--max-num-batched-tokens 2048]
      [--num-kv-blocks 4096] [--max-model-len 4096]
"""

import argparse

from minipic_jax import LLM
from serving.hybrid import checkpoint_plan
from serving.step import step_inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3_5_0_8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=4096)
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
              max_num_batched_tokens=a.max_num_batched_tokens, num_kv_blocks=a.num_kv_blocks,
              warmup=False)  # only the two steps below are compiled (the warm-up's 28 took > 150 s)
    runner = llm.llm_engine.runner
    top = runner.config.token_buckets[-1]
    for m in (checkpoint_plan.CHECKPOINT_ROWS, 1):
        step_inputs.step_rows = lambda s, m=m: min(s, m)  # the layout reads it when (re)built
        step_inputs.layout.cache_clear()
        ints, floats, kw = next(x for x in runner.warmup_steps()
                                if x[2]["t"] == top and not x[2]["decode_only"])
        mem = runner._step.lower(*runner._args(ints, floats, False, kw), **kw).compile() \
            .memory_analysis()
        print(f"K {m}: tokens {top} seqs {kw['s']} temp {mem.temp_size_in_bytes / 2**20:.1f} MiB"
              f" arguments {mem.argument_size_in_bytes / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
