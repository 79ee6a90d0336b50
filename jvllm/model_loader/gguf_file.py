"""Read a GGUF file: its metadata as Python values and its tensors as views of a memory map.

The `gguf` package's GGUFReader makes a NumPy view for every item of every metadata array, which
for a 49k-token vocabulary and its merges takes seconds (BENCHMARKS.md, "Model loading"); this
reads the same header with `struct` in tens of milliseconds. Only little-endian files (all that
llama.cpp writes by default) are read.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

_SUPPORTED_VERSIONS = (2, 3)
_STRING, _ARRAY = GGUFValueType.STRING, GGUFValueType.ARRAY
# Scalar value types -> struct codes (little-endian, standard sizes).
_SCALAR_CODES = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_SCALAR_STRUCTS = {t: struct.Struct("<" + code) for t, code in _SCALAR_CODES.items()}
_SCALAR_DTYPES = {t: np.dtype("<" + code) for t, code in _SCALAR_CODES.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order ([out, in]); the file lists dims innermost first
    data: np.ndarray  # u8[num_bytes]: the encoded blocks, a read-only view of the file


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # key -> str | int | float | bool | list of those
    tensors: dict[str, GGUFTensor]  # in file order


class _Cursor:
    """Reads values one after another from a buffer."""

    def __init__(self, buf: mmap.mmap, path: str):
        self.buf, self.offset, self.path = buf, 0, path

    def scalar(self, fmt: struct.Struct) -> Any:
        (value,) = fmt.unpack_from(self.buf, self.offset)
        self.offset += fmt.size
        return value

    def string(self) -> str:
        size = self.scalar(_U64)
        start, self.offset = self.offset, self.offset + size
        return self.buf[start : self.offset].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type in _SCALAR_STRUCTS:
            return self.scalar(_SCALAR_STRUCTS[value_type])
        if value_type != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        item_type, count = self.scalar(_U32), self.scalar(_U64)
        if item_type in _SCALAR_DTYPES:  # one NumPy read instead of `count` unpacks
            dtype = _SCALAR_DTYPES[item_type]
            items = np.frombuffer(self.buf, dtype, count, self.offset)
            self.offset += count * dtype.itemsize
            return items.tolist()
        if item_type == _STRING:
            return self._strings(count)
        return [self.value(item_type) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """`count` strings: a vocabulary's tokens or merges, so the loop is kept tight."""
        buf, offset, unpack, strings = self.buf, self.offset, _U64.unpack_from, []
        for _ in range(count):
            (size,) = unpack(buf, offset)
            offset += 8 + size
            strings.append(buf[offset - size : offset].decode("utf-8"))
        self.offset = offset
        return strings


def read_gguf(path: str) -> GGUFFile:
    """Read `path`'s metadata and tensor table; tensor data stays in the file until used."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buf, path)
    if cursor.scalar(_U32) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    version = cursor.scalar(_U32)
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(
            f"{path}: GGUF version {version} is not supported; supported: {_SUPPORTED_VERSIONS}"
            " (little-endian files only)"
        )
    num_tensors, num_kvs = cursor.scalar(_U64), cursor.scalar(_U64)
    metadata = {}
    for _ in range(num_kvs):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar(_U32))

    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        num_dims = cursor.scalar(_U32)
        dims = [cursor.scalar(_U64) for _ in range(num_dims)]
        infos.append((name, GGMLQuantizationType(cursor.scalar(_U32)), dims, cursor.scalar(_U64)))
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-cursor.offset // alignment) * alignment

    tensors = {}
    for name, qtype, dims, offset in infos:
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        num_bytes = int(np.prod(dims, dtype=np.int64)) // block_size * block_bytes
        data = np.frombuffer(buf, np.uint8, num_bytes, data_start + offset)
        tensors[name] = GGUFTensor(name, qtype, tuple(reversed(dims)), data)
    return GGUFFile(metadata, tensors)
