"""`LLM.generate` (the public API over the paged engine) vs HF transformers greedy generation."""

import numpy as np
import pytest
from conftest import FIXTURES, LLAMA_FIXTURES, hf_reference

from minipic_jax import LLM, SamplingParams


@pytest.mark.parametrize("name", LLAMA_FIXTURES)
def test_llm_greedy_equals_hf_generate(name):
    ref = hf_reference(FIXTURES / name)
    # one token bucket: the 22-token prefill and the decode steps share a compiled step (CI time)
    llm = LLM(model=str(FIXTURES / name), block_size=4, max_model_len=64, num_kv_blocks=64,
              min_token_bucket=32)
    max_new = max(len(g) for g in ref["greedy"])
    prompts = [{"prompt_token_ids": p} for p in ref["prompts"]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new, logprobs=2),
                        use_tqdm=False)
    for i, (out, prompt) in enumerate(zip(outs, ref["prompts"])):
        assert out.prompt_token_ids == prompt
        got = out.outputs[0]
        assert got.token_ids == ref["greedy"][i], f"prompt {i}"
        eos = ref["greedy"][i][-1] in llm.tokenizer.eos_token_ids
        assert got.finish_reason == ("stop" if eos else "length")
        # the sampled token's logprob equals log_softmax of HF's logits at that position
        hf_logits = ref["logits"][i][len(prompt) - 1:].astype(np.float64)
        hf_logp = hf_logits - np.log(np.exp(hf_logits - hf_logits.max(-1, keepdims=True)).sum(
            -1, keepdims=True)) - hf_logits.max(-1, keepdims=True)
        for step, (tok, lp) in enumerate(zip(got.token_ids, got.logprobs)):
            assert abs(lp[tok].logprob - hf_logp[step, tok]) <= 1e-4
