"""`loom serve` on a harmony model: a tiny random gpt-oss GGUF whose vocabulary carries the
harmony format's tokens (so the server renders conversations in the format and reads outputs
by channel), driven by the openai client as an agent drives gpt-oss: chat completions and
Responses with tools, `reasoning_effort`, forced calls whose arguments follow the tool's
schema, the call's result sent back. The random model writes no harmony structure by itself
unless a grammar makes it: the forced calls and the format's grammar do. How outputs split
by channel is proven on crafted token streams (`test_split_*`)."""

from __future__ import annotations

import json

import pytest
from server.conftest import run_server
from tiny_gguf import write_tiny_gpt_oss
from tiny_reference import tiny_gpt_oss

from loom.server.output_split import HarmonySplit
from loom.server.tool_calls import ParsedCall

openai = pytest.importorskip("openai")

MODEL = "gpt-oss-tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from loom.engine.config import EngineArgs

    folder = tmp_path_factory.mktemp("harmony-serve")
    model = tiny_gpt_oss()
    # The format's system and developer messages take hundreds of the tiny vocabulary's
    # tokens: a longer context (positions are computed, no weight depends on it).
    model.config.max_position_embeddings = 2048
    write_tiny_gpt_oss(folder / "tiny-gpt-oss.gguf", model, harmony=True)
    args = EngineArgs(model=str(folder / "tiny-gpt-oss.gguf"), device="cpu",
                      num_kv_blocks=256, block_size=16)
    with run_server(args, served_model_name=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_the_server_speaks_harmony_for_a_model_whose_vocabulary_carries_it(server):
    state = server.app.state.loom
    assert state.harmony is not None and state.reasoning is None
    import httpx

    ids = httpx.post(f"{server.base_url}/tokenize",
                     json={"model": MODEL, "messages": ASK}, timeout=60).json()["tokens"]
    text = state.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: medium" in text
    assert text.endswith("<|start|>user<|message|>What is the weather in Oslo?<|end|>"
                         "<|start|>assistant")


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_a_forced_call_is_a_tool_call_with_arguments_of_its_schema(client, choice):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
        max_tokens=120, temperature=0, reasoning_effort="high")
    (result,) = response.choices
    assert result.finish_reason == "tool_calls"
    (call,) = result.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius",
                                                                            "fahrenheit")
    assert result.message.content is None
    assert result.message.model_extra["reasoning_content"] is None  # the call came first


def test_a_streamed_forced_call_arrives_whole_in_one_delta(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120,
        temperature=0, stream=True))
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_result_goes_back_and_the_model_answers_in_the_format(client, server):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120,
        temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=30, temperature=0,
        reasoning_effort="low")
    (result,) = second.choices
    assert result.finish_reason in ("stop", "length", "tool_calls")
    assert "reasoning_content" in result.message.model_extra
    # The result was rendered as the function's message to the assistant.
    import httpx

    ids = httpx.post(f"{server.base_url}/tokenize", json={
        "model": MODEL, "messages": messages, "tools": [WEATHER]}, timeout=60).json()["tokens"]
    text = server.app.state.loom.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" \
        '{"temp": 3}<|end|>' in text
    assert "namespace functions {" in text


def test_bad_reasoning_effort_and_template_kwargs_are_400s(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       reasoning_effort="extreme")
    assert error.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {
                                           "enable_thinking": False}})
    assert error.value.body["param"] == "chat_template_kwargs"


def test_responses_with_tools_reasoning_effort_and_a_function_call_output(client, server):
    tool = {"type": "function", "name": "get_weather", "description": "The weather.",
            "parameters": WEATHER["function"]["parameters"]}
    first = client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[tool], tool_choice="required",
        reasoning={"effort": "low"}, max_output_tokens=120, temperature=0)
    assert first.status == "completed" and first.reasoning.effort == "low"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city", "unit"}
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[tool], max_output_tokens=20,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                               "output": '{"temp": 3}'}])
    assert second.status in ("completed", "incomplete")
    assert {item.type for item in second.output} <= {"reasoning", "message", "function_call"}
    # The second turn continued the first one's session: its prompt was not recomputed.
    assert second.usage.input_tokens_details.cached_tokens > 0
    for rid in (first.id, second.id):
        client.responses.delete(rid)


def test_a_streamed_response_gives_the_call_as_a_function_call_item(client):
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}
    events = list(client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[tool], tool_choice="required",
        max_output_tokens=120, temperature=0, stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    (item,) = events[-1].response.output
    assert item.type == "function_call"


# ---------------------------------------------------------------- outputs by channel


def _split(server, names=frozenset({"get_weather"})) -> HarmonySplit:
    return HarmonySplit(server.app.state.loom.harmony.codec.parser(), names)


def _ids(server, text: str) -> list[int]:
    """Token ids of a harmony output written as text, its special tokens as tokens."""
    tokenizer = server.app.state.loom.tokenizer
    return tokenizer.encode(text, add_special_tokens=False)


ANALYSIS_THEN_FINAL = ("<|channel|>analysis<|message|>Think: Oslo is cold.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>It is cold.<|return|>")
A_CALL = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
          "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
          '{"city": "Oslo", "unit": "celsius"}<|call|>')


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_split_analysis_is_reasoning_and_final_is_content(server, chunk):
    ids = _ids(server, ANALYSIS_THEN_FINAL)
    split = _split(server)
    thought, content = "", ""
    for start in range(0, len(ids), chunk):
        delta_thought, pieces = split.feed("", ids[start:start + chunk])
        thought += delta_thought
        content += "".join(p for p in pieces if isinstance(p, str))
    more_thought, more = split.finish()
    assert thought + more_thought == "Think: Oslo is cold."
    assert content + "".join(more) == "It is cold." and split.calls == []
    assert split.history("It is cold.") == ("It is cold.", "Think: Oslo is cold.")


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_split_a_call_to_an_offered_function(server, chunk):
    ids = _ids(server, A_CALL)
    split = _split(server)
    pieces: list = []
    thought = ""
    for start in range(0, len(ids), chunk):
        delta_thought, delta = split.feed("", ids[start:start + chunk])
        thought, pieces = thought + delta_thought, pieces + delta
    pieces += split.finish()[1]
    (call,) = [p for p in pieces if isinstance(p, ParsedCall)]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Oslo", "unit": "celsius"}
    assert thought == "Need weather." and not [p for p in pieces if isinstance(p, str)]


def test_split_a_call_to_an_unknown_function_is_content_and_text_outside_is_too(server):
    split = _split(server, names=frozenset())
    _, pieces = split.feed("", _ids(server, A_CALL))
    assert "".join(p for p in pieces if isinstance(p, str)) == \
        '{"city": "Oslo", "unit": "celsius"}' and split.calls == []
    garbage = _split(server)
    _, pieces = garbage.feed("", _ids(server, "just words"))
    _, more = garbage.finish()
    assert "".join(p for p in pieces + more if isinstance(p, str)) == "just words"


class _CraftedEngine:
    """An engine client whose session generates the given token ids, `chunk` a step."""

    def __init__(self, ids: list[int], chunk: int) -> None:
        self.steps = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]

    async def outputs(self, request_id):
        from types import SimpleNamespace

        for i, step in enumerate(self.steps):
            last = i == len(self.steps) - 1
            yield SimpleNamespace(error=None, outputs=[SimpleNamespace(
                text="(the text is not read)", token_ids=step,
                finish_reason="stop" if last else None)])

    async def get_session(self, request_id):
        from types import SimpleNamespace

        return SimpleNamespace(num_cached_tokens=0)


def _crafted_turn_output(server, text: str, chunk: int) -> tuple[list[dict], list[dict]]:
    """The events and output items of a Responses turn whose model wrote `text`."""
    import asyncio
    from types import SimpleNamespace

    from loom.server.protocol import ResponsesRequest
    from loom.server.response_turn import ResponseTurn
    from loom.server.tools import plan_tools

    state = server.app.state.loom
    body = ResponsesRequest(model=MODEL, input="q", stream=True, tools=[{
        "type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
    tools = plan_tools(body.chat_tools())
    host = SimpleNamespace(state=SimpleNamespace(
        engine=_CraftedEngine(_ids(server, text), chunk), config=state.config,
        reasoning_tokens=state.reasoning_tokens))

    async def finish(turn, final):
        host.final = final

    host.finish = finish
    turn = ResponseTurn(host, body, "resp_1", "", [1, 2, 3], [], [], tools,
                        state.output_split([1, 2, 3], False, tools.names))

    async def collect() -> list[dict]:
        return [event async for event in turn.events()]

    events = asyncio.run(collect())
    return events, host.final["output"]


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_a_crafted_stream_gives_a_reasoning_item_then_the_message(server, chunk):
    events, output = _crafted_turn_output(server, ANALYSIS_THEN_FINAL, chunk)
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Think: Oslo is cold."}]
    assert output[1]["content"][0]["text"] == "It is cold."
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "It is cold." and events[-1]["type"] == "response.completed"


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_a_crafted_stream_gives_a_reasoning_item_then_a_function_call(server, chunk):
    _, output = _crafted_turn_output(server, A_CALL, chunk)
    assert [item["type"] for item in output] == ["reasoning", "function_call"]
    assert output[1]["name"] == "get_weather"
    assert json.loads(output[1]["arguments"]) == {"city": "Oslo", "unit": "celsius"}


def test_crafted_chat_deltas_concatenate_to_the_whole_message(server):
    from loom.server import chat_output

    state = server.app.state.loom
    names = frozenset({"get_weather"})
    ids = _ids(server, ANALYSIS_THEN_FINAL)
    whole = chat_output.message(state.output_split(ids, False, names), "", ids, True)
    assert whole == {"role": "assistant", "content": "It is cold.",
                     "reasoning_content": "Think: Oslo is cold."}
    writer = chat_output.ChoiceDeltas(state.output_split(ids, False, names))
    deltas = [d for i in range(0, len(ids), 3)
              for d in writer.deltas("", ids[i:i + 3], finished=i + 3 >= len(ids))]
    assert "".join(d.get("content", "") for d in deltas) == "It is cold."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Think: Oslo is cold."
    call_ids = _ids(server, A_CALL)
    called = chat_output.message(state.output_split(call_ids, False, names), "", call_ids, True)
    assert called["content"] is None and called["reasoning_content"] == "Need weather."
    assert called["tool_calls"][0]["function"]["name"] == "get_weather"
