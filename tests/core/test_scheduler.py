"""Scheduler: the single rule covers prefill, chunking, decode, appends and preemption."""

from core.helpers import run_step
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler, SchedulerConfig


def make(budget=16, seqs=8, blocks=64, block_size=4):
    return Scheduler(SchedulerConfig(budget, seqs, blocks, block_size))



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
    s.add_request(Request("new", list(range(100, 107))))  # nothing shared with "old"
    run_step(s)  # both fit: 2 blocks each, 8 tokens (7 + 1 sampled)
    out = run_step(s)  # both decode into their second block: 9 tokens each
    assert not out.preempted_request_ids
    # old's decode needs a third block, the pool is full: the newest running request goes.
    out = run_step(s)
    assert out.preempted_request_ids == ["new"]
    assert [c.request_id for c in out.chunks] == ["old"]
    new = s.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert not s.kv.holds_blocks("new") and len(s.kv.block_ids("old")) == 3
    out = run_step(s)  # old keeps decoding; new cannot fit back (3 blocks, 1 free)
    assert [c.request_id for c in out.chunks] == ["old"] and not out.preempted_request_ids
    assert s.num_preemptions == 1 and new.status == RequestStatus.PREEMPTED
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
    s.add_request(Request("r", list(range(100, 112))))  # no prefix-cache hit on p's blocks
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
    s.add_request(Request("r", list(range(100, 112))))
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


# ---- speculative drafts -----------------------------------------------------------------


def decoding(s: Scheduler, rid: str, prompt_len: int) -> Request:
    """A request whose prompt is computed and whose first sampled token is pending."""
    req = Request(rid, list(range(prompt_len)))
    s.add_request(req)
    run_step(s)
    return req


def test_drafts_are_scheduled_with_the_decode_and_ask_for_a_row_each():
    s = make(budget=16)
    req = decoding(s, "a", 6)
    req.add_draft_tokens([1, 2, 3])
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.token_ids == [7, 1, 2, 3] and chunk.num_draft_tokens == 3
    assert chunk.needs_logits and chunk.num_logits == 4


def test_drafts_the_budget_cannot_take_are_dropped_and_never_split_a_chunk():
    s = make(budget=3)
    req = decoding(s, "a", 3)
    req.add_draft_tokens([1, 2, 3, 4])
    (chunk,) = s.schedule().chunks
    assert chunk.token_ids == [7, 1, 2] and chunk.num_draft_tokens == 2
    assert req.token_ids == [0, 1, 2, 7, 1, 2] and req.num_draft_tokens == 2


def test_unscheduled_requests_lose_their_drafts():
    s = make(budget=64)
    a, b = decoding(s, "a", 2), decoding(s, "b", 2)
    s.config = SchedulerConfig(2, 8, 64, 4)  # a (with its draft) fills the budget
    a.add_draft_tokens([5])
    b.add_draft_tokens([6])
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["a"]
    assert b.token_ids[-1] == 7 and b.num_draft_tokens == 0


def test_drafts_never_preempt_another_request():
    s = make(budget=64, blocks=3, block_size=4)
    a = decoding(s, "a", 4)  # 2 blocks (5 tokens)
    decoding(s, "b", 3)  # 1 block
    a.add_draft_tokens([1, 2, 3, 4])  # 9 tokens would need a third block for a
    out = s.schedule()
    assert not out.preempted_request_ids
    assert a.num_draft_tokens == 0 and [len(c.token_ids) for c in out.chunks] == [1, 1]


def test_preemption_discards_drafts():
    s = make(budget=64, blocks=2, block_size=4)
    decoding(s, "old", 3)
    new = decoding(s, "new", 3)  # one block each: the pool is full
    new.add_draft_tokens([1])
    out = s.schedule()  # old's decode needs a second block: the newest running one goes
    assert out.preempted_request_ids == ["new"]
    assert new.token_ids == [0, 1, 2, 7] and new.num_draft_tokens == 0
    assert new.num_computed_tokens == 0
