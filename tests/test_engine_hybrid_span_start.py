"""Issue 29 on the engine: a span prompt's first span start is a checkpoint (off the GDN chunk
grid: the cold chunk stops there, serving/hybrid/checkpoint_plan.py first_span_start), so the same
system prompt and spans in another order with a new question resume there and compute the question
in one step; tokens and logprobs equal the float64 hybrid span reference. The engine and helpers
are tests/test_engine_hybrid_spans.py's (its module's compiled shapes)."""

from __future__ import annotations

import numpy as np

from minipic_jax.prompts import Prompt
from tests.test_engine_hybrid_spans import SP, _docs, _fresh, _run, _span_stats
from tests.test_engine_hybrid_spans import llm  # noqa: F401 - the module's engine fixture


def test_a_reordered_request_resumes_at_the_first_span_start_in_one_step(llm):
    """Issue 29: a cold span prompt checkpoints the state at its first span's start (a 70-token
    system prompt: position 70, off the 64-token GDN chunk grid; its chunk stops there), so the
    same system prompt and spans reordered with a new question resume there, skip every span and
    compute the question in the one prefill step before the decodes; tokens and logprobs equal
    the float64 reference."""
    eng = _fresh(llm, span_map_gb=None, span_map_host_gb=0.0)
    rng = np.random.default_rng(5)
    text = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    system, q1, q2 = Prompt(text(69)), Prompt(text(9)), Prompt(text(7))  # + BOS: 70 tokens
    d = _docs(rng, 40, 25, 33)
    err = _run(llm, [[[system, *d, q1]]])
    before = dict(eng.get_stats())
    err = max(err, _run(llm, [[[system, d[2], d[0], d[1], q2]]]))
    st = eng.get_stats()
    print(f"max abs logprob error vs the float64 reference: {err:.2e}; {_span_stats(eng)}")
    assert err < 1e-5
    assert st["tokens_resumed"] - before["tokens_resumed"] == 80  # 70 tokens + pads to block 5
    assert st["spans_skipped"] - before["spans_skipped"] == 3
    assert st["steps"] - before["steps"] == SP.max_tokens  # 1 prefill (the question) + 3 decodes



def test_the_cold_chunk_runs_on_past_the_first_span_start(llm, monkeypatch):
    """The first span start's checkpoint no longer ends its chunk: the step holds it as a break
    in the GDN packing (model_contract.CHECKPOINT_BREAKS; exact, tests/test_gated_delta_breaks.py)
    and computes the spans' rows after it. With no breaks (the stop as before) the cold request
    takes a step more; both runs equal the float64 reference, and the reordered request resumes
    at the first span start either way."""
    from serving.hybrid import hybrid_prefix
    steps = {}
    for breaks in (0, 2):
        monkeypatch.setattr(hybrid_prefix, "CHECKPOINT_BREAKS", breaks)
        eng = _fresh(llm, span_map_gb=None, span_map_host_gb=0.0)
        rng = np.random.default_rng(5)
        text = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
        system, q1, q2 = Prompt(text(69)), Prompt(text(9)), Prompt(text(7))
        d = _docs(rng, 40, 25, 33)
        before = dict(eng.get_stats())
        err = _run(llm, [[[system, *d, q1]]])
        steps[breaks] = eng.get_stats()["steps"] - before["steps"]
        mid = dict(eng.get_stats())
        err = max(err, _run(llm, [[[system, d[2], d[0], d[1], q2]]]))
        assert err < 1e-5, (breaks, err)
        assert eng.get_stats()["tokens_resumed"] - mid["tokens_resumed"] == 80, breaks
    print(f"engine steps of the cold request: {steps[0]} without breaks, {steps[2]} with")
    assert steps[2] < steps[0], steps
