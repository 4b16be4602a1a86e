"""Outputs as deltas: DELTA outputs concatenate to exactly the CUMULATIVE output (stop strings
cut across deltas included), FINAL_ONLY sends one output, and a session's segment holds only
what it generated, whatever a caller appends meanwhile."""

from __future__ import annotations

import pytest
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import RequestOutputKind, SamplingParams
from loom.engine.outputs import OutputAccumulator

DELTA, CUMULATIVE, FINAL = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                            RequestOutputKind.FINAL_ONLY)


def _all_outputs(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def _text(folder, ids, params: SamplingParams) -> str:
    engine = make_engine(folder)
    engine.add_request("r", ids, params)
    return run_to_completion(engine)["r"].outputs[0].text


@pytest.mark.parametrize("stop_at", [None, 0.3, 0.6])
@pytest.mark.parametrize("include_stop", [False, True])
def test_deltas_concatenate_to_the_cumulative_output(tiny_models, stop_at, include_stop):
    folder, _ = tiny_models["qwen2"]
    ids = prompt_ids(9)
    base = dict(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True, logprobs=2, n=2,
                include_stop_str_in_output=include_stop)
    stop = None
    if stop_at is not None:  # a stop string the first sequence's text contains, mid-way
        text = _text(folder, ids, SamplingParams(**base))
        start = int(len(text) * stop_at)
        stop = [text[start:start + 4]]
        assert stop[0].strip(), text
    base["stop"] = stop
    engine = make_engine(folder)
    engine.add_request("cum", ids, SamplingParams(**base, output_kind=CUMULATIVE))
    engine.add_request("delta", ids, SamplingParams(**base, output_kind=DELTA))
    outs = _all_outputs(engine)
    final = [o for o in outs if o.request_id == "cum"][-1]
    gathered = OutputAccumulator()
    for out in (o for o in outs if o.request_id == "delta"):
        gathered.add(out)
        for comp in out.outputs:
            if comp.logprobs is not None:
                assert len(comp.logprobs) == len(comp.token_ids)
    delta = gathered.result()
    assert delta.finished and final.finished
    if stop is not None:
        assert any(c.finish_reason == "stop" and c.stop_reason == stop[0]
                   for c in final.outputs), final
    for a, b in zip(final.outputs, delta.outputs, strict=True):
        assert (a.index, a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.index, b.text, b.token_ids, b.finish_reason, b.stop_reason)
        assert a.logprobs == b.logprobs
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob)
    assert engine.kv_pool_all_free


def test_final_only_sends_one_output_per_request(tiny_models):
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("cum", prompt_ids(7), params)
    engine.add_request("final", prompt_ids(7), params.with_updates(output_kind=FINAL))
    outs = _all_outputs(engine)
    finals = [o for o in outs if o.request_id == "final"]
    assert len(finals) == 1 and finals[0].finished
    assert len([o for o in outs if o.request_id == "cum"]) > 1
    assert finals[0].outputs[0].token_ids == [o for o in outs if o.request_id == "cum"][
        -1].outputs[0].token_ids


def test_a_segment_holds_only_what_it_generated_while_a_caller_appends(tiny_models):
    """A text-only append made while a session generates is input, not output: the segment's
    deltas hold exactly its max_tokens generated tokens (the append once showed up in them)."""
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(6), session=True)
    run_to_completion(engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=DELTA)
    engine.resume("s", params)
    gathered = OutputAccumulator()
    fragment = prompt_ids(5, offset=3)
    for _ in range(3):
        for out in engine.step():
            gathered.add(out)
    engine.append("s", fragment)  # while generating: the segment continues after it
    for out in run_to_completion_outputs(engine):
        gathered.add(out)
    segment = gathered.result().outputs[0]
    assert len(segment.token_ids) == 12 and segment.finish_reason == "length"
    view = engine.get_session("s")
    tokens = list(view.token_ids)
    start = tokens.index(fragment[0], 6)
    assert tokens[start:start + len(fragment)] == fragment  # the fragment is in the session
    assert segment.token_ids == tokens[6:start] + tokens[start + len(fragment):]


def run_to_completion_outputs(engine):
    """Every output until nothing runs."""
    return _all_outputs(engine)
