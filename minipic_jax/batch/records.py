"""Output records in the shape `vllm run-batch` writes (one JSON object per line):

    {"id": ..., "custom_id": ..., "response": {"status_code": 200, "request_id": ...,
     "body": <an OpenAI completion or chat.completion>}, "error": null}

An error record has status_code 400, body null, the message in "error", and "line" (the input
line it answers). Ids derive from the custom_id (or the line), so a resumed job writes the
same records as an uninterrupted one; only "created" (a timestamp) differs.
"""

from __future__ import annotations

import hashlib
import json
import time


def _rid(key: str) -> str:
    # surrogatepass: a custom_id with a lone surrogate (JSON "\\ud800") is valid JSON
    return hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def dumps(rec: dict) -> str:
    """One output line: UTF-8 text as is, but a record holding a lone surrogate (from the
    request's custom_id or text) written with \\u escapes, which UTF-8 cannot encode and JSON
    can; reading it back gives the same string."""
    line = json.dumps(rec, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(rec)
    return line + "\n"


def error_record(line: int, custom_id: str | None, message: str) -> dict:
    key = custom_id if custom_id is not None else f"line:{line}"
    return {"id": f"minipic-{_rid(key)}", "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": f"minipic-batch-{_rid(key)}",
                         "body": None},
            "error": message, "line": line}


def _cut_at_stop(text: str, stop: list[str]):
    """Text up to the first stop string, and that string (None if none occurs)."""
    best = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return (text, None) if best is None else (text[:best[0]], best[1])


def _completion_logprobs(c, tokenizer):
    tokens, offsets, pos = [], [], 0
    for t in c.token_ids:
        s = tokenizer.decode([t]) if tokenizer is not None else str(t)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
    top = []
    for d in c.logprobs:
        top.append({(lp.decoded_token if lp.decoded_token is not None else str(t)): lp.logprob
                    for t, lp in d.items()})
    return {"tokens": tokens, "token_logprobs": [d[t].logprob for t, d in zip(c.token_ids,
                                                                              c.logprobs)],
            "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(c, tokenizer, top_n: int):
    content = []
    for t, d in zip(c.token_ids, c.logprobs):
        def name(tid, lp):
            return lp.decoded_token if lp.decoded_token is not None else str(tid)
        ranked = sorted(((tid, lp) for tid, lp in d.items() if lp.rank is not None),
                        key=lambda x: x[1].rank)[:top_n]
        content.append({"token": name(t, d[t]), "logprob": d[t].logprob,
                        "top_logprobs": [{"token": name(i, lp), "logprob": lp.logprob}
                                         for i, lp in ranked]})
    return {"content": content}


def result_record(req, out, model: str, tokenizer) -> dict:
    """The success record of request `req` (reading.BatchRequest) from its RequestOutput."""
    c = out.outputs[0]
    text, stop_hit = _cut_at_stop(c.text, req.stop)
    finish = "stop" if stop_hit is not None else c.finish_reason
    stop_reason = stop_hit if stop_hit is not None else c.stop_reason
    n_prompt, n_out = len(out.prompt_token_ids), len(c.token_ids)
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
             "total_tokens": n_prompt + n_out,
             "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
    lp = None
    if c.logprobs is not None:
        lp = (_chat_logprobs(c, tokenizer, req.sampling.logprobs or 0) if req.chat
              else _completion_logprobs(c, tokenizer))
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish,
                  "stop_reason": stop_reason}
        kind, prefix = "text_completion", "cmpl"
    key = _rid(req.custom_id)
    body = {"id": f"{prefix}-{key}", "object": kind, "created": int(time.time()),
            "model": req.model or model, "choices": [choice], "usage": usage}
    return {"id": f"minipic-{key}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": f"minipic-batch-{key}", "body": body},
            "error": None}
