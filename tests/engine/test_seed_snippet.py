"""The seeds' lines as written, on the default model (the README's "The seeds' snippets"):
seed 000's async snippet word for word (`prefill(fragment)` without a request id addresses
the one live request), its sync form, and seed 001's `SpecialKwargs` from `loom.config`
(`vllm` read as `loom`). The fragment lands in the request's KV right after what it
generated, the request goes on generating after it, and a session's stored logits can be
resampled after the prefill."""

from __future__ import annotations

import asyncio

import pytest

from loom import SamplingParams
from loom.engine.async_engine import AsyncLLMEngine
from loom.engine.config import EngineArgs
from loom.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

FRAGMENT = " there was a knight named "


def check_fragment_follows_the_first_token(tokenizer, output, generated_before: int) -> None:
    """The fragment's tokens come right after the tokens generated before it, and the
    request generated its 10 tokens in all (the fragment is input, not counted)."""
    fragment = tokenizer.encode(FRAGMENT, add_special_tokens=False)
    ids = list(output.outputs[0].token_ids)
    assert ids[generated_before:generated_before + len(fragment)] == fragment
    assert len(ids) == 10 + len(fragment)
    assert FRAGMENT in output.outputs[0].text


def test_the_seeds_async_snippet() -> None:
    async def main():
        engine_args = EngineArgs(model="gemma3-270m")
        # Seed 000's lines, unchanged:
        engine = AsyncLLMEngine.from_engine_args(engine_args)
        sampling_params = SamplingParams(temperature=0.8, max_tokens=10)
        prompt = "Once upon a time"
        request_id = "req1"
        await engine.add_request(request_id, prompt, sampling_params)
        outputs = await engine.step()
        await engine.prefill(" there was a knight named ")
        outputs = await engine.step()
        # (the snippet ends here; the request goes on to its 10 tokens)
        before = len(next(o for o in outputs if o.request_id == request_id)
                     .outputs[0].token_ids)
        last = None
        async for out in engine.outputs(request_id):
            last = out
        engine.shutdown()
        return engine.tokenizer, last, before

    tokenizer, last, before = asyncio.run(main())
    assert last.finished
    # One token before the fragment (the prompt's step); the fragment's step appended it.
    check_fragment_follows_the_first_token(tokenizer, last, 1)
    assert before >= 1


def test_seed_001s_special_kwargs_from_loom_config() -> None:
    # Seed 001's lines, `vllm` read as `loom` (and its placeholders filled in):
    from loom import LLM, SamplingParams
    from loom.config import SpecialKwargs

    special_kwargs = SpecialKwargs(
        sync_token_id=12345,    # <sync> token ID
        promise_token_id=67890, # <promise> token ID
    )
    llm = LLM(
        model="gemma3-270m",
        special_kwargs=special_kwargs  # Enables SequenceHookOutputProcessor
    )
    prompts, sampling_params = ["Once upon a time"], SamplingParams(max_tokens=12, seed=0)
    outputs = llm.generate(prompts, sampling_params)
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].outputs[0].token_ids
    assert llm.llm_engine.hooks[0].sync_id == 12345  # the hook is on
    assert llm.llm_engine.kv_pool_all_free


def test_the_seeds_sync_snippet_and_resample() -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model="gemma3-270m"))
    engine.add_request("req1", "Once upon a time", SamplingParams(temperature=0.8,
                                                                  max_tokens=10))
    engine.step()
    engine.prefill(" there was a knight named ")  # the one live request, as the seed writes
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    check_fragment_follows_the_first_token(engine.tokenizer, last, 1)

    engine.add_request("req2", "Once upon a time", SamplingParams(temperature=0.8,
                                                                  max_tokens=10),
                       session=True)
    engine.step()
    engine.prefill("req2", " there was a knight named ")
    engine.step()
    samples = engine.resample("req2", n=3)
    assert len(samples) == 3 and all(s.text for s in samples)
    engine.close("req2")
    assert engine.kv_pool_all_free
