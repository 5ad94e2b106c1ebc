"""On-device sampler vs brute force: top-k / top-p masks, greedy, logprobs and ranks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from serving.step.sampler import SamplingMetadata, _top_k_top_p, sample


def brute_mask(row, k, p):
    order = np.argsort(-row, kind="stable")
    keep = np.zeros(row.size, bool)
    kk = row.size if k <= 0 else min(k, row.size)
    probs = np.exp(row[order[:kk]] - row[order[0]])
    probs /= probs.sum()
    mass = 0.0
    for j in range(kk):
        keep[order[j]] = True
        mass += probs[j]
        if mass >= p:
            break
    return keep


def test_top_k_top_p_mask_matches_brute_force(fresh_rng):
    s, v = 16, 50
    logits = fresh_rng.normal(size=(s, v)).astype(np.float32) * 3
    top_k = fresh_rng.integers(0, 12, s).astype(np.int32)
    top_p = fresh_rng.uniform(0.05, 1.0, s).astype(np.float32)
    top_p[:3] = 1.0
    got = np.asarray(_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for i in range(s):
        want = brute_mask(logits[i].astype(np.float64), int(top_k[i]), float(top_p[i]))
        assert (np.isfinite(got[i]) == want).all(), i


def test_sample_greedy_logprobs_and_seeded_draws(fresh_rng):
    s, v = 8, 40
    logits = jnp.asarray(fresh_rng.normal(size=(s, v)).astype(np.float32))
    sm = SamplingMetadata(temperature=jnp.asarray([0.0] * 4 + [1.0] * 4, jnp.float32),
                          top_k=jnp.asarray([0] * 4 + [3] * 4, jnp.int32),
                          top_p=jnp.ones(s, jnp.float32),
                          seed=jnp.arange(s, dtype=jnp.uint32), step=jnp.zeros(s, jnp.int32))
    out = sample(logits, sm, all_greedy=False, use_filter=True, num_logprobs=4)
    ref = np.asarray(logits, np.float64)
    logp = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    tokens = np.asarray(out["tokens"])
    assert (tokens[:4] == ref[:4].argmax(-1)).all()
    for i in range(4, s):  # sampled from the top 3 only
        assert tokens[i] in np.argsort(-ref[i])[:3]
    np.testing.assert_allclose(np.asarray(out["logprob"]), logp[np.arange(s), tokens], atol=1e-5)
    np.testing.assert_allclose(np.asarray(out["top_logprobs"]), -np.sort(-logp, -1)[:, :4],
                               atol=1e-5)
    ranks = 1 + (logp > logp[np.arange(s), tokens][:, None]).sum(-1)
    assert (np.asarray(out["rank"]) == ranks).all()
    again = sample(logits, sm, all_greedy=False, use_filter=True, num_logprobs=0)
    assert (np.asarray(again["tokens"]) == tokens).all()  # same seeds and steps, same draws
    draws = [np.asarray(sample(logits, SamplingMetadata(sm.temperature, sm.top_k * 0 + 40,
                                                        sm.top_p, sm.seed, sm.step + j),
                               all_greedy=False, use_filter=True, num_logprobs=0)["tokens"])[4:]
             for j in range(6)]
    assert len({tuple(d) for d in draws}) > 1  # the step index changes the draw


def test_top_p_one_keeps_every_token():
    """top_p = 1 (and no top-k) keeps the whole vocabulary even when the float32 running sum of
    the sorted probabilities reaches 1.0 before the last, tiny entry."""
    logits = np.full((1, 64), -30.0, np.float32)
    logits[0, 0] = 10.0
    got = np.asarray(_top_k_top_p(jnp.asarray(logits), jnp.zeros(1, jnp.int32),
                                  jnp.ones(1, jnp.float32)))
    assert np.isfinite(got).all()
