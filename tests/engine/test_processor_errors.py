"""A logits processor that raises fails only its own request: the batch goes on, a session
stays open and paused with its logits, and no KV block leaks."""

from __future__ import annotations

import pytest
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class RaiseAfter:
    """Passes logits through for `n` calls, then spoils its row in place and raises."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, output_ids: list[int], logits):
        self.calls += 1
        if self.calls > self.n:
            logits.fill_(float("nan"))
            raise ValueError("tool lookup failed")
        return logits


def _greedy_alone(folder, ids: list[int]) -> list[int]:
    engine = make_engine(folder)
    engine.add_request("x", ids, GREEDY)
    return run_to_completion(engine)["x"].outputs[0].token_ids


@pytest.mark.parametrize("speculative", [False, True])
def test_a_raising_processor_fails_its_request_and_the_batch_goes_on(tiny_models, speculative):
    folder, _ = tiny_models["qwen2"]
    kwargs = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} \
        if speculative else {}
    engine = make_engine(folder, **kwargs)
    bad = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                         logits_processors=[RaiseAfter(3)])
    engine.add_request("good", prompt_ids(9), GREEDY)
    engine.add_request("bad", prompt_ids(7, 3), bad)
    engine.add_request("late", prompt_ids(5, 7), GREEDY)
    outs = run_to_completion(engine)
    assert outs["bad"].finished and outs["bad"].outputs[0].finish_reason == "error"
    assert "logits processor of request 'bad' raised ValueError: tool lookup failed" in (
        outs["bad"].error or "")
    assert len(outs["bad"].outputs[0].token_ids) == 3  # the tokens before the failure
    for rid, ids in (("good", prompt_ids(9)), ("late", prompt_ids(5, 7))):
        assert outs[rid].error is None
        assert outs[rid].outputs[0].token_ids == _greedy_alone(folder, ids)
    assert engine.kv_pool_all_free


def test_a_session_whose_processor_raises_stays_paused_and_usable(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(10), session=True)
    run_to_completion(engine)
    logits = engine.get_logits("s").clone()
    before = engine.get_session("s")
    # Resuming from stored logits samples at once: the error reaches the caller and the
    # session is as it was.
    raising = SamplingParams(temperature=0.0, max_tokens=4, logits_processors=[RaiseAfter(0)])
    with pytest.raises(InvalidRequestError, match="raised ValueError: tool lookup failed"):
        engine.resume("s", raising)
    assert engine.get_session("s") == before
    assert bool((engine.get_logits("s") == logits).all())
    # A failure inside a generation segment ends the segment with the error on the output.
    engine.resume("s", SamplingParams(temperature=0.0, max_tokens=8,
                                      logits_processors=[RaiseAfter(2)]))
    outs = run_to_completion(engine)
    assert "raised ValueError" in (outs["s"].error or "")
    view = engine.get_session("s")
    # Two calls pass (the first token comes from the stored logits), the third raises.
    assert view.status == "PAUSED" and len(view.token_ids) == 12
    # The session goes on: greedy from here equals a fresh request over the same tokens.
    engine.resume("s", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    run_to_completion(engine)
    tokens = list(engine.get_session("s").token_ids)
    assert tokens[12:] == _greedy_alone(folder, tokens[:12])[:4]
    engine.close("s")
    assert engine.kv_pool_all_free


def test_text_that_is_not_unicode_is_refused_naming_the_request(tiny_models):
    """A lone surrogate (what JSON's `\\ud800` parses to) in a prompt or a session fragment
    is an InvalidRequestError naming the request, not the tokenizer's TypeError; the engine
    serves the next request."""
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder)
    with pytest.raises(InvalidRequestError, match=r"'bad'.*prompt.*surrogate"):
        engine.add_request("bad", "x \ud800 y", SamplingParams(max_tokens=2))
    engine.add_request("s", [5, 6, 7], session=True)
    with pytest.raises(InvalidRequestError, match=r"'s'.*fragment.*surrogate"):
        engine.append("s", "more \udfff")
    engine.close("s")
    engine.add_request("ok", "fine text", SamplingParams(max_tokens=2))
    assert run_to_completion(engine)["ok"].finished
    assert engine.kv_pool_all_free
