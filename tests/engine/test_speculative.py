"""Speculative decoding (n-gram drafts) on tiny models: the output never changes.

Drafts are proposed from repeats in a sequence's own tokens, so the prompts here repeat a
pattern; random-weight models also fall into cycles, which drafts then follow.
"""

from __future__ import annotations

from dataclasses import replace

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


def record_steps(engine) -> list[tuple[list[int], list[int], int]]:
    """Wraps the engine's token appending: per sequence and step, (its drafts, the tokens
    kept by verification, how many of them were taken before a stop)."""
    steps = []
    advance = engine.core.appender._advance

    def recording(seq, tokens, num_drafts, *args):
        request = seq.request
        drafts = request.token_ids[request.num_tokens - num_drafts :] if num_drafts else []
        taken = advance(seq, tokens, num_drafts, *args)
        steps.append((list(drafts), list(tokens), taken))
        return taken

    engine.core.appender._advance = recording
    return steps


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_with_drafts_equals_transformers(tiny_models, arch, device):
    folder, hf = tiny_models[arch]
    engine = make_engine(folder, speculative_config=SPEC, device=device)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for ids, out in zip(PROMPTS, generate(engine, params), strict=True):
        assert out.token_ids == hf_greedy(hf, ids, 24)
    assert engine.speculator.num_accepted > 0  # drafts were really used
    assert engine.speculator.num_accepted <= engine.speculator.num_drafted


def test_seeded_sampling_and_logprobs_are_unchanged_by_drafts(tiny_models):
    """Seeded samples and logprobs equal plain decoding's, with drafts partly accepted."""
    folder, _ = tiny_models["qwen2"]
    # The tiny model's logits are nearly flat: at temperature 0.01 the seeded draws still
    # choose between close tokens, yet the model follows its cycles often enough to accept
    # drafts (at 0.7 every draft is rejected).
    params = SamplingParams(temperature=0.01, top_p=0.95, seed=7, max_tokens=30, logprobs=2,
                            ignore_eos=True)
    # One sequence alone, so both engines take the same (fused) path for every position.
    for prompt in (PROMPTS[0], PROMPTS[2]):
        plain = generate(make_engine(folder), params, [prompt])[0]
        engine = make_engine(folder, speculative_config=SPEC)
        steps = record_steps(engine)
        spec = generate(engine, params, [prompt])[0]
        assert spec.token_ids == plain.token_ids
        assert spec.logprobs == plain.logprobs
        assert engine.speculator.num_accepted > 0
        # A step kept several rows and dropped others: the generator was rewound past them.
        assert any(2 <= taken <= len(drafts) for drafts, _, taken in steps)
    # The draws decide tokens: another seed samples another output.
    other_seed = generate(make_engine(folder), replace(params, seed=8), [prompt])[0]
    assert other_seed.token_ids != plain.token_ids


@pytest.mark.parametrize(
    ("penalty", "prompt"),
    [
        ({"repetition_penalty": 0.8}, PROMPTS[0]),  # below 1: seen tokens are favoured
        ({"presence_penalty": 0.01}, PROMPTS[1]),
        ({"frequency_penalty": 0.01}, PROMPTS[3]),
    ],
    ids=["repetition", "presence", "frequency"],
)
def test_penalties_with_drafts_equal_plain_decoding(tiny_models, penalty, prompt):
    """A draft row is penalised as if the drafts before it had been generated."""
    folder, _ = tiny_models["qwen2"]
    # Penalties apply before the temperature: 0.01 moves a logit by one at temperature 0.01.
    params = SamplingParams(temperature=0.01, seed=7, max_tokens=30, logprobs=2,
                            ignore_eos=True, **penalty)
    plain = generate(make_engine(folder), params, [prompt])[0]
    engine = make_engine(folder, speculative_config=SPEC)
    steps = record_steps(engine)
    spec = generate(engine, params, [prompt])[0]
    assert (spec.token_ids, spec.logprobs) == (plain.token_ids, plain.logprobs)
    assert engine.speculator.num_accepted > 0
    assert any(2 <= taken <= len(drafts) for drafts, _, taken in steps)


# At most eight drafts: a sequence's first step with drafts already carries four.
LONG_SPEC = {**SPEC, "num_speculative_tokens": 8}


def cycle_prompt(folder) -> list[int]:
    """A prompt ending inside the model's own greedy cycle (t1 t2 t3 t1 t2 t3 ...), so that
    drafts copy the cycle from the prompt: the step after the first token drafts tokens
    the segment has not generated yet, and all of them are accepted."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return PROMPTS[1] + generate(make_engine(folder), greedy, PROMPTS[1:2])[0].token_ids


@pytest.mark.parametrize("kind", ["stop_token", "stop_string"])
def test_stop_conditions_cut_inside_accepted_drafts(tiny_models, kind):
    """The stop lands on a verified draft inside a run; the accepted drafts after it go."""
    folder, _ = tiny_models["qwen3"]
    prompt = cycle_prompt(folder)
    stop_token = prompt[-1]  # generated third: the second token of the first run of drafts
    engine = make_engine(folder, speculative_config=LONG_SPEC)
    steps = record_steps(engine)
    stop = (
        {"stop_token_ids": [stop_token]}
        if kind == "stop_token"
        else {"stop": [engine.tokenizer.decode([stop_token])]}
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, **stop)
    want = generate(make_engine(folder), params, [prompt])[0]
    got = generate(engine, params, [prompt])[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert got.finish_reason == "stop" and got.token_ids[-1] == stop_token
    drafts, tokens, taken = steps[-1]
    # The stop token was the taken-th draft, verified after another one, and the draft
    # after it was verified too: kept by verification, then dropped by the stop.
    assert taken >= 2 and tokens[taken - 1] == stop_token
    assert tokens[: taken + 1] == drafts[: taken + 1]


def test_max_tokens_caps_drafts_so_the_limit_ends_a_step(tiny_models):
    """max_tokens never cuts inside drafts: the proposer drafts only the tokens left."""
    folder, _ = tiny_models["qwen3"]
    prompt = cycle_prompt(folder)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = generate(make_engine(folder), params, [prompt])[0]
    engine = make_engine(folder, speculative_config=LONG_SPEC)
    steps = record_steps(engine)
    got = generate(engine, params, [prompt])[0]
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert len(got.token_ids) == 4 and got.finish_reason == "length"
    # After the first token, four drafts were allowed but two fit: all accepted, all taken.
    assert steps[-1] == (got.token_ids[1:3], got.token_ids[1:], 3)


def test_session_with_drafts_equals_fresh_forward(tiny_models):
    folder, hf = tiny_models["gemma3"]
    engine = make_engine(folder, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("s", PROMPTS[0], params, session=True)
    run_to_completion(engine)
    for fragment in (repeating(6, 5), repeating(10, 3, 1)):
        engine.append("s", fragment)
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
