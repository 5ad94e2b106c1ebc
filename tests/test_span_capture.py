"""Which computed spans a hybrid step captures (serving/hybrid/span_capture.py,
Config.span_maps.capture):

- the policy alone: "always" captures everything, "shared" only spans another added request
  holds, "auto" also the rest while the share of recurring span keys (REUSE_PRIOR assumed) is at
  least CAPTURE_MIN_REUSE; declines are counted; a bad name is an error naming the option;
- through the engine (tiny_qwen3_5): a batch where some spans occur in one request only gives
  the same tokens and logprobs under every policy, "shared" declines exactly the singletons and
  still skips every span a second request holds (the queue is the lookahead), and on a fresh
  engine "auto" captures a lone request's spans so the same spans reordered are skipped.
"""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax import LLM, SamplingParams
from minipic_jax.prompts import Prompt, Span
from serving.hybrid import span_capture
from serving.hybrid.span_capture import CapturePolicy

SEED = 38  # every draw below comes from it
SP = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)


def test_the_policies_choose_as_documented():
    always, shared, auto = (CapturePolicy(p) for p in ("always", "shared", "auto"))
    for p in (always, shared, auto):
        p.note([1, 2, 2])  # a request holding spans 1 and 2 (2 twice: counted once)
        p.note([2, 3])
    assert [always.worth(k) for k in (1, 2, 3, 9)] == [True] * 4 and always.declined == 0
    assert [shared.worth(k) for k in (1, 2, 3, 9)] == [False, True, False, False]
    assert shared.declined == 3
    # auto: 1 of 3 keys recurs: (1 + 8) / (3 + 8) = 0.82 >= 0.5, so singletons are captured
    assert auto.reuse() == pytest.approx(9 / 11) and auto.worth(1) and auto.worth(9)
    auto.note(range(100, 120))  # 20 singletons more: (1 + 8) / (23 + 8) < 0.5
    assert auto.reuse() == pytest.approx(9 / 31)
    assert (auto.worth(100), auto.worth(2), auto.declined) == (False, True, 1)
    with pytest.raises(ValueError, match=r"span_map_capture \(Config.span_maps.capture\) must "
                                         r"be one of \('always', 'shared', 'auto'\), got 'some'"):
        CapturePolicy("some")
    with pytest.raises(ValueError, match="span_map_capture"):
        LLM("tiny_qwen3_5", dtype="float32", span_map_capture="never")


def test_the_count_starts_over_past_its_limit(monkeypatch):
    monkeypatch.setattr(span_capture, "HOLDERS_LIMIT", 4)
    p = CapturePolicy("shared")
    p.note([1, 2, 3, 4, 5])
    p.note([1])  # past the limit: counted afresh
    assert (p.holders, p.recurring) == ({1: 1}, 0)


def _engine(policy):
    return LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=64,
               min_token_bucket=64, max_model_len=512, block_size=16, num_kv_blocks=160,
               span_map_capture=policy)


def _text(rng, n):
    return bytes(rng.integers(97, 123, n).tolist()).decode()


def _tokens(outs):
    return [(list(o.outputs[0].token_ids),
             [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in outs]


def test_policies_change_captures_not_outputs():
    """One engine, the batch under "always" then under "shared" (another cache_salt: no key of
    the first run is seen again, so the counts are the second run's own)."""
    rng = np.random.default_rng(SEED)
    system = Prompt(_text(rng, 20))
    docs = [Span(_text(rng, 40)) for _ in range(5)]
    q = [Prompt(_text(rng, 9)) for _ in range(4)]
    # docs 0 and 1 in two requests each, 2 / 3 / 4 in one only
    batch = [[system, docs[0], docs[2], q[0]], [system, docs[3], docs[1], q[1]],
             [system, docs[1], docs[4], q[2]], [system, docs[0], q[3]]]
    llm = _engine("always")
    policy = llm.llm_engine.cache.span_capture
    got, counts = {}, {}
    for name in ("always", "shared"):
        policy.policy = name
        before = llm.llm_engine.cache.stats()
        got[name] = _tokens(llm.generate(batch, SP, use_tqdm=False, cache_salt=name))
        st = llm.llm_engine.cache.stats()
        counts[name] = tuple(st[k] - before[k] for k in (
            "span_maps_captured", "span_maps_declined", "spans_skipped"))
    # "always" captures all five; "shared" declines the three singletons, the shared two still
    # hit (the queue is the lookahead)
    assert counts == {"always": (5, 0, 2), "shared": (2, 3, 2)}, counts
    for (tok_a, lp_a), (tok_b, lp_b) in zip(got["always"], got["shared"]):
        assert tok_a == tok_b
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-5)  # map composed vs computed


def test_auto_captures_a_lone_request_on_a_fresh_engine():
    """Issue 29's request: spans sent once, then the same spans reordered with a new question:
    the second request skips them all under the default policy."""
    rng = np.random.default_rng(SEED + 1)
    system = Prompt(_text(rng, 20))
    docs = [Span(_text(rng, 40)) for _ in range(3)]
    llm = _engine("auto")
    llm.generate([[system, *docs, Prompt(_text(rng, 9))]], SP, use_tqdm=False)
    before = llm.llm_engine.cache.stats()
    llm.generate([[system, docs[2], docs[0], docs[1], Prompt(_text(rng, 9))]], SP,
                 use_tqdm=False)
    st = llm.llm_engine.cache.stats()
    assert before["span_maps_captured"] == 3 and before["span_maps_declined"] == 0, before
    assert st["spans_skipped"] - before["spans_skipped"] == 3, st


def test_cache_spans_captures_every_span_whatever_the_policy():
    """LLM.cache_spans says its spans will be reused: 12 spans no request shares (under "auto"
    alone, (0 + 8) / (12 + 8) < 0.5 would decline them) are all captured, and a request holding
    them skips them."""
    rng = np.random.default_rng(SEED + 2)
    docs = [_text(rng, 40) for _ in range(12)]
    llm = _engine("auto")
    llm.cache_spans(docs)
    st = llm.llm_engine.cache.stats()
    assert st["span_maps_captured"] == 12 and st["span_maps_declined"] == 0, st
    assert not llm.llm_engine.cache.span_capture.forced  # back to the policy after the call
    llm.generate([[Prompt(_text(rng, 20)), *(Span(d) for d in docs[3:6]),
                   Prompt(_text(rng, 9))]], SP, use_tqdm=False)
    assert llm.llm_engine.cache.stats()["spans_skipped"] == 3


def test_a_declined_span_is_captured_by_its_next_holder():
    """Online: a span declined as a singleton (its blocks cached by its first request) is
    captured by the next request that holds it, which computes it beside those ready blocks
    (span_cache's capture condition `_keyed`), so a third request skips it."""
    rng = np.random.default_rng(SEED + 3)
    system, doc = Prompt(_text(rng, 20)), Span(_text(rng, 40))
    llm = _engine("shared")
    for k in range(3):
        llm.generate([[system, doc, Prompt(_text(rng, 9))]], SP, use_tqdm=False)
        st = llm.llm_engine.cache.stats()
        want = [(0, 1, 0), (1, 1, 0), (1, 1, 1)][k]  # captured, declined, skipped so far
        assert (st["span_maps_captured"], st["span_maps_declined"], st["spans_skipped"]) == \
            want, (k, st)


def test_declined_spans_run_in_variants_the_warmup_readies():
    """A step that computes spans without capturing them runs a step variant the default
    warm-up readies (so declining never compiles while serving): every variant the batch
    dispatches under "shared" is in the warm-up's list."""
    from unittest import mock

    from serving.step import model_runner

    def key(kw):
        return tuple(sorted((k, repr(v)) for k, v in kw.items()))
    rng = np.random.default_rng(SEED + 4)
    system = Prompt(_text(rng, 20))
    docs = [Span(_text(rng, 40)) for _ in range(3)]
    batch = [[system, docs[0], docs[1], Prompt(_text(rng, 9))],
             [system, docs[2], docs[0], Prompt(_text(rng, 9))]]
    llm = _engine("shared")
    runner = llm.llm_engine.runner
    warmed = {key(kw) for _, _, kw in runner.warmup_steps(spans=True)}
    dispatched, dispatch = set(), model_runner.ModelRunner._dispatch

    def counted(self, ints, floats, use_prev, kw):
        dispatched.add(key(kw))
        return dispatch(self, ints, floats, use_prev, kw)
    with mock.patch.object(model_runner.ModelRunner, "_dispatch", counted):
        llm.generate(batch, SP, use_tqdm=False)
    st = llm.llm_engine.cache.stats()
    assert st["span_maps_declined"] == 2 and st["span_maps_captured"] == 1, st
    assert dispatched and dispatched <= warmed, dispatched - warmed
