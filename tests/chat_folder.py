"""An HF model folder with a GPT-2 style byte-level BPE tokenizer, a chat template and a
generation_config.json, over the llama_mha fixture's weights (vocab 260).

The vocabulary is laid out so that the ids that were the default markers before they moved out of
the vocabulary (the three highest ids that are not BOS/EOS: 259, 258, 257) are ordinary text:
259 = " t" (a merge), 258 = "b", 257 = "a". So "ab ta" tokenizes to them.
"""

from __future__ import annotations

import json
import pathlib

from tests.conftest import FIXTURES

SPECIALS = ("<s>", "</s>", "<|end|>")  # ids 0 (BOS), 1 (EOS), 2 (end of turn)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character map, as a list indexed by byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def tokenizer_json() -> dict:
    """A byte-level BPE: specials 0-2, bytes 3-258 ("a" 257, "b" 258 last), merge " t" = 259."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    sym = _byte_symbols()
    order = [b for b in range(256) if b not in (ord("a"), ord("b"))] + [ord("a"), ord("b")]
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({sym[b]: 3 + k for k, b in enumerate(order)})
    vocab[sym[ord(" ")] + "t"] = 259
    tok = Tokenizer(BPE(vocab=vocab, merges=[(sym[ord(" ")], "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    return json.loads(tok.to_str())


def make_chat_folder(path: pathlib.Path, *, eos_ids=(1, 2), chat_template=CHAT_TEMPLATE):
    """The folder at `path`: llama_mha's weights, BOS 0 / EOS 1 in config.json, `eos_ids` in
    generation_config.json, the tokenizer above and `chat_template` in tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    src = FIXTURES / "llama_mha"
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(bos_token_id=0, eos_token_id=1)
    (path / "config.json").write_text(json.dumps(cfg))
    weights = path / "model.safetensors"
    if not weights.exists():
        weights.symlink_to(src / "model.safetensors")
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": list(eos_ids)}))
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
          "model_max_length": 4096}
    if chat_template is not None:
        tc["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return path
