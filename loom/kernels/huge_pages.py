"""Tensors in transparent huge pages, for the weights a first load writes.

A first load of a quantised GGUF writes every packed weight (`w4a8_pack`) into memory fresh
from the kernel. In 4 KiB pages every page costs a fault and its zeroing, and in a virtual
machine a fault in the hypervisor as well: measured on a 2-core EPYC guest, 0.6 s per GB of
fresh memory written, against 0.14 s in 2 MiB pages; packing a 30B mixture of experts'
6,000 expert projections of about 1 MB each spent 10 s of a 28 s load there. Each of those
tensors is too small for a huge page of its own, so `HugePageArena` carves them from
mappings of `CHUNK_BYTES` advised MADV_HUGEPAGE (honoured where the kernel's
transparent_hugepage setting is `madvise` or `always`; elsewhere they are ordinary pages).

Ownership: every tensor handed out is its own storage over its bytes of a mapping, and holds
the mapping; a mapping is unmapped when the last such tensor is freed. The arena refers to
the mapping it carves from only weakly, so it holds no memory of its own: dropping a model
frees its mappings, except one that a tensor still alive shares (at most a chunk each).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
import weakref

import torch

# Every mapping starts and ends on a huge page boundary, so all of it can be huge pages.
HUGE_PAGE_BYTES = 2 << 20
CHUNK_BYTES = 64 << 20
# A tensor larger than this gets a mapping of its own (at most this much of a chunk's end is
# never handed out).
_OWN_MAPPING_BYTES = CHUNK_BYTES // 4
# Where each tensor of a chunk starts (the alignment of torch's own allocations).
_ALIGNMENT = 64


def round_up(n: int, to: int) -> int:
    """n rounded up to a multiple of `to`."""
    return -(-n // to) * to


def huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping advised MADV_HUGEPAGE, and the offset in it of the first
    huge page boundary, with at least `nbytes` from there to its end. Nothing is resident
    until written."""
    length = round_up(nbytes, HUGE_PAGE_BYTES) + HUGE_PAGE_BYTES
    if hasattr(mmap, "MAP_ANONYMOUS"):  # private: Python's default, shared memory, gets
        # huge pages on Linux only where shmem_enabled allows them
        mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        mapping = mmap.mmap(-1, length)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # advice only: a kernel without THP ignores it
            mapping.madvise(advice)
    probe = torch.frombuffer(mapping, dtype=torch.uint8, count=1)
    start = -probe.data_ptr() % HUGE_PAGE_BYTES
    del probe
    return mapping, start


def _tensor_at(mapping: mmap.mmap, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 tensor of `shape` over the mapping's bytes from `offset`: a storage of its own
    that keeps the mapping alive."""
    count = math.prod(shape)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=count, offset=offset).view(shape)


class HugePageArena:
    """Hands out uninitialised uint8 tensors from huge-page mappings (see the module
    docstring); thread-safe."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        # The chunk tensors are carved from, [self._next, self._end) of it still free.
        self._chunk: weakref.ref[mmap.mmap] | None = None
        self._next = self._end = 0

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialised contiguous uint8 tensor of `shape`, 64-byte aligned."""
        nbytes = math.prod(shape)
        if nbytes == 0:
            return torch.empty(shape, dtype=torch.uint8)
        if nbytes > min(_OWN_MAPPING_BYTES, self._chunk_bytes // 4):
            mapping, start = huge_page_mapping(nbytes)
            return _tensor_at(mapping, start, shape)
        with self._lock:
            chunk = self._chunk() if self._chunk is not None else None
            if chunk is None or self._next + nbytes > self._end:
                chunk, self._next = huge_page_mapping(self._chunk_bytes)
                self._end = self._next + self._chunk_bytes
                self._chunk = weakref.ref(chunk)
            start = self._next
            self._next = round_up(start + nbytes, _ALIGNMENT)
            return _tensor_at(chunk, start, shape)


# The packed weights of every load in the process (an allocator: it owns no memory).
PACKED_WEIGHTS = HugePageArena()
