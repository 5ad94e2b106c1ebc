"""update_weights on a hybrid model (tiny_qwen3_5): recurrent-state checkpoints made with the old
weights never resume a request afterwards; new ones are made and hit, exact."""

from __future__ import annotations

import numpy as np

from minipic_jax import LLM, SamplingParams
from minipic_jax.loading import load_model

CKPT_BYTES = 16896  # as tests/test_engine_hybrid_cache.py (same engine shapes: shared compiles)
SP = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)


def test_hybrid_checkpoints_of_old_weights_never_resume():
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4,
              max_num_batched_tokens=64, min_token_bucket=64, max_model_len=1280,
              block_size=16, num_kv_blocks=80, checkpoint_gb=4 * CKPT_BYTES / 2**30,
              cpu_offload_gb=8 * CKPT_BYTES / 2**30, checkpoints_per_prompt=4)
    prompt = np.random.default_rng(0).integers(0, 256, 100).tolist()
    first = llm.generate([prompt], SP, use_tqdm=False)[0]
    assert llm.generate([prompt], SP, use_tqdm=False)[0].num_cached_tokens > 0
    llm.update_weights(load_model("tiny_qwen3_5", dtype="float32", seed=1).params)
    after = llm.generate([prompt], SP, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    alone = llm.generate([prompt], SP, use_tqdm=False, cache_salt="fresh")[0]
    again = llm.generate([prompt], SP, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    lps = lambda o: [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]  # noqa
    for out in (after, again):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        np.testing.assert_allclose(lps(out), lps(alone), atol=1e-5)
    assert lps(after) != lps(first)
