"""Chat templates: a model's Jinja template over a conversation, called with transformers' keywords.

HF folders render through transformers itself (`HFTokenizer`). Tokenizers without transformers
behind them (GGUF, the Llama 3 tiktoken tokenizer, bytes) render here: `ChatTemplating` gives a
tokenizer class `apply_chat_template` from two attributes, `chat_template` (the Jinja source or
None) and the special-token texts `bos_token` / `eos_token`. The template sees what transformers
gives it: messages, add_generation_prompt, tools, documents, bos_token, eos_token,
raise_exception, strftime_now, and every extra keyword (chat_template_kwargs).
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Sequence


class TemplateError(ValueError):
    """A chat template called raise_exception (the conversation breaks one of its rules)."""


def _raise(message):
    raise TemplateError(f"chat template: {message}")


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON text
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    # trim_blocks / lstrip_blocks: the whitespace rules templates are written against
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def is_batch(conversation) -> bool:
    """A list of conversations (each a list of messages), not one conversation."""
    return (isinstance(conversation, (list, tuple)) and bool(conversation)
            and isinstance(conversation[0], (list, tuple)))


def check_conversation(messages, where: str = "conversation") -> None:
    """ValueError unless `messages` is a non-empty list of {"role": str, ...} dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{k}]: expected a {{'role': str, 'content': ...}} object, "
                             f"got {m!r:.80}")


def render_chat_template(template: str, messages: Sequence[dict], *,
                         add_generation_prompt: bool = False,
                         continue_final_message: bool = False, tools=None, documents=None,
                         bos_token: str | None = None, eos_token: str | None = None,
                         **kwargs) -> str:
    """The text of `template` over one conversation, as transformers renders it.

    continue_final_message: the text ends inside the last message (its content, then nothing
    the template adds after it), so generation continues that message.
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
    check_conversation(messages)
    text = _compile(template).render(
        messages=list(messages), tools=tools, documents=documents,
        add_generation_prompt=add_generation_prompt, bos_token=bos_token or "",
        eos_token=eos_token or "", **kwargs)
    if continue_final_message:
        final = messages[-1].get("content")
        if not isinstance(final, str) or final.strip() not in text:
            raise ValueError("continue_final_message: the last message's content (a string) "
                             "does not appear in the rendered conversation")
        end = text.rindex(final.strip()) + len(final.strip())
        text = text[:end]
    return text


class ChatTemplating:
    """`apply_chat_template` (transformers' keywords) for a tokenizer with `chat_template`,
    `bos_token`, `eos_token` and `encode`. `encode_rendered` tokenizes the rendered text without
    the BOS `encode` adds (the template places any BOS itself); override it where encode adds
    none."""

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def encode_rendered(self, text: str) -> list[int]:
        ids = list(self.encode(text))
        if ids and self.bos_token_id is not None and ids[0] == self.bos_token_id:
            ids = ids[1:]
        return ids

    def apply_chat_template(self, conversation, tools=None, documents=None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            **kwargs):
        """The conversation through the chat template: text (tokenize=False) or token ids. A
        list of conversations gives a list. Extra keywords reach the template as variables."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template (pass chat_template=...)")
        if is_batch(conversation):
            return [self.apply_chat_template(c, tools, documents, template, add_generation_prompt,
                                             continue_final_message, tokenize, **kwargs)
                    for c in conversation]
        text = render_chat_template(template, conversation, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        return self.encode_rendered(text) if tokenize else text


def _text_content(message: dict, where: str) -> dict:
    """OpenAI content parts ([{"type": "text", "text": ...}, ...]) joined into one string, as
    vLLM's "string" content format does; other messages as they are."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for k, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise ValueError(f"{where}.content[{k}]: only text parts are supported, got "
                             f"{part!r:.80}")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def render_conversations(tokenizer, messages, *, chat_template=None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         tools=None, chat_template_kwargs: dict | None = None) -> list[dict]:
    """One conversation (a list of messages) or a list of them -> [{"prompt_token_ids",
    "prompt"}] through the tokenizer's chat template (or `chat_template`). Errors (no
    template, a bad message, the template's own raise_exception) are ValueErrors naming the
    conversation."""
    from jinja2 import TemplateError as JinjaError
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template; this model has none")
    convs = messages if is_batch(messages) else [messages]
    kw = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
              continue_final_message=continue_final_message, tools=tools,
              **(chat_template_kwargs or {}))
    out = []
    for i, conv in enumerate(convs):
        where = f"conversation {i}" if len(convs) > 1 else "conversation"
        try:
            check_conversation(conv, where)
            conv = [_text_content(m, f"{where}[{k}]") for k, m in enumerate(conv)]
            text = tokenizer.apply_chat_template(conv, tokenize=False, **kw)
            ids = tokenizer.apply_chat_template(conv, tokenize=True, **kw)
        except (TypeError, ValueError, JinjaError) as err:
            msg = str(err)
            raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        out.append({"prompt_token_ids": ids, "prompt": text})
    return out
