"""The span store's file format: one safetensors file per run of consecutive blocks.

Three tensors in this order: `hashes` [n] (uint64, the chained key of every block), `tokens`
[n, B] (int64, to confirm hits) and `kv` [L, n, B, ...] (the run's pages of every cache leaf,
leaf-major, as unsigned ints of the leaf's width; the store's identity gives the real dtype).
Metadata: the first hash, the identity digest, the namespace and an xxh3 checksum of the data.

A read is one `pread` of the file's head (length, header, hashes, tokens) and one `preadv` of the
kv data straight into the array that goes to the device (leaf-major, so each leaf's rows are one
contiguous piece of it), then one checksum pass (xxh3, C, GIL released): the cost is the kernel's
copy out of the page cache, not Python per block. A write is the same pieces, written straight
from the gathered pages (no copy).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import xxhash

MAX_RUN = 256  # blocks per file (longer runs are split): bounds the transfer buckets
HEAD = 1 << 16  # first read of a file: length, header, hashes and tokens of most runs
_UINT = {1: "U8", 2: "U16", 4: "U32", 8: "U64"}


def run_rows(n: int) -> int:
    """Rows a run of n blocks is read into: n rounded up to 16 (at most 15 unused rows, 16
    transfer/scatter shapes up to MAX_RUN)."""
    return -(-n // 16) * 16


class CorruptRun(ValueError):
    pass


@dataclasses.dataclass
class Run:
    """A verified run file: n blocks; `kv` has `rows` >= n rows (the rest unwritten)."""

    hashes: np.ndarray  # [n] uint64
    tokens: np.ndarray  # [n, B] int64
    kv: np.ndarray  # [L, rows, B, ...] real dtype
    dev: object = None  # kv on the device, once sent (serving/tiers/kv_store_tier.py)

    @property
    def n(self) -> int:
        return len(self.hashes)


def preadv_all(fd: int, views: list, off: int) -> int:
    """Read into `views` from offset `off` until they are full or the file ends; bytes read."""
    total, views = 0, list(views)
    while views:
        k = os.preadv(fd, views, off + total)
        if k <= 0:
            break
        total += k
        while views and k >= len(views[0]):
            k -= len(views[0])
            views.pop(0)
        if views and k:
            views[0] = views[0][k:]
    return total


def write_all(fd: int, bufs) -> int:
    done = 0
    for b in bufs:  # os.write may write short
        b = memoryview(b).cast("B")
        while b:
            k = os.write(fd, b)
            done, b = done + k, b[k:]
    return done


@dataclasses.dataclass(frozen=True)
class RunFormat:
    digest: str  # the store identity's digest
    block_size: int
    num_leaves: int
    page_shape: tuple  # [B, ...] of one leaf
    dtype: np.dtype

    @property
    def page_bytes(self) -> int:
        return int(np.prod(self.page_shape)) * self.dtype.itemsize

    def parse_head(self, head: bytes, size: int, h: int):
        """(n, data start, bytes of hashes + tokens, checksum) from a file's first bytes."""
        if len(head) < 8:
            raise CorruptRun(f"{len(head)} bytes, shorter than a safetensors header")
        nh = int.from_bytes(head[:8], "little")
        if 8 + nh > len(head):
            raise CorruptRun(f"header of {nh} bytes runs past the first {len(head)} bytes")
        try:
            header = json.loads(head[8:8 + nh])
            meta = header["__metadata__"]
            n = header["hashes"]["shape"][0]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, IndexError):
            raise CorruptRun("unreadable header") from None
        if meta.get("identity") != self.digest or meta.get("first") != f"{h:016x}":
            raise CorruptRun(f"metadata {meta} does not name this store and run")
        small = 8 * n * (1 + self.block_size)
        end = small + self.num_leaves * n * self.page_bytes
        want = {"hashes": ("U64", [n], [0, 8 * n]),
                "tokens": ("I64", [n, self.block_size], [8 * n, small]),
                "kv": (_UINT[self.dtype.itemsize], [self.num_leaves, n, *self.page_shape],
                       [small, end])}
        for name, (dt, shape, offs) in want.items():
            spec = header.get(name) or {}
            if [spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")] != \
                    [dt, shape, offs]:
                raise CorruptRun(f"tensor {name} {spec} is not {dt} {shape} at {offs}")
        if not 0 < n <= MAX_RUN or 8 + nh + end != size:
            raise CorruptRun(f"{size} bytes, not the {8 + nh + end} its header says")
        return n, 8 + nh, small, meta.get("xxh3")

    def read(self, fd: int, size: int, h: int, pad=None, alloc=np.empty) -> Run:
        """The verified run of an open file; kv gets pad(n) rows (n without pad), from
        `alloc(shape, dtype)` (a pool of reused buffers: no fresh pages to fault in). Raises
        CorruptRun."""
        head = os.pread(fd, HEAD, 0)
        n, data0, small, checksum = self.parse_head(head, size, h)
        meta = head[data0:data0 + small]
        if len(meta) < small:
            meta = os.pread(fd, small, data0)
        kv = alloc((self.num_leaves, pad(n) if pad else n, *self.page_shape), self.dtype)
        views = [memoryview(kv[k, :n].reshape(-1).view(np.uint8)) for k in range(len(kv))]
        want = sum(len(v) for v in views)
        got = preadv_all(fd, views, data0 + small)
        if got != want:
            raise CorruptRun(f"kv data cut short ({got} of {want} bytes)")
        x = xxhash.xxh3_64(meta)
        for v in views:
            x.update(v)
        if x.hexdigest() != checksum:
            raise CorruptRun("checksum mismatch")
        hashes = np.frombuffer(meta, np.uint64, n)
        tokens = np.frombuffer(meta, np.int64, n * self.block_size, 8 * n)
        return Run(hashes, tokens.reshape(n, -1), kv)

    def stored_hashes(self, path) -> np.ndarray | None:
        """The block hashes of a run file (header and hashes only, unverified), or None."""
        h = int(os.path.basename(path).split(".")[0], 16)
        try:
            with open(path, "rb") as f:
                head = f.read(HEAD)
                size = os.fstat(f.fileno()).st_size
            n, data0, _, _ = self.parse_head(head, size, h)
        except (OSError, CorruptRun, ValueError):
            return None
        return np.frombuffer(head, np.uint64, n, data0) if data0 + 8 * n <= len(head) else None

    def encode(self, ns: str, hashes: np.ndarray, tokens: bytes, leaves) -> list:
        """The file's bytes as buffers (views of the inputs, no copy): `hashes` [n] uint64,
        `tokens` n x B int64 bytes, `leaves` [n, B, ...] each, leaf order."""
        n = len(hashes)
        parts = [memoryview(np.ascontiguousarray(hashes, np.uint64)).cast("B"),
                 memoryview(tokens).cast("B")]
        parts += [memoryview(np.ascontiguousarray(a, self.dtype).reshape(-1).view(np.uint8))
                  for a in leaves]
        small = len(parts[0]) + len(parts[1])
        x = xxhash.xxh3_64()
        for b in parts:
            x.update(b)
        header = json.dumps({
            "__metadata__": {"identity": self.digest, "first": f"{int(hashes[0]):016x}",
                             "ns": ns, "xxh3": x.hexdigest()},
            "hashes": {"dtype": "U64", "shape": [n], "data_offsets": [0, 8 * n]},
            "tokens": {"dtype": "I64", "shape": [n, self.block_size],
                       "data_offsets": [8 * n, small]},
            "kv": {"dtype": _UINT[self.dtype.itemsize],
                   "shape": [len(leaves), n, *self.page_shape],
                   "data_offsets": [small, small + sum(len(b) for b in parts[2:])]}}).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        return [len(header).to_bytes(8, "little"), header, *parts]
