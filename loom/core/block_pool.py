"""`BlockPool`: fixed-size KV blocks with reference counts, a free queue and a prefix cache."""

from __future__ import annotations

from collections import OrderedDict, deque

from loom.core.kv_events import KVEventCollector


class BlockPool:
    """Hands out block ids in [0, num_blocks) and takes them back when unreferenced.

    A block may carry the hash of the tokens it holds (prefix caching): hashed blocks can be
    found by `cached_block` and shared by any request whose tokens chain to the same hash.
    A freed block keeps its hash and waits in an LRU queue until it is reused or evicted:

        free = [ never used / un-hashed ... ] + [ hashed, least recently freed first ... ]
                 taken first by `allocate`        evicted (hash dropped) only when needed

    Invariants: a block is free exactly when its reference count is 0, so
    `num_free_blocks + (blocks with ref_count > 0) == num_blocks`; a hash names at most one
    block and that block names it back.

    With an `events` collector, every hash given or dropped is announced there
    (`loom.core.kv_events`): stores by the `KVCacheManager`, which knows the tokens, removals
    and resets here.
    """

    def __init__(self, num_blocks: int, events: KVEventCollector | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # free blocks without a hash
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free hashed, LRU first
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request (cached ones included: they are evictable)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a hash (in use or free)."""
        return len(self._block_of)

    @property
    def all_free(self) -> bool:
        """True when no block is referenced (the leak check of every test)."""
        return self.num_free_blocks == self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold this block."""
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """True when the block carries a hash (other requests may find and share it)."""
        return self._hash_of[block_id] is not None

    def is_free(self, block_id: int) -> bool:
        """True when no request references the block."""
        return self._ref_counts[block_id] == 0

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (ref count 1 each): never-used or un-hashed blocks first,
        then the least recently freed cached ones, whose hashes are dropped (evicted)."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._cached_free.popitem(last=False)
                self._drop_hash(block_id)
                self.num_evictions += 1
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add one reference to each block (a fork sharing them); they must be in use."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"cannot share free block {block_id}")
            self._ref_counts[block_id] += 1

    def touch(self, block_ids: list[int]) -> None:
        """Add one reference to each cached block found by `cached_block`, taking it out of
        the free queue when nobody held it."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._cached_free[block_id]
            self._ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the free queue
        (hashed ones at the most recently used end of the cached part)."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                if self._hash_of[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._cached_free[block_id] = None

    # ---- prefix cache --------------------------------------------------------------------

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the tokens that `block_hash` names, if any."""
        return self._block_of.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Give an in-use, fully computed block its hash; False (no change) when another block
        already holds that content or this one is already hashed."""
        if block_hash in self._block_of or self._hash_of[block_id] is not None:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def uncache(self, block_id: int) -> None:
        """Drop the block's hash: its content is about to change (or is forgotten)."""
        self._uncache(block_id, announce=True)

    def reset_cache(self) -> int:
        """Forget every hash (blocks in use keep their content); returns how many. Announced
        as one `AllBlocksCleared`, not block by block."""
        count = len(self._block_of)
        for block_id in list(self._block_of.values()):
            self._uncache(block_id, announce=False)
        if self.events is not None:
            self.events.cleared()
        return count

    def _uncache(self, block_id: int, announce: bool) -> None:
        if self._hash_of[block_id] is None:
            return
        self._drop_hash(block_id, announce)
        if self._ref_counts[block_id] == 0:
            del self._cached_free[block_id]
            self._free.appendleft(block_id)

    def _drop_hash(self, block_id: int, announce: bool = True) -> None:
        block_hash = self._hash_of[block_id]
        self._hash_of[block_id] = None
        del self._block_of[block_hash]
        if announce and self.events is not None:
            self.events.removed(block_hash)
