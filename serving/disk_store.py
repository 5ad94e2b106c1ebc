"""Persistent span store: cached KV blocks as files, shared by processes (`kv_store_dir`).

A store folder holds one identity and one file per block:

    STORE.json                            what the blocks were made by (`StoreIdentity`)
    <ns>/<hh>/<hash:016x>.safetensors     one block: its pages of every cache leaf, its tokens

`<ns>` is the cache_salt namespace ("shared" without a salt), `<hh>` the hash's top byte (small
folders). A block file is safetensors (no pickles), two tensors: `kv` [L, B, ...], the block's
page of every cache leaf stacked (the raw bits as unsigned ints of the leaf's width; the identity
gives the real dtype), and `tokens` [B] (int64, to confirm a hit); metadata holds the block
hash, the identity digest and an xxh3 checksum of the data. The file is written straight from
the gathered pages (one writev, no copy) and read back as one array (one parse per block: a read
is a few Python calls, so reader threads are not serialized on the GIL).
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
import xxhash

FORMAT_VERSION = 2
_SUFFIX = ".safetensors"
_TOUCH_S = 60.0  # a read marks a file used (mtime) when its mark is older than this
_UINT = {1: ("U8", np.uint8), 2: ("U16", np.uint16), 4: ("U32", np.uint32), 8: ("U64", np.uint64)}


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
        d["markers"] = list(self.markers)
        d["leaves"] = [[list(shape), dtype] for shape, dtype in self.leaves]
        return d

    def digest(self) -> str:
        blob = json.dumps([FORMAT_VERSION, self.compared()], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _stale(entry, age_s: float = 3600.0) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > age_s
    except FileNotFoundError:
        return False


def _checksum(buffers) -> str:
    """xxh3 of the data section (the buffers in file order)."""
    x = xxhash.xxh3_64()
    for b in buffers:
        x.update(b)
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
        shapes = {tuple(s) for s, _ in identity.leaves}
        dtypes = {d for _, d in identity.leaves}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(f"kv store: cache leaves must share one page shape and dtype "
                             f"(attention K/V), got {identity.leaves}")
        self.page_shape, self.dtype = shapes.pop(), np.dtype(dtypes.pop())
        self.num_leaves = len(identity.leaves)
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
    def read(self, h: int, ns: str, confirm: bytes | None = None) -> np.ndarray | None:
        """The block's pages, [L, B, ...] (leaf order, real dtype), or None: absent, corrupt
        (warned, removed) or holding other tokens than `confirm` (int64 bytes)."""
        p = self.path(h, ns)
        t0 = time.perf_counter()
        try:
            with open(p, "rb") as f:
                data = f.read()
                used = os.fstat(f.fileno()).st_mtime
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
            kv, tokens = self._decode(data, h)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self._drop_corrupt(p, err)
            return None
        if confirm is not None and tokens.tobytes() != confirm:
            with self.lock:
                self.counters["misses"] += 1  # a 64-bit hash collision: never a hit
            return None
        if time.time() - used > _TOUCH_S:
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
        return kv

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
        meta = header.get("__metadata__") or {}
        body = memoryview(data)[8 + n:]
        if meta.get("identity") != self.digest or meta.get("hash") != f"{h:016x}":
            raise ValueError(f"metadata {meta} does not name this store and block")
        if _checksum([body]) != meta.get("xxh3"):
            raise ValueError("checksum mismatch")
        kv_spec, tok_spec = header["kv"], header["tokens"]
        shape = [self.num_leaves, *self.page_shape]
        if kv_spec["shape"] != shape or tok_spec["shape"] != [self.identity.block_size] or \
                kv_spec["dtype"] != _UINT[self.dtype.itemsize][0] or tok_spec["dtype"] != "I64":
            raise ValueError(f"tensors {header} do not match the store's page shape {shape}")
        lo, hi = kv_spec["data_offsets"]
        kv = np.frombuffer(body[lo:hi], self.dtype).reshape(shape)
        lo, hi = tok_spec["data_offsets"]
        return kv, np.frombuffer(body[lo:hi], np.int64)

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
        """Store one block (its page of every leaf, [B, ...] each, in leaf order); False if it
        is already there."""
        p = self.path(h, ns)
        if self.has(h, ns):
            return False
        t0 = time.perf_counter()
        parts = [memoryview(np.ascontiguousarray(a, self.dtype).reshape(-1).view(np.uint8))
                 for a in leaves]
        parts.append(memoryview(tokens))
        nkv = sum(len(b) for b in parts[:-1])
        code = _UINT[self.dtype.itemsize][0]
        header = json.dumps({
            "__metadata__": {"identity": self.digest, "hash": f"{h:016x}", "ns": ns,
                             "xxh3": _checksum(parts)},
            "kv": {"dtype": code, "shape": [len(leaves), *self.page_shape],
                   "data_offsets": [0, nkv]},
            "tokens": {"dtype": "I64", "shape": [len(tokens) // 8],
                       "data_offsets": [nkv, nkv + len(tokens)]}}).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        bufs = [len(header).to_bytes(8, "little"), header, *parts]
        size = sum(len(b) for b in bufs)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if os.writev(fd, bufs) != size:  # short write: finish it the plain way
                os.lseek(fd, 0, os.SEEK_SET)
                os.write(fd, b"".join(bytes(b) for b in bufs))
        finally:
            os.close(fd)
        os.replace(tmp, p)
        with self.lock:
            if p not in self.index:
                self.index[p] = size
                self.total_bytes += size
            self.counters["bytes_written"] += size
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
