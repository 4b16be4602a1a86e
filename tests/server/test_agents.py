"""Agents over `loom serve` on the real Gemma 3 270M, through the `openai` client:
`response_format` (JSON schema, JSON object), forced tool calls (required, named; streamed
and not), a tool round trip through chat and through a live session, and bad inputs refused
with a 400 naming the field, leaving nothing in the engine."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from server.conftest import served_clients
from server.test_server_robustness import assert_clean, assert_error

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "minLength": 1,
                                           "maxLength": 16}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["zone", "hour24"],
                   "properties": {"zone": {"enum": ["UTC", "CET", "PST"]},
                                  "hour24": {"type": "boolean"}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
RESULT = json.dumps({"temperature_c": 21, "sky": "clear"})


@pytest.fixture(scope="module")
def agent(gemma_engine):
    with served_clients(gemma_engine, MODEL) as clients:
        yield clients


def _parallel(fn, items):
    """`fn` over `items` from concurrent clients: the engine batches them."""
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def _valid_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_json_schema_and_json_object_always_parse(agent):
    server, client, _ = agent
    subjects = ["a pirate", "a baker", "a queen", "a robot", "a child", "a wizard",
                "a farmer", "a knight"]

    def person(i_subject):
        i, subject = i_subject
        return client.chat.completions.create(
            model=MODEL, max_tokens=40, temperature=0.0 if i % 2 else 0.8, seed=i,
            messages=[{"role": "user", "content": f"Describe {subject} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}})

    for response in _parallel(person, list(enumerate(subjects))):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)

    # Any JSON object: a small model may ramble on; these greedy answers close in time.
    questions = ['Give the capital of France as a JSON object like {"capital": "..."}.',
                 "Return a JSON object with a single key 'color' for the color of grass."]
    objects = _parallel(lambda q: client.chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0.0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": q}]), questions)
    for response in objects:
        assert response.choices[0].finish_reason == "stop", response.choices[0]
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    # The completions endpoint takes response_format too (as vLLM's does).
    completion = client.completions.create(
        model=MODEL, prompt="A person, as JSON:", max_tokens=40, temperature=0.0,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)
    assert_clean(server)


def _required(i: int, client, stream: bool):
    choice = ("required" if i % 2 == 0
              else {"type": "function", "function": {"name": TOOLS[i % 2]["function"]["name"]}})
    params = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=48,
                  temperature=0.0 if i < 2 else 1.0, seed=i, parallel_tool_calls=i % 3 == 0)
    if not stream:
        return client.chat.completions.create(**params)
    with client.chat.completions.stream(**params) as events:  # the SDK's accumulation
        for _ in events:
            pass
        return events.get_final_completion()


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_are_always_valid(agent, stream):
    server, client, _ = agent
    responses = _parallel(lambda i: _required(i, client, stream), list(range(4)))
    for i, response in enumerate(responses):
        choice = response.choices[0]
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls", choice
        assert calls and choice.message.content is None, choice.message
        if i % 3:  # parallel_tool_calls false: exactly one call
            assert len(calls) == 1
        if i % 2:  # named
            assert {c.function.name for c in calls} == {TOOLS[1]["function"]["name"]}
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            _valid_call(call.function.name, call.function.arguments)
    assert_clean(server)


def test_streamed_tool_call_deltas_have_openai_shape(agent):
    server, client, _ = agent
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0.0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"
    _valid_call("get_weather", calls[0].function.arguments)
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert_clean(server)


def test_tool_round_trip_through_chat(agent):
    server, client, http = agent
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=40, temperature=0.0)
    message = first.choices[0].message
    (call,) = message.tool_calls
    conversation = [*ASK, message,  # the SDK's message object, sent back as it is
                    {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=12,
        temperature=0.0)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert isinstance(choice.message.content, str)
    # Gemma's template knows no tools: the call is written in the call format as the
    # assistant's turn, the result as a user turn naming the function.
    sent = [*ASK, message.model_dump(exclude_none=True), conversation[-1]]
    ids = http.post("/tokenize", json={"messages": sent, "tools": TOOLS}).json()["tokens"]
    prompt = server.llm_engine.tokenizer.decode(ids)
    assert f"<tool_call>{{\"name\": \"{call.function.name}\"" in prompt
    assert f"Tool result ({call.function.name}): {RESULT}" in prompt
    assert "You can call functions" in prompt
    # tool_choice "none" offers no tools: the answer's prompt is the conversation alone.
    plain = http.post("/tokenize", json={"messages": sent}).json()["count"]
    assert answer.usage.prompt_tokens == plain < len(ids)
    assert_clean(server)


def test_tool_round_trip_through_a_session(agent):
    server, _, http = agent
    created = http.post("/v1/sessions", json={"messages": ASK, "tools": TOOLS,
                                              "add_generation_prompt": True})
    assert created.status_code == 200, created.text
    sid = created.json()["id"]
    with http.stream("POST", f"/v1/sessions/{sid}/generate", json={
            "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 40, "temperature": 0.0, "stream": True}) as events:
        chunks = [json.loads(line[6:]) for line in events.iter_lines()
                  if line.startswith("data: {")]
    call_segment = chunks[-1]  # the whole segment comes last, with its calls
    assert call_segment["object"] == "session.generation"
    assert "".join(c["text"] for c in chunks[:-1]) == call_segment["text"]
    assert chunks[-2]["finish_reason"] == "tool_calls"
    assert call_segment["finish_reason"] == "tool_calls", call_segment
    assert call_segment["content"] is None
    (call,) = call_segment["tool_calls"]
    _valid_call(call["function"]["name"], call["function"]["arguments"])
    # The call ended with one of the model's end tokens: the agent drops it and writes the
    # turns that follow as Gemma's template writes them.
    assert call_segment["token_ids"][-1] in server.app.state.loom.end_token_ids
    http.post(f"/v1/sessions/{sid}/rewind", json={"num_tokens": 1}).raise_for_status()
    turn = (f"<end_of_turn>\n<start_of_turn>user\nTool result ({call['function']['name']}): "
            f"{RESULT}<end_of_turn>\n<start_of_turn>model\n")
    answer = http.post(f"/v1/sessions/{sid}/append", json={
        "text": turn, "tools": TOOLS, "max_tokens": 12, "temperature": 0.0}).json()
    assert answer["finish_reason"] in ("stop", "length", "tool_calls"), answer
    assert answer["usage"]["prompt_tokens"] > len(call_segment["token_ids"])
    text = http.get(f"/v1/sessions/{sid}").json()["text"]
    assert call_segment["text"] in text and RESULT in text and text.endswith(answer["text"])
    assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    assert_clean(server)


def test_auto_tool_choice_parses_streamed_as_whole(agent):
    """With tools and no forced choice the text is parsed afterwards; streamed deltas give
    the whole response's content and calls (whichever the model wrote)."""
    server, client, _ = agent
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]
    params = dict(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=32,
                  temperature=0.0)
    whole = client.chat.completions.create(**params).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **params)]
    content = "".join(c.delta.content or "" for c in chunks)
    streamed_calls = [(t.function.name, t.function.arguments)
                      for c in chunks for t in c.delta.tool_calls or []]
    assert chunks[-1].finish_reason == whole.finish_reason
    assert (content or None) == whole.message.content
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert calls == streamed_calls
    for name, arguments in calls:
        json.loads(arguments)
        assert name in SCHEMAS
    assert_clean(server)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"],
                                         "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
])
def test_bad_constraints_are_refused_before_anything_runs(agent, body, param):
    server, _, http = agent
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                   "max_tokens": 4, **body})
    assert_error(chat, 400, param=param)
    sid = http.post("/v1/sessions", json={"prompt": "Hello"}).json()["id"]
    before = http.get(f"/v1/sessions/{sid}").json()["num_tokens"]
    refused = http.post(f"/v1/sessions/{sid}/append", json={"text": " there", "max_tokens": 4,
                                                           **body})
    assert_error(refused, 400, param=param)
    assert http.get(f"/v1/sessions/{sid}").json()["num_tokens"] == before  # nothing appended
    http.delete(f"/v1/sessions/{sid}")
    assert_clean(server)
