"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's shape): a prompt token's logprob
is the one a generation reports for the same token after the same context, bit for bit in
the default mode, however the prompt is chunked or batched; the prefix cache gives such a
request nothing (its logits are computed) and the request still ends cleanly."""

from __future__ import annotations

import math

import pytest
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.errors import InvalidSamplingParamsError


@pytest.mark.parametrize("quantization", [None, "w8a8"])
@pytest.mark.parametrize("chunk", [5, 512])
def test_prompt_logprobs_equal_generated_logprobs(tiny_models, quantization, chunk) -> None:
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder, quantization=quantization, max_num_batched_tokens=chunk)
    prompt = prompt_ids(9)
    engine.add_request("gen", prompt, SamplingParams(temperature=0, max_tokens=7, logprobs=3,
                                                     ignore_eos=True))
    generated = run_to_completion(engine)["gen"].outputs[0]
    # The prompt of the second request holds the generated tokens: their prompt logprobs
    # are those the generation reported (computed in prefill chunks instead of decodes),
    # batched with a request of another length.
    whole = prompt + generated.token_ids
    engine.add_request("other", prompt_ids(23, 4), SamplingParams(max_tokens=3))
    engine.add_request("score", whole, SamplingParams(max_tokens=1, prompt_logprobs=3))
    scored = run_to_completion(engine)["score"]
    entries = scored.prompt_logprobs
    assert entries is not None and len(entries) == len(whole) and entries[0] is None
    for i, token in enumerate(generated.token_ids):
        entry, reported = entries[len(prompt) + i], generated.logprobs[i]
        assert token in entry and len(entry) <= 4  # the token and the top 3
        if quantization == "w8a8":  # the default mode's guarantee
            assert entry == reported
        else:
            for t, lp in reported.items():
                assert math.isclose(entry[t], lp, abs_tol=1e-4)
    for entry, token in zip(entries[1:], whole[1:], strict=True):
        assert entry[token] <= 0.0 and max(entry.values()) <= 0.0
    assert engine.kv_pool_all_free


def test_prompt_logprobs_skip_the_prefix_cache_and_zero_asks_for_the_token_alone(
        tiny_models) -> None:
    folder, _ = tiny_models["gemma3"]
    engine = make_engine(folder, enable_prefix_caching=True)
    prompt = prompt_ids(21)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    run_to_completion(engine)
    hits = engine.stats.prefix_cache_hits
    engine.add_request("score", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    out = run_to_completion(engine)["score"]
    assert engine.stats.prefix_cache_hits == hits  # computed, not taken from the cache
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    with pytest.raises(InvalidSamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_delta_outputs_carry_prompt_logprobs_once(tiny_models) -> None:
    from loom.sampling_params import RequestOutputKind

    folder, _ = tiny_models["llama"]
    engine = make_engine(folder, max_num_batched_tokens=4)
    engine.add_request("d", prompt_ids(10), SamplingParams(
        max_tokens=4, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA, ignore_eos=True))
    carried = []
    while engine.has_unfinished_requests():
        carried += [o.prompt_logprobs for o in engine.step() if o.prompt_logprobs is not None]
    assert len(carried) == 1 and len(carried[0]) == 10


def test_llm_takes_vllm_prompt_dicts_and_returns_prompt_logprobs(tiny_models) -> None:
    from loom import LLM
    from loom.errors import InvalidRequestError

    folder, _ = tiny_models["llama"]
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=4)
    ids = prompt_ids(7)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    by_ids, by_list = llm.generate([{"prompt_token_ids": ids}], params)[0], \
        llm.generate(ids, params)[0]
    assert by_ids.prompt_token_ids == ids
    assert by_ids.outputs[0].token_ids == by_list.outputs[0].token_ids
    assert by_ids.prompt_logprobs == by_list.prompt_logprobs
    assert len(by_ids.prompt_logprobs) == len(ids)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {}}, params)
