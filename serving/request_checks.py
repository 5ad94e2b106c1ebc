"""Checks of one request's inputs that need nothing but the request and the model's vocabulary
(the engine's `validate` adds those that need its configuration). Each error names the request
(`who`), the field and the index."""

from __future__ import annotations

import array
import numbers

import numpy as np

from serving.hybrid import span_rows
from serving.layout import build_layout


def check_token_ids(ids, who: str, vocab_size: int, markers: dict | None = None,
                    block_size: int = 1) -> np.ndarray:
    """Prompt token ids -> an int64 array (converted once: the layout and the block hashes use
    it); a TypeError for a non-integer (floats are not truncated), a ValueError for an id
    outside [0, vocab_size) other than a marker beyond the vocabulary (`markers`, the engine's:
    the pad id anywhere, SSEP/PDEP at block starts, see `_check_beyond_vocab`)."""
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype == np.int64:
        # converted already (LLM.prompt_ids: a structured prompt's ids, read-only and owning
        # its memory, so kept as it is); the caller's own array is copied (it may change it)
        arr = ids if ids.base is None and not ids.flags.writeable else ids.copy()
    else:
        if not isinstance(ids, list):
            ids = list(ids)
        try:  # array("q") takes ints (and numpy ints) only, as int64; bools: _first_bool
            arr = np.frombuffer(array.array("q", ids), np.int64) if ids else np.zeros(0, np.int64)
        except (TypeError, ValueError, OverflowError):  # the loop below names the bad entry
            arr = None
        if arr is not None and _first_bool(ids, arr) is not None:
            arr = None  # the loop below names it
    if arr is not None:  # the common case, checked vectorized: two reductions, no temporaries
        lo, hi = (int(arr.min()), int(arr.max())) if arr.size else (0, -1)
        if lo >= 0 and hi < vocab_size:
            return arr
        if lo >= 0 and markers is not None:
            _check_beyond_vocab(arr, who, vocab_size, markers, block_size)
            return arr
        ids = arr.tolist()
    out = []
    for k, t in enumerate(ids):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise TypeError(f"{who}: prompt token ids must be ints; index {k} is {t!r} "
                            f"({type(t).__name__})")
        t = int(t)
        if not 0 <= t < vocab_size and not (markers and t in markers.values()):
            raise id_error(who, f"token id {t}", k,
                           f"is outside the vocabulary [0, {vocab_size})")
        out.append(t)
    arr = np.asarray(out, np.int64)
    if markers:
        _check_beyond_vocab(arr, who, vocab_size, markers, block_size)
    return arr


def _first_bool(ids: list, arr: np.ndarray) -> int | None:
    """Index of the first bool in `ids` (array("q") took it as 0 or 1), else None: only the
    entries whose value is 0 or 1 are looked at, so a list of ids costs one vectorized pass."""
    for k in np.flatnonzero((arr >> 1) == 0).tolist():
        if isinstance(ids[k], bool):
            return k
    return None


def _check_beyond_vocab(arr: np.ndarray, who: str, vocab_size: int, markers: dict,
                        block_size: int) -> None:
    """Ids >= vocab_size are markers only (serving/config.py `default_marker_ids`): the pad id
    anywhere, the SSEP/PDEP ids at a block start, where they mean something; any other is a
    ValueError naming the first such index."""
    heads = [markers["ssep_token_id"], markers["pdep_token_id"]]
    over = np.flatnonzero(arr >= vocab_size)  # only these are looked at (pads, markers: few)
    t = arr[over]
    ok = (t == markers["pad_token_id"]) | ((over % block_size == 0) & np.isin(t, heads))
    if ok.all():
        return
    k = int(over[np.flatnonzero(~ok)[0]])
    t = int(arr[k])
    if t in heads:
        raise id_error(who, f"marker id {t}", k, f"is not at a block start (a multiple of "
                       f"block_size={block_size}); beyond the vocabulary [0, {vocab_size}) a "
                       f"marker id means nothing as text")
    raise id_error(who, f"token id {t}", k, f"is outside the vocabulary [0, {vocab_size}) (ids "
                   f"from there up are marker ids only: "
                   f"{sorted(v for v in markers.values() if v >= vocab_size)})")


def id_error(who: str, what: str, k: int, problem: str) -> ValueError:
    """"{who}: {what} at index {k} {problem}", the index and the parts kept on the error
    (`token_index`, `parts`): a caller that built the prompt from segments names the segment
    and the index inside it instead (LLM.generate)."""
    err = ValueError(f"{who}: {what} at index {k} {problem}")
    err.token_index, err.parts = k, (what, problem)
    return err


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


def check_prompt(ids: np.ndarray, who: str, cfg, markers: dict):
    """The prompt's layout (serving/layout.py), or an error: empty, too long for max_model_len,
    only pads, markers where kv_mode='rotated' cannot honour them."""
    if len(ids) == 0:
        raise ValueError(f"{who}: empty prompt")
    if len(ids) >= cfg.max_model_len:
        raise ValueError(f"{who}: prompt of {len(ids)} tokens is too long "
                         f"for max_model_len={cfg.max_model_len} (it needs room for at "
                         f"least one generated token)")
    layout = build_layout(ids, cfg.block_size, pad_id=markers["pad_token_id"],
                          ssep_id=markers["ssep_token_id"], pdep_id=markers["pdep_token_id"],
                          markers=cfg.kv_mode != "pic_off")
    if layout.num_valid == 0:
        raise ValueError(f"{who}: prompt holds only pad tokens "
                         f"(pad_token_id={markers['pad_token_id']})")
    if cfg.kv_mode == "rotated" and layout.has_markers:
        blk = int(np.flatnonzero(layout.seg_start[1:])[0]) + 1 if layout.seg_start[1:].any() else 0
        raise ValueError(f"{who}: SSEP/PDEP marker at token index "
                         f"{blk * cfg.block_size} but kv_mode='rotated' cannot reuse spans at "
                         f"other offsets; use kv_mode='position_free' or remove the markers")
    return layout


def check_fits(num_prompt: int, sp, who: str, cfg, num_blocks: int) -> None:
    """The request fits the KV pool at its longest, and asks for no more logprobs than allowed."""
    max_tokens = sp.max_tokens or cfg.max_model_len
    total = min(num_prompt + max_tokens, cfg.max_model_len)
    need = -(-total // cfg.block_size)
    if need > num_blocks:
        raise ValueError(f"{who}: needs {need} KV blocks "
                         f"({total} tokens / block_size {cfg.block_size}) but the pool has "
                         f"only {num_blocks}; raise num_kv_blocks or lower max_tokens")
    start = -(-num_prompt // cfg.block_size)  # blocks taken at admission
    if start > num_blocks - cfg.watermark_blocks:
        raise ValueError(f"{who}: its prompt needs {start} KV blocks to start, but admission keeps "
                         f"watermark_blocks={cfg.watermark_blocks} of the pool's {num_blocks} "
                         f"free; lower watermark_blocks or raise num_kv_blocks")
    if sp.logprobs is not None and sp.logprobs > cfg.max_logprobs:
        raise ValueError(f"{who}: logprobs={sp.logprobs} > max_logprobs={cfg.max_logprobs}")


def check_salt(cache_salt, who: str) -> None:
    """A str or None. Salts name tenants by their exact code points: "" is None's tenant (no
    salt), and no Unicode normalization is applied (a composed and a decomposed "é" are two
    tenants). A lone surrogate has no UTF-8 bytes to hash: refused here, not mid-step."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise TypeError(f"{who}: cache_salt must be a str or None, "
                        f"got {type(cache_salt).__name__}")
    try:
        cache_salt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{who}: cache_salt holds a lone surrogate at index {err.start} "
                         f"(not valid Unicode text)") from None


def check_request(request_id, prompt_token_ids, sampling_params, *, who: str, cache_salt,
                  engine, in_use: bool):
    """Everything `LLMEngine.validate` checks, in order (`engine`: its vocab, tokenizer, config,
    markers, pool size and model kind; `in_use`: the id is taken); returns the prompt layout.
    Raises a TypeError/ValueError naming `who`; touches nothing."""
    check_sampling(sampling_params, who, engine.vocab_size, engine.tokenizer)
    check_salt(cache_salt, who)
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
        raise TypeError(f"{who}: prompt token ids must be a list of ints, "
                        f"got {type(prompt_token_ids).__name__}")
    cfg = engine.config
    ids = check_token_ids(prompt_token_ids, who, engine.vocab_size, engine.markers,
                          cfg.block_size)
    layout = check_prompt(ids, who, cfg, engine.markers)
    check_fits(len(ids), sampling_params, who, cfg, engine.num_blocks)
    if engine.hybrid and layout.span_block.any():  # docs/DESIGN.md section 5
        spans = getattr(engine.hybrid_cache, "spans", None)  # long spans go in pieces through it
        span_rows.check_prompt(layout, cfg.block_size, len(ids),
                               cfg.max_num_batched_tokens - cfg.max_num_seqs, who,
                               pieces=spans is not None)
    if in_use:
        raise ValueError(f"{who}: request id already in use")
    return layout
