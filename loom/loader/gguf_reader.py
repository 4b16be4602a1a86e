"""A lean GGUF parser: scalar metadata eagerly, arrays and tensor data lazily (memory-mapped).

`gguf.GGUFReader` builds a numpy view per array element, which costs tens of seconds for a
262k-token vocabulary; this parser walks the same layout once and keeps arrays as offsets.
The model loader and the GGUF tokenizer converter both read files through it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from loom.errors import UnsupportedModelError

# GGUFValueType -> struct format of fixed-size scalars (little endian).
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
_NUMPY: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
    10: "<u8", 11: "<i8", 12: "<f8",
}
# Unquantised tensor types stored as plain numpy arrays; all others are byte blocks.
_PLAIN_TENSORS: dict[GGMLQuantizationType, str] = {
    GGMLQuantizationType.F32: "<f4",
    GGMLQuantizationType.F16: "<f2",
    GGMLQuantizationType.F64: "<f8",
    GGMLQuantizationType.I8: "<i1",
    GGMLQuantizationType.I16: "<i2",
    GGMLQuantizationType.I32: "<i4",
    GGMLQuantizationType.I64: "<i8",
}


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array left in the file until asked for."""

    item_type: int
    count: int
    offset: int  # first element's byte offset in the file


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: `shape` in numpy (row-major) order, i.e. GGUF dims reversed."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file


class GGUFFile:
    """Parsed header of a .gguf file with lazy access to arrays and tensor data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._raw = memoryview(self._buf)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensorInfo] = []
        self._parse()

    def _unpack(self, fmt: str, pos: int) -> tuple[Any, int]:
        return struct.unpack_from(fmt, self._raw, pos)[0], pos + struct.calcsize(fmt)

    def _string(self, pos: int) -> tuple[str, int]:
        n, pos = self._unpack("<Q", pos)
        return bytes(self._raw[pos : pos + n]).decode("utf-8", errors="replace"), pos + n

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype], pos)
        if vtype == _STRING:
            return self._string(pos)
        if vtype != _ARRAY:
            raise UnsupportedModelError(f"{self.path}: unknown GGUF value type {vtype}")
        item_type, pos = self._unpack("<I", pos)
        count, pos = self._unpack("<Q", pos)
        array = GGUFArray(item_type, count, pos)
        return array, self._skip_array(array)

    def _skip_array(self, array: GGUFArray) -> int:
        """Offset just past the array's elements."""
        if array.item_type in _SCALARS:
            return array.offset + array.count * struct.calcsize(_SCALARS[array.item_type])
        pos = array.offset
        for _ in range(array.count):
            _, pos = self._value(array.item_type, pos)
        return pos

    def _parse(self) -> None:
        if bytes(self._raw[:4]) != b"GGUF":
            raise UnsupportedModelError(f"{self.path} is not a GGUF file")
        version, pos = self._unpack("<I", 4)
        if version not in (2, 3):
            raise UnsupportedModelError(f"{self.path}: GGUF version {version} not supported")
        n_tensors, pos = self._unpack("<Q", pos)
        n_kv, pos = self._unpack("<Q", pos)
        for _ in range(n_kv):
            key, pos = self._string(pos)
            vtype, pos = self._unpack("<I", pos)
            self.metadata[key], pos = self._value(vtype, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            n_dims, pos = self._unpack("<I", pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self._raw, pos)
            pos += 8 * n_dims
            qtype, pos = self._unpack("<I", pos)
            rel, pos = self._unpack("<Q", pos)
            infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), rel))
        align = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-pos // align) * align
        self.tensors = [
            GGUFTensorInfo(name, shape, qtype, data_start + rel)
            for name, shape, qtype, rel in infos
        ]

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value; arrays come back as lists."""
        value = self.metadata.get(key, default)
        return self.array(value) if isinstance(value, GGUFArray) else value

    def all_metadata(self) -> dict[str, Any]:
        """Every key/value pair, arrays decoded to (nested) lists."""
        return {key: self.get(key) for key in self.metadata}

    def array(self, array: GGUFArray) -> list[Any]:
        """Decode a metadata array (numeric arrays via numpy, strings one by one)."""
        if array.item_type in _NUMPY:
            dt = np.dtype(_NUMPY[array.item_type])
            return np.frombuffer(self._raw, dt, array.count, array.offset).tolist()
        out, pos = [], array.offset
        for _ in range(array.count):
            item, pos = self._value(array.item_type, pos)
            out.append(self.array(item) if isinstance(item, GGUFArray) else item)
        return out

    def array_item(self, key: str, index: int) -> Any:
        """One element of a metadata array (string arrays are walked up to `index`)."""
        array = self.metadata[key]
        if not isinstance(array, GGUFArray) or not 0 <= index < array.count:
            raise IndexError(f"{key}[{index}]")
        pos = array.offset
        for _ in range(index):
            _, pos = self._value(array.item_type, pos)
        return self._value(array.item_type, pos)[0]

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """The raw (read-only, memory-mapped) data in the layout `gguf.quants.dequantize` takes."""
        n_elems = int(np.prod(info.shape))
        if info.qtype in _PLAIN_TENSORS:
            dt = np.dtype(_PLAIN_TENSORS[info.qtype])
            return np.frombuffer(self._raw, dt, n_elems, info.offset).reshape(info.shape)
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        n_bytes = n_elems * type_size // block
        data = np.frombuffer(self._raw, np.uint8, n_bytes, info.offset)
        return data.reshape(quant_shape_to_byte_shape(info.shape, info.qtype))
