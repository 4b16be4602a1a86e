"""Scoring over HTTP as evaluation harnesses do it (lm-evaluation-harness's
`local-completions`: completions with `echo`, `logprobs` and `max_tokens` 0 or 1), and
vLLM's `prompt_logprobs` field, on the real Gemma 3 270M through the `openai` client: a
prompt token's logprob is the one a generation reports for it after the same context."""

from __future__ import annotations

import math

import pytest
from server.conftest import served_clients
from server.test_server_robustness import assert_error

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def api(gemma_engine):
    with served_clients(gemma_engine, MODEL) as (_, client, http):
        yield client, http


def test_echo_scores_a_continuation_as_its_generation_reported_it(api) -> None:
    client, http = api
    prompt = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    gen = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                    logprobs=2)
    generated = http.post("/tokenize", json={"prompt": gen.choices[0].text,
                                             "add_special_tokens": False}).json()["tokens"]
    scored = client.completions.create(model=MODEL, prompt=prompt + generated, max_tokens=0,
                                       echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == "The capital of France is" + gen.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + len(generated) == scored.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert scored.usage.completion_tokens == 0 and choice.finish_reason == "length"
    tail = lp.token_logprobs[len(prompt):]
    for mine, theirs in zip(tail, gen.choices[0].logprobs.token_logprobs, strict=True):
        assert math.isclose(mine, theirs, abs_tol=1e-3)  # float32 mode: prefill vs decode
    assert lp.text_offset == sorted(lp.text_offset)
    # max_tokens 1 with echo: the prompt's logprobs, then the generated token's.
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                    logprobs=0, temperature=0)
    assert len(one.choices[0].logprobs.tokens) == len(prompt) + 1
    assert one.choices[0].logprobs.token_logprobs[-1] == pytest.approx(
        gen.choices[0].logprobs.token_logprobs[0], abs=1e-5)


def test_vllm_prompt_logprobs_field(api) -> None:
    _, http = api
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 1, "prompt_logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    ids = http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert entries[0] is None and len(entries) == len(ids)
    for entry, token in zip(entries[1:], ids[1:], strict=True):
        assert str(token) in entry and len(entry) <= 3
        ranks = [v["rank"] for v in entry.values() if v["rank"] is not None]
        assert sorted(ranks) == [1, 2]
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_zero_tokens_without_echo_is_refused(api) -> None:
    _, http = api
    refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                 "max_tokens": 0})
    assert_error(refused, 400, param="max_tokens")
    refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                 "prompt_logprobs": -1})
    assert_error(refused, 400, param="prompt_logprobs")
