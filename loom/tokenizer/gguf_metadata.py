"""Read the key/value metadata of a GGUF file (no tensors): fast, and only what tokenizers need."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from loom.errors import UnsupportedModelError

# GGUF value types -> struct format of one scalar (8 = string, 9 = array are handled apart).
_SCALAR_FORMAT = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9


class _Cursor:
    """A read position over the mapped file; every read advances it."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        raw = self.buf[start : self.pos]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            (item_type, count) = self.unpack("IQ")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            fmt = _SCALAR_FORMAT.get(item_type)
            if fmt is None:
                raise UnsupportedModelError(f"{self.path}: unknown GGUF array type {item_type}")
            return list(self.unpack(f"{count}{fmt}"))
        fmt = _SCALAR_FORMAT.get(value_type)
        if fmt is None:
            raise UnsupportedModelError(f"{self.path}: unknown GGUF value type {value_type}")
        return self.unpack(fmt)[0]


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file, arrays as Python lists."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        if buf[:4] != b"GGUF":
            raise UnsupportedModelError(f"{path}: not a GGUF file (bad magic {buf[:4]!r})")
        cur.pos = 4
        (version,) = cur.unpack("I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2, 3)")
        _num_tensors, num_kv = cur.unpack("QQ")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            (value_type,) = cur.unpack("I")
            metadata[key] = cur.value(value_type)
        return metadata
