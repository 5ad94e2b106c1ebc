"""Overlap-depth distributions for the planner benchmark, built from the data in benchmarks/data.

A workload is a list of overlap depths (tokens a request shares with what is already cached) and a
weight per depth. Every construction is spelled out in its function's docstring; the numbers that
are assumptions rather than data are keyword arguments with their defaults stated there.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import pathlib

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent / "data"
CHUNK = 64  # recurrent-kernel chunk: checkpoints may only sit on multiples of this
TOKENS_PER_WORD = 1.3  # word -> token proxy where no text is available


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    depths: np.ndarray  # [R] int64 overlap depth of each request (or distinct depth)
    weights: np.ndarray  # [R] float64 weight of each

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def pmf(self, n: int | None = None) -> np.ndarray:
        """[n+1] pmf over depths 0..n (n defaults to the deepest overlap)."""
        n = self.max_depth if n is None else n
        return np.bincount(self.depths, weights=self.weights, minlength=n + 1)[: n + 1]


@functools.lru_cache(maxsize=1)
def _encoder():
    """Token counter: the shipped Llama 3 tokenizer, else a word-count proxy (None)."""
    try:
        from minipic_jax.loading.tokenizer import Llama3Tokenizer
        tok = Llama3Tokenizer()
        return lambda text: tok.encode(text)[1:]  # no BOS: these are pieces of one prompt
    except Exception:  # noqa: BLE001 - any failure falls back to the documented proxy
        return None


def tokenizer_name() -> str:
    return "llama3-tiktoken" if _encoder() is not None else f"words*{TOKENS_PER_WORD}"


def encode(text: str) -> tuple:
    enc = _encoder()
    if enc is not None:
        return tuple(enc(text))
    return tuple(range(int(np.ceil(TOKENS_PER_WORD * len(text.split())))))  # length proxy only


def longdoc(context: int = 131072, questions_per_doc: int = 30, header_tokens: int = 32,
            reserve: int = 256) -> Workload:
    """Many questions about each of the 1,572 NarrativeQA documents (QuALITY-style reading QA).

    A request is [header][document][question]. Document tokens = 1.3 x story_word_count (the CSV
    has no text), truncated so header + document + `reserve` tokens (question and answer) fit
    `context` (Llama 3.1's 128K). The first question about a document shares only the header with
    the cache; each of the other `questions_per_doc - 1` (NarrativeQA has ~30 per document) shares
    header + the whole document. So the overlap mass sits near each document's full length.
    """
    with open(DATA / "narrativeqa_documents.csv", newline="") as f:
        words = np.array([int(r["story_word_count"]) for r in csv.DictReader(f)])
    doc = np.minimum(np.round(TOKENS_PER_WORD * words).astype(np.int64),
                     context - header_tokens - reserve)
    depths = np.concatenate([[header_tokens], header_tokens + doc])
    weights = np.concatenate([[len(doc)], np.full(len(doc), questions_per_doc - 1.0)])
    return Workload("longdoc", "NarrativeQA documents, 30 questions each, 128K context", depths,
                    weights)


def sysprompt(seed: int = 0, prompts: int = 16, conversations: int = 4000, min_len: int = 200,
              max_len: int = 8000, zipf: float = 1.0, mean_turns: float = 2.5,
              reply_median: float = 200.0) -> Workload:
    """Chat traffic behind a few shared system prompts: overlap concentrated at short depths.

    Assumptions (no system-prompt data ships with the project): `prompts` system prompts with
    lengths log-uniform in [min_len, max_len] tokens, chosen with Zipf(`zipf`) popularity; each
    conversation has 1 + Geometric turns (mean `mean_turns`); user turns are real MuSiQue
    questions (their Llama 3 token counts + 8 template tokens); assistant replies are lognormal
    (median `reply_median` tokens, sigma 0.8, at most 1024). Turn 0 of a conversation shares the
    system prompt with earlier conversations; turn i shares the system prompt and turns < i (the
    previous request and its reply are cached).
    """
    rng = np.random.default_rng(seed)
    questions = [len(encode(s["question"])) + 8 for s in _musique()]
    lengths = np.round(np.exp(rng.uniform(np.log(min_len), np.log(max_len), prompts))).astype(int)
    pop = 1.0 / np.arange(1, prompts + 1) ** zipf
    depths = []
    for _ in range(conversations):
        depth = int(lengths[rng.choice(prompts, p=pop / pop.sum())])
        for _turn in range(int(rng.geometric(1.0 / mean_turns))):
            depths.append(depth)
            reply = min(1024, int(rng.lognormal(np.log(reply_median), 0.8)))
            depth += questions[rng.integers(len(questions))] + reply
    depths = np.asarray(depths, dtype=np.int64)
    return Workload("sysprompt", "16 shared system prompts + multi-turn chat", depths,
                    np.ones(depths.size))


@functools.lru_cache(maxsize=1)
def _musique() -> list:
    with open(DATA / "musique_s.json") as f:
        return json.load(f)


RAG_HEADER = ("You answer questions about the passages below. Read all of them, then reply with "
              "the answer only, in a few words.\n\n")


def _lcp(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _radix_depths(requests: list) -> np.ndarray:
    """Overlap of each request (a list of token segments) with all earlier ones: a radix match.

    Walks a trie of whole segments; at the first segment that no earlier request has at this
    point, adds the longest token-level common prefix with the segments that earlier requests do
    have there. Exact when no segment is a proper prefix of a different one (true here: every
    passage and question ends with its own text and separator).
    """
    root: dict = {}
    out = []
    for segs in requests:
        node, depth = root, 0
        for seg in segs:
            if seg in node:
                node, depth = node[seg], depth + len(seg)
                continue
            depth += max((_lcp(seg, other) for other in node), default=0)
            break
        out.append(depth)
        node = root
        for seg in segs:
            node = node.setdefault(seg, {})
    return np.asarray(out, dtype=np.int64)


def rag(multihop: bool = False, step: int = 2) -> Workload:
    """MuSiQue RAG: [header][passage 1]...[passage k][question], passages in retrieved order.

    One-shot (`multihop=False`): each of the 150 samples is asked once, in dataset order, with all
    10 passages; its overlap is the longest common token prefix with any earlier request (what a
    radix prefix cache hits): the header, plus any leading passages that an earlier sample
    retrieved in the same order.
    Multi-hop (`multihop=True`): an iterative-retrieval agent answers each sample in rounds, adding
    `step` passages per round (2, 4, ..., 10 passages; the question stays last), so round r reuses
    the header and the passages of round r-1.
    """
    header = encode(RAG_HEADER)
    requests = []
    for sample in _musique():
        passages = [encode(f"Passage {i + 1}: {c['text']}\n\n")
                    for i, c in enumerate(sample["ctxs"])]
        question = encode(f"Question: {sample['question']}\nAnswer:")
        counts = range(step, len(passages) + 1, step) if multihop else [len(passages)]
        for k in counts:
            requests.append([header, *passages[:k], question])
    depths = _radix_depths(requests)
    name = "rag-multihop" if multihop else "rag"
    desc = ("MuSiQue, agent adds 2 passages per round" if multihop
            else "MuSiQue, one request per sample, radix prefix overlap")
    return Workload(name, desc, depths, np.ones(depths.size))


def all_workloads() -> list[Workload]:
    return [longdoc(), sysprompt(), rag(), rag(multihop=True)]
