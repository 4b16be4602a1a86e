"""The step-time budget in the engine: the chunks it cuts change no number (the default
mode's guarantee), the engine feeds its measured steps to the cost model, and priorities
reach the scheduler through SamplingParams."""

from __future__ import annotations

from core.test_time_budget import FakeCost
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.core.step_cost import LinearStepCost

PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)


def run(engine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS)
    out = run_to_completion(engine)
    return {rid: (o.outputs[0].token_ids, o.outputs[0].logprobs) for rid, o in out.items()}


def test_time_budgeted_chunks_change_no_bit(tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    prompts = [prompt_ids(37, 1), prompt_ids(5, 2), prompt_ids(61, 3)]
    plain = run(make_engine(folder, quantization="w8a8"), prompts)
    for ms in (3.0, 9.0, 20.0):
        budgeted = make_engine(folder, quantization="w8a8", max_step_ms=ms)
        budgeted.scheduler.cost = FakeCost(fixed=1.0, per_token=1.0)
        sizes = []
        for i, p in enumerate(prompts):
            budgeted.add_request(f"r{i}", p, PARAMS)
        results = {}
        while budgeted.has_unfinished_requests():
            for out in budgeted.step():
                results[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
            sizes.append(sum(len(c.token_ids)
                             for c in budgeted.last_scheduler_output.chunks))
        assert max(sizes) <= max(ms - 1, 3)  # cut by time (decodes may add theirs)
        assert results == plain


def test_the_engine_feeds_measured_steps_to_the_cost_model(tiny_models) -> None:
    folder, _ = tiny_models["gemma3"]
    engine = make_engine(folder, max_step_ms=100.0)
    assert isinstance(engine.scheduler.cost, LinearStepCost)
    run(engine, [prompt_ids(40, 1), prompt_ids(9, 2)])
    assert engine.scheduler.cost.calibrated and engine.scheduler.cost.per_token > 0


def test_priority_reaches_the_request(tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder)
    engine.add_request("u", prompt_ids(4), SamplingParams(max_tokens=2, priority=-3))
    assert engine.scheduler.requests["u"].priority == -3
    run_to_completion(engine)


def test_an_engine_with_a_time_budget_is_calibrated_before_its_first_request(tiny_models):
    """The cost model is fitted at start-up (a few timed steps), so the first prompt is cut
    by the time budget too; the calibration leaves nothing behind (no request, no block, no
    prefix-cache entry) and changes no number."""
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder, quantization="w8a8", max_step_ms=100.0)
    cost = engine.scheduler.cost
    assert cost.calibrated and cost.per_token > 0
    assert not engine.has_unfinished_requests() and engine.kv_pool_all_free
    assert engine.stats.num_cached_kv_blocks == 0
    assert engine.scheduler._clock() is not None  # the time budget is in effect at once
    plain = run(make_engine(folder, quantization="w8a8"), [prompt_ids(37, 1)])
    assert run(engine, [prompt_ids(37, 1)]) == plain
