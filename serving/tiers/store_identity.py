"""What a span store's blocks were made by (`StoreIdentity`), and its STORE.json.

A store folder holds one identity: STORE.json, written by the first engine that opens the folder
and compared by every later one (StoreMismatch names the fields that differ). Every run file
also carries the identity's digest (serving/tiers/run_file.py), so STORE.json is what makes a wrong
setup a clear error at start, not what keeps another setup's blocks from being read: a
STORE.json that is not a JSON object (empty, cut short, `[1, 2]`) is store damage, warned and
rewritten, and one that cannot be read (a folder, a symlink loop) is warned and left alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import threading

FORMAT_VERSION = 3


@dataclasses.dataclass(frozen=True)
class StoreIdentity:
    """What a stored block depends on; a store made under another identity is never read."""

    model: str  # fingerprint of config + dtype + every weight byte (serving/tiers/fingerprint.py)
    model_name: str  # for messages only (not compared)
    block_size: int
    kv_mode: str
    hash_algo: str
    markers: tuple  # (pad, ssep, pdep) ids: they decide layouts and keys
    leaves: tuple  # ((block shape [B, ...], dtype name), ...) of the page leaves

    def compared(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("model_name")
        d["markers"] = list(self.markers)
        d["leaves"] = [[list(shape), dtype] for shape, dtype in self.leaves]
        return d

    def digest(self) -> str:
        blob = json.dumps([FORMAT_VERSION, self.compared()], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class StoreMismatch(ValueError):
    pass


def check_identity(root: pathlib.Path, identity: StoreIdentity, damaged) -> None:
    """Compare root/STORE.json with `identity` (StoreMismatch when they differ), writing it when
    absent. `damaged(path, err, then)` warns about a STORE.json that is damaged (then rewritten)
    or cannot be read or written (then left alone)."""
    path = root / "STORE.json"
    mine = {"format_version": FORMAT_VERSION, "model_name": identity.model_name,
            **identity.compared()}
    theirs = _load(path, damaged)
    if theirs is None:
        _write(path, mine, damaged, replace=False)
        theirs = _load(path, damaged)  # a concurrent creator may have won
    if theirs == "damaged":
        _write(path, mine, damaged, replace=True)
    if not isinstance(theirs, dict):
        return
    diff = [k for k in mine if k != "model_name" and theirs.get(k) != mine[k]]
    if diff:
        parts = ", ".join(f"{k}: store has {theirs.get(k)!r}, this engine {mine[k]!r}"
                          for k in diff)
        raise StoreMismatch(
            f"kv_store_dir {root} was written by another setup (model "
            f"{theirs.get('model_name')!r}); {parts}. Use another kv_store_dir for this "
            f"model/settings, or delete that folder")


def _load(path: pathlib.Path, damaged):
    """STORE.json's object; None when absent; "damaged" (to rewrite) or "unreadable" (to leave
    alone) after a warning."""
    try:
        theirs = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except OSError as err:  # a folder, a symlink loop, no permission
        damaged(path, err, "the store's identity is not checked")
        return "unreadable"
    except ValueError as err:  # empty, cut short, not JSON
        damaged(path, f"not JSON: {err}", "rewritten")
        return "damaged"
    if not isinstance(theirs, dict):
        damaged(path, f"holds a JSON {type(theirs).__name__}, not an object", "rewritten")
        return "damaged"
    return theirs


def _write(path: pathlib.Path, mine: dict, damaged, replace: bool) -> None:
    """STORE.json through a temp file: linked (the first creator wins) or replacing a damaged
    one."""
    tmp = path.with_name(f".STORE.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(mine, indent=1))
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    except FileExistsError:  # a concurrent creator's: the caller compares it
        pass
    except OSError as err:  # a read-only store
        damaged(path, err, "not written (run files still name this setup)")
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
