"""A file read from the disk past the page cache (O_DIRECT), into buffers used again.

A first load reads most of a GGUF once, from the disk, and never again (a warm start reads
the prepared weights). Read through the page cache, every page of the file lands in memory
fresh to the process and, on a virtual machine, to the guest: measured on a 2-core EPYC
guest, `cat` of a 6.6 GB file took 3.5-11 s as the hypervisor backed those pages, against
4.2-4.3 s read with O_DIRECT into two reused 64 MiB buffers, at the disk's 1.55 GB/s. Here
each read lands in a buffer of `ReusedBuffers`: huge-page memory that comes back to the pool
once nothing refers to the data read into it (the loader has packed it), so a load's reads
touch only what is in flight at once (1.3 GB for the Qwen3-30B-A3B-shaped file), and the
packs read their inputs from huge pages, not 4 KiB page-cache pages (the load's user time
7.4-9.5 s before, 4.7-6.0 s after). That load (16 of 48 layers, `build_model` alone, page
cache dropped, first after a `cat`): 9.4-11.8 s mapped, 7.3-9.8 s read directly.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from pathlib import Path

import numpy as np

from loom.kernels.huge_pages import HUGE_PAGE_BYTES, huge_page_mapping, round_up

# O_DIRECT transfers start and end on the device's logical blocks, and their memory on
# such a boundary too; a page is a multiple of every block size Linux supports.
_ALIGN = mmap.PAGESIZE
# A free buffer serves a read that a fresh one of at least this share of its size would
# (in whole huge pages); a larger one would keep memory that data held for long, such as
# blocks a model keeps, does not use.
_MIN_USE = 0.75


class ReusedBuffers:
    """Buffers in huge-page mappings handed out for one read each and used again once every
    array over the data read into them is gone; thread-safe.

    Invariant: a mapping is in `_free` only while nothing refers to its data (its lease's
    numpy base has been freed); at most `keep_bytes` of free mappings are kept, the others
    unmapped."""

    def __init__(self, keep_bytes: int) -> None:
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: list[tuple[int, mmap.mmap, int]] = []  # (capacity, mapping, start)
        self._free_bytes = 0
        self._open = True

    def lease(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of `nbytes`, starting on an `_ALIGN` boundary; its memory
        returns to the pool when the array and every view of it are gone."""
        need = round_up(max(nbytes, 1), HUGE_PAGE_BYTES)
        with self._lock:
            fits = [entry for entry in self._free
                    if need <= entry[0] and need >= entry[0] * _MIN_USE]
            entry = min(fits, key=lambda e: e[0]) if fits else None
            if entry is not None:
                self._free.remove(entry)
                self._free_bytes -= entry[0]
        if entry is None:
            mapping, start = huge_page_mapping(need)
            entry = (need, mapping, start)
        _, mapping, start = entry
        data = np.frombuffer(mapping, np.uint8, nbytes, start)
        # Every array made from `data` refers (through its bases) to this buffer export.
        weakref.finalize(data.base, self._give_back, entry).atexit = False
        return data

    def _give_back(self, entry: tuple[int, mmap.mmap, int]) -> None:
        with self._lock:
            if not self._open or self._free_bytes + entry[0] > self._keep_bytes:
                return  # unmapped once the last reference to the mapping is gone
            self._free.append(entry)
            self._free_bytes += entry[0]

    def close(self) -> None:
        """Keep no free buffers from now on (those leased are freed with their data)."""
        with self._lock:
            self._open = False
            self._free.clear()
            self._free_bytes = 0


class DirectFile:
    """One file's bytes read with O_DIRECT (the page cache neither used nor filled) into
    `ReusedBuffers`. `open` returns None where the file system refuses O_DIRECT."""

    def __init__(self, path: Path, fd: int, buffers: ReusedBuffers) -> None:
        self.path, self._fd, self._buffers = path, fd, buffers
        weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: Path, buffers: ReusedBuffers) -> DirectFile | None:
        flag = getattr(os, "O_DIRECT", None)
        if flag is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | flag)
        except OSError:  # tmpfs and some others: EINVAL
            return None
        return cls(path, fd, buffers)

    def read(self, offset: int, nbytes: int) -> np.ndarray | None:
        """The bytes [offset, offset + nbytes) as a writable uint8 array over a reused
        buffer; None where the file ends first or the kernel refuses the transfer (the
        caller reads it another way)."""
        first = offset - offset % _ALIGN
        wanted = offset + nbytes - first  # from `first` to the last byte asked for
        buffer = self._buffers.lease(round_up(wanted, _ALIGN))
        done = 0
        try:
            while done < wanted:
                got = os.preadv(self._fd, [buffer[done:]], first + done)
                if got <= 0:
                    return None
                done += got
                if got % _ALIGN:  # a short transfer ends at the end of the file
                    break
        except OSError:
            return None
        return buffer[offset - first:wanted] if done >= wanted else None
