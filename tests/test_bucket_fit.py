"""serving/hybrid/bucket_fit.py: a prefill chunk that overflows a token bucket by a little stops at it."""

import types

import pytest

from serving.hybrid.bucket_fit import BucketFit, fit_stop

BUCKETS = (512, 1024, 2048)


@pytest.mark.parametrize("start,total,used,budget,want", [
    (0, 1150, 3, 2045, 1021),  # 1,153 tokens would run as 2,048: stop at 1,024 (3 decodes in)
    (100, 1250, 3, 2045, 1121),  # the cut is relative to the chunk's start
    (0, 1600, 3, 2045, None),  # overflow 579 > spill 508: the next step would not stay at 512
    (0, 1529, 0, 2048, 1024),  # overflow exactly the spill
    (0, 400, 3, 2045, None),  # fits the smallest bucket
    (0, 5000, 3, 2045, None),  # the step is full anyway (budget-bound)
    (0, 300, 1000, 1048, 24),  # most of the step is taken: a 24-token piece, 276 ride on
    (0, 300, 1100, 948, None),  # the step already holds more than the smaller bucket
    (0, 0, 3, 2045, None),  # nothing to compute
])
def test_fit_stop(start, total, used, budget, want):
    assert fit_stop(start, total, used, budget, BUCKETS, spill=508) == want


def test_from_config_is_off_without_room_or_when_disabled():
    on = types.SimpleNamespace(bucket_fit=True)  # Config.hybrid_cache
    cfg = types.SimpleNamespace(token_buckets=BUCKETS, num_seats=4, max_num_batched_tokens=2048,
                                hybrid_cache=on)
    fit = BucketFit.from_config(cfg)
    assert fit.spill == 508 and fit.stop(0, 1150, 2045) == 1021
    off = types.SimpleNamespace(bucket_fit=False)
    assert BucketFit.from_config(types.SimpleNamespace(**{**vars(cfg), "hybrid_cache": off})) \
        is None
    assert BucketFit.from_config(types.SimpleNamespace(**{**vars(cfg), "num_seats": 512})) is None
