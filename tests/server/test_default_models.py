"""Chat out of the box: `loom serve` with no flags serves the instruct model and answers chat;
Gemma 3 served without `--chat-template` renders chat through Loom's packaged template."""

from __future__ import annotations

import argparse
import dataclasses

import httpx
import pytest
from engine.helpers import run_to_completion
from server.conftest import run_server

from loom import SamplingParams
from loom.server.cli import add_serve_parser, engine_args_from, server_config_from
from loom.tokenizer import ChatTemplate
from loom.tokenizer.packaged_templates import GEMMA3_TEMPLATE, packaged_template_file

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The instruct model's chat question. Not France: SmolLM2 135M's first answer token to that
# is a near-tie in exact float ("The" 25.33 against "L" 25.24), which any int8 rounding of
# the activations may flip (w8a8 with a float32 KV cache does; both start "L'Étoile").
CHAT_QUESTION = [{"role": "user", "content": "What is the capital of Germany?"}]


def _serve_namespace(argv: list[str]) -> argparse.Namespace:
    """`loom serve ARGV` parsed as the `loom` command parses it."""
    parser = argparse.ArgumentParser(prog="loom")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_serve_defaults_to_the_instruct_model_and_takes_model_as_a_flag():
    assert engine_args_from(_serve_namespace([])).model == "smollm2-135m-instruct"
    assert engine_args_from(_serve_namespace(["--model", "gemma3-270m"])).model == "gemma3-270m"


@pytest.mark.slow
def test_serve_without_flags_answers_chat():
    """The engine and server configuration `loom serve` builds from no flags at all (default
    mode: w4a8 on the CPU kernels), behind a real server: a chat about Germany gets Berlin."""
    namespace = _serve_namespace([])
    config = server_config_from(namespace)
    assert config.chat_template is None and config.served_model_name == "smollm2-135m-instruct"
    with run_server(engine_args_from(namespace), **dataclasses.asdict(config)) as server:
        assert "tokenizer.chat_template" in server.app.state.loom.chat_template.origin
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            reply = client.post("/v1/chat/completions", json={
                "model": config.served_model_name, "messages": CHAT_QUESTION,
                "max_tokens": 24, "temperature": 0.0,
            })
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert "Berlin" in choice["message"]["content"], choice
        assert choice["finish_reason"] == "stop"
    assert server.llm_engine.kv_pool_all_free


@pytest.mark.slow
def test_gemma_without_a_flag_chats_through_the_packaged_template(gemma_engine):
    config = gemma_engine.config
    template = ChatTemplate.from_model(config.model_path, config.tokenizer_path)
    assert template is not None
    assert template.origin.startswith(str(packaged_template_file(GEMMA3_TEMPLATE)))
    ids = template.render_ids(gemma_engine.tokenizer, QUESTION)
    gemma_engine.add_request("chat", ids, SamplingParams(temperature=0.0, max_tokens=12))
    expected = run_to_completion(gemma_engine)["chat"].outputs[0].text
    with run_server(gemma_engine, served_model_name="gemma3-270m") as server:
        assert server.app.state.loom.chat_template.origin == template.origin
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            tokens = client.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
            reply = client.post("/v1/chat/completions", json={
                "model": "gemma3-270m", "messages": QUESTION, "max_tokens": 12,
                "temperature": 0.0,
            })
    assert tokens == ids
    assert tokens[-3:] == gemma_engine.tokenizer.encode("<start_of_turn>model\n",
                                                        add_special_tokens=False)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == expected
    assert gemma_engine.kv_pool_all_free
