"""KV cache events in the core: the prefix cache announces every hash it gives (BlockStored,
with the blocks' tokens and the chain's parent), drops (BlockRemoved) or forgets at once
(AllBlocksCleared), and nothing when no collector is attached."""

from core.helpers import run_step

from loom.core.block_hash import extend_block_hashes
from loom.core.block_pool import BlockPool
from loom.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventCollector,
)
from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler, SchedulerConfig


def make(blocks=16, block_size=4, cache=True, events=True):
    s = Scheduler(SchedulerConfig(64, 8, blocks, block_size, cache))
    collector = KVEventCollector()
    if events:
        s.kv.attach_events(collector)
    return s, collector


def finish_after_prefill(s: Scheduler, rid: str, tokens: list[int]) -> None:
    s.add_request(Request(rid, list(tokens)))
    run_step(s)
    s.finish(rid, RequestStatus.FINISHED_STOPPED)


def replay(events, held=None):
    """The set of hashes a subscriber believes cached after `events`."""
    held = set() if held is None else held
    for event in events:
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
        else:
            held.clear()
    return held


def cached_hashes(s: Scheduler) -> set[bytes]:
    return set(s.kv.pool._block_of)


def test_a_prompt_stores_its_full_blocks_with_their_tokens_and_chain():
    s, events = make()
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks and one token
    finish_after_prefill(s, "a", tokens)
    (first,) = events.take()
    keys = extend_block_hashes([], tokens, 4, 3)
    assert first == BlockStored(tuple(keys), None, tuple(tokens[:12]), 4)
    assert events.take() == []  # taken once

    # A second prompt sharing two blocks stores only what follows them, chained on block 1.
    other = tokens[:8] + [90, 91, 92, 93, 94]
    finish_after_prefill(s, "b", other)
    (stored,) = events.take()
    assert stored.parent_block_hash == keys[1]
    assert stored.block_hashes == tuple(extend_block_hashes([], other, 4, 3)[2:])
    assert stored.token_ids == (90, 91, 92, 93)
    assert replay([first, stored]) == cached_hashes(s)


def test_eviction_announces_the_dropped_hashes_in_one_event():
    s, events = make(blocks=4)
    tokens = list(range(10, 23))  # 3 full blocks cached, 4 blocks held while it ran
    finish_after_prefill(s, "a", tokens)
    held = replay(events.take())
    assert held == cached_hashes(s) and len(held) == 3
    finish_after_prefill(s, "b", list(range(50, 63)))  # needs every block: evicts all three
    taken = events.take()
    assert isinstance(taken[0], BlockRemoved) and set(taken[0].block_hashes) == held
    assert isinstance(taken[1], BlockStored)
    assert replay(taken, held) == cached_hashes(s)
    assert s.kv.pool.num_evictions == 3


def test_a_shared_block_written_again_loses_its_hash_and_says_so():
    s, events = make()
    s.add_request(Request("a", list(range(10, 18)), sample_when_computed=False))
    run_step(s)
    held = replay(events.take())
    assert len(held) == 2
    s.kv.pool.uncache(s.kv.block_ids("a")[1])
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 1
    assert replay([removed], held) == cached_hashes(s)


def test_reset_announces_one_clear_and_no_removals():
    s, events = make()
    finish_after_prefill(s, "a", list(range(10, 23)))
    events.take()
    assert s.reset_prefix_cache() == 3
    assert events.take() == [AllBlocksCleared()]
    assert cached_hashes(s) == set()


def test_no_events_without_a_collector_or_without_prefix_caching():
    for events_on, cache in ((False, True), (True, False)):
        s, events = make(cache=cache, events=events_on)
        finish_after_prefill(s, "a", list(range(10, 23)))
        finish_after_prefill(s, "b", list(range(50, 63)))
        assert events.take() == []
    assert BlockPool(2).events is None


def test_the_collector_keeps_order_and_merges_consecutive_removals():
    c = KVEventCollector()
    c.removed(b"a")
    c.removed(b"b")
    c.stored([b"c"], b"b", [1, 2], 2)
    c.removed(b"c")
    c.cleared()
    assert c.take() == [BlockRemoved((b"a", b"b")), BlockStored((b"c",), b"b", (1, 2), 2),
                        BlockRemoved((b"c",)), AllBlocksCleared()]
