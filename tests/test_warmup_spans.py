"""LLM()'s default warm-up readies every step variant a span request needs on a hybrid model
(issue 29, "no stalls"): after it, a cold span request, the same spans reordered with a new
question, the same tokens as a plain prompt, and a span longer than a step (captured in pieces,
then reused) compile no step variant while serving. Shapes of
tests/test_engine_hybrid_spans.py (one 64-token bucket, 4 seats), so the compiles are shared.
At 16 seats: the warm-up's span variants do not multiply by the chain-row buckets (counted), and
six requests entering with cached maps in one step compile nothing (slow)."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax import LLM, SamplingParams
from minipic_jax.prompts import Prompt, Span

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


def test_span_requests_compile_nothing_after_the_default_warmup(capsys):
    from collections import Counter
    from unittest import mock

    from minipic_jax import weights_update
    from serving.step import model_runner
    runs, events = Counter(), []  # warm-up runs per variant (its static kwargs), in order
    dispatch, prepare = model_runner.ModelRunner._dispatch, weights_update.prepare

    def counted(self, ints, floats, use_prev, kw):
        key = tuple(sorted((k, repr(v)) for k, v in kw.items()))
        runs[key] += 1
        events.append(key)
        return dispatch(self, ints, floats, use_prev, kw)

    def marked(llm):  # update_weights' write programs: the warm-up's last compiles
        events.append("write programs")
        return prepare(llm)
    with mock.patch.object(model_runner.ModelRunner, "_dispatch", counted), \
            mock.patch.object(weights_update, "prepare", marked):
        llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4,
                  max_num_batched_tokens=64, min_token_bucket=64, max_model_len=512,
                  block_size=16, num_kv_blocks=96, warmup=True)
    # each variant runs when compiled and again after the last program the warm-up makes: on a
    # GPU, XLA drops every program's CUDA graphs whenever it makes a new one and rebuilds them
    # on the next run, which would otherwise fall on a request's step (engine_warmup.py)
    assert runs and min(runs.values()) >= 2, runs
    last = events.index("write programs")
    assert set(events[last + 1:]) == set(runs), "a variant not run after the last compile"
    assert llm.startup["warmup_variants"] >= 2 and llm.startup["warmup_s"] > 0
    assert llm.startup["warmup_write_programs"] >= 2  # update_weights': top leaves, layers
    assert "warm-up" in capsys.readouterr().err  # the progress line on stderr
    steps = llm.llm_engine.runner._step
    rng = np.random.default_rng(29)
    text = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    # 18 spans of a block each: the reordered request enters a chain of 18 cached maps (more
    # than the 16 an engine used to warm)
    system, spans = Prompt(text(30)), [Span(text(12)) for _ in range(18)]
    long_span = Span(text(150))  # longer than a step (60 tokens): captured in pieces
    requests = {"cold": [system, *spans, Prompt(text(20))],
                "reordered": [system, *spans[::-1], Prompt(text(15))],
                "plain": system.content + "".join(s.content for s in spans) + text(20),
                "long": [system, long_span, spans[0], Prompt(text(10))],
                "long reused": [spans[1], long_span, Prompt(text(12))]}
    compiled = {}
    for name, prompt in requests.items():
        before = steps.counts["compiled"]
        llm.generate([prompt], SP, use_tqdm=False)
        compiled[name] = steps.counts["compiled"] - before
    assert compiled == dict.fromkeys(requests, 0)


def test_generate_says_when_a_variant_compiles_outside_warmup(capsys):
    """Without warm-up, the first step compiles its variant: generate's bar says so."""
    from conftest import make_tiny_llm
    llm = make_tiny_llm()  # the suite's engines skip the warm-up (tests/conftest.py)
    llm.generate(["hello there"], SamplingParams(temperature=0.0, max_tokens=2))
    err = capsys.readouterr().err
    assert "Processed prompts (compiling step variant 1" in err
    llm.generate(["hello again"], SamplingParams(temperature=0.0, max_tokens=2))
    assert "compiling" not in capsys.readouterr().err  # nothing new to compile


def test_warmup_readies_one_span_variant_per_token_bucket_and_plan():
    """At 16 seats the span steps' variants no longer multiply by the chain-row buckets: one
    per (token bucket, attention plan), as many as the plain steps, plus one small compose program
    per row bucket (4, 8 and 16 rows), shared by every bucket (serving/hybrid/span_compose.py). Was
    two span variants per bucket and plan (rows 4 and 16), each a whole model compile. Counted
    from the warm-up's list, nothing compiled."""
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=16,
              max_num_batched_tokens=64, min_token_bucket=16, max_model_len=512,
              block_size=16, num_kv_blocks=96, warmup=False)
    runner = llm.llm_engine.runner
    steps = [kw for _, _, kw in runner.warmup_steps(spans=True)]
    plain = [kw for kw in steps if not kw.get("spans") and not kw.get("compose")]
    span = [kw for kw in steps if kw.get("spans")]
    compose = sorted(kw["compose"] for kw in steps if kw.get("compose"))
    assert llm.config.token_buckets == (16, 32, 64) and len(plain) >= 3
    assert len(span) == len(plain), (len(span), len(plain))
    assert compose == [(4, runner.chain_length), (8, runner.chain_length),
                       (16, runner.chain_length)]


@pytest.mark.slow  # CI time (~45 s on CPU: its own 16-seat warm-up): --run-slow
def test_six_span_requests_entering_at_once_at_16_seats_compile_nothing():
    """16 seats: after the warm-up, six requests reordering six cached spans enter together,
    their chains composed by the 16-row program before one step; nothing compiles, and every
    token and logprob is the float64 reference's (tests/test_engine_hybrid_spans._check)."""
    from test_engine_hybrid_spans import _check, _slow_decay
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=16,
              max_num_batched_tokens=64, min_token_bucket=64, max_model_len=512,
              block_size=16, num_kv_blocks=160, warmup=True)
    _slow_decay(llm)  # params are an argument of the step: nothing recompiles
    runner, rng = llm.llm_engine.runner, np.random.default_rng(31)
    text = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    spans = [Span(text(12)) for _ in range(6)]
    before = runner._step.counts["compiled"]
    outs = llm.generate([[*spans, Prompt(text(3))]], SP, use_tqdm=False)
    orders = [rng.permutation(6) for _ in range(6)]
    outs += llm.generate([[*(spans[i] for i in order), Prompt(text(3))] for order in orders],
                         SP, use_tqdm=False)
    assert runner._step.counts["compiled"] == before
    assert any(key[0] == 16 for key in runner.composer._bufs)  # six chains in one step
    assert max(_check(llm, o) for o in outs) < 1e-5
