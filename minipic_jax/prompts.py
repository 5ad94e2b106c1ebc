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
import numbers
from typing import Sequence, Union


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


def as_prompt_list(prompts) -> list:
    """`generate`'s first argument as a list of prompts: one prompt (a str, a dict, a list of
    token ids or of segments) becomes a list of one. Anything else is a TypeError."""
    if isinstance(prompts, (str, dict)) or is_structured(prompts) or (
            isinstance(prompts, (list, tuple)) and prompts and
            all(_is_token(t) for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a dict, a list of token ids or of Prompt/Span "
                        f"segments, or a list of those; got {type(prompts).__name__}")
    return list(prompts)


def _is_token(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _encode(seg, tokenizer, first: bool) -> list[int]:
    if not isinstance(seg.content, str):
        ids = list(seg.content)
        for k, t in enumerate(ids):
            if not _is_token(t):
                raise TypeError(f"{type(seg).__name__} token ids must be ints; index {k} is "
                                f"{t!r} ({type(t).__name__})")
        return [int(t) for t in ids]
    if tokenizer is None:
        raise ValueError("structured prompt with text segments needs a tokenizer")
    ids = list(tokenizer.encode(seg.content))
    bos = getattr(tokenizer, "bos_token_id", None)
    if not (first and isinstance(seg, Prompt)) and ids and bos is not None and ids[0] == bos:
        ids = ids[1:]
    return ids


def build_prompt(segments, *, block_size: int, pad_token_id: int, ssep_token_id: int,
                 pdep_token_id: int, tokenizer=None) -> list[int]:
    """Segments (Prompt / Span, text or ids) -> flat token ids with markers and pads.

    The first segment needs no marker if it is a Prompt (a request starts as PDEP); a leading
    Span gets an SSEP. Raises ValueError for an unknown segment type or an empty segment.
    """
    out: list[int] = []
    prev = None
    for k, seg in enumerate(segments):
        if not isinstance(seg, (Prompt, Span)):
            raise ValueError(f"segment {k}: expected Prompt or Span, got {type(seg).__name__}")
        try:
            ids = _encode(seg, tokenizer, first=(k == 0))
        except TypeError as err:
            raise TypeError(f"segment {k}: {err}") from None
        if not ids:
            raise ValueError(f"segment {k}: empty {type(seg).__name__}")
        if isinstance(seg, Prompt) and isinstance(prev, Prompt):
            out += ids  # consecutive Prompt segments are one PDEP segment
        else:
            if out:
                out += [pad_token_id] * (-len(out) % block_size)
            if isinstance(seg, Span):
                out.append(ssep_token_id)
            elif out:
                out.append(pdep_token_id)
            out += ids
        prev = seg
    return out
