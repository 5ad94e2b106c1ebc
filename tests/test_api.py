"""Public API: prompt forms, output order and format, sampling, custom loops, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from minipic_jax import LLM, Prompt, RequestOutput, SamplingParams, Span
from serving.config import Config

B = 16


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny_llama", dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=64,
               max_model_len=128, num_kv_blocks=64)


def test_prompt_forms_and_input_order(llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    text = "hello world"
    outs = llm.generate([text, tok.encode(text), {"prompt_token_ids": tok.encode(text)},
                         {"prompt": text}, "a much longer prompt than the others, to reorder"],
                        sp, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    first = outs[0].outputs[0].token_ids
    assert all(o.outputs[0].token_ids == first for o in outs[:4])
    assert outs[0].prompt == text and outs[0].prompt_token_ids == tok.encode(text)
    assert outs[0].outputs[0].text == tok.decode(first)
    assert outs[4].prompt.startswith("a much longer")
    single = llm.generate(text, sp, use_tqdm=True)
    assert len(single) == 1 and single[0].outputs[0].token_ids == first


def test_logprobs_vllm_format(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=3)
    o = llm.generate([[256, 10, 20, 30]], sp, use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 3
    for tok, d in zip(o.token_ids, o.logprobs):
        assert tok in d and d[tok].rank == 1  # greedy: the sampled token is the most likely
        assert 3 <= len(d) <= 4
        lps = sorted((v.logprob for v in d.values()), reverse=True)
        assert lps[0] == pytest.approx(d[tok].logprob) and all(v <= 0 for v in lps)
    assert o.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(o.token_ids, o.logprobs)))


def test_seeded_sampling_is_reproducible_across_batches(llm):
    sp = SamplingParams(temperature=1.0, top_k=5, max_tokens=6, seed=1234, logprobs=5)
    p = [256, 1, 2, 3, 4]
    alone = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
    others = [[256] + list(range(30, 30 + k)) for k in (3, 17, 40)]
    mixed = llm.generate(others + [p], [SamplingParams(temperature=0.7)] * 3 + [sp],
                         use_tqdm=False)[-1].outputs[0]
    assert alone.token_ids == mixed.token_ids
    for tok, d in zip(alone.token_ids, alone.logprobs):  # top-k: only the 5 most likely
        assert d[tok].rank <= 5
    other_seed = llm.generate([p], SamplingParams(temperature=1.0, max_tokens=6, seed=99),
                              use_tqdm=False)[0].outputs[0]
    unseeded = [llm.generate([p], SamplingParams(temperature=1.0, max_tokens=6), use_tqdm=False)[0]
                .outputs[0].token_ids for _ in range(2)]
    # near-uniform tiny model: different seeds give different samples with near certainty
    assert other_seed.token_ids != alone.token_ids
    assert unseeded[0] != unseeded[1]


def test_stop_tokens_and_max_tokens(llm):
    greedy = llm.generate([[256, 5, 6]], SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)[0].outputs[0]
    assert greedy.finish_reason in ("length", "stop")
    stop = greedy.token_ids[2]
    o = llm.generate([[256, 5, 6]], SamplingParams(temperature=0, max_tokens=6,
                                                   stop_token_ids=[stop]), use_tqdm=False)[0]
    k = greedy.token_ids.index(stop)
    assert o.outputs[0].token_ids == greedy.token_ids[:k + 1]
    assert o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop


def test_custom_loop_add_request_step(llm):
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    eng.add_request("x", [256, 7, 8, 9], sp)
    eng.add_request("y", [256, 9, 8], sp)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            done[out.request_id] = out
    assert set(done) == {"x", "y"}
    assert done["x"].metrics.first_token_time >= done["x"].metrics.arrival_time
    ref = llm.generate([[256, 7, 8, 9]], sp, use_tqdm=False)[0]
    assert done["x"].outputs[0].token_ids == ref.outputs[0].token_ids
    stats = eng.get_stats()
    assert 0 <= stats["prefix_cache_hit_rate"] <= 1 and stats["num_compiles"] >= 1


@pytest.mark.parametrize("prompt,match", [
    ([], "request 1: .*empty prompt"),
    ([256, 5, 515], "request 1: .*token id 515 at index 2 is outside the vocabulary"),
    # the default markers lie beyond the vocabulary (512 pad, 513 ssep, 514 pdep): an SSEP id
    # off a block start means nothing
    ([256, 5, 513], "request 1: .*marker id 513 at index 2 is not at a block start"),
    ([5] * 128, "request 1: .*128 tokens is too long for max_model_len=128"),
    ([512] * 5, "request 1: .*only pad tokens"),
])
def test_bad_prompts_name_the_request(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[256, 1], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    # nothing ran and the engine still serves others
    assert not llm.llm_engine.has_unfinished()
    assert llm.generate([[256, 1]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_generate_beside_a_custom_loop_takes_no_id_and_loses_no_output(llm):
    # a request queued by add_request under the id generate would use next: generate ran it to
    # the end and dropped its output (the loop never saw it), or refused its own "request id
    # already in use"
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=3)
    want = llm.generate([[256, 7, 8, 9], [256, 1, 2]], sp, use_tqdm=False)
    taken = str(llm._next_id)
    eng.add_request(taken, [256, 7, 8, 9], sp)
    out = llm.generate([[256, 1, 2]], sp, use_tqdm=False)[0]
    assert out.request_id != taken and out.outputs[0].token_ids == want[1].outputs[0].token_ids
    got = []
    while eng.has_unfinished():
        got += eng.step()
    assert [o.request_id for o in got] == [taken]
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_bad_input_in_add_request_leaves_other_requests_alone(llm):
    eng = llm.llm_engine
    eng.add_request("ok", [256, 3, 4], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match="'bad'.*outside the vocabulary"):
        eng.add_request("bad", [256, -1], SamplingParams())
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].outputs[0].token_ids) == 3


def test_engine_config_errors():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        Config(block_size=24)
    with pytest.raises(ValueError, match="must differ"):
        Config(pad_token_id=5, ssep_token_id=5)
    # explicit marker ids are vocabulary tokens (the defaults lie beyond: serving/config.py)
    with pytest.raises(ValueError, match="ssep_token_id=512 is outside the vocabulary"):
        LLM("tiny_llama", num_kv_blocks=8, max_model_len=64, ssep_token_id=512)
    with pytest.raises(ValueError, match="no-such-model.*known preset"):
        LLM("no-such-model")


def test_request_that_never_fits_and_markers_in_rotated_mode():
    # one 32-token bucket (min_token_bucket) for the prefill and the decodes of the request
    # that fits: the claim is admission's, whatever the step's padded size (one compile, not two)
    small = LLM("tiny_llama", num_kv_blocks=4, max_model_len=128, max_num_seqs=2,
                min_token_bucket=32)
    with pytest.raises(ValueError, match="request 0: .*needs 6 KV blocks .* only 4"):
        small.generate([[256] * 80], SamplingParams(max_tokens=10), use_tqdm=False)
    assert small.generate([[256] * 20], SamplingParams(max_tokens=4), use_tqdm=False)[0].finished
    rot = LLM("tiny_llama", num_kv_blocks=32, max_model_len=128, kv_mode="rotated")
    with pytest.raises(ValueError, match="request 0: .*marker at token index 16 .*rotated"):
        rot.generate([[Prompt([256, 1, 2]), Span([3, 4])]], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="cache_spans needs kv_mode='position_free'.*rotated"):
        rot.cache_spans([[3, 4]])


def test_cache_spans_without_prefix_caching_is_refused():
    # it would compute the spans and keep none (silently, before): refused before any step
    plain = LLM("tiny_llama", num_kv_blocks=32, max_model_len=128, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="cache_spans needs enable_prefix_caching=True"):
        plain.cache_spans([[3, 4]])
    assert plain.llm_engine.runner.num_compiles == 0  # nothing ran


def test_abort_frees_blocks_and_others_finish(llm):
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=6)
    eng.add_request("keep", [256] + list(range(40, 70)), sp)
    eng.add_request("drop", [256] + list(range(80, 110)), sp)
    eng.step()
    eng.abort_request("drop")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["keep"] and len(outs[0].outputs[0].token_ids) == 6
    assert eng.bm.num_used == 0 and not any(eng.bm.ref)


def test_default_marker_ids_avoid_bos_and_eos():
    """A 260-id vocabulary whose EOS is 257 and BOS 256: markers are the ids 260-262 beyond the
    vocabulary, fed to the model as the highest other ids (never BOS or EOS)."""
    from pathlib import Path
    llm = LLM(str(Path(__file__).parent / "fixtures" / "llama_mha"))
    markers = llm.llm_engine.markers
    assert markers == {"pad_token_id": 260, "ssep_token_id": 261, "pdep_token_id": 262}
    borrowed = llm.llm_engine.marker_rows
    assert borrowed == {260: 259, 261: 258, 262: 255}
    assert not set(borrowed.values()) & (llm.llm_engine.eos_ids | {256})
