"""KV cache events: what the prefix cache announces to routers that track which blocks an
engine holds (llm-d's precise prefix-cache scorer, Dynamo's KV router, ...).

The prefix cache appends an event whenever the set of hashes it can serve changes:

    BlockStored       full blocks got their hashes (`KVCacheManager.cache_blocks`)
    BlockRemoved      hashes were dropped: a cached free block evicted for reuse
                      (`BlockPool.allocate`) or a cached block about to be rewritten
                      (`BlockPool.uncache`)
    AllBlocksCleared  every hash was forgotten at once (`BlockPool.reset_cache`)

Events carry the cache's own keys (`loom.core.block_hash`: 16-byte BLAKE2b digests); the
engine turns them into the wire format (`loom.engine.kv_events`). The collector is optional:
a pool or manager without one (the default) appends nothing and pays nothing.

Invariant: replaying the events in order over an empty set of hashes gives exactly the set
the pool holds (`BlockPool.cached_block` finds a hash iff it was stored and not removed or
cleared since), so a subscriber that saw every event knows what the engine can serve.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStored:
    """A run of consecutive full blocks of one request became cached.

    `block_hashes[i]` names the block holding `token_ids[i * block_size:(i + 1) *
    block_size]`; `parent_block_hash` is the key of the block right before the run (None
    when the run starts at the request's first block): each key chains on the one before."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """These hashes are no longer cached (their blocks were evicted or rewritten)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every hash was forgotten (a prefix cache reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventCollector:
    """The events since the last `take`, in the order the cache changed.

    Consecutive removals are merged into one `BlockRemoved` (an allocation that evicts many
    blocks announces them together), which keeps the order of every hash's store and removal.
    """

    _events: list[KVCacheEvent] = field(default_factory=list)
    _removed: list[bytes] = field(default_factory=list)  # the open BlockRemoved's hashes

    def stored(self, block_hashes: list[bytes], parent_block_hash: bytes | None,
               token_ids: list[int], block_size: int) -> None:
        """Blocks `block_hashes` (holding `token_ids`, `block_size` per block) got cached."""
        if len(token_ids) != len(block_hashes) * block_size:
            raise ValueError(f"{len(block_hashes)} blocks of {block_size} tokens cannot hold "
                             f"{len(token_ids)} tokens")
        if block_hashes:
            self._close_removed()
            self._events.append(BlockStored(tuple(block_hashes), parent_block_hash,
                                            tuple(token_ids), block_size))

    def removed(self, block_hash: bytes) -> None:
        """The hash `block_hash` was dropped."""
        self._removed.append(block_hash)

    def cleared(self) -> None:
        """Every hash was dropped."""
        self._close_removed()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events collected since the last call, oldest first; forgets them."""
        self._close_removed()
        events, self._events = self._events, []
        return events

    def _close_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(tuple(self._removed)))
            self._removed = []
