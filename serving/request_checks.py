"""Checks of one request's inputs that need nothing but the request and the model's vocabulary
(the engine's `validate` adds those that need its configuration). Each error names the request
(`who`), the field and the index."""

from __future__ import annotations

import numbers

import numpy as np


def check_token_ids(ids, who: str, vocab_size: int) -> list[int]:
    """Prompt token ids -> a list of ints; a TypeError for a non-integer (floats are not
    truncated), a ValueError for an id outside [0, vocab_size)."""
    ids = list(ids)
    try:
        arr = np.asarray(ids) if ids else np.zeros(0, np.int64)
    except (TypeError, ValueError):  # ragged or mixed: the loop below names the entry
        arr = np.zeros((0, 0))
    if arr.ndim == 1 and arr.dtype.kind in "iu":  # the common case, checked vectorized
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if not bad.size:
            return arr.tolist()
    out = []
    for k, t in enumerate(ids):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise TypeError(f"{who}: prompt token ids must be ints; index {k} is {t!r} "
                            f"({type(t).__name__})")
        t = int(t)
        if not 0 <= t < vocab_size:
            raise ValueError(f"{who}: token id {t} at index {k} is outside "
                             f"the vocabulary [0, {vocab_size})")
        out.append(t)
    return out


def check_sampling(sp, who: str, vocab_size: int, tokenizer) -> None:
    """A SamplingParams checked again (it may have been changed after construction), plus what
    needs the model: stop token ids inside the vocabulary, a tokenizer for stop strings."""
    validate = getattr(sp, "validate", None)
    if validate is None:
        raise TypeError(f"{who}: sampling_params must be a SamplingParams, "
                        f"got {type(sp).__name__}")
    try:
        validate()
    except (TypeError, ValueError) as err:
        raise type(err)(f"{who}: {err}") from None
    for k, t in enumerate(sp.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{who}: SamplingParams.stop_token_ids[{k}] = {t} is outside the "
                             f"vocabulary [0, {vocab_size})")
    if sp.stop and tokenizer is None:
        raise ValueError(f"{who}: SamplingParams.stop needs a tokenizer to decode the output "
                         f"text, and this model has none (use stop_token_ids)")
