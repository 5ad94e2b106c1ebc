"""A GGUF file's metadata and tensor table, checked whole before any tensor is read.

GGUF (llama.cpp's checkpoint format, versions 2 and 3, little-endian) is: the magic "GGUF", a
version, the tensor and metadata counts, typed metadata key/values, one info record per tensor
(name, dims in ggml order -- fastest axis first --, quantization type, offset), then the tensor
data from the next `general.alignment` boundary. `GGUFFile` parses the header itself, so every
defect is reported with the file and what is wrong: a file cut short (in the header, or tensors
whose bytes lie past its end), a quantization type this loader does not dequantize (the tensor
and the type), a malformed header. Tensors are memory-mapped and dequantized one at a time by the
`gguf` package (`gguf.quants.dequantize`).
"""

from __future__ import annotations

import pathlib
import struct

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Types dequantized (by gguf.quants) and tested here; ggml's type ids, by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

# GGUF metadata value types: id -> (name, struct format or None for string/array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded; the message names the file and the defect."""


class _Cursor:
    """Sequential little-endian reads over the file's bytes; a read past the end is a
    truncation error naming what was being read."""

    def __init__(self, buf: memoryview, path: pathlib.Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF: the file ends ({len(self.buf)} bytes) "
                            f"inside the header, while reading {what}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        return bytes(self.take(n, what)).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str):
        if vtype == _FLOAT32:  # the shortest decimal that is this float32: 1e-05, not 9.99e-06
            return float(str(np.float32(self.scalar("<f", what))))
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, count = self.scalar("<I", what), self.scalar("<Q", what)
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
                return np.frombuffer(self.take(count * dt.itemsize, what), dt).copy()
            return [self.value(etype, what) for _ in range(count)]
        raise GGUFError(f"{self.path}: malformed GGUF: {what} has unknown value type {vtype}")


class TensorInfo:
    """One tensor's record: name, numpy shape (slowest axis first), ggml type, data span."""

    def __init__(self, name: str, dims: tuple[int, ...], type_id: int, offset: int):
        self.name, self.type_id, self.offset = name, type_id, offset
        self.shape = tuple(reversed(dims))  # ggml lists the fastest axis first

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType
        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"unknown type id {self.type_id}"

    def byte_shape(self) -> tuple[int, ...]:
        """The raw bytes as (*rows, bytes per row): what gguf.quants.dequantize takes."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        if self.shape[-1] % block:
            raise ValueError(f"row length {self.shape[-1]} is not a multiple of the "
                             f"{self.type_name} block of {block}")
        return self.shape[:-1] + (self.shape[-1] // block * size,)

    def nbytes(self) -> int:
        return int(np.prod(self.byte_shape(), dtype=np.int64))


class GGUFFile:
    """A parsed GGUF: `metadata` (key -> value; arrays as lists or numpy arrays), `tensors`
    (name -> TensorInfo). The constructor checks the whole file: raises GGUFError for a bad
    magic or version, a header cut short, a tensor of an unsupported type (named), or tensor
    data past the end of the file (names the first such tensor and how many bytes are missing).
    """

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map), self.path)
        magic = bytes(cur.take(4, "the magic"))
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (starts with {magic!r}, not b'GGUF')")
        version = cur.scalar("<I", "the version")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported "
                            f"(supported: {SUPPORTED_VERSIONS})")
        n_tensors = cur.scalar("<Q", "the tensor count")
        n_kv = cur.scalar("<Q", "the metadata count")
        self.metadata = self._read_metadata(cur, n_kv)
        self.tensors = self._read_tensor_infos(cur, n_tensors)
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = -(-cur.pos // align) * align
        self._check_types()
        self._check_extent()

    def _read_metadata(self, cur: _Cursor, n_kv: int) -> dict:
        meta = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.scalar("<I", f"the type of metadata {key!r}")
            meta[key] = cur.value(vtype, f"metadata {key!r}")
        return meta

    def _read_tensor_infos(self, cur: _Cursor, n_tensors: int) -> dict[str, TensorInfo]:
        tensors = {}
        for i in range(n_tensors):
            name = cur.string(f"the name of tensor #{i}")
            n_dims = cur.scalar("<I", f"tensor {name!r}'s rank")
            dims = tuple(cur.scalar("<Q", f"tensor {name!r}'s dims") for _ in range(n_dims))
            type_id = cur.scalar("<I", f"tensor {name!r}'s type")
            offset = cur.scalar("<Q", f"tensor {name!r}'s offset")
            tensors[name] = TensorInfo(name, dims, type_id, offset)
        return tensors

    def _check_types(self) -> None:
        for info in self.tensors.values():
            if info.type_name not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.path}: tensor {info.name!r} has quantization type "
                                f"{info.type_name}, which this loader does not dequantize "
                                f"(supported: {', '.join(SUPPORTED_TYPES)})")
            try:
                info.byte_shape()
            except ValueError as err:
                raise GGUFError(f"{self.path}: tensor {info.name!r} ({info.type_name}, shape "
                                f"{info.shape}): {err}") from None

    def _check_extent(self) -> None:
        size = len(self._map)
        short = [(self.data_start + t.offset + t.nbytes(), t) for t in self.tensors.values()
                 if self.data_start + t.offset + t.nbytes() > size]
        if short:
            end, first = min(short, key=lambda s: s[1].offset)
            need = max(e for e, _ in short)
            raise GGUFError(f"{self.path}: truncated GGUF: the file is {size} bytes but its "
                            f"tensors need {need} ({need - size} bytes missing); {len(short)} of "
                            f"{len(self.tensors)} tensors are cut or absent, the first "
                            f"{first.name!r} ({first.type_name}, {first.shape}) ends at byte {end}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> np.ndarray:
        """A tensor's stored bytes as (*rows, bytes per row), a view of the memory map."""
        info = self.tensors[name]
        begin = self.data_start + info.offset
        return self._map[begin:begin + info.nbytes()].reshape(info.byte_shape())

    def tensor(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32 (F32 tensors: a read-only view of the file), in
        numpy shape order (for a matrix: [rows = ggml ne1, cols = ggml ne0])."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        info = self.tensors[name]
        if info.type_name == "F32":
            return self.raw(name).view(np.float32).reshape(info.shape)
        out = dequantize(self.raw(name), GGMLQuantizationType(info.type_id))
        return np.asarray(out, np.float32).reshape(info.shape)

    def total_bytes(self) -> int:
        return len(self._map)
