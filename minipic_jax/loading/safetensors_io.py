"""Zero-copy reading of (sharded) safetensors checkpoints into numpy, bf16 included.

The format is an 8-byte little-endian header length, a JSON header mapping tensor name ->
{dtype, shape, data_offsets}, then the raw bytes. Files are memory-mapped; a tensor is a view.
"""

from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of an HF folder (from the index when sharded); [] if none."""
    index = folder / INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise ValueError(f"{folder}: {INDEX_FILE} lists shards that are missing: {missing}")
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


class SafetensorsReader:
    """name -> np.ndarray over one or more safetensors files (memory-mapped, read-only)."""

    def __init__(self, files: list[pathlib.Path]):
        self._where: dict[str, tuple[pathlib.Path, dict, int]] = {}
        self._maps: dict[pathlib.Path, np.memmap] = {}
        for path in files:
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            for name, info in header.items():
                self._where[name] = (path, info, 8 + n)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(name)
        path, info, base = self._where[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._maps[path][base + begin:base + end]
        return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
