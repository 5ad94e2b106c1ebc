"""Segment token ids -> a prompt without a check per token in Python (issue 28: a cached
request's 8 x 4K span ids are converted inside its time to first token), same ids and errors."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax import prompts, segment_ids
from minipic_jax.prompts import Prompt, Span, build_prompt

MARKERS = dict(block_size=4, pad_token_id=0, ssep_token_id=1, pdep_token_id=2)


def test_int_lists_and_int_arrays_take_no_per_token_check(monkeypatch):
    calls = []
    monkeypatch.setattr(prompts, "_is_token", lambda t: calls.append(t) or True)
    monkeypatch.setattr(segment_ids, "is_token", lambda t: calls.append(t) or True)
    ids = list(range(5, 5 + 4096))
    want = build_prompt([Prompt([7, 8]), Span(ids), Span(np.asarray(ids, np.int32)),
                         Prompt((9,))], **MARKERS)
    assert calls == []
    assert want == [7, 8, 0, 0, 1] + ids + [0, 0, 0, 1] + ids + [0, 0, 0, 2, 9]
    assert {type(t) for t in want} == {int}


def test_numpy_ints_in_a_list_become_python_ints():
    out = build_prompt([Span([np.int64(5), 6, np.uint16(7)])], **MARKERS)
    assert out == [1, 5, 6, 7] and {type(t) for t in out} == {int}


@pytest.mark.parametrize("bad,k", [([5, True, 6], 1), ([5, 6, 7.0], 2), (["a"], 0),
                                   ([5, None], 1)])
def test_a_non_int_is_named_with_its_segment_and_index(bad, k):
    with pytest.raises(TypeError, match=rf"segment 1: Span token ids must be ints; index {k} "):
        build_prompt([Prompt([3]), Span(bad)], **MARKERS)


def test_a_float_array_is_refused():
    with pytest.raises(TypeError, match="segment 0: Prompt token ids must be ints; index 0"):
        build_prompt([Prompt(np.asarray([1.0, 2.0]))], **MARKERS)
