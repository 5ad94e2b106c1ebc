"""SSEP spans of hybrid models in the engine (cold path): which rows of a step run a span's local
recurrent pass, and where chunks may end (docs/DESIGN.md section 5; the model side is
minipic_jax/models/qwen3_5_spans.py). Plain host Python over numpy.

A span row reads the local pass when its span starts in the same step, or when the step
continues a span computed in pieces: a non-final span longer than a step (`check_prompt`'s
budget), or one that does not fit the rest of a step of which at least FILL_PIECE rows do
(span_cache.SpanMapCache.cut), is computed in pieces over several steps, each piece's local state
and map carried to the next in the span's map-pool slot (serving/hybrid/span_partial.py). (A
split changes a span's bits at float32 rounding, as chunking any prompt does: its later rows'
attention reads the earlier ones from the pages.) A final span carries its local state on
itself (`carry_local`: its remaining rows and generated tokens continue it as ordinary rows).
Any other non-final span stays in one step: a chunk ends before it rather than inside it
(`cut_chunk`).
"""

from __future__ import annotations

import numpy as np

# The local pass pads each span piece to whole chunks (the GDN kernels' chunk, qwen3_5.CHUNK), and
# its packed stream is static: its XLA gathers and buffers cost the stream, not the rows in it. A
# chunk of r rows may give its span pieces LOCAL_SLACK + r // (2 C) chunks more than ceil(r / C)
# (`cut_local`), so a step's take at most `local_chunk_bound` (over its chunks, sum ceil(r / C) <=
# ceil(T / C) + S - 1). A chunk of LOCAL_SLACK + 1 span pieces or fewer always fits (k ceilings
# sum to at most the ceiling of the sum + k - 1), and so does one whose pieces hold 2 C rows or
# more each, however they align (rag's pieces: SSEP + 128 passage tokens = 129 rows, 3 chunks).
LOCAL_CHUNK, LOCAL_SLACK = 64, 2
# A span that does not fit the rest of a step goes in pieces when this many of its rows fit (and
# the span-map cache can carry them): the step is filled instead of ending before the span (with
# the first span start's break, issue 29's 6 x 900-token span request takes a plain prompt's 6
# prefill steps, was 7). Shorter room is left to other sequences (rag's 129-row passages never
# split).
FILL_PIECE = 256


def _local_budget(rows: int, chunk: int) -> int:
    """The chunks a chunk of `rows` rows may give its span pieces (module comment)."""
    return -(-rows // chunk) + LOCAL_SLACK + rows // (2 * chunk)


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
    return valid_rows(seq, a, b) > budget


def cut_chunk(seq, idx, frontier: int, block_size: int, split=None, chunk: int = LOCAL_CHUNK):
    """(idx, frontier) cut back so the chunk does not end inside a non-final span (unless
    `split(a, b)` says the span [a, b) is computed in pieces), nor run past a span the warm path
    skips (serving/hybrid/span_cache.py) once it has rows: the chunk after it enters with its
    map; then so its span pieces fit the local pass's stream (`cut_local`)."""
    idx, frontier = _cut_spans(seq, idx, frontier, block_size, split)
    return cut_local(seq, idx, frontier, block_size, chunk)


def _cut_spans(seq, idx, frontier: int, block_size: int, split):
    if idx.size:
        for a, _ in seq.span.skips:
            if idx[0] < a < frontier:
                return idx[idx < a], a
    for a, b, final in spans_of(seq, block_size):
        if not final and a < frontier < b and frontier < seq.num_prompt_tokens:
            if split is not None and split(a, b):
                break
            return idx[idx < a], max(a, seq.num_computed)
    return idx, frontier


def valid_rows(seq, a: int, b: int) -> int:
    """Tokens of [a, b) that are rows (not padding)."""
    return int((~seq.layout.is_pad[a:b]).sum())


def local_chunk_bound(t: int, s: int, chunk: int = LOCAL_CHUNK) -> int:
    """Static bound on the local pass's packed chunks in a step of t rows and s sequences
    (SpanPieces.local_chunks), given every chunk keeps `cut_local`'s rule."""
    return -(-t // chunk) + (1 + LOCAL_SLACK) * s + t // (2 * chunk)


def _span_pieces(seq, idx, block_size: int) -> list[int]:
    """Span rows of each piece of the chunk `idx` that holds span rows (step_rows' pieces: a span
    starting in it, or the continued piece of a long non-final span at its first row)."""
    if not idx.size:
        return []
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    out = []
    for a, b, final in spans_of(seq, block_size):
        if lo <= a < hi or (a < lo < b and not final):
            out.append(int(np.searchsorted(idx, b) - np.searchsorted(idx, max(a, lo))))
    return out


def local_chunks(seq, idx, block_size: int, chunk: int = LOCAL_CHUNK) -> int:
    """Packed chunks the local pass gives the chunk `idx`'s span pieces."""
    return sum(-(-n // chunk) for n in _span_pieces(seq, idx, block_size))


def cut_local(seq, idx, frontier: int, block_size: int, chunk: int = LOCAL_CHUNK):
    """(idx, frontier), cut before a span start if its span pieces would take more chunks than
    its rows may (`_local_budget`: many short spans in one chunk): the longest prefix that fits,
    ending before a span start (LOCAL_SLACK + 1 pieces always fit)."""
    def fits(rows):
        return local_chunks(seq, rows, block_size, chunk) <= _local_budget(rows.size, chunk)
    if fits(idx):
        return idx, frontier
    lo = int(idx[0])
    for a in sorted((a for a, _, _ in spans_of(seq, block_size) if lo < a <= int(idx[-1])),
                    reverse=True):
        if fits(idx[idx < a]):
            return idx[idx < a], a
    raise RuntimeError(f"span rows: no cut of sequence {seq.seq_id}'s chunk fits the local pass")


def starts_span(e, block_size: int) -> bool:
    """Whether a scheduled entry's rows hold the first token of one of its sequence's spans."""
    idx = e.token_idx
    return bool(idx.size) and any(int(idx[0]) <= a <= int(idx[-1])
                                  for a, _, _ in spans_of(e.seq, block_size))


def spans_of(seq, block_size: int):
    """span_intervals of the sequence's prompt, computed once a sequence (its layout is fixed)."""
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
        for a, b, final in spans_of(seq, block_size):
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


def depths_outside_spans(layout, depth: int) -> list[int]:
    """k = depth, ..., 1 (descending) whose block k - 1 is no span block, i.e. where a prefix
    checkpoint's key can cover everything before it (a span block's key restarts at its span).
    A generated block past the prompt's layout continues its last segment. One array pass: a
    span prompt's match covers hundreds of span blocks (was a call a block)."""
    span = np.asarray(layout.span_block, bool)
    n = len(span)
    past = [] if n and span[-1] else list(range(depth, n, -1))
    return past + (np.flatnonzero(~span[:min(depth, n)])[::-1] + 1).tolist()
