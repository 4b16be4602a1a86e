"""vLLM's offline surface (issue 43): logprobs are `Logprob` objects (`.logprob`, `.rank`,
`.decoded_token`) that still read as floats, `LLM.get_tokenizer()`, `loom.config` (the
seeds' `vllm.config` imports), and `prefill(fragment)` without a request id addressing the
one live request, on the sync and the async engine."""

from __future__ import annotations

import asyncio
import json
import math
import pickle

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.engine.async_engine import AsyncLLMEngine
from loom.engine.outputs import Logprob
from loom.errors import InvalidRequestError, LoomError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_models):
    return make_engine(tiny_models["llama"][0])


def test_prompt_and_sample_logprobs_are_vllm_logprobs(engine) -> None:
    prompt = prompt_ids(9)
    engine.add_request("r", prompt, GREEDY.with_updates(logprobs=3, prompt_logprobs=2))
    out = run_to_completion(engine)["r"]
    tok = prompt[1]
    entry = out.prompt_logprobs[1][tok]
    assert isinstance(entry, Logprob)
    assert entry.logprob == float(entry) and entry.logprob <= 0.0
    assert entry.decoded_token == engine.tokenizer.decode([tok])
    # The rank is the token's place in the whole vocabulary (1 = the most likely): the
    # tokens whose logit after the first prompt token is at least its own.
    engine.add_request("first", prompt[:1], session=True)
    run_to_completion(engine)
    logits = engine.get_logits("first")
    engine.close("first")
    for token_id, lp in out.prompt_logprobs[1].items():  # the prompt token and the top 2
        assert lp.rank == int((logits >= logits[token_id]).sum())
        assert math.isclose(lp, float(torch.log_softmax(logits, -1)[token_id]), abs_tol=1e-5)
    assert sorted(lp.rank for t, lp in out.prompt_logprobs[1].items() if t != tok)[0] == 1
    completion = out.outputs[0]
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        sampled = position[token_id]
        assert sampled.rank == 1  # greedy: the most likely token
        assert sampled.decoded_token == engine.tokenizer.decode([token_id])
        ranks = sorted(lp.rank for lp in position.values())
        assert ranks == list(range(1, len(position) + 1))
        assert all(lp.decoded_token is not None for lp in position.values())
    # Still floats: arithmetic, comparison, the cumulative logprob, JSON, pickling.
    total = sum(position[t] for t, position in zip(completion.token_ids, completion.logprobs,
                                                   strict=True))
    assert math.isclose(total, completion.cumulative_logprob, rel_tol=1e-9)
    assert json.loads(json.dumps({"lp": entry})) == {"lp": float(entry)}
    again = pickle.loads(pickle.dumps(entry))
    assert again == entry and again.rank == entry.rank
    assert again.decoded_token == entry.decoded_token
    assert str(entry) == repr(float(entry)) and "rank=" in repr(entry)


def test_a_sampled_tokens_rank_counts_the_tokens_at_least_as_likely(engine) -> None:
    """Random sampling picks tokens of any rank: the rank is exact, not only within the
    top-N reported (logprobs=0 reports the sampled token alone, ranked)."""
    engine.add_request("s", prompt_ids(5), session=True)
    run_to_completion(engine)
    logits = engine.get_logits("s").clone()
    engine.resume("s", SamplingParams(temperature=2.0, seed=3, max_tokens=1, logprobs=0))
    run_to_completion(engine)
    view = engine.get_session("s")
    token = view.token_ids[-1]
    engine.close("s")
    expected = int((logits >= logits[token]).sum())
    engine.add_request("again", list(view.token_ids[:-1]),
                       SamplingParams(temperature=2.0, seed=3, max_tokens=1, logprobs=0))
    out = run_to_completion(engine)["again"].outputs[0]
    assert out.token_ids == [token]
    (entry,) = out.logprobs[0].values()
    assert entry.rank == expected


def test_llm_get_tokenizer(tiny_models) -> None:
    from loom import LLM

    llm = LLM(model=str(tiny_models["llama"][0]), dtype="float32", device="cpu",
              num_kv_blocks=64, block_size=4)
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.llm_engine.tokenizer
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert tokenizer.decode(ids) == "Once upon a time"
    (out,) = llm.generate({"prompt_token_ids": prompt_ids(6)},
                          SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert out.prompt_logprobs[1][prompt_ids(6)[1]].decoded_token is not None


def test_loom_config_holds_the_seeds_imports() -> None:
    from loom.config import EngineArgs, SamplingParams, SpecialKwargs

    kwargs = SpecialKwargs(sync_token_id=12345, promise_token_id=67890)
    assert kwargs.sync_token_id == 12345
    assert EngineArgs(model="m", special_kwargs=kwargs).special_kwargs is kwargs
    assert SamplingParams(max_tokens=3).max_tokens == 3


def test_prefill_without_an_id_addresses_the_one_live_request(engine) -> None:
    with pytest.raises(InvalidRequestError, match="none is live"):
        engine.prefill(" and then")
    engine.add_request("only", prompt_ids(6), GREEDY)
    engine.step()
    fragment = prompt_ids(3, 7)
    assert engine.prefill(fragment) == 3  # token ids: the one argument is the fragment
    assert engine.append(" there") >= 1   # text; `append` is the same call
    out = run_to_completion(engine)["only"].outputs[0]
    assert out.token_ids[1:4] == fragment and len(out.token_ids) > 4 + 3

    engine.add_request("a", prompt_ids(6), GREEDY)
    engine.add_request("b", prompt_ids(6, 1), session=True)
    with pytest.raises(InvalidRequestError, match=r"2 are live \('a', 'b'\)") as error:
        engine.prefill(" there was a knight named ")
    assert isinstance(error.value, LoomError)
    engine.prefill("b", " there")  # with an id, as before
    run_to_completion(engine)
    engine.close("b")
    assert engine.kv_pool_all_free


def test_async_prefill_without_an_id(engine) -> None:
    async def main() -> tuple[list[int], list[int]]:
        front = AsyncLLMEngine(engine)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        await front.add_request("req1", prompt_ids(5), params)
        await front.step()
        fragment = prompt_ids(2, 3)
        await front.prefill(fragment)
        last = None
        async for out in front.outputs("req1"):
            last = out
        await front.add_request("x", prompt_ids(5), params)
        await front.add_request("y", prompt_ids(5, 1), params)
        with pytest.raises(InvalidRequestError, match="'x', 'y'"):
            await front.prefill(" knight")
        await front.abort("x")
        await front.abort("y")
        return fragment, last.outputs[0].token_ids

    fragment, token_ids = asyncio.run(main())
    # Appended after the token(s) generated before it, then 3 generated in all.
    start = token_ids.index(fragment[0])
    assert token_ids[start:start + 2] == fragment and len(token_ids) == 3 + 2
    engine.run_async_calls_inline = True
    assert engine.kv_pool_all_free


def test_logprob_is_a_float_for_torch(engine) -> None:
    entry = Logprob(-0.5, 2, "a")
    assert torch.tensor([entry]).item() == -0.5
    assert entry + 1 == 0.5 and -entry == 0.5 and entry < 0 and max(entry, -1.0) is entry
