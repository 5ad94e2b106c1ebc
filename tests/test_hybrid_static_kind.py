"""A hybrid engine whose decode-only steps compile their own variant names the recurrent layers'
step kind on the host (RecurrentMetadata.decode: one-step recurrence vs chunked prefill), so no
step holds a per-layer lax.cond; its greedy tokens still equal HF transformers'."""

from __future__ import annotations

import numpy as np

from conftest import FIXTURES
from minipic_jax import LLM, SamplingParams


def test_static_recurrent_kind_keeps_hf_tokens():
    folder = FIXTURES / "qwen3_5_tied"
    npz = np.load(folder / "reference.npz")
    prompts = [npz[f"prompt_{i}"].tolist() for i in range(2)]
    greedy = [npz[f"greedy_{i}"].tolist() for i in range(2)]
    llm = LLM(str(folder), max_num_seqs=2, max_num_batched_tokens=32, min_token_bucket=32,
              max_model_len=192)  # one bucket: two compiled variants
    runner = llm.llm_engine.runner
    # the GPU's layout (a decode kernel of its own), with the CPU's XLA attention for both kinds
    runner.separate_decode = True
    kinds = []
    step_body = runner._step_body

    def record(*a, decode_only=False, **kw):
        kinds.append(runner._recurrent_kind(decode_only))
        return step_body(*a, decode_only=decode_only, **kw)

    runner._step_body = record  # traced once per compiled variant
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for o, want in zip(llm.generate(prompts, sp, use_tqdm=False), greedy):
        assert o.outputs[0].token_ids == want[:6]
    assert set(kinds) == {True, False}  # decode-only variants decode, the others prefill
