"""Prefix caching on the real Gemma 3 270M: a shared system prompt is computed once, and
every answer equals transformers' and the same engine's answer without the cache."""

from __future__ import annotations

import pytest
import torch
from engine.helpers import run_to_completion

from loom import SamplingParams

SYSTEM = (
    "You are a helpful assistant for a library. Answer in one short sentence. The library "
    "opens at nine in the morning and closes at six in the evening, every day except Sunday. "
    "Members may borrow up to five books for three weeks; late books cost ten cents a day. "
    "The reading room on the second floor is quiet; the children's corner is downstairs.\n"
)
QUESTIONS = ["Q: When does the library open?\nA:", "Q: How many books can I borrow?\nA:",
             "Q: Where is the reading room?\nA:"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def engine(gemma_engine):
    yield gemma_engine
    assert gemma_engine.kv_pool_all_free


def answer(engine, rid, question):
    engine.add_request(rid, SYSTEM + question, SamplingParams(temperature=0.0,
                                                             max_tokens=NEW_TOKENS))
    return run_to_completion(engine)[rid]


def test_shared_system_prompt_hits_and_answers_equal_transformers(engine, gemma_hf):
    engine.reset_prefix_cache()
    before = engine.stats
    # One after another: each question finds the blocks of the one before.
    cached = [answer(engine, f"pc{i}", q) for i, q in enumerate(QUESTIONS)]
    hits = engine.stats.prefix_cache_hits - before.prefix_cache_hits
    system_tokens = len(engine.tokenizer.encode(SYSTEM))
    block = engine.config.block_size
    # Every question after the first found the system prompt's full blocks (and the first
    # question's, when they agree) in the cache.
    assert hits >= (len(QUESTIONS) - 1) * (system_tokens // block - 1) * block
    uncached = []
    for i, question in enumerate(QUESTIONS):
        engine.reset_prefix_cache()  # each answer computed from scratch
        uncached.append(answer(engine, f"nc{i}", question))
    for out, ref_out in zip(cached, uncached, strict=True):
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = gemma_hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        got, want = out.outputs[0].token_ids, ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].finish_reason in ("length", "stop")
        if out.outputs[0].finish_reason == "length":
            assert got == want and len(got) == NEW_TOKENS
        else:
            assert got == want[: len(got)] and got


def test_resubmitted_history_hits_and_equals_fresh_forward(engine, gemma_hf):
    engine.add_request("chat", SYSTEM + QUESTIONS[0], SamplingParams(
        temperature=0.0, max_tokens=6), session=True)
    run_to_completion(engine)
    history = list(engine.get_session("chat").token_ids)
    before = engine.stats.prefix_cache_hits
    engine.add_request("again", history + engine.tokenizer.encode(
        "\nQ: Is it open on Sunday?\nA:", add_special_tokens=False), session=True)
    run_to_completion(engine)
    assert engine.stats.prefix_cache_hits - before >= (len(history) // 16) * 16
    ids = list(engine.get_session("again").token_ids)
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(engine.get_logits("again"), ref, atol=2e-3, rtol=1e-3)
    engine.close("chat")
    engine.close("again")
