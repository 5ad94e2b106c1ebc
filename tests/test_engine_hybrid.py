"""The engine with a hybrid (Gated DeltaNet + attention) model: greedy tokens equal the HF
transformers reference of the fixture, with chunked prefill, mixed batches and preemption."""

from __future__ import annotations

import pytest

import numpy as np

from conftest import FIXTURES
from minipic_jax import LLM, SamplingParams


def test_hybrid_greedy_matches_hf_with_chunks_and_preemption():
    folder = FIXTURES / "qwen3_5_tied"
    npz = np.load(folder / "reference.npz")
    k = sum(f.startswith("prompt_") for f in npz.files)
    prompts = [npz[f"prompt_{i}"].tolist() for i in range(k)]
    greedy = [npz[f"greedy_{i}"].tolist() for i in range(k)]
    # 16 blocks hold all three prompts (1 + 5 + 10 blocks) but not their growth: preemption;
    # one token bucket (CI time: a step variant of this model compiles for seconds)
    llm = LLM(str(folder), max_num_seqs=3, max_num_batched_tokens=32, min_token_bucket=32,
              max_model_len=192, num_kv_blocks=16)
    assert llm.llm_engine.hybrid
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.llm_engine.get_stats()["preemptions"] > 0
    resumed = []
    for o, want, p in zip(outs, greedy, prompts):
        assert o.outputs[0].token_ids[:len(want)] == want  # HF transformers' greedy tokens
        assert o.num_cached_tokens == 0  # each prompt's first sight: nothing to resume from
        # no preemption when alone; a prompt seen before resumes from its recurrent checkpoint
        alone = llm.generate([p], sp, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == o.outputs[0].token_ids
        resumed.append(alone.num_cached_tokens)
    # resumed at 64-token chunk boundaries below the last full block, and still HF's tokens
    # (which checkpoints survive depends on this 16-block pool: the 155-token prompt resumes)
    assert resumed[-1] > 0
    assert all(r % 64 == 0 and r <= (len(p) - 1) // 16 * 16 for r, p in zip(resumed, prompts))


@pytest.mark.slow  # ~25 s of interpreted decode kernel: --run-slow
def test_hybrid_decode_steps_run_the_decode_kernel():
    """Decode-only steps compile their own variant with the decode kernel and its options (what
    the engine does on a GPU by default): a hybrid model must accept them and keep HF's tokens."""
    folder = FIXTURES / "qwen3_5_gva2"
    npz = np.load(folder / "reference.npz")
    prompts = [npz[f"prompt_{i}"].tolist() for i in range(2)]
    greedy = [npz[f"greedy_{i}"].tolist() for i in range(2)]
    llm = LLM(str(folder), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=192,
              attn_impl="xla", decode_attn_impl="triton_decode")
    runner = llm.llm_engine.runner
    assert runner.separate_decode and runner.decode_impl == "triton_decode"
    assert (runner.decode_options.rope, runner.decode_options.max_position) == ("table", 192)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for o, want in zip(llm.generate(prompts, sp, use_tqdm=False), greedy):
        assert o.outputs[0].token_ids == want[:4]
