"""The model runner's side of SSEP spans on hybrid models (serving/hybrid/span_rows.py: the cold path;
serving/hybrid/span_cache.py: the warm path): the step's static span shapes, its host fields, and the
device code of a warm step.

A warm step (a span-map pool is attached) carries up to MAX_CAPTURES (piece, slot, continues)
triples: the spans it computes whole whose maps it stores, and the pieces of long spans
(serving/hybrid/span_partial.py), a continuing one entering with the slot's map so far (`entry`).
Inside the jitted step: the model, whose local pass returns the captured pieces' maps, then the
store into the pool. The chains of cached maps its sequences enter with (`chain_shape`: [Sc, L],
-1 padded) are composed before it, by a program of their own keyed only by that shape
(serving/hybrid/span_compose.py: a checkpoint restore first, then the chain, `enter`), so the
chain rows add no step variant.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from serving.hybrid import checkpoint_pool, span_maps, span_rows
from serving.hybrid.span_cache import MAX_CAPTURES  # noqa: F401 (the runner's static capture count)
from serving.model_contract import SpanPieces


def piece_bound(t: int, s: int) -> int:
    """Static bound on a step's span pieces (serving/hybrid/span_rows.py): one per sequence, one per
    span start in the step, one after each captured span. (The local pass pads every piece to
    whole chunks, so the bound is part of its cost.)"""
    return s + max(8, t // 8) + MAX_CAPTURES


# chain lengths: one static length per engine, the most maps a chain can hold (a skipped span
# covers at least one block, so at most the block-table width; at least 16). The composing loops
# stop where the chains end (serving/hybrid/chain_compose.py), so padding costs nothing on device
# and the length adds no step variant. A longer chain (never expected) pads up by 4x and compiles.
MIN_CHAIN_LENGTH = 16


def chain_length(max_blocks_per_seq: int) -> int:
    """The static chain length of an engine whose block tables hold `max_blocks_per_seq`."""
    return max(MIN_CHAIN_LENGTH, max_blocks_per_seq)


def chain_rows(n: int, s: int) -> int:
    """Rows of the chain array for n sequences with a chain, s the engine's largest step:
    powers of two from 4, at most s. A compose program reads, composes and writes every row's
    state, padding included (at rag's 16 seats, 5 chains on 16 rows: a 0.36 ms state gather
    and a 0.33 ms chain kernel on an H100), and is small to compile (no model)."""
    rows = 4
    while rows < n:
        rows *= 2
    return min(s, rows)


def chain_shape(batch, s: int, length: int = MIN_CHAIN_LENGTH) -> tuple[int, int]:
    """(rows, length) of the step's chains of cached span maps, both static: only sequences
    with a chain get a row (chain_rows, s the engine's largest step), `length` maps
    (chain_length), so the compose programs of warm_chains serve every step."""
    lengths = [len(e.map_chain) for e in batch if e.map_chain]
    longest = max(lengths, default=0)
    while length < longest:
        length *= 4
    return chain_rows(len(lengths), s), length


def warm_chains(s: int, length: int = MIN_CHAIN_LENGTH) -> list[tuple[int, int]]:
    """The chain shapes warm-up compiles for an engine whose largest step holds s sequences:
    every row bucket (serving/hybrid/span_compose.py: one small program each)."""
    return sorted({(chain_rows(n, s), length) for n in range(1, s + 1)})


def has_spans(seq) -> bool:
    if seq.memo.has_spans is None:
        seq.memo.has_spans = bool(seq.layout.span_block.any())
    return seq.memo.has_spans


def step_has_spans(batch, block_size: int) -> bool:
    """Whether a step takes the span variant: some row starts a span (its rows read the local
    pass, span_rows.step_rows), or a sequence captures a span's map. Other steps of span prompts
    (decodes, later chunks of a final span, PDEP rows) are plain steps: all their rows read the
    flow, so the general and decode variants serve them. So is a sequence that only enters with
    cached maps: the compose program before the step (serving/hybrid/span_compose.py) leaves its
    entry state in its slot, and its rows read the flow from there (the span variant cost a
    121-token step after six skipped spans 12.4 ms against a plain step's 6.2, H100)."""
    return any(has_spans(e.seq) and (e.map_caps or span_rows.starts_span(e, block_size))
               for e in batch)


def fill_rows(batch, v, rows: int, block_size: int, t: int, s: int) -> np.ndarray:
    """row_span / piece_cu / carry_local of a step of t rows and s sequences holding span rows
    (serving/hybrid/span_rows.py); returns the pieces' first rows. Checks the static bounds the
    device relies on: the pieces (piece_bound) and the local pass's chunks (local_chunk_bound:
    tokens past it would be lost)."""
    piece, span_row, carry = span_rows.step_rows(batch, block_size)
    starts = np.flatnonzero(np.r_[True, piece[1:] != piece[:-1]]) if rows else np.zeros(0, int)
    bound = piece_bound(t, s)
    if starts.size > bound:
        raise RuntimeError(f"model runner: {starts.size} span pieces in one step exceed the "
                           f"bound {bound}")
    chunks, chunk_bound = step_local_chunks(piece, span_row), span_rows.local_chunk_bound(t, s)
    if chunks > chunk_bound:
        raise RuntimeError(f"model runner: the step's span pieces take {chunks} local-pass "
                           f"chunks, more than its bound {chunk_bound} "
                           f"(span_rows.cut_local keeps every chunk within it)")
    v["piece_cu"][:] = rows
    v["piece_cu"][:starts.size] = starts
    v["row_span"][:rows] = span_row
    v["carry_local"][:len(carry)] = carry
    return starts


def step_local_chunks(piece, span_row, chunk: int = span_rows.LOCAL_CHUNK) -> int:
    """Packed chunks the local pass takes for a step's rows (piece id and is-span per row: each
    piece's span rows padded to whole chunks): the step's sum of span_rows.local_chunks, which
    counts one scheduled chunk's from its sequence's spans."""
    if not len(piece):
        return 0
    n = np.bincount(np.asarray(piece)[np.asarray(span_row, bool)], minlength=int(piece.max()) + 1)
    return int(np.sum(-(-n // chunk)))


def pieces(f, maps, warm: bool, t: int, s: int) -> SpanPieces:
    """The step's SpanPieces from its int fields (traced); warm: with the span-map pool's capture
    and entry fields. The local pass is sized by local_chunk_bound(t, s) (fill_rows checked)."""
    return SpanPieces(row_span=f["row_span"] > 0, piece_cu=f["piece_cu"],
                      carry_local=f["carry_local"] > 0, capture=f["cap_piece"] if warm else None,
                      entry=entry(maps, f) if warm else None,
                      local_chunks=span_rows.local_chunk_bound(t, s))


def fill_maps(batch, v, starts) -> None:
    """cap_piece / cap_slot / cap_cont of a warm span step (serving/hybrid/span_cache.py): the
    piece each captured span fills (a captured span starts a piece: span_rows.step_rows). The
    chains of cached maps go to the compose program (serving/hybrid/span_compose.fill)."""
    v["cap_piece"][:] = -1
    v["cap_slot"][:] = -1
    v["cap_cont"][:] = 0
    k, row = 0, 0
    for e in batch:
        for tok, slot, cont in e.map_caps:
            r = row + int(np.searchsorted(e.token_idx, tok))
            v["cap_piece"][k] = int(np.searchsorted(starts, r, side="right")) - 1
            v["cap_slot"][k] = slot
            v["cap_cont"][k] = cont
            k += 1
        row += e.token_idx.size
    caps = v["cap_piece"][:k]
    if np.unique(caps).size != k:  # affine.ragged_maps gathers the captured pieces' rows
        raise RuntimeError(f"model runner: captured span pieces {caps.tolist()} repeat")


def entry(maps, f) -> dict:
    """SpanPieces.entry of a warm step: the captures that continue a long span read the map so
    far from their own slot (serving/hybrid/span_partial.py; cap_cont), each GDN layer its rows."""
    slot = jnp.clip(f["cap_slot"], 0, maps.a.shape[0] - 1)
    use = (f["cap_cont"] > 0) & (f["cap_slot"] >= 0)
    return dict(use=use, slot=slot, count=maps.count[slot], a=maps.a, b=maps.b, tail=maps.tail)


def enter(family, cache, pool, maps, f, reset, *, precision=None):
    """Restore rows' checkpoints (pool: the checkpoint pool or None), then every chain of cached
    spans (f: state_slots, chain_seq, chain, restore_slot with a pool). Returns (cache, reset,
    f) with the restores marked done; precision: the composition's dots
    (span_maps.entry_states). The compose program runs it (serving/hybrid/span_compose.program)."""
    restore = None
    if pool is not None:  # a resume at c comes before the spans skipped right after c
        # one a chain row (span_compose.py's own field), read with the chain row's state
        restore = (pool, f["restore_slot"])
        f = dict(f, restore_slot=jnp.full_like(f["restore_slot"], -1))
    cache, reset = span_maps.enter(family, cache, maps, f["state_slots"], reset, f["chain_seq"],
                                   f["chain"], precision=precision, restore=restore)
    return cache, reset, f


def forward(family, params, tokens, md, cache, mcfg, pool, maps, f, kw):
    """The model (with the checkpoint pool when there is one), then the captured maps into the
    span-map pool. Returns (logits, cache, checkpoint pool, span-map pool)."""
    if pool is None:
        logits, cache, ck = family.forward_with_checkpoints(params, tokens, md, cache, mcfg, **kw)
    else:
        logits, cache, pool, ck = checkpoint_pool.checkpointed_forward(
            family, params, tokens, md, cache, mcfg, pool, f, False, kw, with_extras=True)
    m = ck["span_maps"]
    maps = span_maps.store(maps, f["cap_slot"], m["a"], m["b"], m["tail"], m["count"])
    return logits, cache, pool, maps
