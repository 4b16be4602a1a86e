"""A safetensors file's tensors read into memory of their own, in huge pages.

Mapping a prepared file (safetensors' own `get_tensor` on CPU) leaves the weights in the
page cache's 4 KiB pages: a decode step that streams a gigabyte of them then walks the page
tables for every 4 KiB, and in a virtual machine each walk is two-dimensional. Measured on
the 2-core EPYC guest with the Qwen3-30B-A3B shape (16 of 48 layers): decode from the mapped
file moved between 30 and 52 tok/s from one prompt to the next in one process, as the page
walks' entries left and re-entered the caches; from the same weights in 2 MiB pages it ran
at 48.7-54.6 tok/s on every prompt (two processes of 12 prompts each; the speed left then
follows the host's memory bandwidth). So a warm start reads each tensor into the huge-page arena
(`loom.kernels.huge_pages.PACKED_WEIGHTS`; tensors under `SMALL_BYTES` into ordinary
memory) with `preadv`, which copies from the page cache without mapping the file: no page
faults on the source, one on each 2 MiB of the destination.

The file format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data_offsets relative to the end of the header; "__metadata__" -> str -> str), the data.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from loom.errors import InvalidModelError
from loom.kernels.huge_pages import PACKED_WEIGHTS
from loom.kv_connector.codec import safetensors_header

# safetensors' dtype names -> torch's.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# Tensors below this many bytes go to ordinary memory (norms, biases, router rows).
SMALL_BYTES = 1 << 16
# Threads copying at once (each copy is a syscall that releases the GIL).
READERS = 2


def read_header(path: Path) -> tuple[dict[str, str], dict[str, dict], int]:
    """(metadata, tensor entries, offset of the data) of a safetensors file;
    InvalidModelError (a ValueError) when the header is truncated or not one."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        size = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        body = f.read(min(size, os.fstat(f.fileno()).st_size))
    header = safetensors_header(prefix + body, InvalidModelError, f"prepared file {path}")
    metadata = header.pop("__metadata__", None) or {}
    return metadata, header, 8 + size


def _read_exactly(fd: int, out: memoryview, offset: int) -> None:
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:]], offset + done)
        if got <= 0:
            raise InvalidModelError(f"the file ends {len(out) - done} bytes before a tensor does")
        done += got


def read_resident(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, name -> tensor) of a safetensors file, every tensor copied into memory of
    its own (huge pages from SMALL_BYTES up). InvalidModelError (a ValueError) naming the
    problem for a malformed or truncated file."""
    metadata, entries, data_at = read_header(path)
    file_bytes = path.stat().st_size
    jobs: list[tuple[str, torch.Tensor, int]] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise InvalidModelError(f"tensor {name!r} has dtype {entry['dtype']}, which "
                                    "Loom does not store")
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        nbytes = end - start
        if nbytes != math.prod(shape) * dtype.itemsize or data_at + end > file_bytes:
            raise InvalidModelError(f"tensor {name!r}: offsets {start}-{end} do not hold "
                                    f"its shape {list(shape)} within the file")
        raw = (PACKED_WEIGHTS.empty((nbytes,)) if nbytes >= SMALL_BYTES
               else torch.empty(nbytes, dtype=torch.uint8))
        tensors[name] = raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
        if nbytes:
            jobs.append((name, raw, data_at + start))
    jobs.sort(key=lambda job: job[2])  # along the file
    fd = os.open(path, os.O_RDONLY)
    try:
        def copy(job: tuple[str, torch.Tensor, int]) -> None:
            _, raw, offset = job
            _read_exactly(fd, memoryview(raw.numpy()), offset)

        with ThreadPoolExecutor(READERS, thread_name_prefix="loom-prepared-read") as pool:
            list(pool.map(copy, jobs))
    finally:
        os.close(fd)
    return metadata, tensors
