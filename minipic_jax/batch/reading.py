"""Reading a batch file: one JSON request per line -> `BatchRequest` or `LineError`.

The OpenAI batch format that `vllm run-batch` reads:

    {"custom_id": "q1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "...", "prompt": "...", "max_tokens": 32, "temperature": 0}}

`url` is "/v1/completions" (body `prompt`: text or token ids) or "/v1/chat/completions" (body
`messages`, where the model has a chat template). A completions body may carry a structured
prompt instead: `"segments": [{"kind": "prompt" | "span", "text": ... | "token_ids": [...]}]`
(minipic_jax.prompts: spans are cached once and reused at any offset). Every problem with a line
(bad JSON, a missing or unknown field, a value out of range) is a `LineError` naming the line
and the field; the job writes it as that line's error record and goes on.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from typing import Any, Iterator

from minipic_jax.prompts import Prompt, Span
from minipic_jax.sampling_params import SamplingParams

URLS = {"/v1/completions": False, "/v1/chat/completions": True}  # url -> is chat
_TOP = {"custom_id", "method", "url", "body"}
# body fields taken (sampling), and fields accepted only at their neutral value
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_tokens", "stop",
           "stop_token_ids", "seed", "n", "ignore_eos", "cache_salt", "user", "stream"}
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "best_of": 1,
            "echo": False, "logit_bias": None, "stream_options": None}
_COMPLETION = _COMMON | {"prompt", "segments", "logprobs"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


class LineError(ValueError):
    def __init__(self, line: int, custom_id: str | None, message: str):
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.custom_id = custom_id


@dataclasses.dataclass
class BatchRequest:
    line: int
    custom_id: str
    chat: bool
    prompt: Any  # text, token ids, or [Prompt | Span, ...]
    sampling: SamplingParams
    stop: list[str]  # stop strings (the text is cut at the first one)
    cache_salt: str | None
    model: str | None


def iter_lines(path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) for every non-blank line, streamed."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


def parse_line(line: int, raw: bytes, *, render_chat, seed: int = 0) -> BatchRequest:
    """One request line -> BatchRequest. `render_chat(messages) -> prompt` applies the model's
    chat template (raising ValueError when it has none). Raises LineError."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LineError(line, None, f"not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise LineError(line, None, f"expected a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError(line, None, "'custom_id' must be a non-empty string")

    def fail(msg):
        raise LineError(line, cid, msg)

    extra = sorted(set(obj) - _TOP)
    if extra:
        fail(f"unknown field(s) {extra}; a request line has {sorted(_TOP)}")
    if obj.get("method", "POST") != "POST":
        fail(f"'method' must be 'POST', got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in URLS:
        fail(f"'url' must be one of {sorted(URLS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        fail("'body' must be a JSON object")
    chat = URLS[url]
    try:
        return _request(line, cid, chat, body, render_chat, seed)
    except LineError:
        raise
    except (ValueError, TypeError) as err:
        fail(str(err))


def _request(line, cid, chat, body, render_chat, seed) -> BatchRequest:
    allowed = _CHAT if chat else _COMPLETION
    unknown = sorted(set(body) - allowed - set(_NEUTRAL))
    if unknown:
        raise ValueError(f"unknown or unsupported body field(s) {unknown}")
    for k, neutral in _NEUTRAL.items():
        if k in body and body[k] != neutral and not (k == "logit_bias" and not body[k]):
            raise ValueError(f"body.{k}={body[k]!r} is not supported (only {neutral!r})")
    if body.get("stream"):
        raise ValueError("body.stream=true is not supported in a batch job")
    if chat:
        prompt = _chat_prompt(body, render_chat)
    else:
        prompt = _completion_prompt(body)
    sp, stop = _sampling(body, chat, cid, seed)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError("body.cache_salt must be a string")
    return BatchRequest(line, cid, chat, prompt, sp, stop, salt, body.get("model"))


def _completion_prompt(body):
    if ("prompt" in body) == ("segments" in body):
        raise ValueError("body needs exactly one of 'prompt' or 'segments'")
    if "segments" in body:
        return _segments(body["segments"])
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a one-prompt list
    if isinstance(p, str):
        if not p:
            raise ValueError("body.prompt is empty")
        return p
    if isinstance(p, list) and p and all(type(t) is int for t in p):
        return p
    raise ValueError("body.prompt must be a string or a non-empty list of token ids "
                     "(one prompt per request line)")


def _segments(segs):
    if not isinstance(segs, list) or not segs:
        raise ValueError("body.segments must be a non-empty list")
    out = []
    for k, s in enumerate(segs):
        where = f"body.segments[{k}]"
        if not isinstance(s, dict) or s.get("kind") not in ("prompt", "span"):
            raise ValueError(f"{where} must be an object with kind 'prompt' or 'span'")
        unknown = sorted(set(s) - {"kind", "text", "token_ids"})
        if unknown or ("text" in s) == ("token_ids" in s):
            raise ValueError(f"{where} needs exactly one of 'text' or 'token_ids'"
                             + (f" (unknown {unknown})" if unknown else ""))
        content = s.get("text", s.get("token_ids"))
        if "text" in s and (not isinstance(content, str) or not content):
            raise ValueError(f"{where}.text must be a non-empty string")
        if "token_ids" in s and not (isinstance(content, list) and content
                                     and all(type(t) is int for t in content)):
            raise ValueError(f"{where}.token_ids must be a non-empty list of ints")
        out.append((Prompt if s["kind"] == "prompt" else Span)(content))
    return out


def _chat_prompt(body, render_chat):
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
        raise ValueError("body.messages must be a non-empty list of {role, content} objects")
    return render_chat(msgs)


def _number(body, key, kind, default):
    v = body.get(key, default)
    if v is None:
        return default
    if kind is int and type(v) is not int:
        raise ValueError(f"body.{key} must be an integer, got {v!r}")
    if kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"body.{key} must be a number, got {v!r}")
        try:
            return float(v)  # a JSON integer too large for a float is no sampling value
        except OverflowError:
            raise ValueError(f"body.{key}={v} is out of range") from None
    return v


def _sampling(body, chat, cid, seed):
    max_tokens = _number(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                         else "max_tokens", int, None if chat else 16)
    stop = body.get("stop")
    if stop is None:
        stop = []
    if isinstance(stop, str):
        stop = [stop]
    # "" is refused as SamplingParams(stop="") is: an empty stop string would match at once;
    # leave the field out (or null, or []) for no stop strings
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError("body.stop must be a non-empty string or a list of non-empty strings "
                         "(null or [] for none)")
    logprobs = None
    if chat:
        if body.get("logprobs"):
            logprobs = _number(body, "top_logprobs", int, 0)
    else:
        logprobs = _number(body, "logprobs", int, None)
    temperature = _number(body, "temperature", float, 1.0)
    req_seed = _number(body, "seed", int, None)
    if req_seed is None and temperature > 0:
        # a seed from the job seed and the custom_id: a resumed job samples what it would have
        # (surrogatepass: a lone surrogate is valid JSON, so a valid custom_id)
        req_seed = zlib.crc32(cid.encode("utf-8", "surrogatepass"), seed) & 0x7FFFFFFF
    sp = SamplingParams(
        temperature=temperature, top_p=_number(body, "top_p", float, 1.0),
        top_k=_number(body, "top_k", int, 0), max_tokens=max_tokens,
        min_tokens=_number(body, "min_tokens", int, 0),
        ignore_eos=bool(body.get("ignore_eos", False)),
        stop_token_ids=body.get("stop_token_ids") or [], seed=req_seed, logprobs=logprobs,
        n=_number(body, "n", int, 1))
    if not all(type(t) is int for t in sp.stop_token_ids):
        raise ValueError("body.stop_token_ids must be a list of ints")
    return sp, stop
