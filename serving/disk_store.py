"""Persistent span store: cached KV blocks as files, shared by processes (`kv_store_dir`).

A store folder holds one identity and one file per block:

    STORE.json                            what the blocks were made by (`StoreIdentity`)
    <ns>/<hh>/<hash:016x>.safetensors     one block: its page leaves ([B, ...] each), its tokens

`<ns>` is the cache_salt namespace ("shared" without a salt), `<hh>` the hash's top byte (small
folders). A block file is safetensors (no pickles): tensors `leaf_<i>` (the raw bits, unsigned
ints of the leaf's width; the identity gives the real dtypes) and `tokens` (int64, to confirm a
hit), metadata holding the block hash, the identity digest and an xxh3 checksum of the data.
Files are written to a temp name and renamed, so a reader sees a whole file or none and two
processes filling one store never corrupt it (the same block written twice is the same data).
A file that is truncated or fails its checksum is a miss: a warning, the file removed, the block
recomputed. Least recently used blocks are deleted past `capacity_bytes` (use = file mtime).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import threading
import time
import warnings

import ml_dtypes  # noqa: F401 - registers bfloat16 & co. with numpy (leaf dtypes by name)
import numpy as np
import safetensors.numpy
import xxhash

FORMAT_VERSION = 1
_SUFFIX = ".safetensors"
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ST_DTYPES = {"U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
              "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class StoreIdentity:
    """What a stored block depends on; a store made under another identity is never read."""

    model: str  # fingerprint of config + dtype + weights (serving/fingerprint.py)
    model_name: str  # for messages only (not compared)
    block_size: int
    kv_mode: str
    hash_algo: str
    markers: tuple  # (pad, ssep, pdep) ids: they decide layouts and keys
    leaves: tuple  # ((block shape [B, ...], dtype name), ...) of the page leaves

    def compared(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("model_name")
        d["markers"], d["leaves"] = list(self.markers), [list(map(_jsonable, x)) for x in self.leaves]
        return d

    def digest(self) -> str:
        blob = json.dumps([FORMAT_VERSION, self.compared()], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _jsonable(x):
    return list(x) if isinstance(x, tuple) else x


def _stale(entry, age_s: float = 3600.0) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > age_s
    except FileNotFoundError:
        return False


def _checksum(tensors: dict) -> str:
    """xxh3 over the tensors' bytes in name order (the data and where each tensor lies)."""
    x = xxhash.xxh3_64()
    for name in sorted(tensors):
        x.update(name.encode())
        x.update(np.ascontiguousarray(tensors[name]).data)
    return x.hexdigest()


def namespace(cache_salt: str | None) -> str:
    if not cache_salt:
        return "shared"
    return "salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:16]


class StoreMismatch(ValueError):
    pass


class DiskStore:
    """The file layer: identity check, block read (verified) / write (atomic), LRU, counters.
    Thread-safe (one lock around the index and counters; file I/O outside it)."""

    def __init__(self, root, identity: StoreIdentity, capacity_bytes: int):
        self.root = pathlib.Path(root).expanduser()
        self.identity = identity
        self.digest = identity.digest()
        self.capacity = int(capacity_bytes)
        self.lock = threading.Lock()
        self.index: dict[pathlib.Path, int] = {}  # path -> bytes, least recently used first
        self.total_bytes = 0
        self.counters = dict(bytes_read=0, bytes_written=0, read_s=0.0, write_s=0.0,
                             blocks_read=0, blocks_written=0, corrupt=0, evicted=0, misses=0)
        self.root.mkdir(parents=True, exist_ok=True)
        self._check_identity()
        self._scan()

    # -- identity ------------------------------------------------------------------------------
    def _check_identity(self) -> None:
        path = self.root / "STORE.json"
        mine = {"format_version": FORMAT_VERSION, "model_name": self.identity.model_name,
                **self.identity.compared()}
        if not path.exists():
            tmp = path.with_name(f".STORE.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(mine, indent=1))
            try:
                os.link(tmp, path)  # first creator wins; a concurrent one compares below
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        theirs = json.loads(path.read_text())
        diff = [k for k in mine if k != "model_name" and theirs.get(k) != mine[k]]
        if diff:
            parts = ", ".join(f"{k}: store has {theirs.get(k)!r}, this engine {mine[k]!r}"
                              for k in diff)
            raise StoreMismatch(
                f"kv_store_dir {self.root} was written by another setup (model "
                f"{theirs.get('model_name')!r}); {parts}. Use another kv_store_dir for this "
                f"model/settings, or delete that folder")

    def _scan(self) -> None:
        found = []
        for ns in os.scandir(self.root):
            if not ns.is_dir():
                continue
            for sub in os.scandir(ns.path):
                if not sub.is_dir():
                    continue
                for f in os.scandir(sub.path):
                    if f.name.endswith(_SUFFIX):
                        st = f.stat()
                        found.append((st.st_mtime_ns, pathlib.Path(f.path), st.st_size))
                    elif f.name.endswith(".tmp") and _stale(f):  # left by a killed writer
                        try:
                            os.unlink(f.path)
                        except FileNotFoundError:
                            pass
        for _, p, size in sorted(found):
            self.index[p] = size
            self.total_bytes += size

    # -- paths ---------------------------------------------------------------------------------
    def path(self, h: int, ns: str) -> pathlib.Path:
        name = f"{h & 0xFFFFFFFFFFFFFFFF:016x}"
        return self.root / ns / name[:2] / (name + _SUFFIX)

    def has(self, h: int, ns: str) -> bool:
        p = self.path(h, ns)
        return p in self.index or p.exists()

    # -- read ----------------------------------------------------------------------------------
    def read(self, h: int, ns: str, confirm: bytes | None = None) -> list[np.ndarray] | None:
        """The block's page leaves ([1, B, ...] each, real dtypes), or None: absent, corrupt
        (warned, removed) or holding other tokens than `confirm` (int64 bytes)."""
        p = self.path(h, ns)
        t0 = time.perf_counter()
        try:
            with open(p, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self.lock:
                self.counters["misses"] += 1
                self._forget(p)
            return None
        except OSError as err:  # unreadable: a miss, the block is recomputed
            warnings.warn(f"kv store: cannot read {p} ({err}); the block is recomputed",
                          RuntimeWarning, stacklevel=2)
            return None
        try:
            leaves, tokens = self._decode(data, h)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self._drop_corrupt(p, err)
            return None
        if confirm is not None and tokens.tobytes() != confirm:
            with self.lock:
                self.counters["misses"] += 1  # a 64-bit hash collision: never a hit
            return None
        try:
            os.utime(p)  # last use, for LRU across processes
        except OSError:
            pass
        with self.lock:
            if p in self.index:
                self.index[p] = self.index.pop(p)
            else:
                self.index[p] = len(data)
                self.total_bytes += len(data)
            self.counters["bytes_read"] += len(data)
            self.counters["blocks_read"] += 1
            self.counters["read_s"] += time.perf_counter() - t0
        return leaves

    def _decode(self, data: bytes, h: int):
        if len(data) < 8:
            raise ValueError(f"{len(data)} bytes, shorter than a safetensors header")
        n = int.from_bytes(data[:8], "little")
        if 8 + n > len(data):
            raise ValueError(f"header of {n} bytes runs past the end ({len(data)} bytes)")
        try:
            header = json.loads(data[8:8 + n])
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"unreadable header ({err})") from None
        meta = header.pop("__metadata__", None) or {}
        body = memoryview(data)[8 + n:]
        if meta.get("identity") != self.digest or meta.get("hash") != f"{h:016x}":
            raise ValueError(f"metadata {meta} does not name this store and block")
        out = {}
        for name, spec in header.items():
            lo, hi = spec["data_offsets"]
            out[name] = np.frombuffer(body[lo:hi], _ST_DTYPES[spec["dtype"]]).reshape(spec["shape"])
        if _checksum(out) != meta.get("xxh3"):
            raise ValueError("checksum mismatch")
        leaves = []
        for i, (shape, dtype) in enumerate(self.identity.leaves):
            a = out.get(f"leaf_{i}")
            if a is None or tuple(a.shape) != tuple(shape):
                raise ValueError(f"leaf_{i} missing or mis-shaped")
            leaves.append(a.view(np.dtype(dtype))[None])
        if "tokens" not in out or out["tokens"].size != self.identity.block_size:
            raise ValueError("tokens missing or mis-shaped")
        return leaves, out["tokens"]

    def _drop_corrupt(self, p: pathlib.Path, err) -> None:
        warnings.warn(f"kv store: {p} is corrupt ({err}); removed, the block is recomputed",
                      RuntimeWarning, stacklevel=3)
        with self.lock:
            self.counters["corrupt"] += 1
            self._forget(p)
        try:
            p.unlink()
        except FileNotFoundError:
            pass

    def _forget(self, p: pathlib.Path) -> None:  # under the lock
        size = self.index.pop(p, None)
        if size is not None:
            self.total_bytes -= size

    # -- write ---------------------------------------------------------------------------------
    def write(self, h: int, ns: str, leaves: list[np.ndarray], tokens: bytes) -> bool:
        """Store one block (leaves [B, ...] each); False if it is already there."""
        p = self.path(h, ns)
        if self.has(h, ns):
            return False
        t0 = time.perf_counter()
        tensors = {f"leaf_{i}": np.ascontiguousarray(a).view(_UINT[a.dtype.itemsize])
                   for i, a in enumerate(leaves)}
        tensors["tokens"] = np.frombuffer(tokens, np.int64)
        meta = {"identity": self.digest, "hash": f"{h:016x}", "ns": ns,
                "xxh3": _checksum(tensors)}
        data = safetensors.numpy.save(tensors, metadata=meta)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
        with self.lock:
            if p not in self.index:
                self.index[p] = len(data)
                self.total_bytes += len(data)
            self.counters["bytes_written"] += len(data)
            self.counters["blocks_written"] += 1
            self.counters["write_s"] += time.perf_counter() - t0
            victims = self._evict()
        for v in victims:
            try:
                v.unlink()
            except FileNotFoundError:
                pass
        return True

    def _evict(self) -> list[pathlib.Path]:  # under the lock
        victims = []
        while self.total_bytes > self.capacity and len(self.index) > 1:
            p = next(iter(self.index))
            self._forget(p)
            victims.append(p)
            self.counters["evicted"] += 1
        return victims

    def stats(self) -> dict:
        with self.lock:
            c = dict(self.counters)
            c.update(blocks_stored=len(self.index), bytes_stored=self.total_bytes,
                     capacity_bytes=self.capacity)
        c["read_GBps"] = c["bytes_read"] / c["read_s"] / 1e9 if c["read_s"] else 0.0
        c["write_GBps"] = c["bytes_written"] / c["write_s"] / 1e9 if c["write_s"] else 0.0
        return c
