"""Resuming a job: what an output file already answers, and appending to it safely.

A job killed mid-write can leave a partial last line; `open_for_append` cuts the file back to
its last newline first, so every line in it is a whole record. A result record answers its
custom_id; an error record answers its input line (every error record carries "line"), never a
custom_id: a duplicate custom_id's error record must not mark the original as answered (the
original may not have finished when the job was killed). `drop_error_records` removes the error
records so a rerun answers those lines again (--retry-errors).
"""

from __future__ import annotations

import json
import os


def _records(path):
    """(raw line, record) of every whole line of the output file."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return  # a partial record from a killed run: redone
            try:
                rec = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                rec = None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}: line {n} is not a JSON record; is this the output of "
                                 f"a batch job? (refusing to resume into it)")
            yield raw, rec


def _is_error(rec: dict) -> bool:
    return rec.get("error") is not None


def answered(path) -> tuple[set[str], set[int]]:
    """(custom_ids of result records, input lines of error records) in the output file."""
    ids, lines = set(), set()
    if not os.path.exists(path):
        return ids, lines
    for _, rec in _records(path):
        if _is_error(rec):
            if isinstance(rec.get("line"), int):
                lines.add(rec["line"])
        elif rec.get("custom_id") is not None:
            ids.add(rec["custom_id"])
    return ids, lines


def drop_error_records(path) -> int:
    """Rewrite the output file without its error records (and any partial last line), through
    a new file renamed over it (a kill leaves the old file or the new one, whole); returns how
    many were dropped."""
    if not os.path.exists(path) or not any(_is_error(rec) for _, rec in _records(path)):
        return 0
    real = os.path.realpath(path)  # through a link: rewrite its target, keep the link
    tmp = real + ".retry-errors.tmp"
    dropped = 0
    with open(tmp, "wb") as out:
        for raw, rec in _records(real):
            if _is_error(rec):
                dropped += 1
            else:
                out.write(raw)
    os.replace(tmp, real)
    return dropped


def open_for_append(path):
    """The output file opened for appending, any partial last line removed."""
    if os.path.exists(path):
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            end = size = f.tell()
            while end > 0:  # back to the byte after the last newline
                step = min(1 << 16, end)
                f.seek(end - step)
                chunk = f.read(step)
                k = chunk.rfind(b"\n")
                if k >= 0:
                    end = end - step + k + 1
                    break
                end -= step
            if end != size:
                f.truncate(end)
    return open(path, "a", encoding="utf-8")
