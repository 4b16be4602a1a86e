"""A GGUF's tensor data read on a thread, ahead of the loader that converts it.

A first load in w4a8 reads most of the file's blocks (`loom.loader.direct_read`, or
`GGUFFile.map_tensor`) and repacks them (`loom.kernels.w4a8_pack`). Reading releases the
GIL (the read or madvise calls), so on a thread it overlaps the loader's Python and its C
calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from loom.loader.direct_read import DirectFile, ReusedBuffers
from loom.loader.gguf_reader import GGUFFile, GGUFTensorInfo

# How far the thread may read ahead of the tensor the loader takes: the data read and not yet
# taken stays within this, or is one tensor where that one is larger. A layer's tensors are
# prepared (packed) when its last one has loaded; this lets the next layer's first large
# tensors be read meanwhile, at a bounded cost in resident memory.
AHEAD_BYTES = 256 << 20
# How far past the tensors being mapped the disk is asked for the next ones' pages
# (POSIX_FADV_WILLNEED): they wait in the page cache, not in this process, so the disk goes
# on reading while the window of mapped tensors is full.
PREFETCH_BYTES = 512 << 20


class ReadAhead:
    """The data of some of a file's tensors (`planned`: their indices in `reader.tensors`,
    ascending) read one after another on a thread.

    A tensor's data, where the load reads the file from the disk (`drop_cached`), is read
    past the page cache into a buffer used again once the data is dropped
    (`loom.loader.direct_read`: the disk's speed, no memory fresh to the guest a tensor);
    otherwise, or where the file system refuses that, its pages mapped and read in
    (`GGUFFile.map_tensor`: a private copy, copy-on-write), or a copy read into memory
    (`GGUFFile.read_tensor`) where the kernel cannot do that either.

    Invariants: tensors are read in the order planned, each at most once; the loader goes
    through the file in order, taking a tensor's data (`take`) or passing it (`done`); data
    passed is dropped, unread or as soon as its read ends. With `drop_cached`, a mapped
    tensor's pages leave the page cache once nothing refers to its data.

        planned:  [ taken or passed | queued (mapped)  | asked of the disk |  later  ]
                                    ^ _queued[0]       ^ _next             ^ _asked
    """

    def __init__(self, reader: GGUFFile, planned: Iterable[int],
                 ahead_bytes: int = AHEAD_BYTES, drop_cached: bool = False) -> None:
        self._reader, self._ahead_bytes, self._drop_cached = reader, ahead_bytes, drop_cached
        # A file read from the disk is read past the page cache where the kernel allows.
        # The buffers in use are the window ahead plus the data the loader still holds
        # (packs queued on workers); up to twice the window of them is kept free.
        self._buffers = ReusedBuffers(2 * ahead_bytes) if drop_cached else None
        self._direct = DirectFile.open(reader.path, self._buffers) \
            if self._buffers is not None else None
        self._planned = list(planned)
        self._next = self._asked = 0  # cursors into _planned, _next <= _asked
        self._asked_bytes = 0  # of _planned[_next:_asked]
        self._queued: deque[tuple[int, Future[np.ndarray]]] = deque()
        self._queued_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-gguf-read")
        # The disk is asked on a thread of its own: the call allocates the pages and queues
        # their reads, milliseconds the loader's thread would wait.
        self._asker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-gguf-ask")
        self._top_up()

    def _nbytes(self, index: int) -> int:
        return self._reader.tensors[index].nbytes

    def _advance(self) -> int:
        """Move `_next` past one planned tensor; returns its index."""
        index = self._planned[self._next]
        if self._next < self._asked:
            self._asked_bytes -= self._nbytes(index)
        self._next += 1
        self._asked = max(self._asked, self._next)
        return index

    def _top_up(self) -> None:
        """Queue reads within the window, then ask the disk for the tensors past it."""
        while self._next < len(self._planned) and (
                not self._queued or self._queued_bytes
                + self._nbytes(self._planned[self._next]) <= self._ahead_bytes):
            index = self._advance()
            info = self._reader.tensors[index]
            self._queued.append((index, self._pool.submit(self._read, info)))
            self._queued_bytes += info.nbytes
        # (A direct read fills no page cache: asking the disk ahead would read it twice.)
        while self._direct is None and self._asked < len(self._planned) and (
                self._asked_bytes + self._nbytes(self._planned[self._asked]) <= PREFETCH_BYTES):
            index = self._planned[self._asked]
            self._asker.submit(self._reader.prefetch, self._reader.tensors[index])
            self._asked_bytes += self._nbytes(index)
            self._asked += 1

    def take(self, index: int) -> np.ndarray:
        """The data of tensor `index` (read now if it was not planned)."""
        self.done(index - 1)
        info = self._reader.tensors[index]
        if self._queued and self._queued[0][0] == index:
            _, read = self._queued.popleft()
            self._queued_bytes -= info.nbytes
            self._top_up()
            return read.result()
        return self._read(info)

    def _read(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor read directly, or its pages mapped and read in, or (a kernel without
        either) a copy. Before mapping, the disk is asked for all of its pages at once: page
        faults alone read 128 KiB at a time (measured: 6.6 GB in 5.3 s against 3.3 s)."""
        if self._direct is not None:
            data = self._direct.read(info.offset, info.nbytes)
            if data is not None:
                return self._reader.shaped(info, data)
        self._reader.prefetch(info)
        data = self._reader.map_tensor(info, drop_when_unmapped=self._drop_cached)
        if data is None:
            data = self._reader.read_tensor(info)
            if self._drop_cached:
                self._reader.drop_cached(info)
        return data

    def done(self, index: int) -> None:
        """The loader is past tensor `index`: drop the data planned up to it."""
        while self._queued and self._queued[0][0] <= index:
            passed, read = self._queued.popleft()
            self._queued_bytes -= self._nbytes(passed)
            read.cancel()
        while self._next < len(self._planned) and self._planned[self._next] <= index:
            self._advance()
        self._top_up()

    def close(self) -> None:
        """Stop reading: a read under way ends on its own, none starts."""
        self._next = self._asked = len(self._planned)
        self._queued.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._asker.shutdown(wait=False, cancel_futures=True)
        if self._buffers is not None:
            self._buffers.close()
