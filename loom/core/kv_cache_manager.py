"""`KVCacheManager`: the block table of every request, on top of the `BlockPool`."""

from __future__ import annotations

from loom.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Owns the mapping request id -> block ids; blocks cover a prefix of the request's slots.

    Invariant: the table of a request holding K/V for positions [0, n) has at least
    cdiv(n, block_size) blocks; blocks are only ever appended, or dropped from the tail
    (rewind) or all at once (free, preemption). Existing entries never move, so a live
    append never re-allocates what is already cached.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        # (src, dst) block copies the runner must perform before the next forward.
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks currently free in the pool."""
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold for one request."""
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def holds_blocks(self, request_id: str) -> bool:
        """True when the request owns at least one block."""
        return bool(self._tables.get(request_id))

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the table covers `num_tokens` slots."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the table to cover `num_tokens` slots; False (no change) if the pool is short."""
        need = self.num_new_blocks(request_id, num_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(need))
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` slots (rewind)."""
        table = self._tables.get(request_id)
        if not table:
            return
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(table):
            self.pool.release(table[keep:])
            del table[keep:]

    def free(self, request_id: str) -> None:
        """Release every block of the request."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.release(table)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> bool:
        """Give `child_id` a table sharing the parent's blocks for its first `num_tokens` slots.

        Full blocks are shared (ref-counted). A partial last block would be written by both
        sides, so the child gets a private copy of it (copy-on-write done eagerly at fork):

            parent: [b0][b1][b2 partial]      child: [b0][b1][b2' = copy of b2]

        Returns False (and changes nothing) when no block is free for the copy.
        """
        if child_id in self._tables:
            raise RuntimeError(f"request {child_id!r} already has a block table")
        parent = self._tables.get(parent_id, [])
        num_full, partial = divmod(num_tokens, self.block_size)
        shared = parent[:num_full]
        table = list(shared)
        if partial:
            if self.pool.num_free_blocks < 1 or num_full >= len(parent):
                return False
            (copy,) = self.pool.allocate(1)
            self._pending_copies.append((parent[num_full], copy))
            table.append(copy)
        self.pool.share(shared)
        self._tables[child_id] = table
        return True

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies
