"""Prefix caching in the core: chained block hashes, the LRU of cached free blocks, lookups
that leave the last token to compute, copy-on-write when a shared block is written again."""

from core.helpers import run_step

from loom.core.block_hash import extend_block_hashes, hash_block
from loom.core.block_pool import BlockPool
from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler, SchedulerConfig


def make(budget=64, blocks=16, block_size=4, cache=True):
    return Scheduler(SchedulerConfig(budget, 8, blocks, block_size, cache))



def finish_after_prefill(s: Scheduler, rid: str, tokens: list[int]) -> list[int]:
    """Run a request's prompt, finish it; returns the blocks it held."""
    s.add_request(Request(rid, list(tokens)))
    run_step(s)
    blocks = list(s.kv.block_ids(rid))
    s.finish(rid, RequestStatus.FINISHED_STOPPED)
    return blocks


def test_block_keys_chain_on_every_earlier_token():
    a = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = extend_block_hashes([], [9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different history
    assert a[1] == hash_block(a[0], [5, 6, 7, 8]) and len(a[0]) == 16
    assert extend_block_hashes(list(a[:1]), [1, 2, 3, 4, 5, 6, 7, 8], 4, 2) == a


def test_pool_allocates_unused_blocks_first_then_evicts_least_recently_freed():
    pool = BlockPool(4)
    b = pool.allocate(3)
    for block_id, key in zip(b, [b"k0", b"k1", b"k2"], strict=True):
        assert pool.cache(block_id, key)
    pool.release([b[1]])
    pool.release([b[0]])
    pool.release([b[2]])  # LRU order of cached free blocks: b1, b0, b2
    assert pool.all_free and pool.num_cached_blocks == 3
    (fresh,) = pool.allocate(1)
    assert fresh == 3 and pool.num_evictions == 0  # the never-used block goes first
    assert pool.allocate(1) == [b[1]] and pool.cached_block(b"k1") is None
    pool.touch([b[2]])  # a hit takes b2 out of the free queue
    assert pool.ref_count(b[2]) == 1 and pool.allocate(1) == [b[0]]
    assert pool.num_free_blocks == 0 and pool.num_evictions == 2


def test_a_repeated_prompt_shares_cached_blocks_and_computes_only_its_last_token():
    s = make()
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks and one token
    first = finish_after_prefill(s, "a", tokens)
    s.add_request(Request("b", list(tokens)))
    out = run_step(s)
    (chunk,) = out.chunks
    assert chunk.start_pos == 12 and chunk.token_ids == [22]
    assert s.kv.block_ids("b")[:3] == first[:3]
    assert (s.kv.stats.queries, s.kv.stats.hits) == (12 + 12, 12)
    assert out.num_recomputed_tokens == 0


def test_a_prompt_of_whole_blocks_recomputes_its_last_block():
    s = make()
    tokens = list(range(10, 22))  # 12 tokens: the last token's logits are needed
    finish_after_prefill(s, "a", tokens)
    s.add_request(Request("b", list(tokens)))
    (chunk,) = run_step(s).chunks
    assert chunk.start_pos == 8 and chunk.token_ids == tokens[8:]


def test_a_different_history_misses_even_with_equal_later_blocks():
    s = make()
    finish_after_prefill(s, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    s.add_request(Request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))
    (chunk,) = run_step(s).chunks
    assert chunk.start_pos == 0


def test_disabled_cache_never_hits_and_hashes_nothing():
    s = make(cache=False)
    finish_after_prefill(s, "a", list(range(10, 23)))
    assert s.kv.pool.num_cached_blocks == 0
    s.add_request(Request("b", list(range(10, 23))))
    assert run_step(s).chunks[0].start_pos == 0


def test_preempted_request_resumes_through_the_cache():
    s = make(blocks=6)
    s.add_request(Request("old", list(range(100, 109))))  # 3 blocks once it decodes
    s.add_request(Request("new", list(range(200, 209))))
    run_step(s)
    for _ in range(4):
        run_step(s)  # both need a third block: "new" is preempted
    assert s.num_preemptions == 1
    s.finish("old", RequestStatus.FINISHED_STOPPED)
    out = run_step(s)  # "new" comes back: its full blocks were cached when it was preempted
    (chunk,) = out.chunks
    # "old" took one block after the preemption: the cache evicted "new"'s tail block first
    # (positions 8..11); the two blocks before it are shared, not recomputed.
    assert chunk.request_id == "new" and chunk.start_pos == 8 and len(chunk.token_ids) == 5
    assert s.num_recomputed_tokens == out.num_recomputed_tokens == 4


def test_evicting_cached_blocks_never_preempts_a_request():
    s = make(blocks=4)
    finish_after_prefill(s, "a", list(range(10, 23)))  # 4 blocks, all free, 3 of them cached
    s.add_request(Request("b", list(range(50, 66))))  # needs all 4 blocks
    out = run_step(s)
    assert out.preempted_request_ids == [] and out.chunks[0].start_pos == 0
    assert s.kv.pool.num_evictions == 3
    assert s.kv.pool.num_cached_blocks == 4  # b's own blocks, hashed as they filled


def test_drafts_are_hashed_only_once_verified():
    s = make()
    req = Request("a", list(range(10, 17)))  # 7 tokens
    s.add_request(req)
    run_step(s, sample_token=17)  # 8 tokens, 7 computed
    req.add_draft_tokens([18, 19, 20, 21])  # positions 8..11: all of block 2
    out = s.schedule()
    s.update_after_step(out)
    assert out.chunks[0].num_draft_tokens == 4 and req.num_computed_tokens == 12
    assert s.kv.pool.num_cached_blocks == 2  # block 2's K/V is written but not verified
    # As the engine settles a step: drafts 18, 19, 20 were sampled again, 21 was not (5).
    req.truncate(8)
    for position, token in enumerate([18, 19, 20, 5], start=8):
        if position > 8:
            req.advance_frontier(position)
        req.append_tokens([token])
    s.truncate(req, req.num_tokens)
    assert req.num_computed_tokens == 11 and s.kv.pool.num_cached_blocks == 2
    run_step(s)  # position 11 computed: block 2 now holds verified tokens only
    assert s.kv.pool.num_cached_blocks == 3
    s.add_request(Request("b", [*range(10, 18), 18, 19, 20, 5, 6]))
    assert run_step(s).chunks[-1].start_pos == 12  # found under the kept tokens


def test_writing_into_a_shared_cached_block_copies_it_first():
    s = make()
    tokens = list(range(10, 19))  # 9 tokens
    shared = finish_after_prefill(s, "a", tokens)[:2]
    s.add_request(Request("b", list(tokens)))
    s.add_request(Request("c", list(tokens)))
    run_step(s)
    assert s.kv.block_ids("b")[:2] == s.kv.block_ids("c")[:2] == shared
    b = s.requests["b"]
    s.park(b, RequestStatus.PAUSED)
    s.truncate(b, 6)  # a rewind into the second shared block
    b.append_tokens([99, 98])
    s.wake(b)
    out = s.schedule()
    (chunk,) = [c for c in out.chunks if c.request_id == "b"]
    assert chunk.start_pos == 6
    new_block = s.kv.block_ids("b")[1]
    assert new_block != shared[1] and (shared[1], new_block) in out.block_copies
    assert s.kv.block_ids("c")[:2] == shared and s.kv.pool.is_cached(shared[1])


def test_writing_into_an_exclusively_held_cached_block_drops_its_hash():
    s = make()
    req = Request("a", list(range(10, 19)))
    s.add_request(req)
    run_step(s)
    block = s.kv.block_ids("a")[1]
    assert s.kv.pool.is_cached(block)
    s.park(req, RequestStatus.PAUSED)
    s.truncate(req, 6)
    req.append_tokens([99, 98])
    s.wake(req)
    out = s.schedule()
    assert out.block_copies == [] and s.kv.block_ids("a")[1] == block
    assert not s.kv.pool.is_cached(block)  # dropped before the write
    s.update_after_step(out)
    assert s.kv.pool.is_cached(block)  # full again: hashed under its new tokens
    s.add_request(Request("b", list(range(10, 19))))  # the old content is not found again
    assert run_step(s).chunks[-1].start_pos == 4
    s.add_request(Request("c", [*range(10, 16), 99, 98, 1]))
    assert run_step(s).chunks[-1].start_pos == 8


def test_reset_forgets_every_hash():
    s = make()
    finish_after_prefill(s, "a", list(range(10, 23)))
    assert s.reset_prefix_cache() == 3 and s.kv.pool.num_cached_blocks == 0
    s.add_request(Request("b", list(range(10, 23))))
    assert run_step(s).chunks[0].start_pos == 0
