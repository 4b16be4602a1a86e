"""BlockPool and KVCacheManager: allocation, sharing, release, rewind, fork."""

import pytest

from loom.core.block_pool import BlockPool
from loom.core.kv_cache_manager import KVCacheManager


def test_allocate_and_release_restores_pool():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
    pool.release(blocks)
    assert pool.all_free


def test_allocate_more_than_free_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)


def test_shared_block_returns_only_after_last_reference():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.share([b])
    pool.release([b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 1
    pool.release([b])
    assert pool.all_free
    with pytest.raises(RuntimeError):
        pool.release([b])


def test_allocate_slots_grows_only_when_needed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 5)
    first = list(kv.block_ids("a"))
    assert len(first) == 2
    assert kv.allocate_slots("a", 8)
    assert kv.block_ids("a") == first  # no new block for slots 5..7
    assert kv.allocate_slots("a", 9)
    assert kv.block_ids("a")[:2] == first and len(kv.block_ids("a")) == 3


def test_allocate_slots_fails_without_change():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.allocate_slots("a", 4)
    assert not kv.allocate_slots("a", 13)
    assert len(kv.block_ids("a")) == 1 and kv.num_free_blocks == 1


def test_truncate_releases_tail_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", 12)
    kept = kv.block_ids("a")[:2]
    kv.truncate("a", 5)
    assert kv.block_ids("a") == kept and kv.num_free_blocks == 6
    kv.free("a")
    assert kv.pool.all_free


def test_fork_shares_full_blocks_and_copies_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 10)  # 3 blocks, the last one partial (2 of 4 slots)
    parent = list(kv.block_ids("p"))
    assert kv.fork("p", "c", 10)
    child = kv.block_ids("c")
    assert child[:2] == parent[:2] and child[2] != parent[2]
    assert kv.take_pending_copies() == [(parent[2], child[2])]
    assert kv.pool.ref_count(parent[0]) == 2
    kv.free("p")
    kv.free("c")
    assert kv.pool.all_free


def test_fork_of_a_fork_before_any_step_copies_from_the_original_block():
    """The runner performs the copies as one gather (every source read first), so a copy
    whose source is itself a pending destination must read that destination's source."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 10)
    assert kv.fork("p", "c", 10) and kv.fork("c", "g", 10)
    src, child, grandchild = kv.block_ids("p")[2], kv.block_ids("c")[2], kv.block_ids("g")[2]
    assert kv.take_pending_copies() == [(src, child), (src, grandchild)]
    kv.free("c")
    assert kv.fork("g", "h", 10)
    assert kv.take_pending_copies() == [(grandchild, kv.block_ids("h")[2])]
    for request_id in "pgh":
        kv.free(request_id)
    assert kv.pool.all_free


def test_fork_at_block_boundary_copies_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 8)
    assert kv.fork("p", "c", 8)
    assert kv.block_ids("c") == kv.block_ids("p")
    assert kv.take_pending_copies() == []
