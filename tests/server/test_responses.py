"""OpenAI's Responses API on the real Gemma 3 270M through the `openai` client: a response
is a session and `previous_response_id` continues it, computing only the new input (the
engine's counters say so) with the tokens chat completions gives the same conversation;
forks of one response do not disturb each other; streaming events; function tools round
trip; structured output; reads, deletes and bad input refused before anything runs."""

from __future__ import annotations

import json

import pytest
from server.conftest import served_clients, wait_until
from server.test_server_robustness import assert_error

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "strict": True,
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city"],
                          "properties": {"city": {"type": "string", "minLength": 1,
                                                  "maxLength": 16}}}}
GREEDY = {"temperature": 0, "max_output_tokens": 10}


@pytest.fixture(scope="module")
def api(gemma_engine):
    with served_clients(gemma_engine, MODEL) as clients:
        yield clients


def chat_text(client, messages, max_tokens=10) -> str:
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_tokens=max_tokens)
    return out.choices[0].message.content


def test_a_chain_computes_only_the_new_input_and_equals_chat(api) -> None:
    server, client, http = api
    engine = server.llm_engine
    r1 = client.responses.create(model=MODEL, input="Name three colours.",
                                 instructions="Answer briefly.", **GREEDY)
    assert r1.status in ("completed", "incomplete") and r1.output_text
    assert r1.usage.input_tokens_details.cached_tokens == 0
    history = [{"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": "Name three colours."}]
    assert r1.output_text == chat_text(client, history)
    previous, transcript = r1, [*history, {"role": "assistant", "content": r1.output_text}]
    for turn in ("And three animals?", "And three fruits?"):
        before = engine.stats.num_computed_tokens
        r = client.responses.create(model=MODEL, input=turn, previous_response_id=previous.id,
                                    instructions="Answer briefly.", **GREEDY)
        # The session computes its last generated token once the response is out.
        assert wait_until(lambda r=r: engine.get_session(r.id).status == "PAUSED")
        computed = engine.stats.num_computed_tokens - before
        cached = r.usage.input_tokens_details.cached_tokens
        # The previous turns (their generated tokens too) stay: only the rest is computed.
        assert cached >= previous.usage.input_tokens + previous.usage.output_tokens - 8
        assert computed == r.usage.input_tokens - cached + r.usage.output_tokens
        transcript.append({"role": "user", "content": turn})
        assert r.output_text == chat_text(client, transcript)
        assert r.usage.input_tokens == http.post(
            "/tokenize", json={"messages": transcript}).json()["count"]
        transcript.append({"role": "assistant", "content": r.output_text})
        previous = r


def test_two_continuations_of_one_response_do_not_disturb_each_other(api) -> None:
    _, client, _ = api
    root = client.responses.create(model=MODEL, input="Say a word.", **GREEDY)
    a = client.responses.create(model=MODEL, input="Another one.", previous_response_id=root.id,
                                **GREEDY)
    b = client.responses.create(model=MODEL, input="A number now.", previous_response_id=root.id,
                                **GREEDY)
    again = client.responses.create(model=MODEL, input="Another one.",
                                    previous_response_id=root.id, **GREEDY)
    assert again.output_text == a.output_text
    assert b.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(root.id).output_text == root.output_text


def test_stream_events(api) -> None:
    _, client, _ = api
    with client.responses.stream(model=MODEL, input="Count to five.", **GREEDY) as stream:
        events = list(stream)
    final = events[-1].response  # response.completed, or response.incomplete at the limit
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{final.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_function_tool_round_trip(api) -> None:
    _, client, http = api
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required", temperature=0,
                                    max_output_tokens=28)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], **GREEDY,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": json.dumps({"temperature_c": 21})}])
    assert second.output_text and second.usage.input_tokens_details.cached_tokens > 0
    items = http.get(f"/v1/responses/{second.id}/input_items").json()
    assert [i["type"] for i in items["data"]] == ["function_call_output"]


def test_structured_output(api) -> None:
    _, client, _ = api
    schema = {"type": "object", "additionalProperties": False, "required": ["name"],
              "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10}}}
    r = client.responses.create(model=MODEL, input="Give a person's name as JSON.",
                                temperature=0, max_output_tokens=30,
                                text={"format": {"type": "json_schema", "name": "person",
                                                 "schema": schema, "strict": True}})
    assert set(json.loads(r.output_text)) == {"name"}


def test_reads_deletes_and_refusals(api) -> None:
    server, client, http = api
    engine = server.llm_engine
    r = client.responses.create(model=MODEL, input="Hello.", **GREEDY)
    assert http.get(f"/v1/responses/{r.id}").json()["output_text"] == r.output_text
    items = http.get(f"/v1/responses/{r.id}/input_items", params={"order": "asc"}).json()
    assert items["data"][0]["content"] == [{"type": "input_text", "text": "Hello."}]
    assert engine.is_live(r.id)
    assert http.delete(f"/v1/responses/{r.id}").json() == {
        "id": r.id, "object": "response", "deleted": True}
    assert not engine.is_live(r.id)
    assert_error(http.get(f"/v1/responses/{r.id}"), 404)
    live = set(engine.table.group_ids())
    body = {"model": MODEL, "input": "Hi", "previous_response_id": r.id}
    assert_error(http.post("/v1/responses", json=body), 404, param="previous_response_id")
    assert_error(http.post("/v1/responses", json={**body, "previous_response_id": "resp_x"}),
                 404, param="previous_response_id")
    bad_items = [
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        ([{"type": "message", "role": "robot", "content": "x"}], "input[0].role"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
         "input[0].content[0].type"),
        ([{"type": "reasoning"}], "input[0].summary"),
        ([{"type": "computer_call"}], "input[0].type"),
    ]
    for items, field in bad_items:
        assert_error(http.post("/v1/responses", json={"model": MODEL, "input": items}), 400,
                     param=field)
    assert_error(http.post("/v1/responses", json={"model": MODEL, "input": "x", "bogus": 1}),
                 400)
    assert set(engine.table.group_ids()) == live  # nothing opened by a refused request
    kept = client.responses.create(model=MODEL, input="Hello.", store=False, **GREEDY)
    assert not engine.is_live(kept.id)
    assert_error(http.get(f"/v1/responses/{kept.id}"), 404)


def test_continuing_a_response_still_in_progress_is_a_409(api) -> None:
    _, _, http = api
    body = {"model": MODEL, "input": "Tell a long story.", "stream": True,
            "temperature": 0, "max_output_tokens": 40}
    with http.stream("POST", "/v1/responses", json=body) as stream:
        lines = stream.iter_lines()
        created = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        rid = created["response"]["id"]
        refused = http.post("/v1/responses", json={"model": MODEL, "input": "More.",
                                                   "previous_response_id": rid})
        assert_error(refused, 409, param="previous_response_id")
        assert any('"response.completed"' in line or '"response.incomplete"' in line
                   for line in lines)
    assert http.get(f"/v1/responses/{rid}").json()["status"] in ("completed", "incomplete")


def test_a_response_whose_session_is_gone_continues_with_the_same_tokens(api) -> None:
    server, client, _ = api
    engine = server.llm_engine
    root = client.responses.create(model=MODEL, input="Say a word.", **GREEDY)
    live = client.responses.create(model=MODEL, input="Another one.",
                                   previous_response_id=root.id, **GREEDY)
    engine.close(root.id)  # as its time to live would
    recomputed = client.responses.create(model=MODEL, input="Another one.",
                                         previous_response_id=root.id, **GREEDY)
    assert recomputed.output_text == live.output_text
    assert recomputed.usage.input_tokens == live.usage.input_tokens
