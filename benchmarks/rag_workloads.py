"""RAG workloads for `minipic-bench rag`, built from the shipped MuSiQue data.

Every request follows Tulu3-Block-FT's prompt layout (Block-Attention): a system block, each
retrieved passage as its own block, then the question, which attends to everything before it,
in Tulu's chat markup (`<|user|>` ... `<|assistant|>`). Segments are tokenized one by one, so a
request's token ids are the same in every kv mode; only the markers and pads differ:

  * `segments(req)`: [Prompt(system), Span(p_1), ..., Span(p_n), Prompt(question)] for the
    position-free (MiniPIC) configurations;
  * `plain(req)`: the same tokens concatenated, no markers, for `rotated` (classic prefix
    caching) and `pic_off` (position-free keys, plain prompts).

Workloads (`make_workload`):
  * `single`: one question per sample, the dataset as is (passages in retriever order);
  * `multi`:  K questions per passage set (the sample's own question and K-1 questions of other
    samples), passages shuffled per question (the retriever ranks them differently each time);
  * `zipf`:   a corpus of the distinct passages; each request draws its passages from a Zipf
    popularity over the corpus (rank r has weight r**-s) and one question of the dataset.
  * `ttft_spans`: the cached-span TTFT pair (n spans of about L tokens each, a cold request and
    the same spans reordered with a new question).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent / "data"
SYSTEM = ("<|system|>\nYou are an intelligent AI assistant. Please answer questions based on the "
          "user's instructions. Below are some reference documents that may help you in "
          "answering the user's question.\n\n")
QUESTION = ("\nPlease write a high-quality answer for the given question using only the provided "
            "search documents (some of which might be irrelevant).\nQuestion: {q}\n<|assistant|>\n")
WORKLOADS = ("single", "multi", "zipf")


@dataclasses.dataclass(frozen=True)
class Request:
    system: tuple  # token ids of each part
    passages: tuple  # tuple of token-id tuples, in prompt order
    question: tuple


def load_musique(path=None) -> list:
    with open(path or DATA / "musique_s.json") as f:
        samples = json.load(f)
    for i, s in enumerate(samples):
        if not s.get("ctxs") or "question" not in s:
            raise ValueError(f"musique sample {i}: needs 'ctxs' and 'question'")
    return samples


class Encoder:
    """Tokenizes each distinct text once; `cap` truncates passages (tiny test runs)."""

    def __init__(self, tokenizer, cap: int | None = None):
        self.tok, self.cap, self.memo = tokenizer, cap, {}

    def __call__(self, text: str, *, strip_bos: bool = True, cap: bool = False) -> tuple:
        key = (text, strip_bos, cap)
        if key not in self.memo:
            ids = list(self.tok.encode(text))
            bos = getattr(self.tok, "bos_token_id", None)
            if strip_bos and ids and ids[0] == bos:
                ids = ids[1:]
            if cap and self.cap:
                ids = ids[:self.cap]
            self.memo[key] = tuple(ids)
        return self.memo[key]


def _passage_text(ctx) -> str:
    title = ctx.get("title") or ""
    return (f"- Title: {title}\n" if title else "- ") + ctx["text"].strip() + "\n"


def _request(enc, passages, question) -> Request:
    return Request(system=enc(SYSTEM, strip_bos=False),
                   passages=tuple(enc(_passage_text(c), cap=True) for c in passages),
                   question=enc(QUESTION.format(q=question)))


def make_workload(name: str, samples, enc, *, num_requests: int, questions_per_set: int = 4,
                  zipf_s: float = 1.0, passages_per_request: int = 10, seed: int = 0):
    """`num_requests` Requests of workload `name` (see module doc); deterministic in `seed`."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown rag workload {name!r}; use one of {WORKLOADS}")
    rng = np.random.default_rng(seed)
    n = len(samples)
    if name == "single":
        return [_request(enc, samples[i % n]["ctxs"][:passages_per_request],
                         samples[i % n]["question"]) for i in range(num_requests)]
    if name == "multi":
        out = []
        for i in range(num_requests):
            s, k = divmod(i, questions_per_set)
            ctxs = samples[s % n]["ctxs"][:passages_per_request]
            q_sample = s % n if k == 0 else int(rng.integers(n))
            order = rng.permutation(len(ctxs)) if k else np.arange(len(ctxs))
            out.append(_request(enc, [ctxs[j] for j in order], samples[q_sample]["question"]))
        return out
    corpus = list({c["text"]: c for s in samples for c in s["ctxs"]}.values())
    weights = np.arange(1, len(corpus) + 1, dtype=np.float64) ** -zipf_s
    weights /= weights.sum()
    out = []
    for _ in range(num_requests):
        picked = rng.choice(len(corpus), size=passages_per_request, replace=False, p=weights)
        out.append(_request(enc, [corpus[j] for j in picked],
                            samples[int(rng.integers(n))]["question"]))
    return out


def ttft_spans(samples, enc, *, num_spans: int, span_tokens: int, seed: int = 0):
    """(cold, cached): num_spans spans of span_tokens tokens (distinct passages concatenated);
    `cached` holds the same spans in another order with a new question."""
    texts = list(dict.fromkeys(c["text"] for s in samples for c in s["ctxs"]))
    spans, cur, k = [], [], 0
    while len(spans) < num_spans:
        if k >= len(texts):
            raise ValueError(f"musique data holds too few passages for {num_spans} spans of "
                             f"{span_tokens} tokens")
        cur += enc("- " + texts[k] + "\n")
        k += 1
        if len(cur) >= span_tokens:
            spans.append(tuple(cur[:span_tokens]))
            cur = []
    rng = np.random.default_rng(seed)
    q0, q1 = (samples[i]["question"] for i in rng.choice(len(samples), 2, replace=False))
    system = enc(SYSTEM, strip_bos=False)
    order = rng.permutation(num_spans)
    while num_spans > 1 and np.all(order == np.arange(num_spans)):
        order = rng.permutation(num_spans)
    cold = Request(system, tuple(spans), enc(QUESTION.format(q=q0)))
    cached = Request(system, tuple(spans[j] for j in order), enc(QUESTION.format(q=q1)))
    return cold, cached


def segments(req: Request):
    from minipic_jax import Prompt, Span
    return [Prompt(list(req.system)), *[Span(list(p)) for p in req.passages],
            Prompt(list(req.question))]


def plain(req: Request) -> list[int]:
    ids = list(req.system)
    for p in req.passages:
        ids += p
    return ids + list(req.question)


def summary(reqs) -> dict:
    lens = [len(plain(r)) for r in reqs]
    distinct = {p for r in reqs for p in r.passages}
    return {"requests": len(reqs), "prompt_tokens_mean": float(np.mean(lens)) if lens else 0.0,
            "passages": sum(len(r.passages) for r in reqs), "distinct_passages": len(distinct)}
