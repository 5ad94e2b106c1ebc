"""The differential fuzzer's oracle: random Span/Prompt structures run through HF transformers.

Run with the torch reference env (docs/USAGE.md, Development; transformers 5.24.0):

    .venv-ref/bin/python scripts/make_fuzz_fixtures.py

Writes tests/fixtures/fuzz_cases.json for tests/test_fuzz_hf.py. The model is the committed tiny
HF Llama `tests/fixtures/llama_gqa2_llama3rope` (GQA 2, Llama 3.1 RoPE scaling). Each case is a
group of requests drawn from a small pool of shared spans and system prompts (so requests reuse
each other's spans at other offsets), then follow-up turns that repeat a request's segments with
its greedy output appended to the last one and new segments after it (so they reuse blocks filled
during generation). Per request the file holds its segments, HF's greedy continuation and, per
generated token, HF's top logprobs (the first row is the prompt's last token); a follow-up also
holds the index of its parent request in the first turn.

Block-Attention is expressed to HF exactly, by a custom 4D attention mask and position_ids, from
the segments (DESIGN §3, independently of the engine's prompt builder): pads are left out (no
position, never attended); a Span is its SSEP marker plus its tokens and attends within itself; a
Prompt after a Span starts with a PDEP marker and attends to everything before it; consecutive
Prompts are one segment; generated tokens extend the last segment. HF runs in float64 (eager
attention), so the oracle carries no float32 error of its own. A draw whose greedy steps have
top logprobs closer than MIN_GAP (an argmax the engine's float32 could flip) or that generates a
marker id is redrawn, deterministically from the seed.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers
from transformers import LlamaForCausalLM

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "llama_gqa2_llama3rope"
MARKERS = {"pad_token_id": 252, "ssep_token_id": 253, "pdep_token_id": 254}
TEXT_IDS = 250  # prompt tokens are drawn from [0, 250): never a marker, BOS (256) or EOS (257)
NUM_CASES, REQUESTS_PER_CASE, MAX_NEW, TOP, MIN_GAP = 10, 3, 5, 3, 1e-3


def windows(segments):
    """Segments [(kind "P"|"S", tokens)] -> (model-visible token ids, window start per token)."""
    kept, win, prev = [], [], None
    for kind, toks in segments:
        if kind == "S":
            start = len(kept)
            kept += [MARKERS["ssep_token_id"], *toks]
            win += [start] * (1 + len(toks))
        else:
            if prev == "S":
                kept.append(MARKERS["pdep_token_id"])
                win.append(0)
            kept += toks
            win += [0] * len(toks)
        prev = kind
    return kept, win


@torch.no_grad()
def last_logprobs(model, kept, win) -> np.ndarray:
    """HF's log-softmax at the last token of `kept` under the Block-Attention mask, float64."""
    n = len(kept)
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (k <= q) & (k >= torch.tensor(win)[:, None])
    mask = torch.zeros(1, 1, n, n, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    logits = model(input_ids=torch.tensor([kept]), attention_mask=mask,
                   position_ids=torch.arange(n)[None]).logits[0, -1]
    return torch.log_softmax(logits, -1).numpy()


def greedy(model, segments):
    """HF greedy continuation of `segments`: tokens and per step the top TOP (ids, logprobs);
    None when a step is a near tie or generates a marker id."""
    kept, win = windows(segments)
    tokens, top_ids, top_lps = [], [], []
    for _ in range(MAX_NEW):
        lp = last_logprobs(model, kept + tokens, win + [win[-1]] * len(tokens))
        order = np.argsort(-lp)[:TOP + 1]
        if np.min(-np.diff(lp[order])) < MIN_GAP or order[0] in MARKERS.values():
            return None
        tokens.append(int(order[0]))
        top_ids.append([int(t) for t in order[:TOP]])
        top_lps.append([float(lp[t]) for t in order[:TOP]])
    return {"segments": segments, "greedy": tokens, "top_ids": top_ids, "top_logprobs": top_lps}


def rand_tokens(rng, lo, hi):
    return [int(t) for t in rng.integers(0, TEXT_IDS, int(rng.integers(lo, hi + 1)))]


def draw_segments(rng, spans, systems):
    segs = []
    if rng.random() < 0.7:
        segs.append(["P", systems[int(rng.integers(len(systems)))]])
    for _ in range(int(rng.integers(0, 4))):
        segs.append(["S", spans[int(rng.integers(len(spans)))]])
        if rng.random() < 0.3:  # an EPIC-style link between spans
            segs.append(["P", rand_tokens(rng, 1, 6)])
    segs.append(["P", rand_tokens(rng, 1, 12)])
    return segs


def draw_follow_up(rng, parent, spans):
    segs = [list(s) for s in parent["segments"]]
    segs[-1] = [segs[-1][0], segs[-1][1] + parent["greedy"]]
    if rng.random() < 0.5:
        segs.append(["S", spans[int(rng.integers(len(spans)))]])
    segs.append(["P", rand_tokens(rng, 1, 10)])
    return segs


def make_case(model, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    spans = [rand_tokens(rng, 5, 40) for _ in range(4)]
    systems = [rand_tokens(rng, 3, 20) for _ in range(2)]
    turns = [[], []]
    while len(turns[0]) < REQUESTS_PER_CASE:
        req = greedy(model, draw_segments(rng, spans, systems))
        if req is not None:
            turns[0].append(req)
    for k, parent in enumerate(turns[0][:int(rng.integers(1, REQUESTS_PER_CASE + 1))]):
        for _ in range(20):
            req = greedy(model, draw_follow_up(rng, parent, spans))
            if req is not None:
                turns[1].append(dict(req, parent=k))
                break
    return {"seed": seed, "turns": turns}


def check_mask_convention(model) -> None:
    """One plain prompt: the custom mask must reproduce HF's own causal forward."""
    ids = list(range(10, 40))
    ours = last_logprobs(model, ids, [0] * len(ids))
    with torch.no_grad():
        theirs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
    assert np.allclose(ours, theirs.numpy(), atol=1e-12), "4D mask convention mismatch"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "fuzz_cases.json"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    assert transformers.__version__ == "5.24.0", transformers.__version__
    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(ROOT / "tests" / "fixtures" / MODEL,
                                             attn_implementation="eager")
    model = model.to(torch.float64).eval()
    check_mask_convention(model)
    cases = [make_case(model, args.seed * 1000 + c) for c in range(NUM_CASES)]
    out = {"model": MODEL, "markers": MARKERS, "max_new": MAX_NEW, "top": TOP,
           "min_gap": MIN_GAP, "transformers": transformers.__version__,
           "torch": torch.__version__, "cases": cases}
    pathlib.Path(args.out).write_text(json.dumps(out, separators=(",", ":")))
    n = sum(len(t) for c in cases for t in c["turns"])
    print(f"wrote {args.out}: {len(cases)} cases, {n} requests")


if __name__ == "__main__":
    main()
