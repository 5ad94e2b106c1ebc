"""Structured prompts: segments -> token ids with SSEP/PDEP markers and padding placed.

    [Prompt(system), Span(doc1), Span(doc2), Prompt(question)]

becomes `system + pads | SSEP doc1 + pads | SSEP doc2 + pads | PDEP question`: every segment after
the first starts at a block boundary with its marker, the one before it padded up to the boundary
(pads are invisible: no position, no attention, so padding never changes the output). A Span's KV
depends only on its own tokens and is a cache hit at any offset in any later request; a Prompt
segment attends to everything before it. Consecutive Prompt segments merge into one.

Recipes:
  * Block-Attention (Tulu3-Block-FT): [Prompt(system), Span(doc_1), ..., Span(doc_n),
    Prompt(question)] -- each retrieved document is a block, the question attends to all.
  * Prompt Cache style modules: each reusable module (a schema, a persona, a tool list) is a
    Span; the request-specific parts between them are Prompt segments. Modules are computed once
    and reused wherever they appear.
  * EPIC-style link blocks: after each Span(doc_i) put a short Prompt(link_i) (e.g. the first few
    tokens of the next document or a separator sentence): link blocks attend to everything before
    them, recovering some cross-document attention at the cost of recomputing only the links.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence, Union

import numpy as np

from minipic_jax.segment_ids import convert, is_token


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A PDEP segment (attends to everything before it): text or token ids."""
    content: Union[str, Sequence[int]]


@dataclasses.dataclass(frozen=True)
class Span:
    """An SSEP span (attends only within itself; reusable at any offset): text or token ids."""
    content: Union[str, Sequence[int]]


def is_structured(prompt) -> bool:
    """A list of segments (its first element is a Prompt or Span), not a list of token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], (Prompt, Span))


def _is_array(x) -> bool:
    return hasattr(x, "__array__") and hasattr(x, "ndim") and not isinstance(x, (str, bytes))


def array_token_ids(x, where: str = "prompt") -> list[int]:
    """A 1-D integer array (numpy or JAX: what a JAX pipeline holds) -> a list of token ids; a
    TypeError for another dtype or shape (a 2-D batch is ambiguous about padding: pass a list
    of 1-D arrays, one per prompt)."""
    import numpy as np
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TypeError(f"{where}: an array prompt must be 1-D with an integer dtype (token ids), "
                        f"got shape {arr.shape} dtype {arr.dtype}; for a batch pass a list of "
                        f"1-D arrays")
    return arr.tolist()


def _from_array(p, index: int):
    if _is_array(p):
        return array_token_ids(p, f"request {index}")
    if isinstance(p, dict) and _is_array(p.get("prompt_token_ids")):
        return {**p, "prompt_token_ids": array_token_ids(p["prompt_token_ids"],
                                                         f"request {index}")}
    return p


def as_prompt_list(prompts) -> list:
    """`generate`'s first argument as a list of prompts: one prompt (a str, a dict, a list of
    token ids or of segments, a 1-D integer array) becomes a list of one; arrays become lists
    of token ids. Anything else is a TypeError."""
    if _is_array(prompts):
        return [array_token_ids(prompts, "prompts")]
    if isinstance(prompts, (str, dict)) or is_structured(prompts) or (
            isinstance(prompts, (list, tuple)) and prompts and
            all(_is_token(t) for t in prompts)):
        return [_from_array(prompts, 0)]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a dict, a list of token ids or of Prompt/Span "
                        f"segments, a 1-D integer array, or a list of those; "
                        f"got {type(prompts).__name__}")
    return [_from_array(p, i) for i, p in enumerate(prompts)]


def _is_token(t) -> bool:
    return is_token(t)


def _encode(seg, tokenizer, first: bool, memo) -> tuple[list[int], np.ndarray | None]:
    """A segment's ids as (Python ints, int64 array or None): segment_ids.convert, through
    `memo` (a SegmentMemo) when given."""
    what = type(seg).__name__
    if not isinstance(seg.content, str):
        return (convert if memo is None else memo.convert)(seg.content, what)
    if tokenizer is None:
        raise ValueError("structured prompt with text segments needs a tokenizer")
    ids = list(tokenizer.encode(seg.content))
    bos = getattr(tokenizer, "bos_token_id", None)
    if not (first and isinstance(seg, Prompt)) and ids and bos is not None and ids[0] == bos:
        ids = ids[1:]
    return convert(ids, what)


@functools.lru_cache(maxsize=1024)
def _head(pad_token_id: int, num_pads: int, marker: int | None) -> tuple[tuple, np.ndarray]:
    """A segment's head: the pads that end the block before it, then its marker (None: none),
    as ids and as a read-only int64 array (made once: ~1 us a segment)."""
    head = (pad_token_id,) * num_pads + (() if marker is None else (marker,))
    arr = np.array(head, np.int64)
    arr.flags.writeable = False
    return head, arr


def build_prompt(segments, *, block_size: int, pad_token_id: int, ssep_token_id: int,
                 pdep_token_id: int, tokenizer=None) -> list[int]:
    """Segments (Prompt / Span, text or ids) -> flat token ids with markers and pads.

    The first segment needs no marker if it is a Prompt (a request starts as PDEP); a leading
    Span gets an SSEP. Raises ValueError for an unknown segment type or an empty segment, and
    a TypeError naming the segment and index of an id that is no int (a bool is none).
    """
    return build_prompt_ids(segments, block_size=block_size, pad_token_id=pad_token_id,
                            ssep_token_id=ssep_token_id, pdep_token_id=pdep_token_id,
                            tokenizer=tokenizer)[0]


def build_prompt_ids(segments, *, block_size: int, pad_token_id: int, ssep_token_id: int,
                     pdep_token_id: int, tokenizer=None, memo=None,
                     starts: list | None = None) -> tuple[list[int], np.ndarray | None]:
    """`build_prompt`'s ids and the same as a read-only int64 array (None where an id does not
    fit int64: the request checks name it), built from each segment's converted ids (minipic_jax/
    segment_ids.py; `memo`: a SegmentMemo, so a list given again is not converted again): no
    pass over the prompt's ids in Python, and none in C beyond copying them. `starts`: a list
    that gets (first, end, segment index, kind) of each segment's ids in the prompt."""
    out: list[int] = []
    pieces: list = []  # int64 arrays, concatenated at the end (None: one segment has none)
    prev = None
    for k, seg in enumerate(segments):
        if not isinstance(seg, (Prompt, Span)):
            raise ValueError(f"segment {k}: expected Prompt or Span, got {type(seg).__name__}")
        try:
            ids, arr = _encode(seg, tokenizer, k == 0, memo)
        except TypeError as err:
            raise TypeError(f"segment {k}: {err}") from None
        if not ids:
            raise ValueError(f"segment {k}: empty {type(seg).__name__}")
        if not (isinstance(seg, Prompt) and isinstance(prev, Prompt)):
            # a new segment (consecutive Prompt segments are one PDEP segment)
            marker = ssep_token_id if isinstance(seg, Span) else pdep_token_id if out else None
            head, head_arr = _head(pad_token_id, -len(out) % block_size if out else 0, marker)
            out += head
            pieces.append(head_arr)
        if starts is not None:
            starts.append((len(out), len(out) + len(ids), k, type(seg).__name__))
        out += ids
        pieces.append(arr)
        prev = seg
    if not pieces or any(p is None for p in pieces):
        return out, None
    arr = np.concatenate(pieces)
    arr.flags.writeable = False  # the request checks keep it as the prompt's ids, uncopied
    return out, arr


def segment_of(segments, index: int, **build) -> tuple[int, str, int] | None:
    """(segment index, its kind, the index inside its ids) of token `index` of the prompt
    `build_prompt_ids(segments, **build)` gives, or None for a pad or marker placed between
    segments. For error messages: the prompt is built again."""
    starts: list = []
    build_prompt_ids(segments, starts=starts, **build)
    for first, end, k, kind in starts:
        if first <= index < end:
            return k, kind, index - first
    return None
