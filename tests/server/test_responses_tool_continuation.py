"""A forced tool call continuing a response that ended in a function call (issue 43): with
`previous_response_id`, `tool_choice` "required" or a named function gives a whole
`function_call` item, the same call as the same items sent without it and as the same
conversation through chat completions (tiny Gemma 3 model, greedy)."""

from __future__ import annotations

import json
import shutil
from typing import Any

import httpx
import pytest
from server.conftest import delete_stored_responses, run_server, wait_until
from server.test_server_robustness import TEMPLATE

from loom.engine.config import EngineArgs

MODEL = "test-model"
# A short tool, so that the tools' system message and two calls fit the tiny context.
TOOL = {"type": "function", "name": "f", "parameters": {
    "type": "object", "required": ["c"], "properties": {"c": {"enum": ["Rome", "Oslo"]}}}}
CHAT_TOOL = {"type": "function", "function": {"name": "f", "parameters": TOOL["parameters"]}}
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 64,
          "parallel_tool_calls": False, "tools": [TOOL]}
NAMED = {"type": "function", "name": "f"}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    """The tiny Gemma 3 model with a 2,048-token context (its 512 cannot hold the turns)."""
    folder = tmp_path_factory.mktemp("long") / "gemma3"
    shutil.copytree(tiny_models["gemma3"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "max_position_embeddings": 2048}))
    args = EngineArgs(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=1024,
                      block_size=4)
    with run_server(args, chat_template=TEMPLATE) as srv:
        yield srv


def _only_call(response: dict[str, Any]) -> dict[str, Any]:
    """The response's output: exactly one whole function call."""
    assert response.get("status") == "completed", response
    output = response["output"]
    assert [item["type"] for item in output] == ["function_call"], output
    call = output[0]
    assert call["name"] == "f" and json.loads(call["arguments"])["c"] in ("Rome", "Oslo")
    return call


def _chat_call(http: httpx.Client, messages: list[dict[str, Any]], choice: Any) -> dict:
    tool_choice = choice if isinstance(choice, str) else {"type": "function",
                                                          "function": {"name": "f"}}
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "tools": [CHAT_TOOL], "tool_choice": tool_choice,
        "parallel_tool_calls": False, "temperature": 0, "max_tokens": 64})
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1, calls
    return calls[0]["function"]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_continues_a_function_call(server, choice) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        first = http.post("/v1/responses", json={**GREEDY, "tool_choice": choice,
                                                 "input": "Weather in Rome?"}).json()
        call = _only_call(first)
        followup = {"type": "function_call_output", "call_id": call["call_id"],
                    "output": "sunny"}
        continued = _only_call(http.post("/v1/responses", json={
            **GREEDY, "tool_choice": choice, "previous_response_id": first["id"],
            "input": [followup]}).json())
        items = [{"role": "user", "content": "Weather in Rome?"},
                 {k: call[k] for k in ("type", "call_id", "name", "arguments")}, followup]
        fresh = _only_call(http.post("/v1/responses", json={
            **GREEDY, "tool_choice": choice, "input": items}).json())
        assert json.loads(continued["arguments"]) == json.loads(fresh["arguments"])
        messages = [items[0], {"role": "assistant", "content": None, "tool_calls": [{
            "id": call["call_id"], "type": "function",
            "function": {"name": "f", "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"}]
        chat = _chat_call(http, messages, choice)
        assert json.loads(continued["arguments"]) == json.loads(chat["arguments"])
    delete_stored_responses(server)
    eng = server.llm_engine
    assert wait_until(lambda: not eng.table.group_ids() and eng.kv_pool_all_free)
