"""The real SmolLM2 135M Instruct (alias `smollm2-135m-instruct`, `loom serve`'s default) in
exact float32: chat through its GGUF's template answers; tokens, chat ids, logits and greedy
continuations equal transformers' on the same (Q4_1, dequantised) weights; the demo's
fork/join scene."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.fork_join_scene import check_fork_join_scene
from engine.helpers import run_to_completion

from loom import SamplingParams
from loom.tokenizer import ChatTemplate

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):\n"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]
NEW_TOKENS = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    yield smollm2_engine
    assert smollm2_engine.kv_pool_all_free


@pytest.fixture(scope="module")
def template(smollm2_path: Path) -> ChatTemplate:
    """The model's own template, from its GGUF metadata (no flag, no fallback)."""
    template = ChatTemplate.from_model(smollm2_path, smollm2_path)
    assert template is not None and "tokenizer.chat_template" in template.origin
    return template


def _prompts(engine, template) -> list[list[int]]:
    """Plain prompts and two conversations, as token ids."""
    plain = [engine.tokenizer.encode(p) for p in PROMPTS]
    chats = [template.render_ids(engine.tokenizer, m) for m in (QUESTION, CONVERSATION)]
    return plain + chats


def test_chat_answers_the_capital_of_france(engine, template):
    ids = template.render_ids(engine.tokenizer, QUESTION)
    engine.add_request("paris", ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    answer = run_to_completion(engine)["paris"].outputs[0]
    assert "Paris" in answer.text, answer.text
    assert answer.finish_reason == "stop"  # the turn ended with <|im_end|>, the model's EOS


def test_tokens_and_chat_ids_equal_transformers(engine, template, smollm2_hf_tokenizer):
    hf = smollm2_hf_tokenizer
    for prompt in PROMPTS:
        assert engine.tokenizer.encode(prompt) == hf(prompt).input_ids, prompt
    for messages in (QUESTION, CONVERSATION):
        for prompt in (True, False):
            hf_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            add_generation_prompt=prompt)["input_ids"]
            assert template.render_ids(engine.tokenizer, messages, prompt) == hf_ids


def test_logits_and_greedy_continuations_equal_transformers(engine, template, smollm2_hf):
    """Each prompt as a session: its stored logits equal transformers' at the last prompt
    position; a greedy segment then gives transformers' tokens, up to EOS or NEW_TOKENS.
    (One transformers `generate` per prompt gives both: its first step's logits are the last
    prompt position's.)"""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i, ids in enumerate(_prompts(engine, template)):
        with torch.no_grad():
            ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, len(ids) :].tolist()
        engine.add_request(f"s{i}", ids, session=True)
        run_to_completion(engine)
        torch.testing.assert_close(engine.get_logits(f"s{i}"), ref.logits[0][0].float(),
                                   atol=2e-3, rtol=1e-3)
        engine.resume(f"s{i}", params)
        got = run_to_completion(engine)[f"s{i}"].outputs[0]
        engine.close(f"s{i}")
        if got.finish_reason == "length":
            assert got.token_ids == ref_tokens, i
        else:  # ended at EOS: transformers wrote the same tokens, EOS included
            assert got.finish_reason == "stop" and got.token_ids[-1] in engine.eos_token_ids
            assert got.token_ids == ref_tokens[: len(got.token_ids)], i


def test_fork_join_scene_shares_kv_and_equals_fresh_forward(engine, smollm2_hf):
    texts = check_fork_join_scene(engine, smollm2_hf)
    assert all(text.rstrip().endswith(".") for text in texts), texts  # whole sentences
