"""Bad ids in a structured prompt's segments are named by request, segment and index inside the
segment, before any work (the cached-span path checks whole arrays, issue 28: no per-token
Python, but no less clear an error); the device step is stubbed (no compile)."""

import numpy as np
import pytest

from benchmarks.engine_host import StubStep
from minipic_jax import Prompt, SamplingParams, Span
from tests.conftest import make_tiny_llm

DOC = list(range(10, 10 + 300))  # a span long enough for the segment memo (MIN_MEMO_IDS)


@pytest.fixture(scope="module")
def llm():
    llm = make_tiny_llm(max_model_len=1024, num_kv_blocks=200)
    llm.llm_engine.runner._step = StubStep(llm.llm_engine.vocab_size)
    return llm


def _with(bad, k: int = 7) -> list:
    doc = list(DOC)
    doc[k] = bad
    return doc


@pytest.mark.parametrize("segment,error,match", [
    (Span(_with(10 ** 6)), ValueError, r"Span token id 1000000 at index 7 is outside the vocab"),
    (Span(_with(-3)), ValueError, r"Span token id -3 at index 7 is outside the vocabulary"),
    (Span(_with(2 ** 64)), ValueError, r"Span token id 18446744073709551616 at index 7 is out"),
    (Span(_with(513)), ValueError, r"Span marker id 513 at index 7 is not at a block start"),
    (Span(_with(7.0)), TypeError, r"Span token ids must be ints; index 7 is 7.0 \(float\)"),
    (Span(_with(True)), TypeError, r"Span token ids must be ints; index 7 is True \(bool\)"),
    (Span(_with("7")), TypeError, r"Span token ids must be ints; index 7 is '7' \(str\)"),
    (Span(np.asarray(DOC, np.float32)), TypeError, r"Span token ids must be ints; index 0 is"),
])
def test_a_bad_span_id_names_request_segment_and_index(llm, segment, error, match):
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([[Prompt([5, 6]), Span(DOC), Prompt([9])]], sp, use_tqdm=False)  # remembered
    good = [Prompt([5, 6]), Span(list(DOC)), Prompt([9])]
    with pytest.raises(error, match=r"request 1: segment 2: " + match):
        llm.generate([good, [Prompt([5, 6]), Span(DOC), segment, Prompt([9])]], sp,
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished()  # nothing ran


def test_a_bad_id_in_a_later_prompt_segment_is_named_there(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    with pytest.raises(ValueError, match=r"request 0: segment 3: Prompt token id 600 at index 1 "
                                         r"is outside the vocabulary \[0, 512\)"):
        llm.generate([[Prompt([5]), Span(DOC), Prompt([7]), Prompt([8, 600])]], sp,
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"request 0: token id 600 at index 2 is outside"):
        llm.generate([[5, 6, 600]], sp, use_tqdm=False)  # plain ids: the prompt's index
