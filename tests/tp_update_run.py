"""Subprocess body of test_weights_update's tensor-parallel case (needs 4 forced host devices
before JAX starts): update_weights at TP=4 (KV heads replicated) equals a fresh TP=4 engine of the
new weights, places every leaf as the load did, and re-traces nothing. Prints one JSON line."""

from __future__ import annotations

import json

import jax

from minipic_jax import LLM, SamplingParams
from minipic_jax.loading import load_model

ARGS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
            num_kv_blocks=32, tensor_parallel_size=4)
SP = SamplingParams(temperature=1.0, max_tokens=5, seed=3, logprobs=0)
PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (6, 21)]


def run(llm):
    outs = llm.generate(PROMPTS, SP, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
             for o in outs])


def main() -> None:
    llm = LLM("tiny_llama", seed=0, **ARGS)
    before = run(llm)
    run(llm)
    runner = llm.llm_engine.runner
    shardings = [x.sharding for x in jax.tree.leaves(runner.params)]
    variants = runner.num_compiles
    with jax.default_device(jax.devices("cpu")[0]):
        new = load_model("tiny_llama", dtype="float32", seed=1).params
    llm.update_weights(new)
    after = run(llm)
    fresh = run(LLM("tiny_llama", seed=1, **ARGS))
    same_place = all(a == b for a, b in zip(shardings, (x.sharding for x in
                                                          jax.tree.leaves(runner.params))))
    err = max(abs(a - b) for x, y in zip(after[1], fresh[1]) for a, b in zip(x, y))
    print(json.dumps(dict(changed=after[1] != before[1], equal=after[0] == fresh[0], err=err,
                          same_place=same_place, retraces=runner.num_compiles - variants)))


if __name__ == "__main__":
    main()
