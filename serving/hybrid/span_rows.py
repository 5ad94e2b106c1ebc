"""SSEP spans of hybrid models in the engine (cold path): which rows of a step run a span's local
recurrent pass, and where chunks may end (docs/DESIGN.md section 5; the model side is
minipic_jax/models/qwen3_5_spans.py). Plain host Python over numpy.

A span row reads the local pass when its span starts in the same step, or when the step
continues a long span: a non-final span longer than a step (`check_prompt`'s budget) is computed
in pieces over several steps, each piece's local state and map carried to the next in the span's
map-pool slot (serving/hybrid/span_partial.py). A final span carries its local state on itself
(`carry_local`: its remaining rows and generated tokens continue it as ordinary rows). Any other
non-final span stays in one step: a chunk ends before it rather than inside it (`cut_chunk`).
"""

from __future__ import annotations

import numpy as np


def span_intervals(layout, block_size: int, num_prompt_tokens: int):
    """[(start, end, final)] token-index intervals of the prompt's SSEP spans."""
    starts = np.flatnonzero(layout.seg_start)
    ends = list(starts[1:] * block_size) + [num_prompt_tokens]
    return [(int(a) * block_size, int(b), i == len(starts) - 1)
            for i, (a, b) in enumerate(zip(starts, ends)) if layout.span_block[a]]


def check_prompt(layout, block_size: int, num_prompt_tokens: int, budget: int, who: str,
                 pieces: bool = True):
    """ValueError for a non-final span with more valid tokens than one step can take, when the
    engine cannot compute it in pieces (`pieces` False: no span-map pool to carry them)."""
    if pieces:
        return
    for a, b, final in span_intervals(layout, block_size, num_prompt_tokens):
        n = int((~layout.is_pad[a:b]).sum())
        if not final and n > budget:
            seg = int(np.count_nonzero(layout.seg_start[:a // block_size]))
            raise ValueError(f"{who}: segment {seg}, an SSEP span at token index {a}, has {n} "
                             f"tokens, more than "
                             f"one step takes ({budget}: max_num_batched_tokens - max_num_seqs); "
                             f"a longer span is computed in pieces through the span-map pool, "
                             f"which this engine lacks (prefix caching off, or "
                             f"Config.span_maps.budget_gb 0)")


def long_span(seq, a: int, b: int, budget: int) -> bool:
    """Whether the span [a, b) has more valid tokens than `budget` (one step's): computed in
    pieces (serving/hybrid/span_partial.py)."""
    return int((~seq.layout.is_pad[a:b]).sum()) > budget


def cut_chunk(seq, idx, frontier: int, block_size: int, split=None):
    """(idx, frontier) cut back so the chunk does not end inside a non-final span (unless
    `split(a, b)` says the span [a, b) is computed in pieces), nor run past a span the warm path
    skips (serving/hybrid/span_cache.py) once it has rows: the chunk after it enters with its
    map."""
    if idx.size:
        for a, _ in seq.span.skips:
            if idx[0] < a < frontier:
                return idx[idx < a], a
    for a, b, final in _spans(seq, block_size):
        if not final and a < frontier < b and frontier < seq.num_prompt_tokens:
            if split is not None and split(a, b):
                break
            return idx[idx < a], max(a, seq.num_computed)
    return idx, frontier


def starts_span(e, block_size: int) -> bool:
    """Whether a scheduled entry's rows hold the first token of one of its sequence's spans."""
    idx = e.token_idx
    return bool(idx.size) and any(int(idx[0]) <= a <= int(idx[-1])
                                  for a, _, _ in _spans(e.seq, block_size))


def _spans(seq, block_size):
    if seq.memo.span_intervals is None:
        seq.memo.span_intervals = span_intervals(seq.layout, block_size, seq.num_prompt_tokens)
    return seq.memo.span_intervals


def step_rows(batch, block_size: int):
    """Per real row of the step: (piece id, is-span row), and per sequence carry_local.

    Piece ids change at each sequence start, at each span start in the step, and at the first
    row after a span whose map the step captures (`map_caps`: its piece holds its rows only, so
    the piece's final local state is the map's B, serving/hybrid/span_cache.py). A piece of a long
    span that started in an earlier step starts at the step's first row (its map so far enters
    it: serving/hybrid/span_partial.py). Rows of other segments ride in the previous piece; the
    model reads their flow outputs."""
    piece, span_row, carry = [], [], []
    pid = -1
    for e in batch:
        seq, idx = e.seq, np.asarray(e.token_idx)
        pid += 1
        lo = int(idx[0]) if idx.size else 0
        hi = int(idx[-1]) + 1 if idx.size else 0
        starts = {}
        for a, b, final in _spans(seq, block_size):
            if lo <= a < hi:
                starts[a] = (b, final)
            elif a < lo < b and not final and idx.size:  # a long span's next piece
                starts[lo] = (b, final)
        caps = {c[0] for c in e.map_caps}
        cur_end, last_final, cut_after = -1, False, False
        for k, i in enumerate(idx.tolist()):
            in_span = i < cur_end
            if i in starts:
                (cur_end, last_final), in_span = starts[i], True
            if k > 0 and (i in starts or (cut_after and not in_span)):
                pid += 1
            if i in starts or not in_span:
                cut_after = i in caps
            span_row.append(in_span)
            piece.append(pid)
        carry.append(bool(idx.size) and last_final and span_row[-1])
    return np.asarray(piece, np.int64), np.asarray(span_row, bool), carry
