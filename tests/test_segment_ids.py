"""Segment ids converted once per list object (minipic_jax/segment_ids.py): the same list given
again reuses its conversion, a changed one is converted again, and a structured prompt's int64
array is the prompt's ids exactly."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax.prompts import Prompt, Span, build_prompt, build_prompt_ids
from minipic_jax.segment_ids import MIN_MEMO_IDS, SegmentMemo

MARKERS = dict(block_size=4, pad_token_id=0, ssep_token_id=1, pdep_token_id=2)


def test_the_same_list_is_converted_once_and_a_changed_one_again():
    memo = SegmentMemo()
    ids = list(range(1000, 1000 + MIN_MEMO_IDS))
    first, arr = memo.convert(ids, "Span")
    assert memo.hits == 0 and first == ids and arr.tolist() == ids
    again, arr2 = memo.convert(ids, "Span")
    assert memo.hits == 1 and again == ids and arr2 is arr
    ids[7] = 5  # changed in place: converted again
    changed, arr3 = memo.convert(ids, "Span")
    assert memo.hits == 1 and changed[7] == 5 and arr3[7] == 5
    memo.convert([t for t in ids], "Span")  # an equal list of the same ints: reused
    assert memo.hits == 2
    ids[9] = True  # a bool put in after the first call is no more an id than before
    with pytest.raises(TypeError, match=r"Span token ids must be ints; index 9 is True"):
        memo.convert(ids, "Span")


def test_numpy_arrays_and_tuples_are_remembered_and_arrays_compared_by_value():
    memo = SegmentMemo()
    a = np.arange(MIN_MEMO_IDS, dtype=np.int32)
    t = tuple(range(MIN_MEMO_IDS))
    for x in (a, t, a, t):
        got, arr = memo.convert(x, "Span")
        assert got == list(range(MIN_MEMO_IDS)) and arr.dtype == np.int64
    assert memo.hits == 2
    a[3] = 77
    got, _ = memo.convert(a, "Span")
    assert memo.hits == 2 and got[3] == 77


def test_a_new_equal_list_of_the_same_ints_is_not_converted_again(monkeypatch):
    """A span list rebuilt per request (`Span(list(doc))`, the RAG benchmark's way) reuses the
    conversion of an equal list (issue 28: ~100 us per 4K ids and page faults each request);
    an equal one holding a bool, a float or numpy ints is converted (refused or made ints)."""
    from minipic_jax import segment_ids
    calls = []
    real = segment_ids.convert
    monkeypatch.setattr(segment_ids, "convert", lambda c, w: calls.append(1) or real(c, w))
    memo = SegmentMemo()
    doc = tuple(range(1000, 1000 + MIN_MEMO_IDS)) + (1, 0)
    first, arr = memo.convert(list(doc), "Span")
    for fresh in (list(doc), list(doc)):
        got, arr2 = memo.convert(fresh, "Span")
        assert got == list(doc) and arr2 is arr
    assert len(calls) == 1 and memo.hits == 2
    assert memo.convert(doc, "Span")[0] == list(doc) and len(calls) == 2  # a tuple: its own
    assert memo.convert(tuple(doc), "Span")[1] is not None and len(calls) == 2
    for k, bad in ((MIN_MEMO_IDS, True), (MIN_MEMO_IDS + 1, False), (3, 1003.0)):
        odd = list(doc)
        odd[k] = bad
        with pytest.raises(TypeError, match=rf"index {k} is {bad!r}"):
            memo.convert(odd, "Span")
    numpy_ints = [np.int64(t) for t in doc]
    got, _ = memo.convert(numpy_ints, "Span")
    assert {type(t) for t in got} == {int} and got == list(doc)
    other = list(doc)
    other[5] = 7  # the same length and sampled ids, another id: converted, not taken
    assert memo.convert(other, "Span")[0][5] == 7
    assert memo.convert(list(doc), "Span")[0][5] == 1005  # the last converted equal one


def test_an_equal_new_list_of_small_ids_is_taken_without_numpy_error_state(monkeypatch):
    """The type check of an equal new list (a sum) needs numpy's overflow state only where numpy
    ints among the ids could wrap: token ids never can (entering the state cost ~2 us a segment,
    8 spans a cached request); ids near int64's limit still sum under it, warning nothing."""
    import warnings

    from minipic_jax import segment_ids
    entered = []
    real = np.errstate

    def spy(**kw):
        entered.append(kw)
        return real(**kw)
    monkeypatch.setattr(segment_ids.np, "errstate", spy)
    memo = SegmentMemo()
    doc = list(range(1000, 1000 + MIN_MEMO_IDS))
    memo.convert(list(doc), "Span")
    entered.clear()
    memo.convert(list(doc), "Span")
    assert memo.hits == 1 and entered == []
    huge = [2 ** 62 + k for k in range(MIN_MEMO_IDS)]
    memo.convert(list(huge), "Span")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a wrapped numpy sum would warn
        got, _ = memo.convert([np.int64(t) for t in huge], "Span")
    assert got == huge and {type(t) for t in got} == {int} and entered


def test_the_memo_keeps_at_most_max_ids():
    memo = SegmentMemo(max_ids=2 * MIN_MEMO_IDS)
    lists = [list(range(k, k + MIN_MEMO_IDS)) for k in range(3)]
    for ids in lists:
        memo.convert(ids, "Span")
    memo.convert(lists[0], "Span")  # the least recently used went
    assert memo.hits == 0
    memo.convert(lists[2], "Span")
    assert memo.hits == 1


def test_a_structured_prompts_array_is_its_ids_and_huge_ids_give_none():
    rng = np.random.default_rng(0)
    doc = rng.integers(3, 500, 300).tolist()
    segs = [Prompt([7, 8]), Span(doc), Span(np.asarray(doc, np.uint16)), Prompt((9,)),
            Prompt([np.int64(4)]), Span(tuple(doc[:5])), Prompt([6])]
    memo = SegmentMemo()
    for _ in range(2):
        ids, arr = build_prompt_ids(segs, memo=memo, **MARKERS)
        assert ids == build_prompt(segs, **MARKERS)
        assert arr.dtype == np.int64 and arr.tolist() == ids
        assert {type(t) for t in ids} == {int}
    assert memo.hits == 2
    ids, arr = build_prompt_ids([Prompt([3, 2 ** 64])], **MARKERS)
    assert ids == [3, 2 ** 64] and arr is None  # the request checks name the id


def test_generate_reuses_span_lists_and_outputs_what_their_ids_give():
    """LLM.generate with the same Span list objects twice (the second converts nothing) gives
    the outputs of the same prompt as plain ids; a bool put into a span later is refused."""
    from minipic_jax import SamplingParams
    from tests.conftest import make_tiny_llm
    # one 256-token bucket (min_token_bucket): the claim compares this engine with itself,
    # whatever the padded step size; one compile instead of three (CI time)
    llm = make_tiny_llm(max_model_len=1024, num_kv_blocks=160, max_num_batched_tokens=256,
                        min_token_bucket=256)
    rng = np.random.default_rng(3)
    docs = [rng.integers(5, 200, MIN_MEMO_IDS + 9 * k).tolist() for k in range(2)]
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    markers = dict(block_size=16, **llm.llm_engine.markers)
    for order in ((0, 1), (1, 0)):
        segs = [Prompt([7, 8, 9])] + [Span(docs[k]) for k in order] + [Prompt([10, 11])]
        got = llm.generate(segs, sp, use_tqdm=False)[0]
        want = llm.generate([build_prompt(segs, **markers)], sp, use_tqdm=False)[0]
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert llm._segments.hits == 2  # each span list converted once
    docs[1][40] = True
    with pytest.raises(TypeError, match=r"request 0: segment 2: Span token ids must be ints; "
                                        r"index 40 is True \(bool\)"):
        llm.generate([Prompt([7]), Span(docs[0]), Span(docs[1])], sp, use_tqdm=False)


def test_request_checks_keep_the_prompts_own_array_and_copy_a_callers():
    from serving.request_checks import check_token_ids
    _, arr = build_prompt_ids([Prompt([3, 4]), Span([5, 6])], **MARKERS)
    assert not arr.flags.writeable and check_token_ids(arr, "r", 10) is arr
    mine = np.asarray([3, 4, 5], np.int64)
    got = check_token_ids(mine, "r", 10)
    mine[0] = 9  # the caller changes its array after the request is checked
    assert got.tolist() == [3, 4, 5]


@pytest.mark.filterwarnings("error")
def test_numpy_ints_of_any_width_in_a_list_become_python_ints():
    for ids in ([np.int8(100)] * 300, [np.uint64(2 ** 62), 5] * 200, [5, np.int16(7)] * 200):
        got, arr = SegmentMemo().convert(ids, "Span")
        assert {type(t) for t in got} == {int} and got == [int(t) for t in ids]
        assert arr.tolist() == got


def test_a_new_list_of_the_very_ints_remembered_is_taken_with_no_pass_over_its_ids(monkeypatch):
    """A span list rebuilt per request from the ids a caller keeps holds the same int objects
    as the list converted before: taken by comparing the items' pointers (list_items), with no
    equality or type pass over its ids (the sum was ~0.23 ms of issue 28's cached request);
    an equal list of other int objects is still checked and taken, one with a float refused."""
    from minipic_jax import list_items, segment_ids
    if list_items.item_bytes([]) is None:
        pytest.skip("this interpreter's lists are not read by pointer")
    memo = SegmentMemo()
    doc = list(range(1000, 1000 + MIN_MEMO_IDS))
    _, arr = memo.convert(list(doc), "Span")
    passes = []
    real_sum, real_eq = segment_ids._python_ints, segment_ids._unchanged
    monkeypatch.setattr(segment_ids, "_python_ints", lambda *a: passes.append(1) or real_sum(*a))
    monkeypatch.setattr(segment_ids, "_unchanged", lambda *a: passes.append(2) or real_eq(*a))
    got, arr2 = memo.convert(list(doc), "Span")
    assert got == doc and arr2 is arr and memo.hits == 1 and passes == []
    other_objects = [int(str(t)) for t in doc]  # equal values, new int objects
    assert memo.convert(other_objects, "Span")[1] is arr and memo.hits == 2 and passes
    floats = list(doc)
    floats[5] = 1005.0
    with pytest.raises(TypeError, match=r"index 5 is 1005.0 \(float\)"):
        memo.convert(floats, "Span")


def test_a_short_list_of_python_ints_is_converted_by_one_type_pass(monkeypatch):
    """A prompt's question (tens of ids) skips array("q") and its bool and type passes, whose
    fixed costs were ~7 us a segment; what it gives, and what it refuses, is unchanged."""
    from minipic_jax import segment_ids
    made = []
    real = segment_ids.array.array
    monkeypatch.setattr(segment_ids.array, "array", lambda *a: made.append(1) or real(*a))
    ids, arr = segment_ids.convert(list(range(300, 340)), "Prompt")
    assert made == [] and ids == list(range(300, 340)) and arr.tolist() == ids
    assert segment_ids.convert((3, 2 ** 64), "Prompt") == ([3, 2 ** 64], None)
    for bad, k in (([5, True], 1), ([5, 6, 7.0], 2)):
        with pytest.raises(TypeError, match=rf"Prompt token ids must be ints; index {k} is"):
            segment_ids.convert(bad, "Prompt")
