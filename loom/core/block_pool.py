"""`BlockPool`: fixed-size KV blocks with reference counts and a free queue."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids in [0, num_blocks) and takes them back when unreferenced.

    Invariant: a block is in the free queue exactly when its reference count is 0, so
    `num_free_blocks + (blocks with ref_count > 0) == num_blocks` at all times.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request."""
        return len(self._free)

    @property
    def all_free(self) -> bool:
        """True when no block is referenced (the leak check of every test)."""
        return len(self._free) == self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold this block."""
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (ref count 1 each); raises if not enough are free."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add one reference to each block (a fork sharing them)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"cannot share free block {block_id}")
            self._ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the pool."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)
