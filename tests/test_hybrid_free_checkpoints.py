"""Config.hybrid_cache.free_room (serving/hybrid/hybrid_prefix.py, `_free_position`): while the
checkpoint store has free slots, a prefill chunk that holds no planned checkpoint takes one at the
deepest candidate it passes, so a cold start leaves no hit on the table (issue 29, item 4). Off by
default (see its comment in serving/config_groups.py); the tests turn it on."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax import LLM, SamplingParams
from serving.hybrid.checkpoint_plan import CheckpointPlanner

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# the shapes of tests/test_engine_hybrid_spans.py's engine (the default pool: 64 checkpoint slots)
KW = dict(dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=64,
          min_token_bucket=64, max_model_len=512, block_size=16, num_kv_blocks=96)
SHARES = [300, 137, 213, 90, 470, 400]  # the cold start, and deeper ones


def _prompts():
    rng = np.random.default_rng(29)
    first = rng.integers(0, 256, 480).tolist()
    return [first] + [first[:d] + rng.integers(0, 256, 12).tolist() for d in SHARES]


@pytest.mark.parametrize("free_room", [True, False])
def test_cold_start_with_free_slots_resumes_at_half_the_shared_depth(free_room):
    """Each later request shares SHARES[i] tokens with the first: with free room each resumes
    at >= half of it (before: the one sharing 90 resumed at 0), outputs equal an engine without
    prefix caching; free_room=False keeps the DP's placement alone (the 90-token one misses)."""
    llm = LLM("tiny_qwen3_5", checkpoint_free_room=free_room, **KW)
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
    want = LLM("tiny_qwen3_5", enable_prefix_caching=False, **KW).generate(
        prompts, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_free_values_rank_off_plan_candidates_by_what_they_save():
    """A candidate c off the plan is worth (mass of depths in [c, next planned)) x (c - previous
    planned); planned positions get no free value."""
    pmf = np.zeros(257)
    pmf[[70, 130, 200]] = [0.5, 0.25, 0.25]
    got = CheckpointPlanner.free_values(pmf, [128], np.array([64, 128, 192, 256]))
    assert got == {64: 0.5 * 64, 192: 0.25 * 64, 256: 0.0}
