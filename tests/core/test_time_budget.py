"""The step-time budget (`max_step_ms`): the scheduler's arithmetic with a fake cost model
(decodes first, then ranges cut to the time left; priorities; a budget too small for one
token still makes progress), the linear cost model's fit, and priorities in admission."""

from __future__ import annotations

import logging

import pytest
from core.helpers import run_step

from loom.core.request import Request
from loom.core.scheduler import Scheduler, SchedulerConfig
from loom.core.step_cost import LinearStepCost, attention_units


class FakeCost:
    """fixed + per_token * tokens (no attention term), calibrated or not."""

    def __init__(self, fixed: float, per_token: float, calibrated: bool = True) -> None:
        self.fixed, self.per_token, self._calibrated = fixed, per_token, calibrated
        self.observed: list[tuple[int, float, float]] = []

    @property
    def calibrated(self) -> bool:
        return self._calibrated

    def fixed_ms(self) -> float:
        return self.fixed

    def chunk_ms(self, num_new: int, start: int) -> float:
        return self.per_token * num_new

    def tokens_within(self, ms: float, start: int) -> int:
        return int(ms // self.per_token) if ms > 0 else 0

    def observe(self, tokens: int, attention: float, ms: float) -> None:
        self.observed.append((tokens, attention, ms))


def make(cost: FakeCost, max_step_ms: float | None = 50.0, budget: int = 512) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, num_kv_blocks=256,
                             block_size=4, max_step_ms=max_step_ms)
    return Scheduler(config, cost=cost)


def test_decodes_first_then_prefill_cut_to_the_time_left() -> None:
    s = make(FakeCost(fixed=10.0, per_token=1.0))  # 50 ms: 40 ms of tokens after the fixed
    s.add_request(Request("a", [1, 2, 3]))
    s.add_request(Request("b", [4, 5]))
    run_step(s)  # both prefilled (5 tokens), each sampled one: two decodes now
    s.add_request(Request("long", list(range(200))))
    out = run_step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [
        ("a", 1), ("b", 1), ("long", 38)]  # 40 - 2 ms of decodes
    sizes = [len(c.token_ids) for c in run_step(s).chunks if c.request_id == "long"]
    assert sizes == [38]  # the same two decodes, and the rest of the prompt's range
    # The token budget stays an upper bound.
    t = make(FakeCost(fixed=0.0, per_token=0.01), budget=64)
    t.add_request(Request("x", list(range(500))))
    assert len(run_step(t).chunks[0].token_ids) == 64


def test_without_calibration_or_budget_tokens_alone_bound_a_step() -> None:
    for s in (make(FakeCost(10.0, 1.0, calibrated=False)),
              make(FakeCost(10.0, 1.0), max_step_ms=None)):
        s.add_request(Request("long", list(range(300))))
        assert len(run_step(s).chunks[0].token_ids) == 300


def test_decodes_cannot_starve_a_prompt_of_its_reserved_share() -> None:
    s = make(FakeCost(fixed=10.0, per_token=1.0), max_step_ms=20.0)
    for name in "abcdefgh":
        s.add_request(Request(name, [1, 2]))
        run_step(s)
    s.add_request(Request("new", list(range(100, 150))))
    out = run_step(s)  # eight decodes spend 8 of the 10 ms left; the prompt keeps 5 ms
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [
        *((name, 1) for name in "abcdefgh"), ("new", 5)]


def test_the_budget_is_at_least_twice_a_steps_fixed_cost() -> None:
    s = make(FakeCost(fixed=80.0, per_token=1.0), max_step_ms=100.0)
    s.add_request(Request("long", list(range(500))))
    assert len(run_step(s).chunks[0].token_ids) == 80  # 160 ms in effect, 80 after the fixed


def test_a_budget_too_small_for_one_token_still_makes_progress(caplog) -> None:
    s = make(FakeCost(fixed=1.0, per_token=50.0), max_step_ms=20.0)
    s.add_request(Request("a", list(range(5))))
    with caplog.at_level(logging.WARNING, logger="loom"):
        sizes = [len(run_step(s).chunks[0].token_ids) for _ in range(5)]
    assert sizes == [1, 1, 1, 1, 1]
    assert sum("too small for one token" in r.getMessage() for r in caplog.records) == 1


def test_priorities_order_admission_then_arrival() -> None:
    s = make(FakeCost(fixed=0.0, per_token=1.0), max_step_ms=10.0)
    s.add_request(Request("first", list(range(10))))
    s.add_request(Request("second", list(range(100, 110))))
    s.add_request(Request("urgent", list(range(200, 210)), priority=-1))
    order = []
    for _ in range(30):  # beside the urgent stream's decodes the others get 2.5 ms a step
        order += [c.request_id for c in run_step(s).chunks if c.start_pos == 0]
    assert order == ["urgent", "first", "second"]


def test_an_urgent_append_goes_before_a_long_prompt() -> None:
    from loom.core.request import RequestStatus

    s = make(FakeCost(fixed=0.0, per_token=1.0), max_step_ms=20.0)
    session = Request("agent", list(range(8)))
    s.add_request(session)
    run_step(s)
    s.park(session, RequestStatus.PAUSED)
    s.add_request(Request("long", list(range(100, 500))))
    run_step(s)  # the long prompt's first chunk: it is running now
    session.append_tokens(list(range(600, 612)))  # a tool result
    session.priority = -1
    s.wake(session)
    out = run_step(s)
    # Its pending sampled token and the 12 appended ones, before the prompt's next chunk.
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("agent", 13),
                                                                      ("long", 7)]


def test_the_linear_model_fits_measured_steps() -> None:
    model = LinearStepCost(min_samples=4)
    assert not model.calibrated
    truth = (5.0, 0.5, 0.002)  # fixed, per token, per 1000 attention units
    for tokens, start in [(1, 100), (64, 0), (128, 256), (256, 0), (32, 900), (512, 512)]:
        att = attention_units(tokens, start)
        model.observe(tokens, att, truth[0] + truth[1] * tokens + truth[2] * att / 1000)
    assert model.calibrated
    assert model.fixed == pytest.approx(5.0, abs=0.05)
    assert model.per_token == pytest.approx(0.5, rel=0.02)
    n = model.tokens_within(45.0, 0)
    assert model.chunk_ms(n, 0) <= 45.0 < model.chunk_ms(n + 1, 0)


def test_a_per_token_cost_lost_in_noise_is_bounded_from_above_not_zero() -> None:
    """A tiny model's steps cost the same whatever their tokens (noise decides the slope):
    the model is still calibrated, with the largest per-token cost the steps allow."""
    model = LinearStepCost(min_samples=4)
    for tokens, ms in [(8, 5.3), (32, 5.1), (96, 5.2), (192, 4.9), (1, 5.4)]:
        model.observe(tokens, 0.0, ms)
    assert model.calibrated and model.per_token > 0
    worst = max((ms - model.fixed) / tokens
                for tokens, ms in [(8, 5.3), (32, 5.1), (96, 5.2), (192, 4.9), (1, 5.4)])
    assert model.per_token == pytest.approx(max(worst, 1e-6))
    assert model.fixed + model.chunk_ms(192, 0) >= 4.9  # no step is predicted too cheap


def test_a_better_priority_stream_keeps_its_pace_beside_a_long_prompt() -> None:
    """While a stream of better (lower) priority decodes, a range of worse priority gets only
    the share reserved for ranges, not the rest of the step: the stream's steps stay short,
    and the prompt still progresses."""
    def step_with(priority: int) -> list[tuple[str, int]]:
        s = make(FakeCost(fixed=10.0, per_token=1.0), max_step_ms=100.0)
        s.add_request(Request("agent", [1, 2], priority=priority))
        run_step(s)  # its prompt; it decodes from now on
        s.add_request(Request("long", list(range(500))))
        return [(c.request_id, len(c.token_ids)) for c in run_step(s).chunks]

    assert step_with(0) == [("agent", 1), ("long", 89)]  # 90 ms left, 1 for the decode
    assert step_with(-1) == [("agent", 1), ("long", 25)]  # the reserved quarter of 100 ms
