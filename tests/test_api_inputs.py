"""`LLM` inputs and faults of issue 12: numbers the device arrays cannot hold (item 4), two
threads on one LLM (item 9), watermark_blocks against the pool (item 11), array prompts and
cache salts (decisions). Every refusal comes before any work: the engine stays clean.

Oracle: the same requests run alone, serially, on the same engine.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import make_tiny_llm
from minipic_jax import SamplingParams
from test_robustness import GREEDY, assert_clean, tokens


@pytest.fixture(scope="module")
def llm():
    # one token bucket (min_token_bucket = max_num_batched_tokens = 64): no test here is about
    # bucket sizes, and each bucket compiled its own step variants (CI time)
    return make_tiny_llm(min_token_bucket=64)


@pytest.mark.parametrize("field,value", [("top_k", 2**31), ("top_k", 2**70),
                                         ("temperature", 1e39), ("temperature", 1e-40)])
def test_sampling_numbers_outside_the_device_range_are_refused(llm, fresh_rng, field, value):
    """Item 4: top_k above 2**31-1 passed validation and raised OverflowError mid-step, taking
    the call's other requests with it."""
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})
    sp = SamplingParams(temperature=1.0, max_tokens=3, seed=1)
    setattr(sp, field, value)  # changed after construction: generate checks again
    with pytest.raises(ValueError, match=f"request 1: SamplingParams.{field}"):
        llm.generate([tokens(fresh_rng, 20), tokens(fresh_rng, 20)], [GREEDY, sp],
                     use_tqdm=False)
    assert_clean(llm)


def test_largest_int32_top_k_runs(llm, fresh_rng):
    prompt = tokens(fresh_rng, 20)
    sp = dict(temperature=1.0, max_tokens=3, seed=5, ignore_eos=True)
    off = llm.generate([prompt], SamplingParams(**sp), use_tqdm=False)[0]
    top = llm.generate([prompt], SamplingParams(top_k=2**31 - 1, **sp), use_tqdm=False)[0]
    assert top.outputs[0].token_ids == off.outputs[0].token_ids  # above the vocabulary: off


def test_two_threads_calling_generate_get_their_serial_results(llm, fresh_rng, monkeypatch):
    """Item 9: two threads calling generate() on one LLM: "Array has been deleted" in one, a
    different logprob in the other. Calls are serialized by a lock. The first thread's step
    waits (up to 0.5 s) for the second to step too, which, unserialized, it always does."""
    prompts = [[tokens(fresh_rng, 30), tokens(fresh_rng, 45)], [tokens(fresh_rng, 25)]]
    sps = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=3, logprobs=2)]
    want = [llm.generate(p, sp, use_tqdm=False) for p, sp in zip(prompts, sps)]
    eng = llm.llm_engine
    # the threaded calls compute what the serial ones did (no hit on the blocks those cached,
    # which would change the prefill's float order), so their results must be bit-equal
    eng.reset_prefix_cache()
    real_step, stepping = eng.step, threading.Event()

    def step():
        if stepping.is_set():
            return real_step()
        stepping.set()
        threading.Event().wait(0.5)  # room for the other thread to step concurrently
        return real_step()
    monkeypatch.setattr(eng, "step", step)
    got, errors = [None, None], []

    def call(k):
        try:
            got[k] = llm.generate(prompts[k], sps[k], use_tqdm=False)
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)
    threads = [threading.Thread(target=call, args=(k,)) for k in (0, 1)]
    threads[0].start()
    stepping.wait(5)
    threads[1].start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for k in (0, 1):
        assert [o.outputs[0].token_ids for o in got[k]] == \
            [o.outputs[0].token_ids for o in want[k]]
        assert [o.outputs[0].cumulative_logprob for o in got[k]] == \
            [o.outputs[0].cumulative_logprob for o in want[k]]
    assert_clean(llm)


def test_watermark_must_leave_room_in_the_pool(llm, fresh_rng, monkeypatch):
    """Item 11: watermark_blocks >= the pool was accepted; generate() then raised "engine made
    no progress". Checked where the pool size is known (Config with num_kv_blocks, the engine
    with a default pool), and per request: a prompt needs room above the watermark."""
    from serving.config import Config, check_watermark
    with pytest.raises(ValueError, match=r"watermark_blocks=128 must be less than the KV pool "
                                         r"size \(128 blocks\)"):
        Config(num_kv_blocks=128, watermark_blocks=128)
    with pytest.raises(ValueError, match="watermark_blocks must be >= 0"):
        Config(watermark_blocks=-1)
    with pytest.raises(ValueError, match=r"watermark_blocks=40 .* \(30 blocks\)"):
        check_watermark(Config(watermark_blocks=40), 30)
    monkeypatch.setattr(llm.llm_engine.config, "watermark_blocks", 125)
    with pytest.raises(ValueError, match="request 0: its prompt needs 4 KV blocks to start, but "
                                         "admission keeps watermark_blocks=125 of the pool's 128"):
        llm.generate([tokens(fresh_rng, 60)], GREEDY, use_tqdm=False)
    assert_clean(llm)
    assert llm.generate([tokens(fresh_rng, 40)], GREEDY, use_tqdm=False)[0].finished  # 3 fit


def test_integer_arrays_are_token_id_prompts(llm, fresh_rng):
    """Decision: a 1-D integer numpy or JAX array is a prompt of token ids (what a JAX
    pipeline holds); other shapes and dtypes are a TypeError naming the request."""
    import jax.numpy as jnp
    a, b = tokens(fresh_rng, 30), tokens(fresh_rng, 20)
    want = [o.outputs[0].token_ids for o in llm.generate([a, b], GREEDY, use_tqdm=False)]
    for prompts in ([np.array(a), np.array(b, np.int32)], [jnp.array(a), b],
                    [{"prompt_token_ids": np.array(a)}, np.array(b, np.uint16)]):
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    one = llm.generate(np.array(a), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in one] == want[:1]
    for bad, where in ((np.array([a[:5], b[:5]]), "prompts"),
                       ([b, np.array(a, np.float32)], "request 1")):
        with pytest.raises(TypeError, match=f"{where}: an array prompt must be 1-D with an "
                                            f"integer dtype"):
            llm.generate(bad, GREEDY, use_tqdm=False)
    assert_clean(llm)


def test_cache_salt_decisions(llm, fresh_rng):
    """Decisions: "" is None's tenant; salts are not Unicode-normalized; a lone surrogate is
    refused before any work (it has no UTF-8 bytes to hash: it failed mid-step)."""
    prompt = tokens(fresh_rng, 40)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, cache_salt="", use_tqdm=False)[0].num_cached_tokens == 32
    llm.generate([prompt], GREEDY, cache_salt="caf\u00e9", use_tqdm=False)
    other = llm.generate([prompt], GREEDY, cache_salt="cafe\u0301", use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    with pytest.raises(ValueError, match="request 0: cache_salt holds a lone surrogate at index 3"):
        llm.generate([prompt], GREEDY, cache_salt="abc\ud800", use_tqdm=False)
    assert_clean(llm)
