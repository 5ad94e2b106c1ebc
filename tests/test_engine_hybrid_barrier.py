"""A hybrid request resumed one token before its prompt's end under the `barrier` policy (issue
29 session 20): its admission chunk is held back while another request is still before its final
segment, and its last prompt token must still run on the restored checkpoint (it rides a prefill
chunk, never a decode row), so its outputs equal the same prompt computed from scratch."""

from __future__ import annotations

import numpy as np

from minipic_jax import LLM, Prompt, SamplingParams, Span
from tests.test_engine_hybrid_cache import _alone, _assert_same


def test_a_restore_held_back_by_the_barrier_still_runs_before_its_last_token():
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4,
              max_num_batched_tokens=64, min_token_bucket=64, max_model_len=512,
              block_size=16, num_kv_blocks=96, scheduling_policy="barrier", warmup=False)
    rng = np.random.default_rng(3)
    ids = lambda n: rng.integers(10, 200, n).tolist()  # noqa: E731
    prompt = ids(129)  # a checkpoint at 128 = n - 1 once computed
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    llm.generate([prompt], sp, use_tqdm=False)
    multi = [Prompt(ids(20)), Span(ids(150)), Prompt(ids(30))]  # holds the barrier shut a while
    got = llm.generate([multi, prompt], sp, use_tqdm=False)[1]
    assert got.num_cached_tokens == 128  # resumed at n - 1 from the checkpoint
    _assert_same([got], _alone(llm, [prompt], sp))
