"""Tokenizers behind one small protocol: HF AutoTokenizer, the shipped Llama 3 tiktoken tokenizer,
and a byte-level tokenizer for tiny-vocabulary test models.

`load_tokenizer(folder, cfg)` picks one: the folder's own tokenizer files when present, else the
Llama 3 tokenizer for a Llama 3 vocabulary, else bytes when the vocabulary has room for them.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Protocol, Sequence, runtime_checkable

from configs.model_config import ModelConfig
from minipic_jax.loading.chat_template import ChatTemplating, check_conversation, is_batch
from minipic_jax.loading.hf_config import generation_eos_ids

ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets"
LLAMA3_TOKENIZER_FILE = ASSETS / "llama3_tokenizer.model"
LLAMA3_NUM_BASE = 128000
LLAMA3_NUM_SPECIAL = 256
# Llama 3's published pre-tokenizer split pattern.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and the API read. `eos_token_ids`: generation stops at any of them (an HF
    folder's generation_config.json may list several). `chat_template`: Jinja source or None.
    A new tokenizer kind (GGUF) sets these attributes and gets `apply_chat_template` from
    `ChatTemplating` (minipic_jax/loading/chat_template.py)."""
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the BOS token first when the model has one."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens dropped)."""

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt=False, continue_final_message=False,
                            tokenize=True, **kwargs):
        """transformers' `apply_chat_template`: a conversation (or a list) as text or ids."""


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens from id 128000, named as in Meta's Llama 3.1 reference tokenizer."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
             "<|python_tag|>"]
    return named + [f"<|reserved_special_token_{i}|>"
                    for i in range(2, 2 + LLAMA3_NUM_SPECIAL - len(named))]


@functools.lru_cache(maxsize=4)
def _llama3_encoding(path: str):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(path)
    if len(ranks) != LLAMA3_NUM_BASE:
        raise ValueError(f"{path}: expected {LLAMA3_NUM_BASE} BPE ranks, found {len(ranks)}")
    special = {tok: LLAMA3_NUM_BASE + i for i, tok in enumerate(llama3_special_tokens())}
    return tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                             special_tokens=special)


class Llama3Tokenizer(ChatTemplating):
    """The Llama 3 tokenizer (tiktoken). Special-token text in the input is parsed as special."""

    bos_token_id = LLAMA3_NUM_BASE
    vocab_size = LLAMA3_NUM_BASE + LLAMA3_NUM_SPECIAL
    bos_token = "<|begin_of_text|>"
    eos_token = "<|eot_id|>"

    def __init__(self, path: str | pathlib.Path = LLAMA3_TOKENIZER_FILE,
                 eos_token_ids: Sequence[int] = (128001, 128008, 128009),
                 chat_template: str | None = None):
        self._enc = _llama3_encoding(str(path))
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + self._enc.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) < LLAMA3_NUM_BASE])

    def token_id(self, special: str) -> int:
        return self._enc.encode_single_token(special)


class ByteTokenizer(ChatTemplating):
    """UTF-8 bytes as ids 0..255, plus BOS/EOS ids (default 256/257) from the model config. A
    chat template (tests) renders with no BOS/EOS text (bytes have none)."""

    def __init__(self, vocab_size: int, bos_token_id: int | None = 256,
                 eos_token_ids: Sequence[int] = (257,), chat_template: str | None = None):
        if vocab_size < 258:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 258, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        bos = [] if self.bos_token_id is None else [self.bos_token_id]
        return bos + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer behind the Tokenizer protocol. EOS ids: the model config's (which
    include generation_config.json's, minipic_jax/loading/hf_config.py), the folder's
    generation_config.json and the tokenizer's eos token."""

    def __init__(self, folder: str | pathlib.Path, cfg: ModelConfig | None = None):
        from transformers import AutoTokenizer
        folder = pathlib.Path(folder)
        self._tok = AutoTokenizer.from_pretrained(str(folder))
        self.vocab_size = len(self._tok)
        # ids the model can embed: text must never tokenize beyond (markers live there)
        self.model_vocab_size = cfg.vocab_size if cfg else self.vocab_size
        self.bos_token_id = self._tok.bos_token_id
        eos = set(cfg.eos_token_ids if cfg else ()) | set(generation_eos_ids(folder))
        if self._tok.eos_token_id is not None:
            eos.add(int(self._tok.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        template = self._tok.chat_template  # tokenizer_config.json (or chat_template.jinja)
        if isinstance(template, dict):  # named templates: transformers uses "default"
            template = template.get("default")
        self.chat_template = template if isinstance(template, str) else None

    def _checked(self, ids) -> list[int]:
        ids = [int(t) for t in ids]
        beyond = [t for t in ids if t >= self.model_vocab_size]
        if beyond:
            raise ValueError(f"the tokenizer produced id {beyond[0]}, beyond the model's "
                             f"vocab_size {self.model_vocab_size} (the tokenizer does not "
                             f"match the model)")
        return ids

    def encode(self, text: str) -> list[int]:
        return self._checked(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) < self.vocab_size],
                                skip_special_tokens=True)

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt=False, continue_final_message=False,
                            tokenize=True, **kwargs):
        """transformers' apply_chat_template (same keywords): text (tokenize=False) or token ids
        (a list of ints, or one list per conversation of a batch)."""
        if not (chat_template or self.chat_template):
            raise ValueError("this model has no chat template (tokenizer_config.json "
                             "chat_template); pass chat_template=... or use plain prompts")
        for k, conv in enumerate(conversation if is_batch(conversation) else [conversation]):
            check_conversation(conv, f"conversation {k}")
        out = self._tok.apply_chat_template(
            conversation, tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=tokenize, **kwargs)
        if not tokenize:
            return out
        if hasattr(out, "keys"):  # a BatchEncoding
            out = out["input_ids"]
        if is_batch(conversation):
            return [self._checked(ids) for ids in out]
        return self._checked(out)


def load_tokenizer(folder: pathlib.Path | None, cfg: ModelConfig) -> Tokenizer | None:
    """The tokenizer for a model: folder files, else Llama 3 (tiktoken), else bytes, else None."""
    if folder is not None:
        if any((folder / f).exists() for f in HF_TOKENIZER_FILES):
            return HFTokenizer(folder, cfg)
        for candidate in (folder / "tokenizer.model", folder / "original" / "tokenizer.model"):
            if candidate.exists() and cfg.vocab_size == Llama3Tokenizer.vocab_size:
                return Llama3Tokenizer(candidate, cfg.eos_token_ids or (128001, 128009))
    if cfg.vocab_size == Llama3Tokenizer.vocab_size and cfg.bos_token_id == LLAMA3_NUM_BASE:
        return Llama3Tokenizer(eos_token_ids=cfg.eos_token_ids or (128001, 128009))
    if cfg.vocab_size >= 258:
        return ByteTokenizer(cfg.vocab_size, cfg.bos_token_id if cfg.bos_token_id is not None
                             else 256, cfg.eos_token_ids or (257,))
    return None
