"""Scheduler: the single rule covers prefill, chunking, decode, appends and preemption."""

from hypothesis import given, settings
from hypothesis import strategies as st

from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler, SchedulerConfig


def make(budget=16, seqs=8, blocks=64, block_size=4):
    return Scheduler(SchedulerConfig(budget, seqs, blocks, block_size))


def run_step(s: Scheduler, sample_token: int = 7):
    """One step with a fake model: every chunk reaching the end samples `sample_token`."""
    out = s.schedule()
    s.update_after_step(out)
    for chunk in out.chunks:
        if chunk.needs_logits:
            s.requests[chunk.request_id].append_tokens([sample_token])
    return out


def test_prompt_is_chunked_by_budget():
    s = make(budget=8)
    s.add_request(Request("a", list(range(20))))
    sizes = [len(run_step(s).chunks[0].token_ids) for _ in range(3)]
    assert sizes == [8, 8, 4]
    assert s.requests["a"].num_computed_tokens == 20


def test_decodes_scheduled_before_prefill_chunks():
    s = make(budget=8)
    s.add_request(Request("a", [1, 2, 3]))
    run_step(s)  # a prefilled, one token sampled
    s.add_request(Request("b", list(range(30))))
    out = run_step(s)
    assert [c.request_id for c in out.chunks] == ["a", "b"]
    assert len(out.chunks[0].token_ids) == 1 and len(out.chunks[1].token_ids) == 7


def test_append_schedules_only_new_tokens_and_keeps_blocks():
    s = make(budget=64)
    req = Request("a", list(range(10)))
    s.add_request(req)
    run_step(s)
    blocks_before = list(s.kv.block_ids("a"))
    s.park(req, RequestStatus.PAUSED)
    req.append_tokens([1, 2, 3])
    s.wake(req)
    out = run_step(s)
    (chunk,) = out.chunks
    assert chunk.start_pos == 10 and chunk.token_ids == [7, 1, 2, 3]
    assert s.kv.block_ids("a")[: len(blocks_before)] == blocks_before
    assert out.num_recomputed_tokens == 0


def test_preemption_frees_newest_and_recomputes():
    s = make(budget=64, blocks=4, block_size=4)
    s.add_request(Request("old", list(range(7))))
    s.add_request(Request("new", list(range(7))))
    run_step(s)  # both fit: 2 blocks each
    for _ in range(3):
        run_step(s)  # needs a third block for one of them -> preempt "new"
    assert s.num_preemptions >= 1
    assert s.requests["new"].status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
    s.finish("old", RequestStatus.FINISHED_STOPPED)
    for _ in range(3):
        run_step(s)
    assert s.num_recomputed_tokens > 0
    s.finish("new", RequestStatus.FINISHED_STOPPED)
    assert s.kv.pool.all_free


def test_idle_session_preempted_before_running_requests():
    s = make(budget=64, blocks=4, block_size=4)
    paused = Request("p", list(range(8)))
    s.add_request(paused)
    run_step(s)
    s.truncate(paused, 8)
    s.park(paused, RequestStatus.PAUSED)
    s.add_request(Request("r", list(range(12))))
    out = run_step(s)
    assert out.preempted_request_ids == ["p"]
    assert paused.status == RequestStatus.PAUSED and paused.num_computed_tokens == 0
    s.wake(paused)
    assert paused.status == RequestStatus.WAITING


def test_pinned_session_is_not_preempted():
    s = make(budget=64, blocks=4, block_size=4)
    pinned = Request("p", list(range(8)), pinned=True)
    s.add_request(pinned)
    run_step(s)
    s.truncate(pinned, 8)
    s.park(pinned, RequestStatus.PAUSED)
    s.add_request(Request("r", list(range(12))))
    out = run_step(s)
    assert "p" not in out.preempted_request_ids
    assert s.kv.holds_blocks("p")


def test_max_num_seqs_limits_running():
    s = make(budget=64, seqs=2)
    for i in range(4):
        s.add_request(Request(str(i), [1, 2]))
    out = run_step(s)
    assert len(out.chunks) == 2 and len(s.waiting) == 2


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    budget=st.integers(1, 24),
    blocks=st.integers(8, 20),
    steps=st.integers(1, 40),
)
def test_random_workloads_never_leak_and_frontier_is_sound(lengths, budget, blocks, steps):
    s = make(budget=budget, blocks=blocks, block_size=4)
    for i, n in enumerate(lengths):
        s.add_request(Request(str(i), list(range(n))))
    for _ in range(steps):
        out = run_step(s)
        assert out.num_batched_tokens <= budget
        for r in s.requests.values():
            assert 0 <= r.num_computed_tokens <= r.num_tokens
            assert len(s.kv.block_ids(r.request_id)) * 4 >= r.num_computed_tokens
        for r in list(s.requests.values()):
            if r.num_tokens > 32:
                s.finish(r.request_id, RequestStatus.FINISHED_LENGTH)
    for rid in list(s.requests):
        s.finish(rid, RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.all_free
