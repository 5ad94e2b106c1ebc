"""xxh3-128 digests of checkpoint files, every byte, cached by file identity.

The span store's model fingerprint covers every weight byte (serving/tiers/fingerprint.py). Reading a
checkpoint once more to hash it costs its size over the disk or page cache (16 GB for an 8B
model in bfloat16, about a second from the page cache), so a file's digest is kept under its
identity: resolved path, size, mtime_ns, ctime_ns and inode. Any rewrite, copy or replacement
changes one of them (ctime cannot be set back by a tool that restores mtime), and the file is
hashed again. The cache is a small JSON file in the store folder (`CACHE_NAME`; written through a
temp file, the last writer wins, at most `MAX_ENTRIES` files), so a second start on the same
checkpoint reads no weights to fingerprint them. A cache that cannot be read or written only
costs the hashing.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import pathlib
import threading

import xxhash

CACHE_NAME = "weight_digests.json"
MAX_ENTRIES = 64
_CHUNK = 16 << 20


def _identity(path: pathlib.Path) -> tuple:
    st = os.stat(path)
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def hash_file(path) -> str:
    """xxh3-128 (hex) of every byte of the file."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(view[:k])  # the GIL is released while a chunk is hashed
    return h.hexdigest()


def _load(cache: pathlib.Path | None) -> dict:
    if cache is None:
        return {}
    try:
        rows = json.loads(cache.read_bytes())
        return {tuple(r["id"]): r["xxh3_128"] for r in rows}
    except (OSError, ValueError, TypeError, KeyError):  # absent or damaged: hashed again
        return {}


def _save(cache: pathlib.Path, table: dict) -> None:
    rows = [{"id": list(k), "xxh3_128": v} for k, v in list(table.items())[-MAX_ENTRIES:]]
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(rows, indent=1))
        os.replace(tmp, cache)
    except OSError:  # a read-only store: the next start hashes again
        pass
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def file_digests(files, cache_dir=None) -> list[str]:
    """The xxh3-128 digest of each file (in order): from the cache in `cache_dir` (None: no
    cache), else hashed (files in parallel) and added to it."""
    paths = [pathlib.Path(f).resolve() for f in files]
    ids = [_identity(p) for p in paths]
    cache = pathlib.Path(cache_dir) / CACHE_NAME if cache_dir is not None else None
    found = _load(cache)
    missing = [(i, p) for i, p in zip(ids, paths) if i not in found]
    if not missing:
        return [found[i] for i in ids]
    with cf.ThreadPoolExecutor(min(8, len(missing))) as pool:
        for (i, _), digest in zip(missing, pool.map(hash_file, [p for _, p in missing])):
            found[i] = digest
    if cache is not None:
        mine = {i[0] for i in ids}  # older identities of these paths leave the cache
        table = {k: v for k, v in _load(cache).items() if k[0] not in mine}  # others' news too
        table.update({i: found[i] for i in ids})  # newest last: kept past MAX_ENTRIES
        _save(cache, table)
    return [found[i] for i in ids]
