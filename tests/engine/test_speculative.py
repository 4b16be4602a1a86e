"""Speculative decoding (n-gram drafts) on tiny models: the output never changes.

Drafts are proposed from repeats in a sequence's own tokens, so the prompts here repeat a
pattern; random-weight models also fall into cycles, which drafts then follow.
"""

from __future__ import annotations

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion
from tiny_reference import TINY_ARCHS, hf_greedy, hf_last_logits

from loom import SamplingParams
from loom.engine.hooks import HookContext, SequenceHook
from loom.errors import InvalidRequestError

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def repeating(n: int, period: int, offset: int = 0) -> list[int]:
    """n ids cycling through `period` distinct ones."""
    return [prompt_ids(period, offset)[i % period] for i in range(n)]


PROMPTS = [repeating(24, 5), repeating(9, 3, 1), prompt_ids(17, 2), repeating(40, 7, 3)]


def generate(engine, params, prompts=PROMPTS):
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outs = run_to_completion(engine)
    assert engine.kv_pool_all_free
    return [outs[str(i)].outputs[0] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_with_drafts_equals_transformers(tiny_models, arch):
    folder, hf = tiny_models[arch]
    engine = make_engine(folder, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for ids, out in zip(PROMPTS, generate(engine, params), strict=True):
        assert out.token_ids == hf_greedy(hf, ids, 24)
    assert engine.speculator.num_accepted > 0  # drafts were really used
    assert engine.speculator.num_accepted <= engine.speculator.num_drafted


def test_seeded_sampling_and_logprobs_are_unchanged_by_drafts(tiny_models):
    folder, _ = tiny_models["qwen2"]
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=7, max_tokens=30, logprobs=2,
                            ignore_eos=True)
    # One sequence alone, so both engines take the same (fused) path for every position.
    for prompt in PROMPTS[:2]:
        plain = generate(make_engine(folder), params, [prompt])[0]
        engine = make_engine(folder, speculative_config=SPEC)
        spec = generate(engine, params, [prompt])[0]
        assert spec.token_ids == plain.token_ids
        assert spec.logprobs == plain.logprobs
        assert engine.speculator.num_drafted > 0


def test_stop_conditions_cut_inside_accepted_drafts(tiny_models):
    folder, _ = tiny_models["llama"]
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = generate(make_engine(folder), base, PROMPTS[:1])[0].token_ids
    stop_token = plain[9]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
    ):
        want = generate(make_engine(folder), params, PROMPTS[:1])[0]
        got = generate(make_engine(folder, speculative_config=SPEC), params, PROMPTS[:1])[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.finish_reason, want.stop_reason)
    assert len(got.token_ids) == 13


def test_session_with_drafts_equals_fresh_forward(tiny_models):
    folder, hf = tiny_models["gemma3"]
    engine = make_engine(folder, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("s", PROMPTS[0], params, session=True)
    run_to_completion(engine)
    for fragment in (repeating(6, 5), repeating(10, 3, 1)):
        engine.prefill("s", fragment)
        run_to_completion(engine)
        engine.resume("s", params)
        run_to_completion(engine)
        ids = list(engine.get_session("s").token_ids)
        torch.testing.assert_close(
            engine.get_logits("s"), hf_last_logits(hf, ids), atol=1e-4, rtol=1e-4)
    assert engine.speculator.num_accepted > 0
    assert engine.num_recomputed_tokens == 0
    engine.close("s")
    assert engine.kv_pool_all_free


class Recorder(SequenceHook):
    """Checks that every token reaches hooks as if decoded alone; forks at the 5th token."""

    def __init__(self) -> None:
        self.children: list[str] = []
        self.engine = None  # set once the engine exists

    def on_token(self, ctx: HookContext, seq_id: str, token_id: int) -> None:
        request = self.engine.scheduler.requests[seq_id]
        assert request.token_ids[-1] == token_id and request.num_draft_tokens == 0
        assert request.num_computed_tokens == request.num_tokens - 1
        if ctx.parent(seq_id) is None and len(ctx.generated_token_ids(seq_id)) == 5:
            self.children.append(ctx.spawn_child(seq_id, max_tokens=6))


def test_hooks_see_each_token_in_order_and_forks_match_plain_decoding(tiny_models):
    folder, _ = tiny_models["qwen3"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = []
    for spec in (None, SPEC):
        hook = Recorder()
        engine = make_engine(folder, speculative_config=spec, hooks=[hook])
        hook.engine = engine
        engine.add_request("r", PROMPTS[0], params)
        out = run_to_completion(engine)["r"]
        assert len(hook.children) == 1 and engine.kv_pool_all_free
        assert spec is None or engine.speculator.num_accepted > 0
        outputs.append((out.outputs[0].token_ids, [c.outputs[0].token_ids for c in out.children]))
    assert outputs[0] == outputs[1]


def test_drafting_pauses_for_large_batches_and_bad_configs_are_rejected(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder, speculative_config={**SPEC, "disable_by_batch_size": 2})
    generate(engine, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), PROMPTS[:2])
    assert engine.speculator.num_drafted == 0
    with pytest.raises(InvalidRequestError, match="unknown speculative method"):
        make_engine(folder, speculative_config={"method": "medusa"})
    with pytest.raises(InvalidRequestError, match="speculative_config must be a dict"):
        make_engine(folder, speculative_config=4)


def test_async_streaming_with_drafts_is_cumulative_and_equal(tiny_models):
    """A step may now add several tokens: streams stay cumulative and end equal to plain."""
    import asyncio

    from loom.engine.async_engine import AsyncLLMEngine

    folder, hf = tiny_models["llama"]
    engine = AsyncLLMEngine(make_engine(folder, speculative_config=SPEC))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def stream():
        return [o async for o in engine.generate(PROMPTS[0], params, "a")]

    outs = asyncio.run(stream())
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and outs[-1].finished
    assert outs[-1].outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 20)
    assert len(outs) < 20  # some steps delivered more than one token
    assert engine.engine.kv_pool_all_free
