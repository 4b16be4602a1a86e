"""Faults stay with their request: a hook that raises, an async hook call that raises, and a
forward that raises fail only the requests they concern, with a message naming the cause;
nothing escapes `step()`, no block leaks, and the same engine serves the next request."""

from __future__ import annotations

import pytest
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.engine.hooks import SequenceHook

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _alone(folder, ids):
    engine = make_engine(folder)
    engine.add_request("x", ids, GREEDY)
    return run_to_completion(engine)["x"].outputs[0].token_ids


class RaisingHook(SequenceHook):
    """Raises on the `at`-th token of sequence `victim` (once)."""

    def __init__(self, victim: str, at: int = 3) -> None:
        self.victim, self.at, self.seen, self.raised = victim, at, 0, False

    def on_token(self, ctx, seq_id, token_id):
        if seq_id == self.victim and not self.raised:
            self.seen += 1
            if self.seen == self.at:
                self.raised = True
                raise KeyError("tool table is empty")


class RaisingAsyncCall(SequenceHook):
    """Asks for an async call on the victim's 2nd token; the call raises."""

    def __init__(self, victim: str) -> None:
        self.victim, self.count = victim, 0

    def on_token(self, ctx, seq_id, token_id):
        if seq_id == self.victim:
            self.count += 1
            if self.count == 2:
                async def fail():
                    raise ConnectionError("tool server down")
                ctx.run_async(seq_id, fail)


@pytest.mark.parametrize("hook_kind", ["on_token", "async_call"])
def test_a_raising_hook_fails_only_its_request(tiny_models, hook_kind):
    folder, _ = tiny_models["qwen2"]
    hook = RaisingHook("bad") if hook_kind == "on_token" else RaisingAsyncCall("bad")
    engine = make_engine(folder, hooks=[hook])
    engine.add_request("bad", prompt_ids(8, offset=1), GREEDY)
    engine.add_request("good", prompt_ids(8, offset=2), GREEDY)
    last = run_to_completion(engine)
    bad, good = last["bad"], last["good"]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    cause = "KeyError" if hook_kind == "on_token" else "ConnectionError"
    assert "'bad'" in bad.error and cause in bad.error, bad.error
    assert good.error is None and good.outputs[0].token_ids == _alone(folder, prompt_ids(8, 2))
    assert engine.kv_pool_all_free
    engine.add_request("next", prompt_ids(8, offset=3), GREEDY)
    assert run_to_completion(engine)["next"].outputs[0].token_ids == _alone(
        folder, prompt_ids(8, 3))
    assert engine.kv_pool_all_free


def test_a_hook_raising_on_a_session_ends_its_segment_and_keeps_the_session(tiny_models):
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder, hooks=[RaisingHook("s", at=2)])
    engine.add_request("s", prompt_ids(6), session=True)
    run_to_completion(engine)
    engine.resume("s", GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    failed = [o for o in outs if o.error is not None]
    assert len(failed) == 1 and "KeyError" in failed[0].error
    assert not outs[-1].finished and outs[-1].outputs[0].finish_reason == "error"
    view = engine.get_session("s")
    assert view.status == "PAUSED" and view.num_computed_tokens == len(view.token_ids)
    engine.resume("s", GREEDY)  # the hook raised once: the next segment runs to its end
    assert run_to_completion(engine)["s"].outputs[0].finish_reason == "length"
    engine.close("s")
    assert engine.kv_pool_all_free


def test_a_failing_forward_fails_the_step_and_the_engine_goes_on(tiny_models, monkeypatch):
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder)
    real = engine.runner.execute_model
    calls = {"n": 0}

    def flaky(sched_out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(sched_out)

    monkeypatch.setattr(engine.runner, "execute_model", flaky)
    engine.add_request("a", prompt_ids(8, offset=1), GREEDY)
    engine.add_request("b", prompt_ids(8, offset=2), GREEDY)
    last = run_to_completion(engine)
    for rid in ("a", "b"):
        assert last[rid].finished and last[rid].outputs[0].finish_reason == "error"
        assert "RuntimeError: device lost" in last[rid].error
    assert engine.kv_pool_all_free
    engine.add_request("c", prompt_ids(8, offset=3), GREEDY)
    assert run_to_completion(engine)["c"].outputs[0].token_ids == _alone(
        folder, prompt_ids(8, 3))
    assert engine.kv_pool_all_free
