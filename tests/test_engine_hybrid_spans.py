"""Span prompts on a hybrid model through the engine (cold path, serving/span_rows.py): tokens and
logprobs equal the float64 hybrid span reference (tests/hybrid_span_reference.py), for prompts with
the same spans at other offsets and in other orders in one batch, a prompt ending in a span, and
chunked prefills (64-token steps) that cut between segments."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_span_reference as hsr
from minipic_jax import LLM, SamplingParams
from minipic_jax.prompts import Prompt, Span

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4,
               max_num_batched_tokens=64, min_token_bucket=64, max_model_len=512,
               block_size=16, num_kv_blocks=96)


def _check(llm, out):
    """Teacher-forced: every generated token is the reference's argmax, its logprob within 1e-5."""
    eng = llm.llm_engine
    m, bs = eng.markers, llm.config.block_size
    kept, seg, span = hsr.segments(list(out.prompt_token_ids), bs, m["pad_token_id"],
                                   m["ssep_token_id"], m["pdep_token_id"])
    gen = list(out.outputs[0].token_ids)
    full = kept + gen[:-1]
    seg_full = np.r_[seg, np.full(len(gen) - 1, seg[-1])]
    ref = hsr.reference_logprobs(eng.runner.params, eng.runner.mcfg, full, seg_full, span)
    ref = ref[len(kept) - 1:]
    err = 0.0
    for j, tok in enumerate(gen):
        assert ref[j, tok] >= ref[j].max() - 1e-6, f"token {j}: {tok} is not the argmax"
        got = next(iter(out.outputs[0].logprobs[j].values())).logprob
        err = max(err, abs(got - ref[j, tok]))
    return err


def test_span_prompts_match_the_reference(llm):
    rng = np.random.default_rng(19)
    text = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    sys_a, sys_b, question = Prompt(text(20)), Prompt(text(45)), Prompt(text(9))
    doc1, doc2, doc3 = Span(text(40)), Span(text(13)), Span(text(29))
    prompts = [[sys_a, doc1, doc2, question],
               [sys_b, doc2, doc1, question],  # other offsets, other order
               [doc3, doc1, question],  # starts with a span
               [sys_a, question, doc3],  # ends in a span: generated tokens extend it
               [sys_b, question, Span("x")]]  # a short final span: the flow still shows
    outs = llm.generate(prompts, SP, use_tqdm=False)
    assert any(key[3] for key in llm.llm_engine.runner._bufs)  # steps ran with span pieces
    errs = [_check(llm, o) for o in outs]
    print(f"max abs logprob error per prompt vs the float64 reference: {errs}")
    assert max(errs) < 1e-5


@pytest.mark.slow  # CI time: --run-slow
@settings(max_examples=4, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), min_size=1, max_size=5))
def test_random_segment_structures_match_the_reference(llm, segments):
    """Random structures (span or plain segments of 1..40 characters), two requests per batch:
    the structure and the same segments in reverse order."""
    rng = np.random.default_rng(sum(n for _, n in segments))
    parts = [(Span if span else Prompt)(bytes(rng.integers(97, 123, n).tolist()).decode())
             for span, n in segments]
    outs = llm.generate([parts, parts[::-1]], SP, use_tqdm=False)
    assert max(_check(llm, o) for o in outs) < 1e-5


def test_non_final_span_longer_than_a_step_is_rejected(llm):
    with pytest.raises(ValueError, match=r"request 0: SSEP span .* must fit one step"):
        llm.generate([[Span("a" * 100), Prompt("question?")]], SP, use_tqdm=False)
