"""Block fine-tuning data: JSONL records -> laid-out examples, exactly as the engine lays them out.

One record per line: {"segments": [{"kind": "prompt"|"span", "text": ...}, ...], "answer": ...},
with "tokens" (a list of ids) accepted instead of "text", and an answer as text or a list of ids.
Segments go through the engine's own `build_prompt` (markers, pads) and `serving.layout`
(logical positions, attention windows); the answer extends the last segment, as generated tokens
do in the engine. The loss covers the answer tokens (and the EOS after them) only.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from minipic_jax.prompts import Prompt, Span, build_prompt
from serving.layout import build_layout


@dataclasses.dataclass(frozen=True)
class Markers:
    block_size: int
    pad_token_id: int
    ssep_token_id: int
    pdep_token_id: int
    # marker ids beyond the vocabulary -> the vocabulary id the model is fed in their place
    # (serving/config.py marker_embedding_ids), as the engine feeds them
    embedding_ids: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Record:
    segments: tuple  # Prompt | Span with text or token ids
    answer: str | tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Example:
    """One laid-out example of N tokens (prompt with markers and pads, then the answer)."""
    tokens: np.ndarray  # [N] int32 the embedding's input (markers as the ids they borrow)
    positions: np.ndarray  # [N] int32 logical positions (the engine's)
    windows: np.ndarray  # [N] int32 smallest logical position each token may attend
    valid: np.ndarray  # [N] bool; False for pads
    targets: np.ndarray  # [N] int32 the next token (0 where there is none)
    loss_mask: np.ndarray  # [N] bool; True where targets[i] is an answer token (or its EOS)


def _content(seg, where: str):
    if not isinstance(seg, dict):
        raise ValueError(f"{where}: expected an object with 'kind' and 'text' or 'tokens', got "
                         f"{type(seg).__name__}")
    kind = seg.get("kind")
    if kind not in ("prompt", "span"):
        raise ValueError(f"{where}.kind: expected 'prompt' or 'span', got {kind!r}")
    if ("text" in seg) == ("tokens" in seg):
        raise ValueError(f"{where}: give exactly one of 'text' or 'tokens'")
    content = seg["text"] if "text" in seg else seg["tokens"]
    if "text" in seg and not (isinstance(content, str) and content):
        raise ValueError(f"{where}.text: expected a non-empty string")
    if "tokens" in seg and not (isinstance(content, list) and content
                                and all(isinstance(t, int) and t >= 0 for t in content)):
        raise ValueError(f"{where}.tokens: expected a non-empty list of non-negative ints")
    return (Prompt if kind == "prompt" else Span)(content if "text" in seg else tuple(content))


def parse_record(obj, where: str) -> Record:
    """A decoded JSON record -> Record; ValueError naming `where` and the bad field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    segs = obj.get("segments")
    if not isinstance(segs, list) or not segs:
        raise ValueError(f"{where}.segments: expected a non-empty list of segments")
    if "answer" not in obj:
        raise ValueError(f"{where}.answer: missing (every training record needs an answer)")
    answer = obj["answer"]
    if isinstance(answer, list):
        if not answer or not all(isinstance(t, int) and t >= 0 for t in answer):
            raise ValueError(f"{where}.answer: expected a non-empty list of non-negative ints")
        answer = tuple(answer)
    elif not (isinstance(answer, str) and answer):
        raise ValueError(f"{where}.answer: expected a non-empty string or list of token ids")
    return Record(tuple(_content(s, f"{where}.segments[{k}]") for k, s in enumerate(segs)),
                  answer)


def read_jsonl(path) -> list[Record]:
    """Records of a JSONL file; ValueError naming the file, line and field of the first bad one."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"training data {path} does not exist")
    records = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i}: not valid JSON ({err.msg})") from None
        records.append(parse_record(obj, f"{path}:{i}"))
    if not records:
        raise ValueError(f"training data {path} has no records")
    return records


def layout_example(record: Record, markers: Markers, tokenizer, *, eos_token_id: int | None,
                   plain: bool = False, where: str = "record") -> Example:
    """Lay a record out as the engine would serve it, plus its answer.

    plain=True: the same segments as one full-attention prompt (no markers, no pads), the mode
    Block-Attention mixes in so the model keeps working without blocks."""
    segs = record.segments
    if plain:
        segs = [Prompt(_ids(s.content, tokenizer, first=(k == 0), where=f"{where}.segments[{k}]"))
                for k, s in enumerate(segs)]
    try:
        prompt = build_prompt(segs, block_size=markers.block_size,
                              pad_token_id=markers.pad_token_id,
                              ssep_token_id=markers.ssep_token_id,
                              pdep_token_id=markers.pdep_token_id, tokenizer=tokenizer)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    answer = list(_ids(record.answer, tokenizer, first=False, where=f"{where}.answer"))
    if eos_token_id is not None:
        answer.append(eos_token_id)
    lay = build_layout(prompt, markers.block_size, pad_id=markers.pad_token_id,
                       ssep_id=markers.ssep_token_id, pdep_id=markers.pdep_token_id,
                       markers=not plain)
    n_ans = len(answer)
    tokens = np.asarray(_embedding_input(prompt, markers) + answer, np.int32)
    positions = np.concatenate([lay.pos, lay.num_valid + np.arange(n_ans)]).astype(np.int32)
    windows = np.concatenate([lay.win, np.full(n_ans, lay.last_win)]).astype(np.int32)
    valid = np.concatenate([~lay.is_pad, np.ones(n_ans, bool)])
    targets = np.concatenate([tokens[1:], [0]]).astype(np.int32)
    loss_mask = np.zeros(len(tokens), bool)
    loss_mask[len(prompt) - 1:len(tokens) - 1] = True  # rows whose next token is in the answer
    return Example(tokens, positions, windows, valid, targets, loss_mask)


def _embedding_input(prompt: list[int], markers: Markers) -> list[int]:
    """The prompt as the model's embedding reads it: markers beyond the vocabulary replaced by
    the ids they borrow (the layout was built from the marker ids)."""
    if not markers.embedding_ids:
        return prompt
    borrowed = dict(markers.embedding_ids)
    return [borrowed.get(t, t) for t in prompt]


def _ids(content, tokenizer, *, first: bool, where: str) -> tuple[int, ...]:
    if not isinstance(content, str):
        return tuple(int(t) for t in content)
    if tokenizer is None:
        raise ValueError(f"{where}: text needs a tokenizer (give token ids instead)")
    ids = list(tokenizer.encode(content))
    bos = getattr(tokenizer, "bos_token_id", None)
    if not first and ids and bos is not None and ids[0] == bos:
        ids = ids[1:]
    return tuple(ids)
