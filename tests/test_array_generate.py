"""LLM.generate_arrays: ragged prompts as arrays in, tokens / logprobs / lengths as device arrays
out, equal to generate(); and the engine's sampled-token logprobs equal the training forward's
(the on-policy check an RL loop relies on)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from minipic_jax import SamplingParams
from minipic_jax.training.rollout_logprobs import rollout_logprobs
from tests.conftest import make_tiny_llm

LENS = np.array([5, 37, 20], np.int32)


@pytest.fixture(scope="module")
def llm():
    # one token bucket (min_token_bucket = max_num_batched_tokens = 64): no test here is about
    # bucket sizes, and each bucket compiled its own step variants (CI time)
    return make_tiny_llm(min_token_bucket=64)


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(LENS), LENS.max()), np.int32)
    for b, n in enumerate(LENS):
        ids[b, :n] = rng.integers(3, 256, n)
    return ids


def test_arrays_equal_generate(llm):
    ids = _prompts()
    sp = SamplingParams(temperature=1.0, max_tokens=7, seed=3, n=2, stop_token_ids=[200])
    got = llm.generate_arrays(ids, LENS, sp)
    assert isinstance(got.tokens, jax.Array) and got.tokens.shape == (6, 7)
    assert got.logprobs.dtype == np.float32 and got.lengths.shape == (6,)
    ref = llm.generate([{"prompt_token_ids": ids[b, :n].tolist()} for b, n in enumerate(LENS)],
                       SamplingParams(temperature=1.0, max_tokens=7, seed=3, n=2, logprobs=0,
                                      stop_token_ids=[200]), use_tqdm=False)
    tokens, logprobs, lengths = map(np.asarray, (got.tokens, got.logprobs, got.lengths))
    for b, out in enumerate(ref):
        for k, comp in enumerate(out.outputs):
            r = 2 * b + k
            n = len(comp.token_ids)
            assert lengths[r] == n and tokens[r, :n].tolist() == comp.token_ids
            assert not tokens[r, n:].any() and not logprobs[r, n:].any()
            want = [d[t].logprob for d, t in zip(comp.logprobs, comp.token_ids)]
            np.testing.assert_allclose(logprobs[r, :n], want, atol=1e-5)


def test_bad_arrays_are_named(llm):
    with pytest.raises(ValueError, match="prompt_ids must be a 2-D integer array"):
        llm.generate_arrays(np.zeros(4, np.int32), [4])
    with pytest.raises(ValueError, match=r"prompt_lens must be an integer array of shape \[3\]"):
        llm.generate_arrays(_prompts(), LENS[:2])
    with pytest.raises(ValueError, match=r"prompt 1: length 0 outside \[1, 37\]"):
        llm.generate_arrays(_prompts(), np.array([5, 0, 3]))
    with pytest.raises(ValueError, match="same n and max_tokens"):
        llm.generate_arrays(_prompts(), LENS, [SamplingParams(n=2), SamplingParams(n=1),
                                              SamplingParams(n=2)])


def test_engine_logprobs_equal_training_forward(llm):
    """Same weights, float32: every sampled token's logprob from the engine equals the training
    forward's within 1e-4 (the off-policy error RL frameworks fight)."""
    ids = _prompts(1)
    got = llm.generate_arrays(ids, LENS, SamplingParams(temperature=1.0, max_tokens=12, seed=5,
                                                        n=3))
    loaded = llm.llm_engine.loaded
    params = loaded.family.unfuse_params(llm.llm_engine.runner.params)
    # under jit, as an RL loss calls it: one compile, not one per eager op (CI time)
    train = jax.jit(rollout_logprobs, static_argnums=(1, 6))(params, loaded.cfg, ids, LENS,
                                                             got.tokens, got.lengths, 3)
    assert int(got.lengths.sum()) > 20
    np.testing.assert_allclose(np.asarray(train), np.asarray(got.logprobs), atol=1e-4, rtol=0)
