"""A file's pages in the page cache: mapped and read in at once, dropped once done with.

A first load of a quantised GGUF reads most of the file once and never again (a warm start
reads the prepared weights). A file on the disk is read past the page cache
(`loom.loader.direct_read`); one already in the page cache, or on a file system without
O_DIRECT, has its blocks used straight from the page cache through a private mapping of
each tensor (`FilePages.map_populated`): no copy, and none of the fresh memory a copy would
be written into, which on a virtual machine costs as much as the copy's data
twice over (every page a guest writes for the first time faults in the hypervisor too:
measured on a 2-core EPYC guest, 0.8 s a GB). The pages are read in by one call
(MADV_POPULATE_READ, Linux 5.14+), where touching a fresh mapping takes a fault every 4 KiB.
Once nothing refers to a tensor's mapping any more its pages can leave the page cache, and
the memory they free is what the load writes next.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np

# madvise advice Python's mmap module does not name (Linux 5.14+).
_MADV_POPULATE_READ = 22


class FilePages:
    """A file's pages through one read-only descriptor, open while this object or a mapping
    made from it lives (a loader's calls, many a second on two threads, open nothing)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def _advise(self, offset: int, nbytes: int, advice: int | None) -> None:
        if advice is None or nbytes <= 0:
            return
        with contextlib.suppress(OSError):  # advice is only advice
            os.posix_fadvise(self._fd, offset, nbytes, advice)

    def prefetch(self, offset: int, nbytes: int) -> None:
        """Ask the disk for the pages of [offset, offset + nbytes) in the background."""
        self._advise(offset, nbytes, getattr(os, "POSIX_FADV_WILLNEED", None))

    def drop(self, offset: int, nbytes: int) -> None:
        """Drop the pages of [offset, offset + nbytes) from the page cache where nothing maps
        them (clean pages: a later read gets them from the disk again)."""
        self._advise(offset, nbytes, getattr(os, "POSIX_FADV_DONTNEED", None))

    def map_populated(self, offset: int, nbytes: int,
                      drop_when_unmapped: bool) -> tuple[mmap.mmap, int] | None:
        """A private (copy-on-write, so writable) mapping of the bytes [offset, offset +
        nbytes) with every page read in and mapped, and where those bytes start in it; None
        where the kernel cannot read a mapping in at once (before Linux 5.14). The mapping
        lives as long as anything refers to it (a numpy array over it, and every view of
        that); with `drop_when_unmapped`, its pages are then dropped from the page cache."""
        if not hasattr(mmap, "MAP_PRIVATE"):  # not a POSIX system
            return None
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset + nbytes - start
        mapping = mmap.mmap(self._fd, length, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        try:
            mapping.madvise(_MADV_POPULATE_READ)
        except (OSError, ValueError):
            mapping.close()
            return None
        if drop_when_unmapped:
            finalizer = weakref.finalize(mapping, self.drop, start, length)
            finalizer.atexit = False  # a process that exits frees the pages anyway
        return mapping, offset - start


@functools.cache
def _mincore() -> Any | None:
    library = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(library).mincore if library else None
    except (OSError, AttributeError):
        return None
    if function is not None:
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        function.restype = ctypes.c_int
    return function


def cached_fraction(data: np.ndarray) -> float:
    """The share of the pages under `data` (a contiguous array over a file mapping) that
    the page cache holds; 1.0 where it cannot tell."""
    mincore = _mincore()
    if mincore is None or data.nbytes == 0:
        return 1.0
    first = data.ctypes.data - data.ctypes.data % mmap.PAGESIZE
    length = data.ctypes.data + data.nbytes - first
    resident = np.zeros(-(-length // mmap.PAGESIZE), dtype=np.uint8)
    if mincore(first, length, resident.ctypes.data) != 0:
        return 1.0
    return float(np.count_nonzero(resident & 1)) / resident.size
