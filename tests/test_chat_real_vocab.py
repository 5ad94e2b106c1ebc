"""HF conventions of real models, and markers that are safe on any vocabulary, on an HF folder
with a GPT-2 style byte-level BPE tokenizer (tests/chat_folder.py).

Oracles: transformers' own `apply_chat_template` on the same tokenizer_config.json; the float64
dense reference (tests/dense_reference.py) for every generated token; greedy reference
continuations for where generation must stop.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from dense_reference import check_against_reference, reference_logprobs

from minipic_jax import Prompt, SamplingParams, Span
from minipic_jax.loading import load_model
from minipic_jax.loading.chat_template import ChatTemplating, render_chat_template
from minipic_jax.loading.tokenizer import HFTokenizer, Llama3Tokenizer
from tests.chat_folder import CHAT_TEMPLATE, make_chat_folder

BS = 8  # block size of the engine below
OLD_MARKERS = (259, 258, 257)  # the old default pad/ssep/pdep: here " t", "b", "a"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab ta?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_chat_folder(tmp_path_factory.mktemp("chat") / "model")


def _greedy(params, cfg, ids, n):
    out = []
    for _ in range(n):
        full = list(ids) + out
        out.append(int(reference_logprobs(params, cfg, full, [0] * len(full))[-1].argmax()))
    return out


def _stop_pair(g1, g2, avoid):
    """(A, B, j1, j2): g1 first meets {A, B} or config.json's EOS 1 at j1 (A), g2 at j2 (B);
    A and B are not in `avoid`."""
    for j1 in range(1, len(g1)):
        for j2 in range(1, len(g2)):
            a, b = g1[j1], g2[j2]
            if a == b or {a, b} & avoid:
                continue
            if not {a, b, 1} & set(g1[:j1] + g2[:j2]):
                return a, b, j1, j2
    return None


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The engine on a folder whose generation_config.json lists two EOS ids picked from greedy
    reference continuations so one prompt stops at each."""
    from minipic_jax import LLM
    folder = make_chat_folder(tmp_path_factory.mktemp("chat_eos") / "model")
    m = load_model(folder, dtype="float32")
    tok = m.tokenizer
    prompts = [tok.encode("hello there"), tok.encode("ab ta ab")]
    g = [_greedy(m.params, m.cfg, p, 8) for p in prompts]
    pair = _stop_pair(g[0], g[1], avoid={0, 1, 2, *OLD_MARKERS})
    assert pair is not None, f"no EOS pair in {g}"
    make_chat_folder(folder, eos_ids=pair[:2])
    llm = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64,
              max_model_len=256, block_size=BS, num_kv_blocks=96)
    return types.SimpleNamespace(llm=llm, folder=folder, prompts=prompts, greedy=g, pair=pair)


def _check(job, out, markers=True):
    eng = job.llm.llm_engine
    m = eng.markers
    c = out.outputs[0]
    check_against_reference(eng.loaded.params, eng.loaded.cfg, out.prompt_token_ids,
                            c.token_ids, c.logprobs, block_size=BS, pad=m["pad_token_id"],
                            ssep=m["ssep_token_id"], pdep=m["pdep_token_id"], markers=markers)


# -- chat templates ------------------------------------------------------------------------------
def test_chat_template_matches_transformers(folder):
    """transformers' keywords through HFTokenizer and through the jinja renderer that tokenizers
    without transformers use (GGUF): the same text and ids as transformers itself."""
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(folder))
    hf = HFTokenizer(folder)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "<b>"}}}]
    cases = [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
             dict(add_generation_prompt=True, tools=tools, enable_thinking=False),
             dict(continue_final_message=True)]
    for kw in cases:
        want = ref.apply_chat_template(CONV, tokenize=False, **kw)
        assert hf.apply_chat_template(CONV, tokenize=False, **kw) == want, kw
        assert render_chat_template(CHAT_TEMPLATE, CONV, bos_token="<s>", eos_token="</s>",
                                    **kw) == want, kw
        ids = ref.apply_chat_template(CONV, tokenize=True, **kw)
        assert hf.apply_chat_template(CONV, **kw) == list(ids["input_ids"]), kw
    both = hf.apply_chat_template([CONV, CONV[1:]], tokenize=False, add_generation_prompt=True)
    assert both == [ref.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                    for c in (CONV, CONV[1:])]
    assert hf.chat_template == CHAT_TEMPLATE and hf.eos_token_ids == (1, 2)
    with pytest.raises(Exception, match="unknown role tool"):
        render_chat_template(CHAT_TEMPLATE, [{"role": "tool", "content": "x"}])


def test_own_renderer_tokenizes_without_a_second_bos():
    """ChatTemplating on the Llama 3 tokenizer: the template places BOS, encode adds none."""
    tok = Llama3Tokenizer(chat_template="{{ bos_token }}{% for m in messages %}"
                          "<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}"
                          "<|eot_id|>{% endfor %}")
    assert isinstance(tok, ChatTemplating)
    ids = tok.apply_chat_template(CONV[1:])
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids[-1] == 128009 and tok.decode(ids) == "userab ta?"
    with pytest.raises(ValueError, match="no chat template"):
        Llama3Tokenizer().apply_chat_template(CONV)


def test_folder_without_template(tmp_path):
    tok = HFTokenizer(make_chat_folder(tmp_path / "m", chat_template=None))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)


# -- LLM.chat, run-batch, EOS --------------------------------------------------------------------
def test_llm_chat_renders_like_transformers_and_generates(job):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(job.folder))
    convs = [CONV, [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]]
    outs = job.llm.chat(convs, GREEDY, use_tqdm=False,
                        chat_template_kwargs={"enable_thinking": False})
    assert len(outs) == 2
    for conv, out in zip([CONV, [{"role": "user", "content": "hello"}]], outs):
        text = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
        assert out.prompt == text and text.endswith("<think></think>")
        assert out.prompt_token_ids == ref.encode(text, add_special_tokens=False)
        _check(job, out)
    one = job.llm.chat(CONV, GREEDY, use_tqdm=False)  # one conversation
    assert len(one) == 1 and one[0].prompt.endswith("assistant\n")
    with pytest.raises(ValueError, match="conversation 1: .*unknown role tool"):
        job.llm.chat([CONV, [{"role": "tool", "content": "x"}]], GREEDY, use_tqdm=False)


def test_generation_stops_at_either_eos_of_generation_config(job):
    a, b, j1, j2 = job.pair
    assert {a, b} <= job.llm.llm_engine.eos_ids
    assert {a, b} <= set(job.llm.get_tokenizer().eos_token_ids)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    outs = job.llm.generate([{"prompt_token_ids": p} for p in job.prompts], sp, use_tqdm=False)
    for out, g, j, eos in zip(outs, job.greedy, (j1, j2), (a, b)):
        assert out.outputs[0].token_ids == g[:j + 1] and out.outputs[0].token_ids[-1] == eos
        assert out.outputs[0].finish_reason == "stop"


def test_run_batch_answers_chat_lines(job, tmp_path):
    from minipic_jax.batch.run_batch import main
    lines = [
        {"custom_id": "c1", "url": "/v1/chat/completions",
         "body": {"messages": CONV, "max_completion_tokens": 3, "temperature": 0}},
        {"custom_id": "c2", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "tool", "content": "x"}], "max_tokens": 3}},
        {"custom_id": "p1", "url": "/v1/completions",
         "body": {"prompt": "ab ta", "max_tokens": 3, "temperature": 0}},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"method": "POST", **x}) + "\n" for x in lines))
    assert main(["-i", str(src), "-o", str(dst), "--model", "m", "--no-progress"],
                llm=job.llm) == 0
    recs = [json.loads(r) for r in dst.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in recs}
    assert set(by_id) == {"c1", "c2", "p1"}
    body = by_id["c1"]["response"]["body"]
    want = job.llm.chat(CONV, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == want.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert by_id["p1"]["error"] is None
    assert "line 2" in json.dumps(by_id["c2"]["error"]) and "unknown role tool" in \
        json.dumps(by_id["c2"]["error"])


# -- markers on a real vocabulary ----------------------------------------------------------------
def test_text_that_tokenizes_to_the_old_marker_ids_is_plain_text(job):
    """Prompt text made of the ids that were the default pad/ssep/pdep (also at block starts)
    means what it says: every generated token and logprob equals the reference's with no
    markers at all. (With the old in-vocabulary defaults, " t" was an invisible pad.)"""
    tok = job.llm.get_tokenizer()
    text = "hello wab ta hellbab ta ab tab tab"
    ids = tok.encode(text)
    assert set(OLD_MARKERS) <= set(ids)
    assert {ids[i] for i in range(0, len(ids), BS)} >= {258, 257}  # old SSEP, PDEP at starts
    out = job.llm.generate([ids, {"prompt": text}], GREEDY, use_tqdm=False)
    for o in out:
        assert o.prompt_token_ids == ids
        _check(job, o, markers=False)
    assert min(job.llm.llm_engine.markers.values()) >= job.llm.llm_engine.vocab_size


def test_spans_still_cache_and_reuse_on_a_real_vocabulary(job):
    """Span() over text full of the old marker ids: the span is computed once and hit after
    another system prompt, and both answers equal the Block-Attention reference (markers at
    vocab_size.. read the embeddings of the old ids, the engine's documented rule)."""
    doc = " ta ab ta ab tab tab ta ab ta ab ta b"
    first = [Prompt("sys one"), Span(doc), Prompt("ab?")]
    second = [Prompt("another system prompt"), Span(doc), Prompt("ab?")]
    a = job.llm.generate([first], GREEDY, use_tqdm=False)[0]
    b = job.llm.generate([second], GREEDY, use_tqdm=False)[0]
    span_blocks = len(job.llm.get_tokenizer().encode(doc)) // BS  # its full blocks (SSEP first)
    assert span_blocks >= 2 and b.num_cached_tokens >= span_blocks * BS
    _check(job, a)
    _check(job, b)


def test_token_ids_beyond_the_vocabulary_are_markers_only(job):
    m = job.llm.llm_engine.markers
    v = job.llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=f"request 1: token id {v + 7} at index 2 is outside"):
        job.llm.generate([[0, 5], [0, 5, v + 7]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=f"request 0: marker id {m['ssep_token_id']} at index 3 "
                                         f"is not at a block start"):
        job.llm.generate([[0, 5, 6, m["ssep_token_id"]]], GREEDY, use_tqdm=False)
    ids = [0, 5, 6] + [m["pad_token_id"]] * 5 + [m["ssep_token_id"], 7, 8]  # pads anywhere
    out = job.llm.generate([ids], GREEDY, use_tqdm=False)[0]
    _check(job, out)


def test_training_data_feeds_markers_as_the_engine_does(job):
    """Block fine-tuning data: laid out with the engine's marker ids, fed with the ids they
    borrow (no id beyond the vocabulary reaches the embedding)."""
    from minipic_jax.training.data import Record, layout_example
    from minipic_jax.training.loop import engine_markers
    eng = job.llm.llm_engine
    markers = engine_markers(eng.loaded, BS)
    assert dict(markers.embedding_ids) == eng.marker_rows
    segs = (Prompt("sys"), Span(" ta ab ta ab"), Prompt("q"))
    ex = layout_example(Record(segs, "ab"), markers, eng.tokenizer, eos_token_id=1)
    raw = list(job.llm.to_token_ids(list(segs))[0])
    assert len(raw) < len(ex.tokens) and (ex.tokens < eng.vocab_size).all()
    want = [eng.marker_rows.get(t, t) for t in raw]
    assert ex.tokens[:len(raw)].tolist() == want and np.any(np.array(raw) >= eng.vocab_size)


@pytest.mark.parametrize("vocab_size", [260, 512, 49152, 151936, 248320])
def test_no_vocabulary_id_is_a_default_marker(vocab_size, fresh_rng):
    """The rule on any vocabulary but Llama 3's: every id text can produce (< vocab_size) lays
    out exactly as plain text (no pads, no segment starts), so no text changes a prompt's
    meaning; the markers' embedding rows are vocabulary ids that are not BOS/EOS."""
    from serving.config import Config, default_marker_ids, marker_embedding_ids, resolve_markers
    from serving.layout import build_layout
    m = resolve_markers(Config(), vocab_size)
    assert m == default_marker_ids(vocab_size) and min(m.values()) == vocab_size
    rows = marker_embedding_ids(m, vocab_size, reserved={0, 1, vocab_size - 1})
    assert set(rows) == set(m.values()) and max(rows.values()) == vocab_size - 2
    ids = fresh_rng.integers(0, vocab_size, 64)
    ids[::8] = fresh_rng.choice([vocab_size - 1, vocab_size - 2, vocab_size - 3], 8)
    lay = build_layout(ids, 8, pad_id=m["pad_token_id"], ssep_id=m["ssep_token_id"],
                       pdep_id=m["pdep_token_id"])
    assert not lay.has_markers and not lay.is_pad.any() and lay.seg_start.sum() == 1
