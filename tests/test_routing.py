"""Span-aware routing (host only, no ray): span keys against token-tuple identity, routes
against brute-force span placement, random routes balanced."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax import Prompt, Span, build_prompt
from minipic_jax.distributed.routing import route_by_spans, route_random, span_keys

BS = 4
MARKERS = {"pad_token_id": 511, "ssep_token_id": 510, "pdep_token_id": 509}


def _prompts(rng, num_requests: int, pool: int = 6):
    """Random prompts over a pool of spans; returns token ids and each prompt's span tuples."""
    spans = [tuple(rng.integers(0, 500, int(rng.integers(1, 3 * BS))).tolist())
             for _ in range(pool)]
    spans.append(spans[0])  # an equal span under another pool index
    out, truth = [], []
    for _ in range(num_requests):
        picked = rng.choice(len(spans), size=int(rng.integers(1, 4)), replace=False)
        segs = [Prompt(rng.integers(0, 500, 3).tolist()), *[Span(spans[j]) for j in picked],
                Prompt(rng.integers(0, 500, 5).tolist())]
        out.append(build_prompt(segs, block_size=BS, **MARKERS))
        # SSEP marker + tokens, padded to a block boundary: every block of the span is full
        truth.append([(spans[j], -(-(len(spans[j]) + 1) // BS)) for j in picked])
    return out, truth


def test_span_keys_match_span_identity():
    rng = np.random.default_rng(0)
    print("seed 0")
    prompts, truth = _prompts(rng, 30)
    memo: dict = {}
    got = [span_keys(p, block_size=BS, markers=MARKERS, memo=memo) for p in prompts]
    key_of: dict = {}
    for keys, spans in zip(got, truth):
        assert [b for _, b in keys] == [b for _, b in spans]
        for (k, _), (toks, _) in zip(keys, spans):
            assert key_of.setdefault(toks, k) == k  # one key per span text, at any offset
    assert len(set(key_of.values())) == len(key_of)  # different spans, different keys
    # a salted tenant gets other keys (the engine would not hit across salts)
    salted = span_keys(prompts[0], block_size=BS, markers=MARKERS, cache_salt="t1")
    assert not {k for k, _ in salted} & {k for k, _ in got[0]}


def test_span_keys_of_unmarked_prompt_is_empty():
    assert span_keys(list(range(40)), block_size=BS, markers=MARKERS) == []


def _placements(spans, routes):
    return {(k, int(r)) for req, r in zip(spans, routes) for k, _ in req}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_routed_groups_share_one_replica(seed):
    """Groups of requests that share a span (and nothing else) each land on one replica when the
    load cap allows, and the cap holds; brute force over the routes."""
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    groups = rng.integers(1, 5, 12)
    spans = [[(1000 + g, 3)] for g, size in enumerate(groups) for _ in range(size)]
    spans = [spans[i] for i in rng.permutation(len(spans))]
    loads = rng.uniform(1, 2, len(spans))
    routes = route_by_spans(spans, 4, loads=loads, slack=10.0)
    for g in range(len(groups)):
        assert len({int(r) for req, r in zip(spans, routes) if req[0][0] == 1000 + g}) == 1
    tight = route_by_spans(spans, 4, loads=loads, slack=0.1)
    cap = 1.1 * loads.sum() / 4
    per = np.bincount(tight, weights=loads, minlength=4)
    assert (per <= cap + loads.max()).all(), (per, cap)
    assert len(_placements(spans, tight)) <= len(_placements(spans, route_random(len(spans), 4)))
    np.testing.assert_array_equal(tight, route_by_spans(spans, 4, loads=loads, slack=0.1))


def test_routed_places_fewer_span_copies_than_random():
    rng = np.random.default_rng(4)
    print("seed 4")
    prompts, _ = _prompts(rng, 60, pool=10)
    spans = [span_keys(p, block_size=BS, markers=MARKERS) for p in prompts]
    routed = route_by_spans(spans, 4, loads=[len(p) for p in prompts])
    randomly = route_random(len(prompts), 4, seed=4)
    assert len(_placements(spans, routed)) < len(_placements(spans, randomly))


def test_route_random_is_balanced_and_seeded():
    r = route_random(10, 4, seed=7)
    assert sorted(np.bincount(r, minlength=4)) == [2, 2, 3, 3]
    np.testing.assert_array_equal(r, route_random(10, 4, seed=7))


def test_route_errors():
    with pytest.raises(ValueError, match="num_replicas"):
        route_by_spans([[]], 0)
    with pytest.raises(ValueError, match="loads"):
        route_by_spans([[], []], 2, loads=[1.0])
    with pytest.raises(ValueError, match="num_replicas"):
        route_random(3, 0)
