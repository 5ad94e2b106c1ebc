"""A span that does not fit the rest of a step goes in pieces when at least FILL_PIECE of its rows
do (serving/hybrid/span_rows.py, SpanMapCache.cut), so the step is filled rather than ended
before the span (issue 29's cold span request took 7 prefill steps, a plain prompt 6). A
300-token span after a 40-token system prompt in 320-token steps: a first piece rides with the
system prompt, the next step continues it; tokens and logprobs equal the float64 reference, and
a second request reuses the span (skipped whole) with the same exactness."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax import LLM
from minipic_jax.prompts import Prompt, Span
from tests.test_engine_hybrid_spans import SP, _check, _slow_decay


@pytest.fixture(scope="module")
def llm():
    return _slow_decay(LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=2,
                           max_num_batched_tokens=320, min_token_bucket=320, max_model_len=512,
                           block_size=16, num_kv_blocks=96, warmup=False))


def test_a_span_fills_the_step_in_pieces(llm, monkeypatch):
    from serving.hybrid import span_step
    continued, fill = [], span_step.fill_maps

    def counted(batch, v, starts):
        fill(batch, v, starts)
        continued.append(int((v["cap_cont"] > 0).sum()))
    monkeypatch.setattr(span_step, "fill_maps", counted)
    rng = np.random.default_rng(3)
    text = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    span = Span(text(300))
    eng = llm.llm_engine
    before = eng.get_stats()
    out = llm.generate([[Prompt(text(39)), span, Prompt(text(9))]], SP, use_tqdm=False)[0]
    mid = eng.get_stats()
    err = _check(llm, out)
    assert sum(continued) == 1, continued  # one piece continued: the span was split
    assert mid["steps"] - before["steps"] == 2 + SP.max_tokens - 1, mid["steps"] - before["steps"]
    out2 = llm.generate([[Prompt(text(20)), span, Prompt(text(7))]], SP, use_tqdm=False)[0]
    err = max(err, _check(llm, out2))
    print(f"max abs logprob error vs the float64 reference: {err:.2e}")
    assert err < 1e-5
    assert eng.get_stats()["spans_skipped"] - mid["spans_skipped"] == 1
