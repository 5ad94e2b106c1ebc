"""Engine vs an independent dense Block-Attention reference (tests/dense_reference.py).

Greedy tokens and logprobs, for random segment structures (hypothesis), cold and warm, the same
span at different offsets, several requests sharing spans in one step, a pool so small that
eviction, host offload and preemption all happen, and all three scheduling policies.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dense_reference import check_against_reference
from conftest import make_tiny_llm
from minipic_jax import Prompt, SamplingParams, Span, build_prompt

B = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1)


def make_llm(**kw):
    # one token bucket unless a test names one (CI time: a compiled step per bucket and mode)
    return make_tiny_llm(**{"num_kv_blocks": 96, "min_token_bucket": 64, **kw})


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def check(llm, prompts, outs, markers=True):
    eng = llm.llm_engine
    m = eng.markers
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        check_against_reference(eng.loaded.params, eng.loaded.cfg, p, c.token_ids, c.logprobs,
                                block_size=llm.config.block_size, pad=m["pad_token_id"],
                                ssep=m["ssep_token_id"], pdep=m["pdep_token_id"], markers=markers)


def ids(llm, segs):
    return build_prompt(segs, block_size=llm.config.block_size, **llm.llm_engine.markers)


def rand_tokens(rng, lo=1, hi=40):
    return [int(t) for t in rng.integers(0, 256, int(rng.integers(lo, hi)))]


segment_lists = st.lists(st.tuples(st.sampled_from("PS"), st.integers(0, 5), st.integers(1, 40)),
                         min_size=1, max_size=4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(structure=segment_lists, salt=st.integers(0, 2**31 - 1))
def test_random_structures_cold_and_warm(llm, structure, salt):
    """Random segment structures from a small pool of shared spans; warm run reuses them."""
    rng = np.random.default_rng(salt)
    docs = [[int(t) for t in np.random.default_rng(d).integers(0, 256, 5 + 7 * d)] for d in range(6)]
    prompts = []
    for r in range(3):
        segs = []
        for kind, doc, n in structure:
            if kind == "S":
                segs.append(Span(docs[(doc + r) % 6]))  # same spans, other orders/offsets
            else:
                segs.append(Prompt(rand_tokens(rng, 1, n + 1)))
        segs.append(Prompt(rand_tokens(rng, 1, 10)))
        prompts.append(ids(llm, segs))
    cold = llm.generate(prompts, GREEDY, use_tqdm=False)
    check(llm, prompts, cold)
    warm = llm.generate(prompts, GREEDY, use_tqdm=False)
    check(llm, prompts, warm)
    for c, w in zip(cold, warm):
        assert c.outputs[0].token_ids == w.outputs[0].token_ids
        assert w.num_cached_tokens >= c.num_cached_tokens


def test_same_span_at_different_offsets_shared_in_one_step(llm, fresh_rng):
    doc = rand_tokens(fresh_rng, 30, 40)
    prompts = [ids(llm, [Prompt(rand_tokens(fresh_rng, k, k + 1)), Span(doc),
                         Prompt(rand_tokens(fresh_rng, 3, 8))]) for k in (1, 17, 40, 70)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)  # 4 requests, one step, one span
    check(llm, prompts, outs)


def test_padding_amount_and_batch_composition_do_not_change_output(llm, fresh_rng):
    m = llm.llm_engine.markers
    sys_, doc, q = (rand_tokens(fresh_rng, 5, 12), rand_tokens(fresh_rng, 20, 30),
                    rand_tokens(fresh_rng, 3, 6))
    base = ids(llm, [Prompt(sys_), Span(doc), Prompt(q)])
    # the same prompt with an extra block of pads after the system prompt
    cut = (len(sys_) + B - 1) // B * B
    padded = base[:cut] + [m["pad_token_id"]] * B + base[cut:]
    alone = llm.generate([base], GREEDY, use_tqdm=False)[0]
    more_pad = llm.generate([padded], GREEDY, use_tqdm=False)[0]
    others = [ids(llm, [Prompt(rand_tokens(fresh_rng, 20, 60))]) for _ in range(3)]
    mixed = llm.generate(others + [base], GREEDY, use_tqdm=False)[-1]
    for o in (more_pad, mixed):
        assert o.outputs[0].token_ids == alone.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, alone.outputs[0].logprobs):
            tok = next(iter(a))
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
    check(llm, [base, padded], [alone, more_pad])


@pytest.mark.parametrize("policy", [  # isps is the default; barrier in the slow tier (CI time)
    pytest.param("barrier", marks=pytest.mark.slow), "isps"])
def test_tiny_pool_evicts_offloads_preempts(policy, fresh_rng):
    # barrier: one-row step buckets (the CPU default), where a step's entries can outnumber its
    # tokens (the runner's S covers every entry)
    llm = make_llm(num_kv_blocks=14, max_num_seqs=3, max_num_batched_tokens=32,
                   cpu_offload_gb=0.01, scheduling_policy=policy,
                   min_token_bucket=1 if policy == "barrier" else 32)
    docs = [rand_tokens(fresh_rng, 20, 30) for _ in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, logprobs=1, ignore_eos=True)
    prompts = []
    for r in range(7):
        segs = [Prompt(rand_tokens(fresh_rng, 2, 10)), Span(docs[r % 3]), Span(docs[(r + 1) % 3]),
                Prompt(rand_tokens(fresh_rng, 2, 8))]
        prompts.append(ids(llm, segs))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    check(llm, prompts, outs)
    stats = llm.llm_engine.get_stats()
    assert stats["preemptions"] > 0, stats
    assert stats["blocks_evicted"] > 0 and stats["blocks_offloaded"] > 0, stats
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    # unrelated traffic pushes every cached block out of the device pool ...
    llm.generate([rand_tokens(fresh_rng, 150, 200) for _ in range(3)], GREEDY, use_tqdm=False)
    # ... so the docs now come back from the host tier
    again = llm.generate(prompts[:3], sp, use_tqdm=False)
    assert llm.llm_engine.get_stats()["blocks_restored"] > 0
    for a, o in zip(again, outs):
        assert a.outputs[0].token_ids == o.outputs[0].token_ids
        assert a.num_cached_tokens > 0
    check(llm, prompts[:3], again)


@pytest.mark.parametrize("mode", ["rotated", "pic_off"])
def test_other_kv_modes_match_reference(mode, fresh_rng):
    llm = make_llm(kv_mode=mode)
    shared = rand_tokens(fresh_rng, 33, 40)
    prompts = [shared + rand_tokens(fresh_rng, 2, 9) for _ in range(3)]
    if mode == "pic_off":  # markers and pads are plain text here
        m = llm.llm_engine.markers
        prompts.append(ids(llm, [Prompt(shared), Span(rand_tokens(fresh_rng, 5, 9))]))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check(llm, prompts, outs, markers=False)
    warm = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 32  # two full shared blocks
    assert warm.outputs[0].token_ids == outs[0].outputs[0].token_ids
