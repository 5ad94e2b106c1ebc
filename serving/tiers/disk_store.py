"""Persistent span store: cached KV blocks as files, shared by processes (`kv_store_dir`).

A store folder holds one identity and one file per *run* of consecutive blocks of one prompt
segment (a span, or the prompt part between markers), named by the run's first block hash:

    STORE.json                            what the blocks were made by (`StoreIdentity`)
    <ns>/<hh>/<first:016x>.safetensors    one run of n blocks

`<ns>` is the cache_salt namespace ("shared" without a salt), `<hh>` the hash's top byte (small
folders); serving/tiers/run_file.py has the file format. Runs, not blocks: a hit reads a whole span
(~36 blocks, 18 MB for a 1B model) in two system calls and one checksum, so a read costs the
kernel's copy out of the page cache, not Python per block. Chained keys name a prefix, so a file
is a branch of a prefix tree: a request uses the longest prefix of a run whose hashes and tokens
match its own, and a writer that finds a run at its first hash writes only the blocks past the
common prefix (under the first new hash).

Files are written to a temp name and renamed, so a reader sees a whole file or none and two
processes filling one store never corrupt it. A file that is truncated or fails its checksum is
a miss: a warning, the file removed, the blocks recomputed. A write that fails (a full disk, a
read-only folder, a folder where the run file belongs) removes its temp file and raises; the
tier makes that a miss (serving/tiers/kv_store_tier.py). Damage to the folder (an entry that cannot be
listed or read, a symlink loop, a damaged STORE.json: serving/tiers/store_identity.py) is warned once
per path and skipped. Only a `kv_store_dir` that is not a folder is an error. Least recently
used runs (file mtime, and this process's own order) are deleted past `capacity_bytes`, counted
over every file in the folder (the folder is rescanned at most every `rescan_s` seconds and
before evicting), so several processes on one store keep it under one size.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import stat
import threading
import time
import warnings

import ml_dtypes  # noqa: F401 - registers bfloat16 & co. with numpy (leaf dtypes by name)
import numpy as np

from serving.tiers.run_file import MAX_RUN, CorruptRun, Run, RunFormat, write_all
from serving.tiers.store_identity import (FORMAT_VERSION, StoreIdentity,  # noqa: F401 - public here
                                    StoreMismatch, check_identity)

_SUFFIX = ".safetensors"
_TOUCH_S = 60.0  # a read marks a file used (mtime) when its mark is older than this


def _stale(entry, age_s: float = 3600.0) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > age_s
    except OSError:  # gone, or a dangling link: not a temp file of ours
        return False


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already, or cannot be removed (read-only): nothing more to do
        pass


def open_root(root) -> pathlib.Path:
    """The store folder, created when absent. ValueError naming it when it is not a folder (a
    file there or on its path): a setting to change, found before any work."""
    path = pathlib.Path(root).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"kv_store_dir {path} is not a folder (a file is there or on its "
                         f"path); give kv_store_dir a folder") from None
    except OSError as err:  # cannot be made (permissions): a store that misses
        warnings.warn(f"kv store: cannot create {path} ({err}); nothing is stored",
                      RuntimeWarning, stacklevel=2)
    return path


def namespace(cache_salt: str | None) -> str:
    if not cache_salt:
        return "shared"
    return "salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:16]


class DiskStore:
    """The file layer: identity check, run read (verified) / write (atomic), LRU over the whole
    folder, counters. Thread-safe (one lock around the index and counters; I/O outside it)."""

    def __init__(self, root, identity: StoreIdentity, capacity_bytes: int,
                 rescan_s: float = 30.0):
        self.root = open_root(root)
        self.identity = identity
        self.digest = identity.digest()
        self.capacity = int(capacity_bytes)
        self.rescan_s = rescan_s
        self.lock = threading.Lock()
        self.index: dict[pathlib.Path, int] = {}  # path -> bytes, least recently used first
        self.total_bytes = 0
        self.last_scan = 0.0
        self._recent: set[pathlib.Path] = set()  # used by this process since the last scan
        self._warned: set[str] = set()  # damaged paths already warned about
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
        check_identity(self.root, identity, self._damaged)
        self.rescan()

    def _damaged(self, path, err, then: str = "skipped") -> None:
        """Warn once per path about damage to the store's folder (any thread)."""
        with self.lock:
            if str(path) in self._warned:
                return
            self._warned.add(str(path))
        warnings.warn(f"kv store: {path} cannot be used ({err}); {then}", RuntimeWarning,
                      stacklevel=3)

    def rescan(self) -> None:
        """Index every run file in the folder (all processes' files), least recently used
        first: by mtime, then the files this process used since the last scan, in its order."""
        found = []
        for ns in self._listing(self.root):
            if not self._is_dir(ns):
                continue
            for sub in self._listing(ns.path):
                if not self._is_dir(sub):
                    continue
                for f in self._listing(sub.path):
                    if f.name.endswith(_SUFFIX):
                        st = self._stat_run(f)
                        if st is not None:
                            found.append((st.st_mtime_ns, pathlib.Path(f.path), st.st_size))
                    elif f.name.endswith(".tmp") and _stale(f):  # left by a killed writer
                        _unlink(f.path)
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

    def _listing(self, path) -> list:
        try:
            with os.scandir(path) as it:
                return list(it)
        except OSError as err:
            self._damaged(path, err)
            return []

    def _is_dir(self, entry) -> bool:
        try:
            return entry.is_dir()
        except OSError as err:  # a symlink loop
            self._damaged(entry.path, err)
            return False

    def _stat_run(self, entry):
        """The stat of a run file; None when it is gone, damaged (warned) or not a file."""
        try:
            st = entry.stat()
        except FileNotFoundError:
            return None
        except OSError as err:
            self._damaged(entry.path, err)
            return None
        return st if stat.S_ISREG(st.st_mode) else None

    # -- paths ---------------------------------------------------------------------------------
    def path(self, h: int, ns: str) -> pathlib.Path:
        name = f"{h & 0xFFFFFFFFFFFFFFFF:016x}"
        return self.root / ns / name[:2] / (name + _SUFFIX)

    def has(self, h: int, ns: str) -> bool:
        """A run starts at block hash h (this process's index, else the folder)."""
        p = self.path(h, ns)
        return p in self.index or p.is_file()

    # -- read ----------------------------------------------------------------------------------
    def read(self, h: int, ns: str, pad=None, alloc=np.empty) -> Run | None:
        """The run starting at h (its kv allocated with pad(n) rows: serving/tiers/run_file.py), or
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
            self._damaged(p, err, "its blocks are recomputed")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a folder where the run belongs: not a run
                os.close(fd)
                return None
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
        _unlink(p)

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
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                size = write_all(fd, bufs)
            finally:
                os.close(fd)
            os.replace(tmp, p)
        except BaseException:  # a full disk, a read-only store, a folder at p: no file left
            _unlink(tmp)
            raise
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
            _unlink(v)

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
