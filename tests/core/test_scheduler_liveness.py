"""Scheduler liveness: a request that can never fit beside pinned idle sessions is reported
unschedulable instead of preempting itself and recomputing forever."""

from core.helpers import run_step

from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler, SchedulerConfig


def pinned_session(s: Scheduler, rid: str, num_tokens: int) -> Request:
    """A pinned session holding the blocks of `num_tokens` computed tokens, parked PAUSED."""
    request = Request(rid, list(range(num_tokens)), pinned=True)
    s.add_request(request)
    run_step(s)
    s.truncate(request, num_tokens)  # drop the sampled token: all computed
    s.park(request, RequestStatus.PAUSED)
    return request


def test_running_request_that_outgrows_the_unpinned_pool_is_reported_not_preempted():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, num_kv_blocks=6, block_size=4))
    pinned_session(s, "pinned", 16)  # 4 of the 6 blocks, never evictable
    s.add_request(Request("r", list(range(100, 106))))
    out = run_step(s)  # 2 blocks: the whole pool is in use
    assert [c.request_id for c in out.chunks] == ["r"]
    for _ in range(2):
        run_step(s)  # decodes up to 8 tokens, the second block full
    out = s.schedule()  # the 9th token needs a 3rd block: only 2 can ever be free
    assert not out.chunks and out.preempted_request_ids == []
    (item,) = out.unschedulable
    assert (item.request_id, item.blocks_needed, item.blocks_available) == ("r", 3, 2)
    assert s.num_preemptions == 0 and s.requests["r"].num_computed_tokens == 8
    s.finish("r", RequestStatus.FINISHED_ERROR)
    s.finish("pinned", RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.all_free


def test_waiting_request_too_big_beside_pinned_sessions_is_reported_and_evicts_nobody():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32, num_kv_blocks=6, block_size=4))
    pinned_session(s, "pinned", 12)  # 3 blocks
    unpinned = Request("idle", list(range(50, 54)))
    s.add_request(unpinned)
    run_step(s)
    s.park(unpinned, RequestStatus.PAUSED)
    s.add_request(Request("big", list(range(100, 116))))  # 4 blocks, 3 can ever be free
    out = s.schedule()
    assert [(u.request_id, u.blocks_needed, u.blocks_available) for u in out.unschedulable] == [
        ("big", 4, 3)
    ]
    assert s.kv.holds_blocks("idle")  # nothing was evicted for a request that cannot fit


def test_blocks_shared_with_a_pinned_session_count_as_the_requests_own():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, num_kv_blocks=6, block_size=4))
    parent = pinned_session(s, "parent", 16)  # 4 blocks
    child = Request("child", list(parent.token_ids), num_computed_tokens=16)
    assert s.kv.fork("parent", "child", 16)  # shares all 4 full blocks
    s.add_request(child)
    s.waiting.remove(child)
    child.status = RequestStatus.RUNNING
    s.running.append(child)
    child.append_tokens([1] * 8)  # 24 tokens: 6 blocks, 4 of them shared
    out = run_step(s)
    assert out.unschedulable == [] and out.chunks[0].request_id == "child"
    assert s.kv.num_free_blocks == 0
