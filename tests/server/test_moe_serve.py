"""`loom serve --model` on a mixture-of-experts GGUF, as a user starts it: a tiny Qwen3-MoE
file (experts from their Q4_K / Q6_K blocks, the default mode) whose own
`tokenizer.chat_template` has think blocks (so the qwen3 reasoning parser is on), answering
the openai client's chat (the reasoning in `reasoning_content`, streamed too) and a live
session over HTTP."""

from __future__ import annotations

import httpx
import pytest
from processes import free_port, start_tiny_serve, wait_until_serving
from server.test_reasoning import WRITES_THINK
from tiny_gguf import MOE_KQUANTS, write_tiny_moe
from tiny_reference import build_tiny_tokenizer

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-serve")
    build_tiny_tokenizer(folder)
    write_tiny_moe(folder / "tiny-qwen3moe.gguf", "qwen3moe", MOE_KQUANTS,
                   chat_template=WRITES_THINK)
    port = free_port()
    server = start_tiny_serve(folder, port, quiet=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(server, base, timeout=120)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_chat_reasoning_and_answer_from_a_moe_gguf(moe_server):
    client = openai.OpenAI(base_url=f"{moe_server}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    # The random model is made to write a think block, then an answer.
    forced = {"structured_outputs": {"regex": "<think>[a-z]{1,6}</think>[a-z]{1,6}"}}
    message = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi."}], temperature=0,
        max_tokens=40, extra_body=forced).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.isalpha() and message.content.isalpha()
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi."}], temperature=0,
        max_tokens=40, extra_body=forced, stream=True))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in chunks if c.choices)
    assert streamed == reasoning  # the same greedy tokens, split the same way
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi."}], temperature=0,
        max_tokens=8, extra_body={"structured_outputs": {"regex": "[a-z]{1,6}"}})
    assert plain.choices[0].message.model_extra["reasoning_content"] is None


def test_a_live_session_on_a_moe_gguf(moe_server):
    opened = httpx.post(f"{moe_server}/v1/sessions", json={"prompt": "Once upon a time"},
                        timeout=60)
    assert opened.status_code == 200, opened.text
    sid = opened.json()["id"]
    for text in (" there", " was"):
        turn = httpx.post(f"{moe_server}/v1/sessions/{sid}/append",
                          json={"text": text, "max_tokens": 3, "temperature": 0}, timeout=60)
        assert turn.status_code == 200, turn.text
    assert httpx.delete(f"{moe_server}/v1/sessions/{sid}", timeout=60).status_code == 200
