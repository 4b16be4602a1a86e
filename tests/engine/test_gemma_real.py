"""The real Gemma 3 270M end to end: greedy equals transformers, sessions equal fresh passes."""

from __future__ import annotations

import pytest
import torch
from engine.helpers import run_to_completion
from tiny_reference import GEMMA_NEW_TOKENS as NEW_TOKENS
from tiny_reference import GEMMA_PROMPTS as PROMPTS

from loom import SamplingParams


@pytest.fixture(scope="module")
def engine(gemma_engine):
    yield gemma_engine
    assert gemma_engine.kv_pool_all_free


def test_greedy_continuations_equal_transformers(engine, gemma_hf):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"g{i}", prompt, params)
    outs = run_to_completion(engine)
    for i, prompt in enumerate(PROMPTS):
        out = outs[f"g{i}"]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = gemma_hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = ref[0, ids.shape[1] :].tolist()
        got = out.outputs[0].token_ids
        assert got == expected[: len(got)] and len(got) <= len(expected), prompt
        if out.outputs[0].finish_reason == "length":
            assert len(got) == NEW_TOKENS


def test_prompt_tokens_equal_transformers_tokenizer(engine, gemma_hf_tokenizer):
    for prompt in PROMPTS:
        assert engine.tokenizer.encode(prompt) == gemma_hf_tokenizer(prompt).input_ids


def test_live_session_equals_fresh_forward_on_gemma(engine, gemma_hf):
    engine.add_request("madlib", "The knight's name was", SamplingParams(
        temperature=0.0, max_tokens=5), session=True)
    run_to_completion(engine)
    for fragment in [" and his horse was called", ". They rode to the"]:
        engine.prefill("madlib", fragment)
        run_to_completion(engine)
        ids = list(engine.get_session("madlib").token_ids)
        with torch.no_grad():
            ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(engine.get_logits("madlib"), ref, atol=2e-3, rtol=1e-3)
        engine.resume("madlib", SamplingParams(temperature=0.0, max_tokens=4))
        run_to_completion(engine)
    assert engine.num_recomputed_tokens == 0
    engine.close("madlib")


def test_heal_retokenizes_across_the_boundary(engine):
    engine.add_request("h", "Hello wor", session=True)
    run_to_completion(engine)
    engine.prefill("h", "ld, how are you?", heal=True)
    run_to_completion(engine)
    view = engine.get_session("h")
    assert list(view.token_ids) == engine.tokenizer.encode("Hello world, how are you?")
    engine.close("h")


def test_fork_join_scene_shares_kv_and_equals_fresh_forward(engine, gemma_hf):
    from loom.demo_fork import run_fork_join

    out, script = run_fork_join(engine, "outline-test", close=False)
    assert len(out.children) == 3 and all(c.finished for c in out.children)
    ids = list(engine.get_session("outline-test").token_ids)
    tok = engine.tokenizer
    text = tok.decode(ids)
    for child in out.children:  # every expansion is merged into the parent's text
        assert child.outputs[0].text.strip()[:20] in text
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(engine.get_logits("outline-test"), ref, atol=2e-3, rtol=1e-3)
        assert len(script.child_first_logits) == 3
        for context, logits in script.child_first_logits:
            ref = gemma_hf(torch.tensor([context])).logits[0, -1].float()
            torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)
    assert engine.num_recomputed_tokens == 0
    engine.close("outline-test")


REPEATING = (
    "The lamp was lit at dusk. The bell was rung at dawn. The lamp was lit at dusk. "
    "The bell was rung at dawn. The lamp was lit"
)


def test_speculative_decoding_equals_transformers_and_fresh_forward(gemma_path, gemma_hf):
    """n-gram drafts on the real model: greedy tokens equal transformers' and a session's
    logits equal a fresh forward pass; drafts were accepted along the way."""
    from loom.engine.config import EngineArgs
    from loom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(gemma_path), dtype="float32", num_kv_blocks=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    ))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate([REPEATING, *PROMPTS[2:]]):
        engine.add_request(f"s{i}", prompt, params)
        out = run_to_completion(engine)[f"s{i}"]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = gemma_hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        got = out.outputs[0].token_ids
        assert got == ref[0, ids.shape[1] :].tolist()[: len(got)], prompt
    assert engine.speculator.num_accepted > 0
    engine.add_request("sess", REPEATING, params, session=True)
    run_to_completion(engine)
    engine.prefill("sess", " at dusk. The bell")
    run_to_completion(engine)
    engine.resume("sess", SamplingParams(temperature=0.0, max_tokens=12))
    run_to_completion(engine)
    ids = list(engine.get_session("sess").token_ids)
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(engine.get_logits("sess"), ref, atol=2e-3, rtol=1e-3)
    assert engine.num_recomputed_tokens == 0
    engine.close("sess")
    assert engine.kv_pool_all_free
