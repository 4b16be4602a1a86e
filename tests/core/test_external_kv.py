"""Loads from a KV connector and segmented prefill, in the scheduler alone (fake connector).

The request's computed set stops being a prefix: the store supplies ranges above the
frontier and the scheduler computes exactly the gaps, in order, under the token budget.
"""

from __future__ import annotations

import pytest
from core.helpers import run_step

from loom.core.kv_transfer import blocks_to_ranges, subtract_ranges, widen_to_blocks
from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler, SchedulerConfig
from loom.core.scheduler_output import SchedulerOutput

B = 4


class FakeConnector:
    """Matches `matched` tokens of every request with `gaps`; records the calls."""

    def __init__(self, matched: int, gaps=None, policy: str = "recompute") -> None:
        self.matched, self.gaps, self.load_failure_policy = matched, gaps, policy
        self.calls: list[tuple[str, int]] = []
        self.allocated: dict[str, list[int]] = {}
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append((request.request_id, num_computed_tokens))
        return self.matched, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.allocated[request.request_id] = list(blocks)

    def get_computed_token_gaps(self, request):
        return self.gaps

    def build_connector_meta(self, scheduler_output):
        return {"loads": list(scheduler_output.loading_request_ids)}

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return False, None


def make(connector, budget: int = 64, blocks: int = 32) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, num_kv_blocks=blocks, block_size=B),
        connector,
    )


def spans(out):
    return [(c.request_id, c.start_pos, c.end_pos) for c in out.chunks]


def test_range_arithmetic():
    assert subtract_ranges([(0, 12)], [(6, 9), (2, 4)]) == [(0, 2), (4, 6), (9, 12)]
    assert subtract_ranges([(0, 4), (8, 12)], [(0, 12)]) == []
    assert blocks_to_ranges([5, 1, 2], 4) == [(4, 12), (20, 24)]
    assert widen_to_blocks([(5, 6), (7, 9)], 4) == [(4, 12)]


def test_a_load_runs_in_a_step_of_its_own_then_only_the_gaps_and_the_rest_are_computed():
    conn = FakeConnector(matched=24, gaps=[(4, 8), (12, 20)])
    s = make(conn)
    s.add_request(Request("r", list(range(30))))
    out = run_step(s)
    assert out.chunks == [] and out.loading_request_ids == ["r"] and not out.is_empty
    assert out.kv_connector_metadata == {"loads": ["r"]}
    assert conn.calls == [("r", 0)] and len(conn.allocated["r"]) == 6  # slots for 24 tokens
    request = s.requests["r"]
    assert request.num_computed_tokens == 4  # [0, 4) arrived; the first gap starts there
    # Both gaps in one step (they lie in blocks allocated at the match), the rest after it.
    assert [spans(run_step(s)) for _ in range(2)] == [
        [("r", 4, 8), ("r", 12, 20)], [("r", 24, 30)]
    ]
    assert request.num_computed_tokens == 30 and request.num_tokens == 31  # sampled
    assert s.external.num_gap_tokens == 12 and s.external.num_loaded_tokens == 12
    assert s.num_recomputed_tokens == 0
    s.finish("r", RequestStatus.FINISHED_STOPPED)
    assert conn.finished == ["r"] and s.kv.pool.all_free


def test_a_gap_is_chunked_by_the_budget_and_batched_with_other_requests():
    conn = FakeConnector(matched=24, gaps=[(4, 20)])
    s = make(conn, budget=6)
    s.add_request(Request("r", list(range(26))))
    run_step(s)
    conn.matched = 0
    s.add_request(Request("d", [1, 2]))
    assert spans(run_step(s)) == [("r", 4, 10)]  # the waiting request gets no budget left
    assert spans(run_step(s)) == [("r", 10, 16)]
    out = run_step(s)
    assert spans(out) == [("r", 16, 20), ("d", 0, 2)]
    assert s.external.num_gap_tokens == 16


def test_several_gaps_share_a_step_in_order_while_the_budget_lasts():
    conn = FakeConnector(matched=32, gaps=[(0, 4), (8, 12), (16, 24), (28, 32)])
    s = make(conn, budget=10)
    s.add_request(Request("r", list(range(40))))
    run_step(s)
    assert s.requests["r"].num_computed_tokens == 0
    assert spans(run_step(s)) == [("r", 0, 4), ("r", 8, 12), ("r", 16, 18)]
    assert spans(run_step(s)) == [("r", 18, 24), ("r", 28, 32)]
    assert spans(run_step(s)) == [("r", 32, 40)]  # the rest, after the match
    assert s.external.num_gap_tokens == 20 and s.requests["r"].num_computed_tokens == 40


def test_failed_loads_become_gaps_under_recompute():
    conn = FakeConnector(matched=16)
    s = make(conn)
    s.add_request(Request("r", list(range(20))))
    out = s.schedule()
    table = s.kv.block_ids("r")
    s.update_after_step(out, {table[1]: "checksum mismatch", table[2]: "missing"})
    assert s.requests["r"].num_computed_tokens == 4
    assert spans(run_step(s)) == [("r", 4, 12)]
    assert spans(run_step(s)) == [("r", 16, 20)]
    ext = s.external
    assert (ext.num_loaded_tokens, ext.num_load_failed_tokens, ext.num_gap_tokens) == (8, 8, 8)


def test_a_failed_load_under_fail_is_reported_naming_the_tokens_and_block():
    conn = FakeConnector(matched=16, policy="fail")
    s = make(conn)
    s.add_request(Request("r", list(range(20))))
    out = s.schedule()
    block = s.kv.block_ids("r")[2]
    s.update_after_step(out, {block: "key/abc: checksum mismatch"})
    (failure,) = out.load_failures
    assert failure.request_id == "r"
    assert f"[8, 12) (block {block})" in failure.message and "checksum" in failure.message
    s.finish("r", RequestStatus.FINISHED_ERROR)
    assert s.kv.pool.all_free


class RaisingConnector(FakeConnector):
    """A FakeConnector matching only request "r", whose method `method` raises every time."""

    def __init__(self, method: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.method = method

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id != "r":
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def __getattribute__(self, name):
        if name == object.__getattribute__(self, "method"):
            def boom(*args, **kwargs):
                raise RuntimeError(f"boom in {name}")
            return boom
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("method", ["update_state_after_alloc", "get_computed_token_gaps",
                                    "build_connector_meta"])
def test_a_connector_raising_while_planning_a_load_fails_that_load(method, policy):
    s = make(RaisingConnector(method, matched=16, gaps=[(4, 8)], policy=policy))
    s.add_request(Request("r", list(range(20))))
    s.add_request(Request("other", list(range(100, 106))))
    out = run_step(s)  # does not raise; settles r's load as failed
    assert out.loading_request_ids == ["r"] and spans(out) == [("other", 0, 6)]
    assert f"{method} raised RuntimeError: boom in {method}" in out.failed_load_plans["r"]
    request = s.requests["r"]
    assert not request.loading_kv and request.num_computed_tokens == 0
    # Planning failed before the gap [4, 8) was known, else only the blocks to load failed.
    failed = 12 if method == "build_connector_meta" else 16
    assert s.external.num_load_failed_tokens == failed and s.external.num_loaded_tokens == 0
    if policy == "fail":
        (failure,) = out.load_failures
        assert failure.request_id == "r" and f"boom in {method}" in failure.message
        s.finish("r", RequestStatus.FINISHED_ERROR)
    else:
        assert not out.load_failures
        assert spans(run_step(s)) == [("other", 6, 7), ("r", 0, 20)]  # computes it all
        s.finish("r", RequestStatus.FINISHED_STOPPED)
    s.finish("other", RequestStatus.FINISHED_STOPPED)
    assert s.kv.pool.all_free


def test_a_connector_raising_in_a_match_or_at_the_end_costs_no_request(caplog):
    s = make(RaisingConnector("get_num_new_matched_tokens", matched=16))
    s.add_request(Request("r", list(range(20))))
    with caplog.at_level("WARNING", logger="loom"):
        assert spans(run_step(s)) == [("r", 0, 20)]  # no hit: it computes everything
    (record,) = caplog.records
    assert "'r'" in record.getMessage() and "boom in get_num_new_matched_tokens" in (
        record.getMessage())
    s = make(RaisingConnector("request_finished", matched=16))
    s.add_request(Request("r", list(range(20))))
    run_step(s)
    s.finish("r", RequestStatus.FINISHED_ABORTED)  # logged, not raised; blocks freed
    assert s.kv.pool.all_free and not s.requests


def test_the_connector_is_asked_after_local_cache_hits_and_only_on_a_block_boundary():
    conn = FakeConnector(matched=0)
    s = make(conn)
    s.add_request(Request("a", list(range(13))))
    run_step(s)
    s.finish("a", RequestStatus.FINISHED_STOPPED)  # its 3 full blocks stay cached
    conn.matched = 4
    s.add_request(Request("b", list(range(12)) + [99, 98, 97, 96, 95, 94]))
    out = run_step(s)
    assert conn.calls[-1] == ("b", 12) and out.loading_request_ids == ["b"]
    assert spans(run_step(s)) == [("b", 16, 18)]
    # A forked child waiting with a partial block is never matched.
    parent = s.requests["b"]
    assert s.kv.fork("b", "c", parent.num_computed_tokens)
    s.add_request(Request("c", list(parent.token_ids),
                          num_computed_tokens=parent.num_computed_tokens))
    calls = len(conn.calls)
    run_step(s)
    assert len(conn.calls) == calls


def test_a_connector_must_match_whole_blocks_and_leave_the_last_token(caplog):
    for matched in (6, 20, -4, "8"):
        s = make(FakeConnector(matched=matched))
        s.add_request(Request("r", list(range(20))))
        caplog.clear()
        with caplog.at_level("WARNING", logger="loom"):
            out = run_step(s)  # a match outside the contract is no match: r computes
        assert spans(out) == [("r", 0, 20)] and not out.loading_request_ids
        (record,) = caplog.records
        assert "'r'" in record.getMessage() and "whole blocks of 4" in record.getMessage()


def test_preemption_forgets_loaded_ranges_and_readmission_asks_the_store_again():
    conn = FakeConnector(matched=16, gaps=[(4, 8)])
    s = make(conn, blocks=8)
    s.add_request(Request("r", list(range(22))))
    run_step(s)
    request = s.requests["r"]
    assert request.ready_ranges == [(8, 16)]
    s._preempt(request, SchedulerOutput())
    assert request.ready_ranges == [] and request.external_end == 0
    assert request.num_computed_tokens == 0
    run_step(s)
    # The loaded block [0, 4) was offered to the prefix cache when it was preempted; the
    # store is asked for what follows it.
    assert conn.calls == [("r", 0), ("r", 4)] and request.ready_ranges == [(8, 20)]


def test_truncate_clips_ready_ranges():
    request = Request("r", list(range(20)), ready_ranges=[(4, 8), (12, 16)], external_end=16)
    request.truncate(14)
    assert request.ready_ranges == [(4, 8), (12, 14)] and request.external_end == 14
    request.truncate(10)
    assert request.ready_ranges == [(4, 8)] and request.computable_end == 4
