"""AsyncLLMEngine: streaming, sessions as coroutines, concurrent appends in call order."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine.helpers import make_engine, prompt_ids
from tiny_reference import hf_greedy, hf_last_logits

from loom import SamplingParams
from loom.engine.async_engine import AsyncLLMEngine
from loom.errors import SessionClosedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture()
def aengine(tiny_models):
    folder, hf = tiny_models["llama"]
    return AsyncLLMEngine(make_engine(folder)), hf


def test_generate_streams_and_batches_many_requests(aengine):
    engine, hf = aengine

    async def one(i):
        outs = [o async for o in engine.generate(prompt_ids(5 + i, i), GREEDY, f"r{i}")]
        return outs

    async def main():
        return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert outs[-1].finished and len(outs) >= 2
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths)  # cumulative
        assert outs[-1].outputs[0].token_ids == hf_greedy(hf, prompt_ids(5 + i, i), 5)
    assert engine.engine.kv_pool_all_free


def test_session_object_and_concurrent_prefills_apply_in_call_order(aengine):
    engine, hf = aengine
    fragments = [prompt_ids(3, k) for k in range(6)]

    async def main():
        async with engine.session(prompt_ids(7)) as s:
            await asyncio.gather(*(s.append(f) for f in fragments))
            seg = await s.generate(GREEDY)
            view = await s.view()
            samples = await s.resample(SamplingParams(temperature=0.0), n=2)
            await s.rewind(2)
            return s.request_id, seg, view, samples

    rid, seg, view, samples = asyncio.run(main())
    expected_prefix = prompt_ids(7) + [t for f in fragments for t in f]
    assert list(view.token_ids[: len(expected_prefix)]) == expected_prefix
    assert seg.token_ids == hf_greedy(hf, expected_prefix, 5)
    assert seg.finish_reason == "length"
    assert seg.text == engine.engine.tokenizer.decode(seg.token_ids)
    logits = hf_last_logits(hf, list(view.token_ids))
    assert [s.token_id for s in samples] == [int(logits.argmax())] * 2
    with pytest.raises(SessionClosedError):
        engine.engine.get_session(rid)
    assert engine.engine.kv_pool_all_free


def test_step_and_stored_logits_through_coroutines(aengine):
    engine, hf = aengine

    async def main():
        await engine.add_request("s", prompt_ids(9), session=True)
        while (await engine.get_session("s")).status != "PAUSED":
            await engine.step()
        await engine.append("s", prompt_ids(4, 2))
        while True:
            view = await engine.get_session("s")
            if view.status == "PAUSED" and view.num_computed_tokens == len(view.token_ids):
                break
            await engine.step()
        logits = engine.engine.get_logits("s")
        await engine.close("s")
        return view, logits

    view, logits = asyncio.run(main())
    torch.testing.assert_close(logits, hf_last_logits(hf, list(view.token_ids)), atol=1e-4,
                               rtol=0)
