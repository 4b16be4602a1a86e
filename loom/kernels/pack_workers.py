"""Where packed weights are written: at once, or on worker threads while a load goes on.

A first load packs thousands of tensors (`w4a8_pack`: a 30B mixture of experts' 6,000
expert projections), one call between stretches of the loader's Python. Run inline, each
call's OpenMP team spin-waited through the Python that followed it, and two threads writing
one fresh huge page both faulted it in; measured on a 2-core EPYC, a third of the load's CPU
time. Inside `packing_in_background()` a pack only allocates its output and queues the work
on one of `threads` workers, each packing alone (one OpenMP thread) into an arena of its
own, while the loader goes on with the next tensors; the calls release the GIL, so the
workers run beside the loader's Python and each other.

Invariant: a packed tensor handed out inside the scope is written when the scope ends (it
waits for every queued pack), so nothing may read one before. The loader reads none of them
(it only stores them in the modules it builds); the model is used after the scope.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from loom.kernels.build import load_library
from loom.kernels.huge_pages import PACKED_WEIGHTS, HugePageArena

# The packs queued but not yet done keep their inputs (a layer's file blocks) alive; past
# this many input bytes the loader waits for the oldest to finish.
PENDING_BYTES = 512 << 20

Fill = Callable[[torch.Tensor], None]


def _one_omp_thread() -> None:
    """Run this worker's kernel calls on one OpenMP thread (the workers are the
    parallelism); a runtime without `omp_set_num_threads` is left as it is."""
    setter = getattr(load_library(), "omp_set_num_threads", None)
    if setter is not None:
        setter(1)


class _Workers:
    """`threads` single-threaded workers, each with its own arena, served in turn."""

    def __init__(self, threads: int) -> None:
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix="loom-pack",
                                          initializer=_one_omp_thread)
                       for _ in range(threads)]
        self._arenas = [HugePageArena() for _ in range(threads)]
        self._turn = 0
        self._pending: deque[tuple[Future[None], int]] = deque()
        self._pending_bytes = 0

    def submit(self, shape: tuple[int, ...], fill: Fill, input_bytes: int) -> torch.Tensor:
        """A tensor of `shape` that the next worker in turn fills (`fill(out)`)."""
        while self._pending and self._pending_bytes + input_bytes > PENDING_BYTES:
            self._wait_oldest()
        turn, self._turn = self._turn, (self._turn + 1) % len(self._pools)
        out = self._arenas[turn].empty(shape)
        self._pending.append((self._pools[turn].submit(fill, out), input_bytes))
        self._pending_bytes += input_bytes
        return out

    def _wait_oldest(self) -> None:
        done, input_bytes = self._pending.popleft()
        self._pending_bytes -= input_bytes
        done.result()  # a pack's error is raised here

    def finish(self) -> None:
        """Wait for every queued pack, then stop the workers."""
        try:
            while self._pending:
                self._wait_oldest()
        finally:
            for pool in self._pools:
                pool.shutdown(wait=True, cancel_futures=True)


_workers: contextvars.ContextVar[_Workers | None] = contextvars.ContextVar(
    "loom_pack_workers", default=None)


@contextlib.contextmanager
def packing_in_background(threads: int | None = None) -> Iterator[None]:
    """Within the block, `packed_tensor` queues its work on `threads` workers (default:
    torch's intra-op thread count) and every queued pack is done when the block ends."""
    workers = _Workers(max(1, threads or torch.get_num_threads()))
    token = _workers.set(workers)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the block's own error is the one to raise
            workers.finish()
        raise
    else:
        workers.finish()
    finally:
        _workers.reset(token)


def packed_tensor(shape: tuple[int, ...], fill: Fill, input_bytes: int) -> torch.Tensor:
    """A uint8 tensor of `shape` in huge pages, written by `fill(out)`: now, or inside
    `packing_in_background` by a worker before the block ends (`input_bytes`: what `fill`
    reads, which it keeps alive until then)."""
    workers = _workers.get()
    if workers is not None:
        return workers.submit(shape, fill, input_bytes)
    out = PACKED_WEIGHTS.empty(shape)
    fill(out)
    return out

