"""Many Responses conversations at once on the tiny Gemma 3 model (issue 43): chains of
continuations, streamed and not, over raw HTTP, the openai client and openai-agents' Runner,
forks of one response, a response deleted while it is continued, streams cancelled midway.
Every turn is answered or refused with an OpenAI-style 4xx; a stream always ends with its
terminal event; nothing hangs; at the end the engine runs nothing and holds no KV block."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

import agents
import httpx
import openai
import pytest
from server.conftest import delete_stored_responses, engine_args, run_server, wait_until
from server.test_server_robustness import TEMPLATE

MODEL = "test-model"
CONVERSATIONS = 32
TURN_S = 30.0  # no turn may take longer
STEP_S = 0.005  # a real model's step takes milliseconds: the engine is busy between calls
DONE = ("response.completed", "response.incomplete")


@pytest.fixture(scope="module")
def server(tiny_models):
    with run_server(engine_args(tiny_models, num_kv_blocks=2048), chat_template=TEMPLATE) as srv:
        yield srv


def _body(text: str, previous: str | None, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "input": text, "previous_response_id": previous, "stream": stream,
            "temperature": 0, "max_output_tokens": 6}


def _refusal(r: httpx.Response, *statuses: int) -> None:
    """An OpenAI-style error body with one of `statuses`."""
    assert r.status_code in statuses, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["message"] and error["type"], error


async def _create(c: httpx.AsyncClient, text: str, previous: str | None) -> str:
    """A non-streamed turn that must be answered; its id."""
    r = await asyncio.wait_for(c.post("/v1/responses", json=_body(text, previous)), TURN_S)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] in ("completed", "incomplete") and body["id"].startswith("resp_")
    return body["id"]


async def _stream(c: httpx.AsyncClient, text: str, previous: str | None,
                  cancel_after: int | None = None) -> str | None:
    """A streamed turn: its events end with the terminal event (its id), or the client leaves
    after `cancel_after` events (None)."""

    async def run() -> str | None:
        events: list[dict[str, Any]] = []
        async with c.stream("POST", "/v1/responses", json=_body(text, previous, True)) as r:
            assert r.status_code == 200, await r.aread()
            if cancel_after == 0:
                return None
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if cancel_after is not None and len(events) >= cancel_after:
                        return None
        assert events and events[-1]["type"] in DONE, events[-1:]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        return events[-1]["response"]["id"]

    return await asyncio.wait_for(run(), TURN_S)


async def _turn(c: httpx.AsyncClient, k: int, text: str, previous: str | None) -> str:
    """Streamed for odd conversations, not for even ones."""
    if k % 2:
        rid = await _stream(c, text, previous)
        assert rid is not None
        return rid
    return await _create(c, text, previous)


async def _chain(c: httpx.AsyncClient, k: int) -> None:
    previous = None
    for j in range(4):
        previous = await _turn(c, k, f"Turn {j} of chat {k}.", previous)


async def _fork(c: httpx.AsyncClient, k: int) -> None:
    root = await _turn(c, k, f"Root of {k}.", None)
    a, b = await asyncio.gather(_create(c, "Left.", root), _stream(c, "Right.", root))
    assert b is not None
    await asyncio.gather(_turn(c, k, "Left again.", a), _turn(c, k + 1, "Right again.", b))


async def _delete_while_continued(c: httpx.AsyncClient, k: int) -> None:
    root = await _turn(c, k, f"Doomed {k}.", None)
    continued, deleted = await asyncio.gather(
        asyncio.wait_for(c.post("/v1/responses", json=_body("Go on.", root)), TURN_S),
        asyncio.wait_for(c.delete(f"/v1/responses/{root}"), TURN_S))
    assert deleted.status_code == 200, deleted.text
    if continued.status_code == 200:  # it forked before the delete, or computed afresh
        await _turn(c, k, "And on.", continued.json()["id"])
    else:  # the delete came first
        _refusal(continued, 404)
    _refusal(await c.post("/v1/responses", json=_body("Gone?", root)), 404)


async def _cancel_midway(c: httpx.AsyncClient, k: int) -> None:
    root = await _turn(c, k, f"Cancelled {k}.", None)
    assert await _stream(c, "Stream this.", root, cancel_after=3 * (k // 6 % 2)) is None
    await _turn(c, k, "After the cancel.", root)  # the root is intact


def _openai_client(c: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The openai client (its own connections) on the server `c` talks to."""
    return openai.AsyncOpenAI(base_url=f"{str(c.base_url).rstrip('/')}/v1", api_key="unused",
                              max_retries=0, timeout=TURN_S)


async def _openai_chain(c: httpx.AsyncClient, k: int) -> None:
    """Four turns through the openai client, streamed for odd conversations."""
    client, previous = _openai_client(c), None
    for j in range(4):
        args = dict(model=MODEL, input=f"Client turn {j} of {k}.", temperature=0,
                    max_output_tokens=6, previous_response_id=previous)
        if k % 2:  # the stream's last event carries the response (completed or incomplete)
            events = [e async for e in await client.responses.create(stream=True, **args)]
            assert events[-1].type in DONE, events[-1].type
            final = events[-1].response
        else:
            final = await asyncio.wait_for(client.responses.create(**args), TURN_S)
        assert final.status in ("completed", "incomplete") and final.id.startswith("resp_")
        previous = final.id


async def _agents_chain(c: httpx.AsyncClient, k: int) -> None:
    """Four runs of an openai-agents agent, each continuing the last by its response id.
    The SDK fails a response cut by max tokens, so the agent answers a short structured
    output (its schema ends the random model's document: `completed`)."""
    agent = agents.Agent(
        name=f"agent-{k}", instructions="Answer yes or no.", output_type=Literal["yes", "no"],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=_openai_client(c)),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=64))
    previous = None
    for j in range(4):
        result = await asyncio.wait_for(
            agents.Runner.run(agent, f"Agent turn {j} of {k}.", max_turns=1,
                              previous_response_id=previous), TURN_S)
        assert result.final_output in ("yes", "no")
        assert result.last_response_id and result.last_response_id != previous
        previous = result.last_response_id


async def _all(base_url: str) -> None:
    agents.set_tracing_disabled(True)
    scenes = [_chain, _openai_chain, _fork, _delete_while_continued, _cancel_midway,
              _agents_chain, _chain, _openai_chain]
    limits = httpx.Limits(max_connections=4 * CONVERSATIONS)
    async with httpx.AsyncClient(base_url=base_url, timeout=TURN_S, limits=limits) as c:
        await asyncio.gather(*(scenes[k % len(scenes)](c, k) for k in range(CONVERSATIONS)))


def test_concurrent_conversations_forks_deletes_and_cancels(server) -> None:
    eng = server.llm_engine
    step = eng.step

    def busy_step():
        time.sleep(STEP_S)
        return step()

    eng.step = busy_step  # the async engine looks `step` up on every step
    try:
        asyncio.run(_all(server.base_url))
    finally:
        del eng.step
    assert wait_until(lambda: eng.load.num_running == 0 and eng.load.num_waiting == 0)
    delete_stored_responses(server)
    queues = server.engine._queues
    assert wait_until(lambda: not eng.table.group_ids() and not queues
                      and eng.kv_pool_all_free), (eng.table.group_ids(), list(queues))


def test_a_turn_whose_engine_step_fails_ends_clearly(server) -> None:
    """Streamed: the events after the headers end with `response.failed` naming the error;
    not streamed: a JSON error. Either way the turn's session is gone."""
    eng = server.llm_engine
    step, failures = eng.step, [0]

    def failing_step():
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("injected step failure")
        return step()

    eng.step = failing_step
    try:
        with httpx.Client(base_url=server.base_url, timeout=TURN_S) as http:
            failures[0] = 1
            with http.stream("POST", "/v1/responses", json=_body("Fail.", None, True)) as r:
                assert r.status_code == 200
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ")]
            assert [e["type"] for e in events] == ["response.created",
                                                   "response.in_progress", "response.failed"]
            failed = events[-1]["response"]
            assert failed["status"] == "failed" and "injected" in failed["error"]["message"]
            assert events[-1]["sequence_number"] == 2
            failures[0] = 1
            r = http.post("/v1/responses", json=_body("Fail.", None))
            assert r.status_code == 503 and "injected" in r.json()["error"]["message"], r.text
            assert http.get(f"/v1/responses/{failed['id']}").status_code == 404
    finally:
        del eng.step
    assert wait_until(lambda: not eng.table.group_ids() and eng.kv_pool_all_free)
