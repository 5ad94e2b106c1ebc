"""Config.small_seq_bucket (issue 29): a step of few sequences runs with a small S instead of
min(T, seats), so a hybrid step's recurrent-state work follows the sequences it holds. The
bucket's arithmetic and default, then a tiny hybrid engine at 16 seats with a bucket of 4: one
request with spans, then four at once (spans reordered), match the float64 reference token by
token (tests/test_engine_hybrid_spans._check); every step ran with S = 4, and every step's
variant is one the warm-up compiles."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax import LLM, SamplingParams
from minipic_jax.prompts import Prompt, Span
from serving.config import HYBRID_SMALL_SEQ_BUCKET, Config, effective_config

SP = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)


def test_seq_buckets_pick_the_smallest_that_holds_the_sequences():
    cfg = Config(max_num_seqs=64, max_num_batched_tokens=1024, min_token_bucket=8,
                 small_seq_bucket=8)
    assert cfg.seq_buckets(8) == (8,) and cfg.seq_buckets(128) == (8, 64)
    assert cfg.seq_buckets(32) == (8, 32)
    assert [cfg.seq_bucket(128, n) for n in (1, 8, 9, 64)] == [8, 8, 64, 64]
    assert cfg.seq_bucket(128) == 64  # no count: the largest
    off = Config(max_num_seqs=64, max_num_batched_tokens=1024, small_seq_bucket=0)
    assert off.seq_buckets(128) == (64,) and off.seq_bucket(128, 1) == 64
    with pytest.raises(ValueError, match="small_seq_bucket must be None or >= 0, got -1"):
        Config(small_seq_bucket=-1)


def test_the_default_is_on_for_hybrid_models_on_an_accelerator(monkeypatch):
    import jax
    cfg = Config()
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert effective_config(cfg, hybrid=True).small_seq_bucket == 0
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert effective_config(cfg, hybrid=True).small_seq_bucket == HYBRID_SMALL_SEQ_BUCKET
    assert effective_config(cfg, hybrid=False).small_seq_bucket == 0
    assert effective_config(Config(small_seq_bucket=2), hybrid=True).small_seq_bucket == 2
    assert cfg.small_seq_bucket is None  # the caller's Config is never changed


def test_a_small_step_runs_with_the_small_bucket_and_matches_the_reference():
    from test_engine_hybrid_spans import _check, _slow_decay
    # one token bucket (T = 64 > 16 seats: S would be 16 without the small bucket); each further
    # bucket compiled its own variants (CI time)
    llm = _slow_decay(LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=16,
                          max_num_batched_tokens=64, min_token_bucket=64, max_model_len=512,
                          block_size=16, num_kv_blocks=160, small_seq_bucket=4))
    runner, seen = llm.llm_engine.runner, []
    dispatch = runner._dispatch

    def record(ints, floats, use_prev, kw):
        if "compose" not in kw:
            seen.append(dict(kw))
        return dispatch(ints, floats, use_prev, kw)

    runner._dispatch = record
    rng = np.random.default_rng(24)
    text = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    spans = [Span(text(12)) for _ in range(4)]
    outs = llm.generate([[Prompt(text(20)), *spans, Prompt(text(9))]], SP, use_tqdm=False)
    outs += llm.generate([[Prompt(text(5 + i)), *spans[::-1], Prompt(text(7))] for i in range(4)],
                         SP, use_tqdm=False)  # four at once, the spans reordered
    assert max(_check(llm, o) for o in outs) < 1e-5
    assert {kw["s"] for kw in seen} == {4} and any(kw.get("spans") for kw in seen)
    key = lambda kw: tuple(sorted((k, v) for k, v in kw.items()))  # noqa: E731
    warmed = {key(kw) for _, _, kw in runner.warmup_steps(spans=True)}
    assert all(key(kw) in warmed for kw in seen), [kw for kw in seen if key(kw) not in warmed]


def test_warmup_readies_small_decode_variants_only_where_a_decode_can_take_them():
    """n decodes run at T = token_bucket(n), so a decode-only variant with the small S exists
    only at the token buckets a decode of <= that many sequences reaches: with min_token_bucket
    16 and a bucket of 4 at 64 seats, T = 16 only (S = 4 at T = 32 or 64 would never run).
    Counted from the warm-up list with the separate decode variant on (as on a GPU)."""
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=64,
              max_num_batched_tokens=64, min_token_bucket=16, max_model_len=512,
              block_size=16, num_kv_blocks=160, small_seq_bucket=4, warmup=False)
    runner = llm.llm_engine.runner
    runner.separate_decode = True
    decode = sorted((kw["t"], kw["s"]) for _, _, kw in runner.warmup_steps() if kw["decode_only"])
    assert decode == [(16, 4), (16, 16), (32, 32), (64, 64)]
    prefill = {(kw["t"], kw["s"]) for _, _, kw in runner.warmup_steps() if not kw["decode_only"]}
    assert prefill == {(16, 4), (16, 16), (32, 4), (32, 32), (64, 4), (64, 64)}
