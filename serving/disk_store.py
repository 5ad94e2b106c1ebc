"""Persistent span store: cached KV blocks as files, shared by processes (`kv_store_dir`).

A store folder holds one identity and one file per *run* of consecutive blocks of one prompt
segment (a span, or the prompt part between markers), named by the run's first block hash:

    STORE.json                            what the blocks were made by (`StoreIdentity`)
    <ns>/<hh>/<first:016x>.safetensors    one run of n blocks

`<ns>` is the cache_salt namespace ("shared" without a salt), `<hh>` the hash's top byte (small
folders); serving/run_file.py has the file format. Runs, not blocks: a hit reads a whole span
(~36 blocks, 18 MB for a 1B model) in two system calls and one checksum, so a read costs the
kernel's copy out of the page cache, not Python per block. Chained keys name a prefix, so a file
is a branch of a prefix tree: a request uses the longest prefix of a run whose hashes and tokens
match its own, and a writer that finds a run at its first hash writes only the blocks past the
common prefix (under the first new hash).

Files are written to a temp name and renamed, so a reader sees a whole file or none and two
processes filling one store never corrupt it. A file that is truncated or fails its checksum is
a miss: a warning, the file removed, the blocks recomputed. Least recently used runs (file
mtime, and this process's own order) are deleted past `capacity_bytes`, counted over every file
in the folder (the folder is rescanned at most every `rescan_s` seconds and before evicting), so
several processes on one store keep it under one size.
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

from serving.run_file import MAX_RUN, CorruptRun, Run, RunFormat, write_all

FORMAT_VERSION = 3
_SUFFIX = ".safetensors"
_TOUCH_S = 60.0  # a read marks a file used (mtime) when its mark is older than this


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


def namespace(cache_salt: str | None) -> str:
    if not cache_salt:
        return "shared"
    return "salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:16]


class StoreMismatch(ValueError):
    pass


class DiskStore:
    """The file layer: identity check, run read (verified) / write (atomic), LRU over the whole
    folder, counters. Thread-safe (one lock around the index and counters; I/O outside it)."""

    def __init__(self, root, identity: StoreIdentity, capacity_bytes: int,
                 rescan_s: float = 30.0):
        self.root = pathlib.Path(root).expanduser()
        self.identity = identity
        self.digest = identity.digest()
        self.capacity = int(capacity_bytes)
        self.rescan_s = rescan_s
        self.lock = threading.Lock()
        self.index: dict[pathlib.Path, int] = {}  # path -> bytes, least recently used first
        self.total_bytes = 0
        self.last_scan = 0.0
        self._recent: set[pathlib.Path] = set()  # used by this process since the last scan
        self.counters = dict(bytes_read=0, bytes_written=0, read_s=0.0, write_s=0.0,
                             blocks_read=0, blocks_written=0, runs_read=0, runs_written=0,
                             corrupt=0, evicted=0, misses=0, rescans=0)
        shapes = {tuple(s) for s, _ in identity.leaves}
        dtypes = {d for _, d in identity.leaves}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(f"kv store: cache leaves must share one page shape and dtype "
                             f"(attention K/V), got {identity.leaves}")
        self.page_shape, self.dtype = shapes.pop(), np.dtype(dtypes.pop())
        self.num_leaves = len(identity.leaves)
        self.fmt = RunFormat(self.digest, identity.block_size, self.num_leaves,
                             self.page_shape, self.dtype)
        self.root.mkdir(parents=True, exist_ok=True)
        self._check_identity()
        self.rescan()

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

    def rescan(self) -> None:
        """Index every run file in the folder (all processes' files), least recently used
        first: by mtime, then the files this process used since the last scan, in its order."""
        found = []
        for ns in os.scandir(self.root):
            if not ns.is_dir():
                continue
            for sub in os.scandir(ns.path):
                if not sub.is_dir():
                    continue
                for f in os.scandir(sub.path):
                    if f.name.endswith(_SUFFIX):
                        try:
                            st = f.stat()
                        except FileNotFoundError:
                            continue
                        found.append((st.st_mtime_ns, pathlib.Path(f.path), st.st_size))
                    elif f.name.endswith(".tmp") and _stale(f):  # left by a killed writer
                        try:
                            os.unlink(f.path)
                        except FileNotFoundError:
                            pass
        found.sort(key=lambda x: x[0])
        with self.lock:
            mine = [p for p in self.index if p in self._recent]
            index = {p: size for _, p, size in found}
            for p in mine:  # this process's order wins over coarse mtimes
                if p in index:
                    index[p] = index.pop(p)
            self.index, self.total_bytes = index, sum(index.values())
            self._recent = set()
            self.last_scan = time.monotonic()
            self.counters["rescans"] += 1

    # -- paths ---------------------------------------------------------------------------------
    def path(self, h: int, ns: str) -> pathlib.Path:
        name = f"{h & 0xFFFFFFFFFFFFFFFF:016x}"
        return self.root / ns / name[:2] / (name + _SUFFIX)

    def has(self, h: int, ns: str) -> bool:
        """A run starts at block hash h (this process's index, else the folder)."""
        p = self.path(h, ns)
        return p in self.index or p.exists()

    # -- read ----------------------------------------------------------------------------------
    def read(self, h: int, ns: str, pad=None, alloc=np.empty) -> Run | None:
        """The run starting at h (its kv allocated with pad(n) rows: serving/run_file.py), or
        None: absent, or corrupt (warned, removed)."""
        p = self.path(h, ns)
        t0 = time.perf_counter()
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            with self.lock:
                self.counters["misses"] += 1
                self._forget(p)
            return None
        except OSError as err:  # unreadable: a miss, the blocks are recomputed
            warnings.warn(f"kv store: cannot read {p} ({err}); its blocks are recomputed",
                          RuntimeWarning, stacklevel=2)
            return None
        try:
            st = os.fstat(fd)
            run = self.fmt.read(fd, st.st_size, h, pad, alloc)
        except (CorruptRun, OSError) as err:
            os.close(fd)
            self._drop_corrupt(p, err)
            return None
        os.close(fd)
        if time.time() - st.st_mtime > _TOUCH_S:
            try:
                os.utime(p)  # last use, for LRU across processes
            except OSError:
                pass
        with self.lock:
            self._used(p, st.st_size)
            self.counters["bytes_read"] += st.st_size
            self.counters["blocks_read"] += run.n
            self.counters["runs_read"] += 1
            self.counters["read_s"] += time.perf_counter() - t0
        return run

    def _drop_corrupt(self, p: pathlib.Path, err) -> None:
        warnings.warn(f"kv store: {p} is corrupt ({err}); removed, its blocks are recomputed",
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

    def _used(self, p: pathlib.Path, size: int) -> None:  # under the lock: p is now the MRU
        self._forget(p)
        self.index[p] = size
        self.total_bytes += size
        self._recent.add(p)

    # -- write ---------------------------------------------------------------------------------
    def write(self, ns: str, hashes, tokens: bytes, leaves: list[np.ndarray]) -> int:
        """Store consecutive blocks of one segment: `hashes` [n] their keys, `tokens` their ids
        (int64 bytes, n x B), `leaves` their pages of every leaf ([n, B, ...] each, leaf order).
        Blocks already stored under a run at the same keys are skipped; returns the number of
        blocks written."""
        hashes = np.asarray(hashes, np.uint64)
        n, step, written, off = len(hashes), len(tokens) // max(len(hashes), 1), 0, 0
        while off < n:
            have = self.fmt.stored_hashes(self.path(int(hashes[off]), ns))
            if have is not None:
                m = len(have[:n - off])
                m = int(np.argmin(np.append(have[:m] == hashes[off:off + m], False)))
                off += max(m, 1)  # m == 0: another run under a colliding name; skip the block
                continue
            end = min(n, off + MAX_RUN)  # absent or unreadable: (re)written whole
            self._write_run(ns, hashes[off:end], tokens[off * step:end * step],
                            [a[off:end] for a in leaves])
            written += end - off
            off = end
        return written

    def _write_run(self, ns, hashes, tokens: bytes, leaves) -> None:
        p = self.path(int(hashes[0]), ns)
        t0 = time.perf_counter()
        bufs = self.fmt.encode(ns, hashes, tokens, leaves)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            size = write_all(fd, bufs)
        finally:
            os.close(fd)
        os.replace(tmp, p)
        with self.lock:
            self._used(p, size)
            self.counters["bytes_written"] += size
            self.counters["blocks_written"] += len(hashes)
            self.counters["runs_written"] += 1
            self.counters["write_s"] += time.perf_counter() - t0
            over = self.total_bytes > self.capacity
            rescan = time.monotonic() - self.last_scan > min(self.rescan_s, 1.0 if over
                                                              else self.rescan_s)
        if rescan:  # count what other processes wrote too before choosing victims
            self.rescan()
        with self.lock:
            victims = self._evict()
        for v in victims:
            try:
                v.unlink()
            except FileNotFoundError:
                pass

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
            c.update(runs_stored=len(self.index), bytes_stored=self.total_bytes,
                     capacity_bytes=self.capacity)
        c["read_GBps"] = c["bytes_read"] / c["read_s"] / 1e9 if c["read_s"] else 0.0
        c["write_GBps"] = c["bytes_written"] / c["write_s"] / 1e9 if c["write_s"] else 0.0
        return c
