"""Config.hybrid_cache.free_room (serving/hybrid/hybrid_prefix.py, `_free_position` and the
free-room cuts `ck_cuts`): while the checkpoint store has free slots, a prefill chunk that holds no
planned checkpoint takes one at the deepest candidate it passes, and a prefill stops at the
halving cover (serving/hybrid/checkpoint_plan.py, `halving_cover`: 64, 128, 256... from where it
resumed), so a cold start leaves no hit on the table at any chunk size (issue 29, item 4)."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax import LLM, SamplingParams
from serving.hybrid.checkpoint_plan import CheckpointPlanner, halving_cover

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# the shapes of tests/test_engine_hybrid_spans.py's engine (the default pool: 64 checkpoint slots)
KW = dict(dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=64,
          min_token_bucket=64, max_model_len=512, block_size=16, num_kv_blocks=96)
SHARES = [300, 137, 213, 90, 470, 400]  # the cold start, and deeper ones


def _prompts():
    rng = np.random.default_rng(29)
    first = rng.integers(0, 256, 480).tolist()
    return [first] + [first[:d] + rng.integers(0, 256, 12).tolist() for d in SHARES]


@pytest.mark.parametrize("free_room,chunk", [(True, 64), (False, 64), (True, None)])
def test_cold_start_with_free_slots_resumes_at_half_the_shared_depth(free_room, chunk):
    """Each later request shares SHARES[i] tokens with the first: with free room each resumes
    at >= half of it (before: the one sharing 90 resumed at 0; at the default chunk size of 1024
    tokens, where the first prompt is one chunk, those sharing 300, 137 and 90 resumed at 0),
    outputs equal an engine without prefix caching; free_room=False keeps the DP's placement
    alone (the 90-token one misses)."""
    kw = dict(KW) if chunk else {k: v for k, v in KW.items() if k != "max_num_batched_tokens"}
    llm = LLM("tiny_qwen3_5", checkpoint_free_room=free_room, **kw)
    prompts = _prompts()
    got = [llm.generate([p], SP, use_tqdm=False)[0] for p in prompts]
    depths = [o.num_cached_tokens for o in got[1:]]
    stats = llm.llm_engine.hybrid_cache.stats()
    assert stats["tokens_resumed"] == sum(depths)
    assert stats["checkpoints_stored"] < stats["checkpoint_device_slots"]  # free room left
    short = [(d, c) for d, c in zip(SHARES, depths) if 2 * c < d]
    if not free_room:
        assert short == [(90, 0)]
        return
    assert not short, f"(shared, resumed) below half: {short}"
    want = LLM("tiny_qwen3_5", enable_prefix_caching=False, **kw).generate(
        prompts, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_free_values_rank_off_plan_candidates_by_what_they_save():
    """A candidate c off the plan is worth (mass of depths in [c, next planned)) x (c - previous
    planned); planned positions get no free value."""
    pmf = np.zeros(257)
    pmf[[70, 130, 200]] = [0.5, 0.25, 0.25]
    got = CheckpointPlanner.free_values(pmf, [128], np.array([64, 128, 192, 256]))
    assert got == {64: 0.5 * 64, 192: 0.25 * 64, 256: 0.0}


def test_halving_cover_leaves_every_depth_a_checkpoint_at_half_of_it():
    """From where a prefill resumes, each next checkpoint is the deepest candidate within twice
    the last one; a planned position within reach stands in for it."""
    cand = np.arange(64, 2001, 64)
    assert halving_cover(cand, 0, [], 480) == [64, 128, 256]
    assert halving_cover(cand, 0, [192], 480) == [64, 128, 384]
    assert halving_cover(cand, 0, [], 2000) == [64, 128, 256, 512, 1024]
    assert halving_cover(cand, 256, [], 312) == []
    for start, planned in [(0, []), (0, [448, 1600]), (320, [700])]:
        got = sorted(set(halving_cover(cand, start, planned, 2000)) | set(planned) | {start})
        for d in range(max(64, start), 2001):
            assert 2 * max(c for c in got if c <= d) >= d, (start, planned, d)


def test_free_room_cuts_stop_when_the_pool_is_full():
    """Five unrelated 480-token prompts, one at a time, with four checkpoint slots: the first
    takes its cuts (64, 128, 256) and its planned checkpoint, which fills the pool; every later
    prompt runs the chunks and takes the checkpoints of the DP's placement alone, as with free
    room off (the budgeted case keeps the DP's placement)."""
    from benchmarks.engine_host import StubStep
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, 480).tolist() for _ in range(5)]
    logs = {}
    for free_room in (False, True):
        llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4, max_model_len=512,
                  num_kv_blocks=200, checkpoint_gb=4 * 16896 / 2**30,
                  checkpoint_free_room=free_room)
        llm.llm_engine.runner._step = StubStep(llm.llm_engine.vocab_size)
        cache, log = llm.llm_engine.hybrid_cache, logs.setdefault(free_room, [])
        annotate = cache.annotate
        cache.annotate = lambda mgr, e: annotate(mgr, e) or log[-1].append(
            (e.seq.num_computed, e.new_computed, e.ck_pos))
        for p in prompts:
            log.append([])
            llm.generate([p], SamplingParams(max_tokens=1), use_tqdm=False)
        assert cache.store.free_slots == []
    plain = [(0, 480, 448)]
    assert logs[False] == [plain] * 5
    assert logs[True] == [[(0, 128, 64), (128, 256, 128), (256, 448, 256), (448, 480, 448)]] + \
        [plain] * 4
