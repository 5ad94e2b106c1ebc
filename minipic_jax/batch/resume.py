"""Resuming a job: what an output file already answers, and appending to it safely.

A job killed mid-write can leave a partial last line; `open_for_append` cuts the file back to
its last newline first, so every line in it is a whole record. Records are keyed by custom_id,
or by input line for error records of lines that had none (bad JSON, no custom_id).
"""

from __future__ import annotations

import json
import os


def answered(path) -> tuple[set[str], set[int]]:
    """(custom_ids, line numbers of id-less error records) already in the output file."""
    ids, lines = set(), set()
    if not os.path.exists(path):
        return ids, lines
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break  # a partial record from a killed run: redone
            try:
                rec = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise ValueError(f"{path}: line {n} is not a JSON record; is this the output of "
                                 f"a batch job? (refusing to resume into it)") from None
            if rec.get("custom_id") is not None:
                ids.add(rec["custom_id"])
            elif isinstance(rec.get("line"), int):
                lines.add(rec["line"])
    return ids, lines


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
