"""`KVCacheManager`: the block table of every request and the prefix cache, on the `BlockPool`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loom.core.block_pool import BlockPool
from loom.core.kv_events import KVEventCollector
from loom.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens: `queries` could have come from the cache (every
    token of a prompt, fragment or recompute but its last), `hits` did."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Owns the mapping request id -> block ids; blocks cover a prefix of the request's slots.

    Invariant: the table of a request holding K/V for positions [0, n) has at least
    cdiv(n, block_size) blocks; blocks are only ever appended, or dropped from the tail
    (rewind) or all at once (free, preemption). Existing entries never move, so a live
    append never re-allocates what is already cached. The one exception keeps shared data
    safe: the block a chunk starts writing into is replaced by a private copy when others
    hold it too (copy-on-write), and loses its hash when only this request holds it.

    Prefix caching: every full block whose tokens are all computed gets its chained hash
    (`cache_blocks`); `find_cached_blocks` finds the longest run of cached blocks that
    continues a request's table, which `allocate_slots` then shares instead of computing.
    With `attach_events`, every change to the set of cached hashes is also announced as a
    KV cache event (`loom.core.kv_events`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already offered to the cache (hashed, or a duplicate).
        self._num_settled: dict[str, int] = {}
        # Block copies the runner performs before the next forward, as dst -> src. Queued in
        # order but kept in the form of one gather (every src read before any dst is written):
        # a src that is itself a pending dst is replaced by that dst's own src, and a later
        # copy into the same dst replaces the earlier one. Sources hold the same K/V until the
        # copies run (only a forward writes blocks), so the gather equals the queued order.
        self._pending_copies: dict[int, int] = {}
        self.events: KVEventCollector | None = None

    def attach_events(self, events: KVEventCollector) -> None:
        """Announce every hash stored, removed or cleared from now on in `events` (attach
        before the first request, so a subscriber's view starts from an empty cache)."""
        self.events = events
        self.pool.events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks currently free in the pool (cached ones included: they are evictable)."""
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def holds_blocks(self, request_id: str) -> bool:
        """True when the request owns at least one block."""
        return bool(self._tables.get(request_id))

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        cached_blocks: Sequence[int] = (),
        write_from: int | None = None,
    ) -> bool:
        """Grow the table to cover `num_tokens` slots: first `cached_blocks` (shared, from
        `find_cached_blocks`), then new blocks; the block holding position `write_from` (where
        the next chunk starts writing) is made private first. False (no change) if the pool
        is short."""
        table = self._tables.get(request_id, [])
        need = cdiv(num_tokens, self.block_size) - len(table) - len(cached_blocks)
        need = max(0, need) + sum(1 for b in cached_blocks if self.pool.is_free(b))
        written = self._written_block(table, write_from)
        copy_needed = written is not None and self.pool.ref_count(table[written]) > 1
        if need + copy_needed > self.pool.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, table)
        if cached_blocks:
            self.pool.touch(list(cached_blocks))
            table.extend(cached_blocks)
            self.stats.hits += len(cached_blocks) * self.block_size
        if written is not None:
            self._make_private(request_id, table, written, copy_needed)
        missing = cdiv(num_tokens, self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def _written_block(self, table: list[int], write_from: int | None) -> int | None:
        """Index of the table block that a write at `write_from` lands in, when it is shared
        or cached (it must change owner or lose its hash first); else None."""
        if write_from is None:
            return None
        index = write_from // self.block_size
        if index >= len(table):
            return None
        block_id = table[index]
        if self.pool.ref_count(block_id) > 1 or self.pool.is_cached(block_id):
            return index
        return None

    def _make_private(self, request_id: str, table: list[int], index: int, copy: bool) -> None:
        """Copy-on-write a shared block, or drop the hash of an exclusively held one.

            before: [b0][b1][b2 shared, hashed]    after: [b0][b1][b2' private copy of b2]
        """
        block_id = table[index]
        if copy:
            (new_id,) = self.pool.allocate(1)
            self._queue_copy(block_id, new_id)
            table[index] = new_id
            self.pool.release([block_id])
        else:
            self.pool.uncache(block_id)
        settled = self._num_settled.get(request_id, 0)
        self._num_settled[request_id] = min(settled, index)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` slots (rewind)."""
        table = self._tables.get(request_id)
        if not table:
            return
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(table):
            self.pool.release(table[keep:][::-1])
            del table[keep:]
        settled = self._num_settled.get(request_id, 0)
        self._num_settled[request_id] = min(settled, num_tokens // self.block_size)

    def free(self, request_id: str) -> None:
        """Release every block of the request (the tail first: it is the least likely to be
        shared again, so the cache evicts it first)."""
        table = self._tables.pop(request_id, None)
        self._num_settled.pop(request_id, None)
        if table:
            self.pool.release(table[::-1])

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
            self._queue_copy(parent[num_full], copy)
            table.append(copy)
        self.pool.share(shared)
        self._tables[child_id] = table
        self._num_settled[child_id] = min(self._num_settled.get(parent_id, 0), num_full)
        return True

    def _queue_copy(self, src: int, dst: int) -> None:
        src = self._pending_copies.get(src, src)
        self._pending_copies.pop(dst, None)  # a re-queued dst moves to the end
        if src != dst:
            self._pending_copies[dst] = src

    @property
    def pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last `take_pending_copies`, to be
        performed as one gather: read every src, then write every dst (no dst repeats)."""
        return [(src, dst) for dst, src in self._pending_copies.items()]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """`pending_copies`, and forget them (the runner performs them now)."""
        copies = self.pending_copies
        self._pending_copies = {}
        return copies

    # ---- prefix cache --------------------------------------------------------------------

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Cached blocks that continue the request's table: the longest run of full blocks
        after its frontier whose hashes are cached, leaving at least its last token to compute
        (its logits are needed). Empty unless the table ends exactly at the frontier, on a
        block boundary, and no drafts are pending.

            tokens: [ computed | B tokens | B tokens | ... | rest, >= 1 token ]
                               ^ frontier  \\_ cached blocks found _/
        """
        computed, size = request.num_computed_tokens, self.block_size
        first = computed // size
        last = (request.num_tokens - 1) // size  # full blocks before the last token
        if (
            not self.enable_prefix_caching
            or request.num_draft_tokens
            or (request.computes_whole_prompt and computed < request.num_prompt_tokens)
            or last <= first
            or computed % size
            or len(self._tables.get(request.request_id, ())) != first
        ):
            return []
        hashes = self.block_hashes(request, last)
        found = []
        for i in range(first, last):
            block_id = self.pool.cached_block(hashes[i])
            if block_id is None:
                break
            found.append(block_id)
        return found

    def count_query(self, request: Request) -> None:
        """Count the request's tokens that could come from the cache and were not counted yet
        (a prompt, an appended fragment, a recompute), for the hit rate."""
        if not self.enable_prefix_caching:
            return
        end = request.num_tokens - 1 - request.num_draft_tokens
        start = max(request.num_computed_tokens, request.num_cache_queried_tokens)
        if end > start:
            self.stats.queries += end - start
            request.num_cache_queried_tokens = end

    def cache_blocks(self, request: Request, num_computed: int) -> None:
        """Hash the full blocks of the request whose tokens are all below `num_computed` (their
        K/V is written and verified), so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        settled = self._num_settled.get(request.request_id, 0)
        full = min(num_computed // self.block_size, len(table))
        if full <= settled:
            return
        hashes = self.block_hashes(request, full)
        stored = [i for i in range(settled, full) if self.pool.cache(table[i], hashes[i])]
        self._num_settled[request.request_id] = full
        if self.events is not None and stored:
            self._announce_stored(request, hashes, stored)

    def _announce_stored(self, request: Request, hashes: list[bytes], stored: list[int]) -> None:
        """One `BlockStored` per run of consecutive block indices in `stored` (blocks whose
        content another block already held are not stored, and split the runs)."""
        size = self.block_size
        start = 0
        for k in range(1, len(stored) + 1):
            if k == len(stored) or stored[k] != stored[k - 1] + 1:
                first, last = stored[start], stored[k - 1] + 1
                self.events.stored(  # type: ignore[union-attr]
                    hashes[first:last], hashes[first - 1] if first else None,
                    request.token_ids[first * size:last * size], size)
                start = k

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their K/V); returns how many."""
        return self.pool.reset_cache()

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Keys of the request's first `num_blocks` full blocks."""
        return request.block_keys(self.block_size, num_blocks)
