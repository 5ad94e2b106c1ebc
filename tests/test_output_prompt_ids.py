"""A finished request's RequestOutput holds its prompt ids as the sequence's own list, not a copy
(Sequence.hand_over_prompt_ids: a cached span request's 33K-id copy was ~40 us of its host
time, issue 28), with its generated ids apart; the device step is stubbed (no compile)."""

import pytest

from benchmarks.engine_host import StubStep
from minipic_jax import SamplingParams
from tests.conftest import make_tiny_llm


def test_the_output_takes_the_sequences_prompt_list_and_keeps_its_generated_ids():
    engine = make_tiny_llm().llm_engine
    engine.runner._step = StubStep(engine.vocab_size)
    prompt = list(range(5, 45))
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=3,
                                                   ignore_eos=True))
    seq = engine._seqs["a"]
    with pytest.raises(RuntimeError, match="request 'a'.*only once it has finished"):
        seq.hand_over_prompt_ids()
    own = seq.token_ids
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.flush_kv_store()
    (out,) = outs
    assert out.prompt_token_ids is own and out.prompt_token_ids == prompt
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].token_ids is not own
    assert prompt == list(range(5, 45))  # the caller's list: copied by the sequence, untouched
