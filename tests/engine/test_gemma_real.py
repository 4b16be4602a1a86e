"""The real Gemma 3 270M end to end: greedy equals transformers, sessions equal fresh passes."""

from __future__ import annotations

import pytest
import torch
from engine.fork_join_scene import check_fork_join_scene
from engine.helpers import run_to_completion
from tiny_reference import GEMMA_NEW_TOKENS as NEW_TOKENS
from tiny_reference import GEMMA_PROMPTS as PROMPTS

from loom import SamplingParams


@pytest.fixture(scope="module")
def engine(gemma_engine):
    yield gemma_engine
    assert gemma_engine.kv_pool_all_free


def assert_greedy_matches(engine, completion, expected: list[int], context: str) -> None:
    """A completion equals transformers' greedy tokens and ended for a stated reason: all
    NEW_TOKENS tokens ("length"), or an end-of-sequence token ("stop"), never cut short."""
    got = completion.token_ids
    assert got, context
    if completion.finish_reason == "length":
        assert len(got) == NEW_TOKENS and got == expected, context
    else:
        assert completion.finish_reason == "stop", context
        assert got[-1] in engine.eos_token_ids and len(got) <= NEW_TOKENS, context
        # transformers stops at the EOS ids its generation config names, which may be fewer.
        assert got == expected[: len(got)], context


def assert_prompts_greedy_match(engine, gemma_hf, prefix: str) -> None:
    """Every prompt of PROMPTS, batched, generates transformers' greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{prefix}{i}", prompt, params)
    outs = run_to_completion(engine)
    for i, prompt in enumerate(PROMPTS):
        out = outs[f"{prefix}{i}"]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = gemma_hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert_greedy_matches(engine, out.outputs[0], ref[0, ids.shape[1] :].tolist(), prompt)


def test_greedy_continuations_equal_transformers(engine, gemma_hf):
    assert_prompts_greedy_match(engine, gemma_hf, "g")


def test_prompt_tokens_equal_transformers_tokenizer(engine, gemma_hf_tokenizer):
    for prompt in PROMPTS:
        assert engine.tokenizer.encode(prompt) == gemma_hf_tokenizer(prompt).input_ids


def test_live_session_equals_fresh_forward_on_gemma(engine, gemma_hf):
    # The engine is shared by the session: count only what this scene recomputes.
    recomputed = engine.num_recomputed_tokens
    engine.add_request("madlib", "The knight's name was", SamplingParams(
        temperature=0.0, max_tokens=5), session=True)
    run_to_completion(engine)
    for fragment in [" and his horse was called", ". They rode to the"]:
        engine.append("madlib", fragment)
        run_to_completion(engine)
        ids = list(engine.get_session("madlib").token_ids)
        with torch.no_grad():
            ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(engine.get_logits("madlib"), ref, atol=2e-3, rtol=1e-3)
        engine.resume("madlib", SamplingParams(temperature=0.0, max_tokens=4))
        run_to_completion(engine)
    assert engine.num_recomputed_tokens == recomputed
    engine.close("madlib")


def test_heal_retokenizes_across_the_boundary(engine):
    engine.add_request("h", "Hello wor", session=True)
    run_to_completion(engine)
    engine.append("h", "ld, how are you?", heal=True)
    run_to_completion(engine)
    view = engine.get_session("h")
    assert list(view.token_ids) == engine.tokenizer.encode("Hello world, how are you?")
    engine.close("h")


def test_fork_join_scene_shares_kv_and_equals_fresh_forward(engine, gemma_hf):
    """The demo's scene (which runs on SmolLM2) on Gemma 3 too, through its packaged chat
    template, with its unused tokens as <promise>/<sync> (tests/conftest.py)."""
    check_fork_join_scene(engine, gemma_hf)


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
        model=str(gemma_path), dtype="float32", quantization=None, num_kv_blocks=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    ))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate([REPEATING, *PROMPTS[2:]]):
        engine.add_request(f"s{i}", prompt, params)
        out = run_to_completion(engine)[f"s{i}"]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = gemma_hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert_greedy_matches(engine, out.outputs[0], ref[0, ids.shape[1] :].tolist(), prompt)
    assert engine.speculator.num_accepted > 0
    engine.add_request("sess", REPEATING, params, session=True)
    run_to_completion(engine)
    engine.append("sess", " at dusk. The bell")
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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_gemma_on_cuda_equals_transformers_and_fresh_forward(gemma_path, gemma_hf):
    """The CUDA path (Triton attention, decode steps from CUDA graphs) on the real model, in
    float32: greedy tokens equal transformers', a live session equals a fresh forward."""
    from loom.engine.config import EngineArgs
    from loom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(gemma_path), dtype="float32", quantization=None, device="cuda",
        num_kv_blocks=256, max_num_seqs=8,
    ))
    assert engine.runner.decode_graphs is not None
    assert_prompts_greedy_match(engine, gemma_hf, "c")
    assert engine.runner.decode_graphs.steps_run > 0
    engine.add_request("madlib", "The knight's name was", SamplingParams(
        temperature=0.0, max_tokens=5), session=True)
    run_to_completion(engine)
    engine.append("madlib", " and his horse was called")
    run_to_completion(engine)
    ids = list(engine.get_session("madlib").token_ids)
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(engine.get_logits("madlib").cpu(), ref, atol=2e-3, rtol=1e-3)
    assert engine.num_recomputed_tokens == 0
    engine.close("madlib")
    assert engine.kv_pool_all_free
