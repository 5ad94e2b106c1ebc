"""The tokenizer a GGUF describes in its metadata, built as a `tokenizers` byte-level BPE.

A GGUF from llama.cpp's converter keeps the HF tokenizer as `tokenizer.ggml.*` keys: the model
kind (`gpt2` = byte-level BPE), the pre-tokenizer name (`pre`), the vocabulary (already in the
byte-to-unicode spelling), the merges, each token's type (3 = control, 4 = user-defined), the
BOS/EOS ids, whether BOS is prepended, and `tokenizer.chat_template`. The pre-tokenizer is
rebuilt from its name the way llama.cpp splits text for it (SmolLM2's `smollm`: every digit on
its own, then GPT-2's byte-level split, as its own tokenizer.json does).
"""

from __future__ import annotations

from typing import Sequence

from minipic_jax.loading.chat_template import ChatTemplating
from minipic_jax.loading.gguf_reader import GGUFError, GGUFFile
from minipic_jax.loading.tokenizer import LLAMA3_PATTERN

_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str, path):
    from tokenizers import Regex, pre_tokenizers
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise GGUFError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: default, "
                    f"gpt2, smollm, llama-bpe); put the model's tokenizer.json beside the file")


def build_backend(gguf: GGUFFile):
    """A `tokenizers.Tokenizer` from the GGUF's byte-level BPE vocabulary and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    m = gguf.metadata
    kind = m.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.model {kind!r} is not supported (only "
                        f"'gpt2', byte-level BPE); put the model's tokenizer.json beside the file")
    tokens = list(m["tokenizer.ggml.tokens"])
    merges = [tuple(pair.split(" ")) for pair in m.get("tokenizer.ggml.merges", [])]
    bad = next((p for p in merges if len(p) != 2), None)
    if bad is not None:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.merges has a malformed entry "
                        f"{' '.join(bad)!r}")
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = _pre_tokenizer(m.get("tokenizer.ggml.pre", "default"), gguf.path)
    backend.decoder = decoders.ByteLevel()
    types = m.get("tokenizer.ggml.token_type")
    if types is not None:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, k in zip(tokens, types) if k == _CONTROL])
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return backend


class GGUFTokenizer(ChatTemplating):
    """The Tokenizer protocol over a GGUF's own tokenizer, plus what a chat layer needs:
    `chat_template` (the Jinja string from the metadata, or None), `bos_token` / `eos_token`
    (their text, for templates that print them), `eos_token_ids`, and `apply_chat_template`
    with transformers' keywords (`ChatTemplating`)."""

    def __init__(self, gguf: GGUFFile):
        m = gguf.metadata
        self._tok = build_backend(gguf)
        self.vocab_size = len(m["tokenizer.ggml.tokens"])
        bos, eos = m.get("tokenizer.ggml.bos_token_id"), m.get("tokenizer.ggml.eos_token_id")
        self.bos_token_id = None if bos is None else int(bos)
        self.eos_token_ids = () if eos is None else (int(eos),)
        self.add_bos_token = bool(m.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template = m.get("tokenizer.chat_template")
        tokens = m["tokenizer.ggml.tokens"]
        self.bos_token = None if bos is None else tokens[int(bos)]
        self.eos_token = None if eos is None else tokens[int(eos)]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special-token text such as <|im_start|> parsed as the special
        token), with BOS first when the GGUF says tokenizer.ggml.add_bos_token."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat template: no BOS added (the template places its own;
        stripping a leading BOS id would cut SmolLM2's first <|im_start|>, which is its BOS)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
