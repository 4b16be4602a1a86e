"""Each rank's share of the CPU cores: torch's and Loom's kernels' thread counts.

torch's intra-op pool takes one process-wide count (`torch.set_num_threads`). Loom's C kernels
open plain OpenMP parallel regions, whose team size is the calling thread's OpenMP setting:
a thread that never set it (the async engine's step thread, say) uses the process default
(every core). So a rank sets both, and the driver sets the OpenMP count again on whichever
thread runs its steps (`ComputeThreads.apply`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch


def cores_per_rank(world_size: int) -> int:
    """This machine's usable cores split evenly over `world_size` ranks (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    try:  # the runtime torch and the kernels share (loaded already: dlopen finds it)
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


class ComputeThreads:
    """Holds a process to `count` compute threads, and restores the previous torch count."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._previous = torch.get_num_threads()
        self._applied: set[int] = set()
        torch.set_num_threads(count)

    def apply(self) -> None:
        """Set the OpenMP team size of the calling thread (once per thread)."""
        ident = threading.get_ident()
        if ident in self._applied:
            return
        lib = _openmp()
        if lib is not None:
            lib.omp_set_num_threads(ctypes.c_int(self.count))
        self._applied.add(ident)

    def restore(self) -> None:
        """Give the process its previous torch thread count back."""
        torch.set_num_threads(self._previous)
        lib = _openmp()
        if lib is not None and threading.get_ident() in self._applied:
            lib.omp_set_num_threads(ctypes.c_int(self._previous))
